"""The self-describing block frame: one stored object per KV block.

This module owns no state: :class:`KeyRing`, :class:`FrameCodec` and every function are
immutable or pure and safe to call from any thread (blake3 may hash a large payload on its own
worker threads; they hold no kvtier state).

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

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import blake3
import xxhash

from kvtier.errors import KvtierError
from kvtier.keys import MAX_KEY_BYTES, NAMESPACE_DIGEST_BYTES, check_key

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

# BLAKE3 derive-key contexts: the MAC key and the key id are independent one-way functions of
# the configured key, so a key id in a frame tells nothing about the MAC key.
_MAC_KEY_CONTEXT = "kvtier 2026-12-02 frame MAC key"
_KEY_ID_CONTEXT = "kvtier 2026-12-02 frame key id"
PARALLEL_MIN_BYTES = 16 << 20
"""Payloads at least this large are hashed by blake3 on several cores; smaller ones on the
calling thread (blake3 releases the GIL either way, so a tier's I/O threads hash in parallel).
Measured on the 2-core test machine (interleaved medians): hashing alone, ``max_threads=AUTO``
against 1 is 0.35-0.5x at 64-256 KiB, 1.15x at 1 MiB, 1.2-1.6x at 4 MiB and 1.8x at 16 MiB; but in
a file-tier get (read, then verify) threads lose at 1 MiB (2.10 against 2.65 GB/s) and 4 MiB
(2.26 against 2.97 GB/s)."""


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


class FrameError(KvtierError):
    """A stored frame is not the block that was asked for (corrupt, foreign or truncated)."""


class ForeignFrame(FrameError):
    """A frame this reader cannot judge (another key, a newer format): refused, but not proof
    of damage, so backends leave it for a writer that can read it."""


class BadMagic(FrameError):
    """The frame does not start with the kvtier magic bytes."""


class UnsupportedVersion(FrameError):
    """The frame was written by an unknown format version."""


class NewerVersion(UnsupportedVersion, ForeignFrame):
    """The frame's format version is newer than this kvtier's."""


class UnknownAlgorithm(ForeignFrame):
    """The frame's integrity algorithm is not one this kvtier knows."""


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
    """The frame has no valid MAC under the reader's keys, or is keyed while the reader is not
    (or the reverse)."""


class ForeignKey(AuthenticationError, ForeignFrame):
    """The frame names a signing key that is not in the reader's key ring."""


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


# --------------------------------------------------------------------------- keys


def _derive(context: str, secret: bytes, length: int) -> bytes:
    return blake3.blake3(secret, derive_key_context=context).digest(length)


@dataclass(frozen=True, slots=True, repr=False)
class _RingKey:
    secret: bytes   # the configured key (format 2's HMAC key)
    key_id: bytes   # KEY_ID_BYTES, written into the frames it signs
    mac_key: bytes  # BLAKE3's 32-byte key


class KeyRing:
    """The auth keys of a tier: the first signs every new frame, every one verifies.

    Immutable; never shows a key (``repr`` counts them).
    """

    __slots__ = ("_by_id", "_keys")

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not isinstance(keys, (list, tuple)) or not keys:
            raise ValueError("auth keys must be a non-empty list of non-empty bytes")
        ring: list[_RingKey] = []
        by_id: dict[bytes, int] = {}
        for index, secret in enumerate(keys):
            if not isinstance(secret, bytes) or not secret:
                raise ValueError(f"auth key {index + 1} must be non-empty bytes")
            entry = _RingKey(secret, _derive(_KEY_ID_CONTEXT, secret, KEY_ID_BYTES),
                             _derive(_MAC_KEY_CONTEXT, secret, 32))
            if entry.key_id in by_id:
                raise ValueError(f"auth key {index + 1} repeats key {by_id[entry.key_id] + 1}")
            by_id[entry.key_id] = index
            ring.append(entry)
        self._keys = tuple(ring)
        self._by_id = by_id

    @classmethod
    def of(cls, value: bytes | KeyRing | Sequence[bytes]) -> KeyRing:
        """``value`` as a ring: a ring as is, one key, or keys in order (the first signs)."""
        if isinstance(value, KeyRing):
            return value
        if isinstance(value, bytes):
            return cls([value])
        return cls(value)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"KeyRing({len(self._keys)} key{'s' if len(self._keys) != 1 else ''})"

    @property
    def key_ids(self) -> tuple[bytes, ...]:
        """The key ids frames carry, in ring order (fingerprints: they reveal no key)."""
        return tuple(entry.key_id for entry in self._keys)

    @property
    def signing(self) -> _RingKey:
        return self._keys[0]

    @property
    def entries(self) -> tuple[_RingKey, ...]:
        return self._keys

    def find(self, key_id: bytes) -> int | None:
        """The position of the key with ``key_id`` (0: the signing key), or None."""
        return self._by_id.get(key_id)


def _blake3_tag(mac_key: bytes, prefix: Buffer, payload: Buffer, nbytes: int, *,
                payload_first: bool = False) -> bytes:
    threads = blake3.blake3.AUTO if nbytes >= PARALLEL_MIN_BYTES else 1
    hasher = blake3.blake3(payload if payload_first else prefix, key=mac_key,
                           max_threads=threads)
    hasher.update(prefix if payload_first else payload)
    return hasher.digest(TAG_BYTES)


# --------------------------------------------------------------------------- the codec


class FrameCodec:
    """Encodes and verifies the frames of one namespace, with or without auth keys.

    ``layout`` is what it writes (and counts as current); it reads every layout. Immutable after
    construction; safe to share between threads.
    """

    __slots__ = ("_digest", "_layout", "_pad_tail", "_parts", "_ring", "_tail", "_version")

    def __init__(self, namespace_digest: bytes,
                 auth_key: bytes | KeyRing | Sequence[bytes] | None = None,
                 layout: FrameLayout = FrameLayout.HEADER) -> None:
        _check_digest(namespace_digest)
        if not isinstance(layout, FrameLayout):
            raise TypeError(f"layout must be a FrameLayout, got {layout!r}")
        self._digest = namespace_digest
        self._layout = layout
        self._version = layout.version
        self._ring = None if auth_key is None else KeyRing.of(auth_key)
        # Record bytes [287, 304) of every frame this codec writes: algorithm, key id, reserved.
        if self._ring is None:
            self._tail = bytes((Algorithm.XXH3,)) + _ZERO_16
        else:
            self._tail = bytes((Algorithm.BLAKE3,)) + self._ring.signing.key_id + _ZERO_8
        # Per key length: the key echo's zero padding and the tail (the store path's parts).
        self._pad_tail = tuple(_ZERO_KEY_PAD[length:] + self._tail
                               for length in range(MAX_KEY_BYTES + 1))
        # (version, key length, payload length) -> record bytes [0, 32) (:meth:`_fixed_part`).
        self._parts: dict[tuple[int, int, int], bytes] = {}

    @property
    def keyed(self) -> bool:
        return self._ring is not None

    @property
    def ring(self) -> KeyRing | None:
        return self._ring

    @property
    def layout(self) -> FrameLayout:
        return self._layout

    # -- encoding -----------------------------------------------------------------------------

    def _prefix(self, version: int, key: bytes, nbytes: int) -> bytes:
        return (_FIXED.pack(MAGIC, version, len(key), nbytes, self._digest) + key
                + _ZERO_KEY_PAD[len(key):] + self._tail)

    def _fixed_part(self, version: int, key_len: int, nbytes: int) -> bytes:
        """Record bytes [0, 32) for a version, key length and payload length, cached (a few
        block sizes and key lengths in practice; a lost race computes the same bytes)."""
        cache = self._parts
        if len(cache) > 64:
            cache.clear()
        fixed = cache[(version, key_len, nbytes)] = _FIXED.pack(
            MAGIC, version, key_len, nbytes, self._digest)
        return fixed

    def _trailer_prefix(self, key: bytes, nbytes: int) -> bytes:
        """:meth:`_prefix` of format 4 from cached parts (the store path builds one a block)."""
        fixed = self._parts.get((TRAILER_VERSION, len(key), nbytes))
        if fixed is None:
            fixed = self._fixed_part(TRAILER_VERSION, len(key), nbytes)
        return b"".join((fixed, key, self._pad_tail[len(key)]))

    def encode_header(self, key: bytes, payload: memoryview) -> bytes:
        """The format-3 header for ``payload`` (a flat byte view) under a valid ``key``."""
        prefix = self._prefix(HEADER_VERSION, key, payload.nbytes)
        return prefix + _check(self._ring, prefix, payload, payload_first=False)

    def encode_trailer(self, key: bytes, payload: memoryview) -> bytes:
        """The format-4 trailer that follows ``payload`` (a flat byte view) under ``key``."""
        prefix = self._trailer_prefix(key, payload.nbytes)
        if self._ring is None:
            hasher = xxhash.xxh3_64(payload)
            hasher.update(prefix)
            return prefix + _CHECKSUM_PADDED.pack(hasher.intdigest(), 0)
        return prefix + _check(self._ring, prefix, payload, payload_first=True)

    def encode_record(self, key: bytes, payload: memoryview) -> bytes:
        """The header or trailer of ``payload``, as this codec's layout places it."""
        if self._layout is FrameLayout.TRAILER:
            return self.encode_trailer(key, payload)
        return self.encode_header(key, payload)

    # -- verification -------------------------------------------------------------------------

    def split(self, frame: memoryview) -> tuple[memoryview, memoryview]:
        """(record, payload) of a whole frame: its layout's place for the record first."""
        tail = frame.nbytes - HEADER_BYTES
        trailer = tail >= 0 and _is_trailer(frame, tail)
        if not trailer or (self._layout is FrameLayout.HEADER and _is_header(frame)):
            return frame[:HEADER_BYTES], frame[HEADER_BYTES:]
        return frame[tail:], frame[:tail]

    def decode(self, frame: memoryview, key: bytes, out: memoryview, *,
               trusted: bool = False) -> Provenance:
        """Verify a whole ``frame``, then copy its payload into ``out`` (untouched on error).

        ``trusted``: the caller guarantees ``frame`` is a frame this codec encoded for ``key``
        and nothing can have changed it since (private process memory); only the size is
        checked, the bytes are copied once.
        """
        if trusted and frame.nbytes - HEADER_BYTES == out.nbytes:
            if self._layout is FrameLayout.TRAILER:
                out[:] = frame[:out.nbytes]
            else:
                out[:] = frame[HEADER_BYTES:]
            return Provenance.CURRENT
        record, payload = self.split(frame)
        length = self._verify_header(record, key, payload.nbytes)
        provenance = self._verify_integrity(record, payload)
        if out.nbytes != length:
            raise OutputSizeMismatch(f"out has {out.nbytes} bytes, the frame payload has {length}")
        out[:] = payload
        return provenance

    def verify_in_place(self, header: Buffer, key: bytes, out: memoryview,
                        payload_bytes: int) -> Provenance:
        """Verify a record (``header``: a header or trailer) + the payload already read into
        ``out`` (one pass over ``out``).

        ``payload_bytes`` is how many bytes the stored object carried besides its record.
        """
        if (self._ring is None and type(header) is bytes and len(header) == HEADER_BYTES
                and payload_bytes == out.nbytes
                and header[4] == self._version):
            # The common case (an unkeyed record of this codec's format) in two compares and
            # one hash pass, without the calls of the general path below.
            fixed = self._parts.get((self._version, len(key), payload_bytes))
            if fixed is not None and header.startswith(
                    b"".join((fixed, key, self._pad_tail[len(key)]))):
                payload_first = self._layout is FrameLayout.TRAILER
                hasher = xxhash.xxh3_64(out if payload_first else header[:_CHECK_OFFSET])
                hasher.update(header[:_CHECK_OFFSET] if payload_first else out)
                if header.endswith(_CHECKSUM_PADDED.pack(hasher.intdigest(), 0)):
                    return Provenance.CURRENT
        length = self._verify_header(header, key, payload_bytes)
        if length != out.nbytes:  # the medium should have returned the whole frame instead
            raise LengthMismatch(f"header says {length} payload bytes, out has {out.nbytes}")
        return self._verify_integrity(header, out)

    def verify(self, frame: memoryview, key: bytes) -> int:
        """Verify a whole frame without copying it; its payload length."""
        record, payload = self.split(frame)
        length = self._verify_header(record, key, payload.nbytes)
        self._verify_integrity(record, payload)
        return length

    def _verify_header(self, header: Buffer, key: bytes, actual: int) -> int:
        """The payload length, if record bytes [0, 287) are exactly what this codec would write
        for ``key`` and ``actual`` payload bytes (or an older format's record that matches the
        same way); else the precise :class:`FrameError`."""
        if actual >= 0 and len(header) >= HEADER_BYTES:
            # The common case in one compare (a memoryview compares slowly: copy 287 bytes).
            prefix = bytes(header[:_ALGORITHM_OFFSET]) if type(header) is not bytes else header
            fixed = self._parts.get((self._version, len(key), actual))
            if fixed is None:
                fixed = self._fixed_part(self._version, len(key), actual)
            if prefix.startswith(b"".join((fixed, key, _ZERO_KEY_PAD[len(key):]))):
                return actual
        return self._diagnose(memoryview(header), key, actual)

    def _diagnose(self, header: memoryview, key: bytes, actual: int) -> int:
        """Which check a record fails, in the documented order (the slow path; also the path
        of every frame in another format than this codec writes)."""
        if header.nbytes < HEADER_BYTES or actual < 0:
            raise TruncatedFrame(f"frame is {header.nbytes} bytes, shorter than the header")
        magic, version, key_len, length, digest = _FIXED.unpack_from(header)
        _check_magic_and_version(magic, version)
        if digest != self._digest:
            raise NamespaceMismatch(
                f"frame namespace {bytes(digest).hex()}, expected {self._digest.hex()}"
            )
        if key_len != len(key) or bytes(header[_KEY_OFFSET:_ALGORITHM_OFFSET]) != (
            key + _ZERO_KEY_PAD[len(key):]
        ):
            stored_key = bytes(header[_KEY_OFFSET : _KEY_OFFSET + min(key_len, MAX_KEY_BYTES)])
            raise KeyMismatch(f"frame key {stored_key.hex()}, expected {key.hex()}")
        if actual < length:
            raise TruncatedFrame(f"frame carries {actual} payload bytes, header says {length}")
        if actual > length:
            raise LengthMismatch(f"frame carries {actual} payload bytes, header says {length}")
        return int(length)

    def _verify_integrity(self, header: Buffer, payload: memoryview) -> Provenance:
        """The check of a record already matched by :meth:`_verify_header` (format 2, 3, 4)."""
        version = header[4]
        if version == HEADER_VERSION_2:
            return self._verify_format_2(header, payload)
        payload_first = version == TRAILER_VERSION
        older = version < self._version
        tail = header[_ALGORITHM_OFFSET:_CHECK_OFFSET]
        algorithm = header[_ALGORITHM_OFFSET]
        if self._ring is None:
            hasher = xxhash.xxh3_64(payload if payload_first else header[:_CHECK_OFFSET])
            hasher.update(header[:_CHECK_OFFSET] if payload_first else payload)
            # The common case in one compare: this codec's tail, the checksum, 8 zero bytes.
            if header[_ALGORITHM_OFFSET:] == self._tail + _CHECKSUM_PADDED.pack(
                    hasher.intdigest(), 0):
                return Provenance.OLDER_FORMAT if older else Provenance.CURRENT
            if tail != self._tail:
                raise _unexpected_tail(algorithm, keyed_reader=False)
            (stored,) = _CHECKSUM.unpack_from(header, _CHECK_OFFSET)
            if hasher.intdigest() != stored or header[_CHECK_OFFSET + 8:HEADER_BYTES] != _ZERO_8:
                raise ChecksumMismatch(
                    f"checksum {hasher.intdigest():#018x}, stored {stored:#018x}"
                )
            return Provenance.OLDER_FORMAT if older else Provenance.CURRENT
        if tail == self._tail:
            position = 0
        elif algorithm != Algorithm.BLAKE3:
            raise _unexpected_tail(algorithm, keyed_reader=True)
        else:
            key_id = bytes(header[_KEY_ID_OFFSET:_RESERVED_OFFSET])
            found = self._ring.find(key_id)
            if found is None:
                raise ForeignKey(f"frame signed by key id {key_id.hex()}, which is none of "
                                 f"this tier's {len(self._ring)} auth key(s)")
            if header[_RESERVED_OFFSET:_CHECK_OFFSET] != _ZERO_8:
                raise ChecksumMismatch("reserved header bytes are not zero")
            position = found
        mac_key = self._ring.entries[position].mac_key
        expected = _blake3_tag(mac_key, header[:_CHECK_OFFSET], payload, payload.nbytes,
                               payload_first=payload_first)
        if not hmac.compare_digest(expected, header[_CHECK_OFFSET:HEADER_BYTES]):
            raise AuthenticationError("MAC tag does not verify under the auth key it names")
        if position:
            return Provenance.OLDER_KEY
        return Provenance.OLDER_FORMAT if older else Provenance.CURRENT

    def _verify_format_2(self, header: Buffer, payload: memoryview) -> Provenance:
        mode = header[_ALGORITHM_OFFSET]
        if mode == Algorithm.XXH3 and self._ring is None:
            hasher = xxhash.xxh3_64(header[:_V2_CHECKSUM_OFFSET])
            hasher.update(payload)
            (stored,) = _CHECKSUM.unpack_from(header, _V2_CHECKSUM_OFFSET)
            if hasher.intdigest() != stored:
                raise ChecksumMismatch(
                    f"format-2 checksum {hasher.intdigest():#018x}, stored {stored:#018x}")
            return Provenance.OLDER_FORMAT
        if mode == Algorithm.HMAC_SHA256 and self._ring is not None:
            stored_tag = header[_V2_TAG_OFFSET:_V2_TAG_OFFSET + TAG_BYTES]
            if header[_V2_TAG_OFFSET + TAG_BYTES:HEADER_BYTES] != _ZERO_16:
                raise ChecksumMismatch("reserved header bytes are not zero")
            for position, entry in enumerate(self._ring.entries):
                mac = hmac.new(entry.secret, header[:_V2_TAG_OFFSET], hashlib.sha256)
                mac.update(payload)
                if hmac.compare_digest(mac.digest()[:TAG_BYTES], stored_tag):
                    return Provenance.OLDER_FORMAT if position == 0 else Provenance.OLDER_KEY
            raise AuthenticationError("format-2 HMAC tag verifies under none of this tier's "
                                      f"{len(self._ring)} auth key(s)")
        if mode in (Algorithm.XXH3, Algorithm.HMAC_SHA256):
            raise AuthenticationError(_mode_mismatch(mode, keyed_reader=self._ring is not None))
        raise ChecksumMismatch(f"format-2 frame with integrity mode {mode} (only 0 and 1 exist)")


def _check(ring: KeyRing | None, prefix: bytes, payload: memoryview, *,
           payload_first: bool) -> bytes:
    """Record bytes [304, 320) over ``prefix`` (bytes [0, 304)) and ``payload``."""
    if ring is None:
        hasher = xxhash.xxh3_64(payload if payload_first else prefix)
        hasher.update(prefix if payload_first else payload)
        return _CHECKSUM.pack(hasher.intdigest()) + _ZERO_8
    return _blake3_tag(ring.signing.mac_key, prefix, payload, payload.nbytes,
                       payload_first=payload_first)


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


def _mode_mismatch(algorithm: int, *, keyed_reader: bool) -> str:
    if keyed_reader:
        return (f"frame integrity algorithm {algorithm}: not signed with a key, but this tier "
                "has one")
    return f"frame integrity algorithm {algorithm}: signed with a key, but this tier has none"


def _unexpected_tail(algorithm: int, *, keyed_reader: bool) -> FrameError:
    """The error for format-3/4 record bytes [287, 304) that are not this reader's."""
    if algorithm not in (Algorithm.XXH3, Algorithm.BLAKE3):
        return UnknownAlgorithm(f"frame integrity algorithm {algorithm}: not one this kvtier "
                                "knows (written by a newer kvtier?)")
    if (algorithm == Algorithm.BLAKE3) != keyed_reader:
        return AuthenticationError(_mode_mismatch(algorithm, keyed_reader=keyed_reader))
    return ChecksumMismatch("key id or reserved header bytes are not zero")


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


# --------------------------------------------------------------------------- functional API
# Unkeyed helpers over :class:`FrameCodec`, with full argument checks.


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
