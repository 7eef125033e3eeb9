"""The functional API: unkeyed helpers over :class:`~kvtier.codec.FrameCodec`, with full
argument checks.

This module owns no state: everything here is immutable or pure and safe to call from any
thread.
"""

from __future__ import annotations

from kvtier.codec.errors import TruncatedFrame
from kvtier.codec.frame_codec import FrameCodec
from kvtier.codec.record import (
    _FIXED,
    HEADER_BYTES,
    Buffer,
    FrameLayout,
    _check_magic_and_version,
    as_byte_view,
)
from kvtier.keys import check_key


def encode_header(namespace_digest: bytes, key: bytes, payload: Buffer) -> bytes:
    """The ``HEADER_BYTES`` header for ``payload`` stored under ``key``, checksum included."""
    return FrameCodec(namespace_digest).encode_header(check_key(key), as_byte_view(payload))


def encode(namespace_digest: bytes, key: bytes, payload: Buffer,
           layout: FrameLayout = FrameLayout.HEADER) -> bytearray:
    """A whole frame (header + payload, or payload + trailer) as one buffer; the payload is
    copied exactly once."""
    view = as_byte_view(payload)
    record = FrameCodec(namespace_digest, layout=layout).encode_record(check_key(key), view)
    if layout is FrameLayout.TRAILER:
        frame = bytearray(view)
        frame += record
        return frame
    frame = bytearray(record)
    frame += view
    return frame


def payload_length(record: Buffer) -> int:
    """The payload length a record (a frame's header or trailer) states (magic and version
    checked)."""
    view = as_byte_view(record, "record")
    if view.nbytes < HEADER_BYTES:
        raise TruncatedFrame(f"frame is {view.nbytes} bytes, shorter than the header")
    magic, version, _key_len, length, _digest = _FIXED.unpack_from(view)
    _check_magic_and_version(magic, version)
    return int(length)


def decode_into(frame: Buffer, namespace_digest: bytes, key: bytes, out: memoryview) -> None:
    """Verify ``frame`` completely, then copy its payload into ``out``.

    Raises a :class:`FrameError` subclass for a bad frame and :class:`OutputSizeMismatch` when
    ``out`` has the wrong size; in both cases ``out`` is left untouched.
    """
    target = as_byte_view(out, "out")
    if target.readonly:
        raise TypeError("out must be a writable memoryview")
    FrameCodec(namespace_digest).decode(as_byte_view(frame, "frame"), check_key(key), target)


def verify_frame(frame: Buffer, namespace_digest: bytes, key: bytes) -> int:
    """Verify ``frame`` completely (checksum included) without copying; return its payload length.

    Raises a :class:`FrameError` subclass for a bad frame.
    """
    return FrameCodec(namespace_digest).verify(as_byte_view(frame, "frame"), check_key(key))
