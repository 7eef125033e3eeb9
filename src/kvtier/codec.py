"""The self-describing block frame: one stored object per KV block.

This module owns no state; every function and :class:`FrameCodec` are pure and safe to call from
any thread.

Frame layout (little-endian), ``HEADER_BYTES`` (320) of header followed by the payload::

    offset  size  field
         0     4  magic b"KVTB"
         4     2  format version (2)
         6     2  key length (1 .. MAX_KEY_BYTES)
         8     8  payload length in bytes
        16    16  namespace digest
        32   255  key echo, zero-padded to MAX_KEY_BYTES
       287     1  integrity mode: 0 = xxh3 checksum, 1 = keyed MAC
       288    16  MAC tag (mode 1): HMAC-SHA256 over header bytes [0, 288) and the payload,
                  truncated to 128 bits; zero in mode 0
       304     8  reserved, zero
       312     8  checksum (mode 0): xxh3_64 over header bytes [0, 312) and the payload;
                  zero in mode 1

The header has a fixed size so that readers can pre-size buffers; keys are therefore bounded by
``MAX_KEY_BYTES`` (255). Either check covers every header byte before it and the payload, so a
flipped byte anywhere in the frame is detected. Empty (0-byte) payloads are valid frames.

A reader configured with a key accepts only mode-1 frames whose tag verifies under that key; a
reader without a key accepts only mode-0 frames. Every other frame raises
:class:`AuthenticationError` (a :class:`FrameError`): a writer without the key cannot get bytes
served, and a keyed tier is never silently read as an unkeyed one (or the reverse).

Verification order: magic, version, mode, namespace, key, length against the frame's size, then
the checksum or tag, and only then the length against the caller's buffer, so a damaged length
field is always a frame error, never a caller error.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from typing import TypeAlias

import xxhash

from kvtier.errors import KvtierError
from kvtier.keys import MAX_KEY_BYTES, NAMESPACE_DIGEST_BYTES, check_key

Buffer: TypeAlias = bytes | bytearray | memoryview

MAGIC = b"KVTB"
FORMAT_VERSION = 2
HEADER_BYTES = 320
TAG_BYTES = 16

_FIXED = struct.Struct("<4sHHQ16s")  # magic, version, key length, payload length, namespace
_KEY_OFFSET = _FIXED.size  # 32
_MODE_OFFSET = _KEY_OFFSET + MAX_KEY_BYTES  # 287
_TAG_OFFSET = _MODE_OFFSET + 1  # 288
_CHECKSUM_OFFSET = HEADER_BYTES - 8  # 312
_CHECKSUM = struct.Struct("<Q")
_ZERO_KEY_PAD = bytes(MAX_KEY_BYTES)
_ZERO_TAIL = bytes(HEADER_BYTES - _TAG_OFFSET)  # tag + reserved + checksum, all zero
_ZERO_CHECK_TAIL = bytes(_CHECKSUM_OFFSET - _TAG_OFFSET)  # tag + reserved (mode 0)
_ZERO_AFTER_TAG = bytes(HEADER_BYTES - _TAG_OFFSET - TAG_BYTES)  # reserved + checksum (mode 1)


class IntegrityMode(enum.IntEnum):
    """How a frame proves it is whole (and, with a key, whose it is)."""

    CHECKSUM = 0  # xxh3_64: integrity only
    MAC = 1       # keyed HMAC-SHA256: integrity and authenticity


class FrameError(KvtierError):
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


class AuthenticationError(FrameError):
    """The frame has no valid MAC under the reader's key, or is keyed while the reader is not."""


