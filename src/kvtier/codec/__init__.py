"""The self-describing block frame: one stored object per KV block.

This package owns no state: :class:`KeyRing`, :class:`FrameCodec` and every function are
immutable or pure and safe to call from any thread (blake3 may hash a large payload on its own
worker threads; they hold no kvtier state). Its modules: ``record`` (the record's constants,
enums and fields), ``errors`` (the frame errors), ``keyring`` (:class:`KeyRing`),
``frame_codec`` (:class:`FrameCodec`) and ``functional`` (unkeyed helpers); every public name
is re-exported here.

Two layouts share one 320-byte record (``HEADER_BYTES``, little-endian), which says what the
frame holds and proves it:

    offset  size  field
         0     4  magic b"KVTB"
         4     2  format version (3: the record is a header, 4: a trailer)
         6     2  key length (1 .. MAX_KEY_BYTES)
         8     8  payload length in bytes
        16    16  namespace digest
        32   255  key echo, zero-padded to MAX_KEY_BYTES
       287     1  integrity algorithm (:class:`Algorithm`): 0 = xxh3_64 checksum,
                  2 = keyed BLAKE3 MAC
       288     8  key id (algorithm 2): which key of the writer's :class:`KeyRing` signed (a
                  one-way fingerprint of it); zero for algorithm 0
       296     8  reserved, zero
       304    16  the check: the MAC tag (BLAKE3 keyed with a key derived from the auth key, 128
                  bits), or the xxh3_64 checksum followed by 8 zero bytes

- Format 3 (:attr:`FrameLayout.HEADER`): the record, then the payload; the check covers record
  bytes [0, 304), then the payload. Media that hand out a whole value (memory, Redis, S3) write it.
- Format 4 (:attr:`FrameLayout.TRAILER`, the file tier): the payload at offset 0, then the
  record as a trailer; the check covers the payload, then record bytes [0, 304). A reader reads
  the payload straight into its (page-aligned) destination and the trailer into a small buffer
  (``preadv``), buffered or O_DIRECT, with no bounce copy; the payload's pages are the file's.

A reader accepts formats 2, 3 and 4 whatever it writes: a frame in the other layout of the same
record (a format-3 file written by kvtier before format 4) verifies and is reported as
:attr:`Provenance.OLDER_FORMAT` where the reader writes format 4, so that the next store of its
key rewrites it.

Format 2 (kvtier before key rotation) is still read: the same bytes [0, 287), then an integrity
mode at 287 (0: xxh3_64 over [0, 312) stored at 312; 1: HMAC-SHA256 over [0, 288) and the
payload, truncated to 128 bits, at 288) and no key id, so a keyed reader tries each of its keys.
Such a frame is served and reported as :attr:`Provenance.OLDER_FORMAT`, so that the backend's
next store of its key rewrites it in the reader's format.

The record has a fixed size so that readers can pre-size buffers; keys are therefore bounded by
``MAX_KEY_BYTES`` (255). The check covers every record byte before it and the payload, so a
flipped byte anywhere in the frame is detected. Empty (0-byte) payloads are valid frames.

A reader with a key ring accepts only keyed frames whose tag verifies under one of its keys; a
reader without one accepts only unkeyed frames; everything else raises a :class:`FrameError`.
Two kinds of refusal are not proof of damage and raise a :class:`ForeignFrame`: a frame signed
by a key the reader does not hold (:class:`ForeignKey`: a key rotation in progress, or another
tenant), and a frame in a newer format or with an unknown algorithm (a newer kvtier). Backends
never serve those, and leave them in place for a writer that can read them; the reader's own
next store of the key replaces them.

Verification order: magic, version, namespace, key, length against the frame's size, the
algorithm (and key id), the check, and only then the length against the caller's buffer, so a
damaged length field is always a frame error, never a caller error. A whole frame is split by
its reader's layout first (a format-4 trailer at its end, else a header at its start), then the
other.
"""

from __future__ import annotations

from kvtier.codec.errors import (
    AuthenticationError,
    BadMagic,
    ChecksumMismatch,
    ForeignFrame,
    ForeignKey,
    FrameError,
    KeyMismatch,
    LengthMismatch,
    NamespaceMismatch,
    NewerVersion,
    OutputSizeMismatch,
    TruncatedFrame,
    UnknownAlgorithm,
    UnsupportedVersion,
)
from kvtier.codec.frame_codec import PARALLEL_MIN_BYTES, FrameCodec
from kvtier.codec.functional import (
    decode_into,
    encode,
    encode_header,
    payload_length,
    verify_frame,
)
from kvtier.codec.keyring import KeyRing
from kvtier.codec.record import (
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_VERSION,
    HEADER_VERSION_2,
    KEY_ID_BYTES,
    MAGIC,
    OLDEST_READ_VERSION,
    TAG_BYTES,
    TRAILER_VERSION,
    Algorithm,
    Buffer,
    FrameInfo,
    FrameLayout,
    Provenance,
    as_byte_view,
    frame_info,
    frame_size,
    record_offset,
)

__all__ = [
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "HEADER_VERSION",
    "HEADER_VERSION_2",
    "KEY_ID_BYTES",
    "MAGIC",
    "OLDEST_READ_VERSION",
    "PARALLEL_MIN_BYTES",
    "TAG_BYTES",
    "TRAILER_VERSION",
    "Algorithm",
    "AuthenticationError",
    "BadMagic",
    "Buffer",
    "ChecksumMismatch",
    "ForeignFrame",
    "ForeignKey",
    "FrameCodec",
    "FrameError",
    "FrameInfo",
    "FrameLayout",
    "KeyMismatch",
    "KeyRing",
    "LengthMismatch",
    "NamespaceMismatch",
    "NewerVersion",
    "OutputSizeMismatch",
    "Provenance",
    "TruncatedFrame",
    "UnknownAlgorithm",
    "UnsupportedVersion",
    "as_byte_view",
    "decode_into",
    "encode",
    "encode_header",
    "frame_info",
    "frame_size",
    "payload_length",
    "record_offset",
    "verify_frame",
]
