"""The self-describing block frame: one stored object per KV block.

This module owns no state; every function is pure and safe to call from any thread.

Frame layout (little-endian), ``HEADER_BYTES`` (320) of header followed by the payload::

    offset  size  field
         0     4  magic b"KVTB"
         4     2  format version (1)
         6     2  key length (1 .. MAX_KEY_BYTES)
         8     8  payload length in bytes
        16    16  namespace digest
        32   255  key echo, zero-padded to MAX_KEY_BYTES
       287    25  reserved, zero
       312     8  checksum: xxh3_64 over header bytes [0, 312) followed by the payload

The header has a fixed size so that readers can pre-size buffers; keys are therefore bounded by
``MAX_KEY_BYTES`` (255). The checksum covers every header byte before it, so a flipped byte
anywhere in the frame is detected. Empty (0-byte) payloads are valid frames.

Verification order in :func:`decode_into` is magic, version, namespace, key, length, checksum,
and nothing is written to the caller's buffer until all of it has passed.
"""

from __future__ import annotations

import struct
from typing import TypeAlias

import xxhash

from kvtier.keys import NAMESPACE_DIGEST_BYTES

Buffer: TypeAlias = bytes | bytearray | memoryview

MAGIC = b"KVTB"
FORMAT_VERSION = 1
MAX_KEY_BYTES = 255
HEADER_BYTES = 320

_FIXED = struct.Struct("<4sHHQ16s")  # magic, version, key length, payload length, namespace
_KEY_OFFSET = _FIXED.size  # 32
_CHECKSUM_OFFSET = HEADER_BYTES - 8  # 312
_CHECKSUM = struct.Struct("<Q")
_ZERO_KEY_PAD = bytes(_CHECKSUM_OFFSET - _KEY_OFFSET)


class FrameError(Exception):
    """A stored frame is not the block that was asked for (corrupt, foreign or truncated)."""


class BadMagic(FrameError):
    """The frame does not start with the kvtier magic bytes."""


class UnsupportedVersion(FrameError):
    """The frame was written by an unknown format version."""


class NamespaceMismatch(FrameError):
    """The frame belongs to another namespace (model, dtype, layout, tenant ...)."""


class KeyMismatch(FrameError):
    """The frame was stored under another key."""


class LengthMismatch(FrameError):
    """The frame's payload length disagrees with the frame's actual size."""


class TruncatedFrame(FrameError):
    """The frame is shorter than its header says."""


class ChecksumMismatch(FrameError):
    """The payload (or a header byte) does not match the stored checksum."""


class OutputSizeMismatch(ValueError):
    """The caller's output buffer does not have the frame's payload size.

    This is a caller error, not a frame error: the frame itself may be perfectly valid, so
    backends keep the stored object when they see it.
    """


def frame_size(payload_len: int) -> int:
    """Size in bytes of the frame that carries a payload of ``payload_len`` bytes."""
    if not isinstance(payload_len, int) or isinstance(payload_len, bool) or payload_len < 0:
        raise ValueError(f"payload_len must be an int >= 0, got {payload_len!r}")
    return HEADER_BYTES + payload_len


def as_byte_view(buffer: Buffer, argument: str = "payload") -> memoryview:
    """A flat, C-contiguous byte view of ``buffer`` (no copy), or ``TypeError``/``ValueError``."""
    if not isinstance(buffer, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"{argument} must be bytes, bytearray or memoryview, got {type(buffer).__name__}"
        )
    if (
        type(buffer) is memoryview
        and buffer.format == "B"
        and buffer.ndim == 1
        and buffer.c_contiguous
    ):
        return buffer
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError(f"{argument} must be a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _check_digest(namespace_digest: bytes) -> None:
    if not isinstance(namespace_digest, bytes) or len(namespace_digest) != NAMESPACE_DIGEST_BYTES:
        raise ValueError(
            f"namespace_digest must be {NAMESPACE_DIGEST_BYTES} bytes, got {namespace_digest!r}"
        )


def check_key(key: object, argument: str = "key") -> bytes:
    """Return ``key`` if it is a storable block key, else raise naming what was expected."""
    if not isinstance(key, bytes):
        raise TypeError(f"{argument} must be a BlockKey (bytes), got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"{argument} must be 1..{MAX_KEY_BYTES} bytes long, got {len(key)} bytes")
    return key


def encode_header(namespace_digest: bytes, key: bytes, payload: Buffer) -> bytes:
    """The ``HEADER_BYTES`` header for ``payload`` stored under ``key``, checksum included."""
    _check_digest(namespace_digest)
    check_key(key)
    view = as_byte_view(payload)
    prefix = (
        _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), view.nbytes, namespace_digest)
        + key
        + _ZERO_KEY_PAD[len(key) :]
    )
    hasher = xxhash.xxh3_64(prefix)
    hasher.update(view)
    return prefix + _CHECKSUM.pack(hasher.intdigest())


