"""The 320-byte frame record: its constants, offsets and enums, and reading its fields.

The layout of the record and of formats 2, 3 and 4 is described in :mod:`kvtier.codec`.
This module owns no state: everything here is immutable or pure and safe to call from any
thread.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TypeAlias

from kvtier.codec.errors import BadMagic, NewerVersion, TruncatedFrame, UnsupportedVersion
from kvtier.keys import MAX_KEY_BYTES, NAMESPACE_DIGEST_BYTES

Buffer: TypeAlias = bytes | bytearray | memoryview

MAGIC = b"KVTB"
FORMAT_VERSION = 4
"""The newest format this kvtier reads and writes (a trailer); see :class:`FrameLayout`."""
HEADER_VERSION = 3
TRAILER_VERSION = 4
OLDEST_READ_VERSION = 2
HEADER_VERSION_2 = 2
HEADER_BYTES = 320
TAG_BYTES = 16
KEY_ID_BYTES = 8

_FIXED = struct.Struct("<4sHHQ16s")  # magic, version, key length, payload length, namespace
_KEY_OFFSET = _FIXED.size  # 32
_ALGORITHM_OFFSET = _KEY_OFFSET + MAX_KEY_BYTES  # 287
_KEY_ID_OFFSET = _ALGORITHM_OFFSET + 1  # 288
_RESERVED_OFFSET = _KEY_ID_OFFSET + KEY_ID_BYTES  # 296
_CHECK_OFFSET = _RESERVED_OFFSET + 8  # 304
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_PADDED = struct.Struct("<QQ")  # the xxh3 check and its 8 zero bytes
_ZERO_KEY_PAD = bytes(MAX_KEY_BYTES)
_ZERO_8 = bytes(8)
_ZERO_16 = bytes(16)
# Format 2's offsets: the mode byte sat where the algorithm sits, the checks elsewhere.
_V2_TAG_OFFSET = 288
_V2_CHECKSUM_OFFSET = 312


class Algorithm(enum.IntEnum):
    """How a frame proves it is whole (and, keyed, whose it is): the byte at offset 287."""

    XXH3 = 0          # xxh3_64: integrity only
    HMAC_SHA256 = 1   # format 2 only: read, never written
    BLAKE3 = 2        # keyed BLAKE3: integrity and authenticity


class FrameLayout(enum.Enum):
    """Where a medium's frames put their record, and so the format it writes."""

    HEADER = "header"    # format 3: record, then payload (whole values: memory, Redis, S3)
    TRAILER = "trailer"  # format 4: payload, then record (files: direct I/O into the target)

    @property
    def version(self) -> int:
        return HEADER_VERSION if self is FrameLayout.HEADER else TRAILER_VERSION


class Provenance(enum.Enum):
    """Who wrote a frame that verified, as far as the reader's next store cares."""

    CURRENT = "current"            # this format, the signing key (or unkeyed): keep it
    OLDER_KEY = "older_key"        # signed by a later key of the ring: rewrite it
    OLDER_FORMAT = "older_format"  # an older format than the reader writes: rewrite it


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


def _is_trailer(frame: Buffer, offset: int) -> bool:
    """Whether a record of format 4 or newer (a newer one is refused as foreign, not as damage)
    starts at ``offset`` of ``frame`` (magic and version only)."""
    return (frame[offset:offset + 4] == MAGIC
            and frame[offset + 4] | frame[offset + 5] << 8 >= TRAILER_VERSION)


def _is_header(frame: Buffer) -> bool:
    """Whether ``frame`` starts with the magic and a header format (2 or 3)."""
    return (frame[:4] == MAGIC and frame[4] in (HEADER_VERSION_2, HEADER_VERSION)
            and frame[5] == 0)


def record_offset(frame: Buffer) -> int:
    """Where the record of a whole ``frame`` starts: 0 (a header) or its size minus
    ``HEADER_BYTES`` (a format-4 trailer); a trailer is looked for first."""
    view = as_byte_view(frame, "frame")
    tail = view.nbytes - HEADER_BYTES
    return tail if tail >= 0 and _is_trailer(view, tail) else 0


def _check_magic_and_version(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version > FORMAT_VERSION:
        raise NewerVersion(f"frame format version {version}, newer than this kvtier's "
                           f"{FORMAT_VERSION}")
    if version < OLDEST_READ_VERSION:
        raise UnsupportedVersion(f"frame format version {version}, written by an older kvtier "
                                 f"(this one reads {OLDEST_READ_VERSION} to {FORMAT_VERSION})")


@dataclass(frozen=True, slots=True)
class FrameInfo:
    """What a header says about how its frame was written (nothing verified but the magic)."""

    version: int
    algorithm: int
    key_id: bytes  # zero bytes where the frame carries none


def frame_info(frame: Buffer) -> FrameInfo:
    """Version, algorithm and key id of a whole ``frame``'s record (magic and version
    checked; a format-4 trailer is looked for first)."""
    view = as_byte_view(frame, "frame")
    if view.nbytes < HEADER_BYTES:
        raise TruncatedFrame(f"frame is {view.nbytes} bytes, shorter than the header")
    record = view[record_offset(view):]
    magic, version, _key_len, _length, _digest = _FIXED.unpack_from(record)
    _check_magic_and_version(magic, version)
    key_id = (bytes(record[_KEY_ID_OFFSET:_RESERVED_OFFSET]) if version >= HEADER_VERSION
              else _ZERO_8)
    return FrameInfo(int(version), record[_ALGORITHM_OFFSET], key_id)