class OutputSizeMismatch(ValueError):
    """The caller's output buffer does not have the frame's payload size.

    This is a caller error, not a frame error: the frame itself is valid (it has been verified
    before this is raised), so backends keep the stored object when they see it.
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


class FrameCodec:
    """Encodes and verifies the frames of one namespace, with or without an auth key.

    Immutable after construction; safe to share between threads.
    """

    __slots__ = ("_auth_key", "_digest", "_mode", "_mode_byte")

    def __init__(self, namespace_digest: bytes, auth_key: bytes | None = None) -> None:
        _check_digest(namespace_digest)
        if auth_key is not None and (not isinstance(auth_key, bytes) or not auth_key):
            raise ValueError("auth_key must be non-empty bytes")
        self._digest = namespace_digest
        self._auth_key = auth_key
        self._mode = IntegrityMode.CHECKSUM if auth_key is None else IntegrityMode.MAC
        self._mode_byte = bytes((self._mode,))

    @property
    def keyed(self) -> bool:
        return self._auth_key is not None

    # -- encoding -----------------------------------------------------------------------------

    def encode_header(self, key: bytes, payload: memoryview) -> bytes:
        """The header for ``payload`` (a flat byte view) under a valid ``key``."""
        prefix = (
            _FIXED.pack(MAGIC, FORMAT_VERSION, len(key), payload.nbytes, self._digest)
            + key
            + _ZERO_KEY_PAD[len(key) :]
            + self._mode_byte
        )
        if self._auth_key is None:
            hasher = xxhash.xxh3_64(prefix)
            hasher.update(_ZERO_CHECK_TAIL)
            hasher.update(payload)
            return prefix + _ZERO_CHECK_TAIL + _CHECKSUM.pack(hasher.intdigest())
        return prefix + self._tag(prefix, payload) + _ZERO_AFTER_TAG

    def _tag(self, prefix: Buffer, payload: Buffer) -> bytes:
        mac = hmac.new(self._auth_key or b"", prefix, hashlib.sha256)
        mac.update(payload)
        return mac.digest()[:TAG_BYTES]

    # -- verification -------------------------------------------------------------------------

    def decode(self, frame: memoryview, key: bytes, out: memoryview, *,
               trusted: bool = False) -> None:
        """Verify a whole ``frame``, then copy its payload into ``out`` (untouched on error).

        ``trusted``: the caller guarantees ``frame`` is a frame this codec encoded for ``key``
        and nothing can have changed it since (private process memory); only the size is
        checked, the bytes are copied once.
        """
        if trusted and frame.nbytes - HEADER_BYTES == out.nbytes:
            out[:] = frame[HEADER_BYTES:]
            return
        length = self._verify_header(frame[:HEADER_BYTES], key, frame.nbytes - HEADER_BYTES)
        payload = frame[HEADER_BYTES:]
        self._verify_integrity(frame[:HEADER_BYTES], payload)
        if out.nbytes != length:
            raise OutputSizeMismatch(f"out has {out.nbytes} bytes, the frame payload has {length}")
        out[:] = payload

    def verify_in_place(self, header: Buffer, key: bytes, out: memoryview,
                        payload_bytes: int) -> None:
        """Verify ``header`` + the payload already read into ``out`` (one pass over ``out``).

        ``payload_bytes`` is how many bytes the stored object carried after its header.
        """
        length = self._verify_header(header, key, payload_bytes)
        if length != out.nbytes:  # the medium should have returned the whole frame instead
            raise LengthMismatch(f"header says {length} payload bytes, out has {out.nbytes}")
        self._verify_integrity(header, out)

    def verify(self, frame: memoryview, key: bytes) -> int:
        """Verify a whole frame without copying it; its payload length."""
        length = self._verify_header(frame[:HEADER_BYTES], key, frame.nbytes - HEADER_BYTES)
        self._verify_integrity(frame[:HEADER_BYTES], frame[HEADER_BYTES:])
        return length

    def _verify_header(self, header: Buffer, key: bytes, actual: int) -> int:
        """The payload length, if ``header`` is exactly the header this codec would write for
        ``key`` and ``actual`` payload bytes (checks and reserved bytes aside); else the precise
        :class:`FrameError`."""
        if actual >= 0 and len(header) >= HEADER_BYTES:
            # The common case in one compare (a memoryview compares slowly: copy 288 bytes).
            prefix = bytes(header[:_TAG_OFFSET]) if type(header) is memoryview else header
            expected = (_FIXED.pack(MAGIC, FORMAT_VERSION, len(key), actual, self._digest) + key
                        + _ZERO_KEY_PAD[len(key):] + self._mode_byte)
            if prefix.startswith(expected):
                return actual
        return self._diagnose(memoryview(header), key, actual)

    def _diagnose(self, header: memoryview, key: bytes, actual: int) -> int:
        """Which check a header fails, in the documented order (the slow path)."""
        if header.nbytes < HEADER_BYTES or actual < 0:
            raise TruncatedFrame(f"frame is {header.nbytes} bytes, shorter than the header")
        magic, version, key_len, length, digest = _FIXED.unpack_from(header)
        _check_magic_and_version(magic, version)
        mode = header[_MODE_OFFSET]
        if mode != self._mode:
            raise AuthenticationError(_mode_mismatch(mode, self._mode))
        if digest != self._digest:
            raise NamespaceMismatch(
                f"frame namespace {bytes(digest).hex()}, expected {self._digest.hex()}"
            )
        if key_len != len(key) or bytes(header[_KEY_OFFSET:_MODE_OFFSET]) != (
            key + _ZERO_KEY_PAD[len(key):]
        ):
            stored_key = bytes(header[_KEY_OFFSET : _KEY_OFFSET + min(key_len, MAX_KEY_BYTES)])
            raise KeyMismatch(f"frame key {stored_key.hex()}, expected {key.hex()}")
        if actual < length:
            raise TruncatedFrame(f"frame carries {actual} payload bytes, header says {length}")
        if actual > length:
            raise LengthMismatch(f"frame carries {actual} payload bytes, header says {length}")
        return int(length)

    def _verify_integrity(self, header: Buffer, payload: memoryview) -> None:
        if self._auth_key is None:
            hasher = xxhash.xxh3_64(header[:_CHECKSUM_OFFSET])
            hasher.update(payload)
            (stored,) = _CHECKSUM.unpack_from(header, _CHECKSUM_OFFSET)
            if hasher.intdigest() != stored:
                raise ChecksumMismatch(
                    f"checksum {hasher.intdigest():#018x}, stored {stored:#018x}"
                )
            return
        tag_end = _TAG_OFFSET + TAG_BYTES
        expected = self._tag(header[:_TAG_OFFSET], payload)
        if not hmac.compare_digest(expected, header[_TAG_OFFSET:tag_end]):
            raise AuthenticationError("MAC tag does not verify under this tier's auth key")
        if header[tag_end:HEADER_BYTES] != _ZERO_AFTER_TAG:
            raise ChecksumMismatch("reserved header bytes are not zero")


def _mode_mismatch(found: int, expected: IntegrityMode) -> str:
    if expected is IntegrityMode.MAC:
        return f"frame integrity mode {found}: not signed with a key, but this tier has one"
    return f"frame integrity mode {found}: signed with a key, but this tier has none"


def _check_magic_and_version(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"frame format version {version}, expected {FORMAT_VERSION}")


# --------------------------------------------------------------------------- functional API
# Unkeyed helpers over :class:`FrameCodec`, with full argument checks.


def encode_header(namespace_digest: bytes, key: bytes, payload: Buffer) -> bytes:
    """The ``HEADER_BYTES`` header for ``payload`` stored under ``key``, checksum included."""
    return FrameCodec(namespace_digest).encode_header(check_key(key), as_byte_view(payload))


def encode(namespace_digest: bytes, key: bytes, payload: Buffer) -> bytearray:
    """Header + payload as one buffer; the payload is copied exactly once."""
    view = as_byte_view(payload)
    frame = bytearray(encode_header(namespace_digest, key, view))
    frame += view
    return frame


def payload_length(frame: Buffer) -> int:
    """The payload length recorded in ``frame``'s header (magic and version checked).

    Readers of padded storage (O_DIRECT files) use it to cut the exact frame out of a larger
    buffer before verifying it.
    """
    view = as_byte_view(frame, "frame")
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