def encode(namespace_digest: bytes, key: bytes, payload: Buffer) -> bytearray:
    """Header + payload as one buffer; the payload is copied exactly once."""
    view = as_byte_view(payload)
    frame = bytearray(encode_header(namespace_digest, key, view))
    frame += view
    return frame


def payload_length(frame: Buffer) -> int:
    """The payload length recorded in ``frame``'s header (magic and version checked).

    Readers of padded storage (O_DIRECT files) use it to cut the exact frame out of a larger
    buffer before calling :func:`decode_into`, which re-verifies everything.
    """
    view = as_byte_view(frame, "frame")
    if view.nbytes < HEADER_BYTES:
        raise TruncatedFrame(f"frame is {view.nbytes} bytes, shorter than the header")
    magic, version, _key_len, length, _digest = _FIXED.unpack_from(view)
    _check_magic_and_version(magic, version)
    return int(length)


def _check_magic_and_version(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"frame format version {version}, expected {FORMAT_VERSION}")


def _verify_header(view: memoryview, namespace_digest: bytes, key: bytes) -> int:
    if view.nbytes < HEADER_BYTES:
        raise TruncatedFrame(f"frame is {view.nbytes} bytes, shorter than the header")
    magic, version, key_len, length, digest = _FIXED.unpack_from(view)
    _check_magic_and_version(magic, version)
    if digest != namespace_digest:
        raise NamespaceMismatch(
            f"frame namespace {bytes(digest).hex()}, expected {namespace_digest.hex()}"
        )
    key_end = _KEY_OFFSET + len(key)
    if key_len != len(key) or view[_KEY_OFFSET:key_end] != key:
        stored_key = bytes(view[_KEY_OFFSET : _KEY_OFFSET + min(key_len, MAX_KEY_BYTES)])
        raise KeyMismatch(f"frame key {stored_key.hex()}, expected {key.hex()}")
    actual = view.nbytes - HEADER_BYTES
    if actual < length:
        raise TruncatedFrame(f"frame carries {actual} payload bytes, header says {length}")
    if actual > length:
        raise LengthMismatch(f"frame carries {actual} payload bytes, header says {length}")
    return int(length)


def decode_into(frame: Buffer, namespace_digest: bytes, key: bytes, out: memoryview) -> None:
    """Verify ``frame`` completely, then copy its payload into ``out``.

    Raises a :class:`FrameError` subclass for a bad frame and :class:`OutputSizeMismatch` when
    ``out`` has the wrong size; in both cases ``out`` is left untouched.
    """
    _check_digest(namespace_digest)
    check_key(key)
    target = as_byte_view(out, "out")
    if target.readonly:
        raise TypeError("out must be a writable memoryview")
    decode_checked(as_byte_view(frame, "frame"), namespace_digest, key, target)


def decode_checked(
    view: memoryview, namespace_digest: bytes, key: bytes, target: memoryview
) -> None:
    """:func:`decode_into` for callers that already validated their arguments.

    ``view`` and ``target`` must be flat, C-contiguous byte views (``target`` writable),
    ``namespace_digest`` 16 bytes and ``key`` a valid key, as the backends' argument checks
    guarantee. The frame itself is verified exactly as in :func:`decode_into`.
    """
    length = _verify_header(view, namespace_digest, key)
    if target.nbytes != length:
        raise OutputSizeMismatch(f"out has {target.nbytes} bytes, the frame payload has {length}")
    _verify_checksum(view)
    target[:] = view[HEADER_BYTES:]


def verify_frame(frame: Buffer, namespace_digest: bytes, key: bytes) -> int:
    """Verify ``frame`` completely (checksum included) without copying; return its payload length.

    Raises a :class:`FrameError` subclass for a bad frame. Backends use it to tell a valid block
    read with a wrong-size ``out`` (kept) from a block whose length field is damaged (deleted).
    """
    _check_digest(namespace_digest)
    check_key(key)
    view = as_byte_view(frame, "frame")
    length = _verify_header(view, namespace_digest, key)
    _verify_checksum(view)
    return length


def _verify_checksum(view: memoryview) -> None:
    hasher = xxhash.xxh3_64(view[:_CHECKSUM_OFFSET])
    hasher.update(view[HEADER_BYTES:])
    (stored,) = _CHECKSUM.unpack_from(view, _CHECKSUM_OFFSET)
    if hasher.intdigest() != stored:
        raise ChecksumMismatch(f"checksum {hasher.intdigest():#018x}, stored {stored:#018x}")
