"""The :class:`FrameCodec`: encodes and verifies the frames of one namespace.

This module owns no state: :class:`FrameCodec` is immutable after construction (its cache of
record parts is filled racily with identical bytes) and safe to share between threads (blake3
may hash a large payload on its own worker threads; they hold no kvtier state).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import blake3
import xxhash

from kvtier.codec.errors import (
    AuthenticationError,
    ChecksumMismatch,
    ForeignKey,
    FrameError,
    KeyMismatch,
    LengthMismatch,
    NamespaceMismatch,
    OutputSizeMismatch,
    TruncatedFrame,
    UnknownAlgorithm,
)
from kvtier.codec.keyring import KeyRing
from kvtier.codec.record import (
    _ALGORITHM_OFFSET,
    _CHECK_OFFSET,
    _CHECKSUM,
    _CHECKSUM_PADDED,
    _FIXED,
    _KEY_ID_OFFSET,
    _KEY_OFFSET,
    _RESERVED_OFFSET,
    _V2_CHECKSUM_OFFSET,
    _V2_TAG_OFFSET,
    _ZERO_8,
    _ZERO_16,
    _ZERO_KEY_PAD,
    HEADER_BYTES,
    HEADER_VERSION,
    HEADER_VERSION_2,
    MAGIC,
    TAG_BYTES,
    TRAILER_VERSION,
    Algorithm,
    Buffer,
    FrameLayout,
    Provenance,
    _check_digest,
    _check_magic_and_version,
    _is_header,
    _is_trailer,
)
from kvtier.keys import MAX_KEY_BYTES

PARALLEL_MIN_BYTES = 16 << 20
"""Payloads at least this large are hashed by blake3 on several cores; smaller ones on the
calling thread (blake3 releases the GIL either way, so a tier's I/O threads hash in parallel).
Measured on the 2-core test machine (interleaved medians): hashing alone, ``max_threads=AUTO``
against 1 is 0.35-0.5x at 64-256 KiB, 1.15x at 1 MiB, 1.2-1.6x at 4 MiB and 1.8x at 16 MiB; but in
a file-tier get (read, then verify) threads lose at 1 MiB (2.10 against 2.65 GB/s) and 4 MiB
(2.26 against 2.97 GB/s)."""


def _blake3_tag(mac_key: bytes, prefix: Buffer, payload: Buffer, nbytes: int, *,
                payload_first: bool = False) -> bytes:
    threads = blake3.blake3.AUTO if nbytes >= PARALLEL_MIN_BYTES else 1
    hasher = blake3.blake3(payload if payload_first else prefix, key=mac_key,
                           max_threads=threads)
    hasher.update(prefix if payload_first else payload)
    return hasher.digest(TAG_BYTES)


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

    def seal_template(self, key_len: int, nbytes: int) -> bytes | None:
        """The format-4 trailer of a payload of ``nbytes`` under a key of ``key_len`` bytes,
        with its key echo and checksum left zero, for a sealer that fills both in (the file
        tier's native store: the key at ``_KEY_OFFSET``, then, at ``_CHECK_OFFSET``, the
        little-endian xxh3-64 of the payload followed by the trailer's first ``_CHECK_OFFSET``
        bytes: :meth:`encode_trailer`'s rule). None where this codec signs (a keyed MAC) or
        writes headers."""
        if self._ring is not None or self._layout is not FrameLayout.TRAILER:
            return None
        return b"".join((self._parts.get((TRAILER_VERSION, key_len, nbytes))
                         or self._fixed_part(TRAILER_VERSION, key_len, nbytes),
                         bytes(key_len), self._pad_tail[key_len], _ZERO_16))

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

    def encode_records(self, keys: Sequence[bytes], payloads: Sequence[memoryview]) -> list[bytes]:
        """:meth:`encode_record` of each (key, payload) pair of a batch: the unkeyed trailer
        (the file tier's store) in one loop without a call per block, its fixed part looked up
        once per run of blocks of one key and payload length."""
        if self._ring is not None or self._layout is not FrameLayout.TRAILER:
            encode = self.encode_record
            return [encode(key, payload) for key, payload in zip(keys, payloads, strict=True)]
        records: list[bytes] = []
        append = records.append
        pack = _CHECKSUM_PADDED.pack
        hasher_of = xxhash.xxh3_64
        shape = (-1, -1)
        fixed = tail = b""
        for key, payload in zip(keys, payloads, strict=True):
            if (len(key), payload.nbytes) != shape:
                shape = (len(key), payload.nbytes)
                fixed = self._parts.get((TRAILER_VERSION, *shape)) or \
                    self._fixed_part(TRAILER_VERSION, *shape)
                tail = self._pad_tail[shape[0]]
            prefix = b"".join((fixed, key, tail))  # :meth:`_prefix` of format 4
            hasher = hasher_of(payload)
            hasher.update(prefix)
            append(prefix + pack(hasher.intdigest(), 0))
        return records

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
        if self.is_current(header, key, out, payload_bytes):
            return Provenance.CURRENT
        length = self._verify_header(header, key, payload_bytes)
        if length != out.nbytes:  # the medium should have returned the whole frame instead
            raise LengthMismatch(f"header says {length} payload bytes, out has {out.nbytes}")
        return self._verify_integrity(header, out)

    def is_current(self, header: Buffer, key: bytes, out: memoryview, payload_bytes: int) -> bool:
        """Whether ``header`` + ``out`` are exactly an unkeyed frame of this codec's format for
        ``key`` (the common case of :meth:`verify_in_place`, in two compares and one hash pass,
        raising nothing). False says only "not this case": :meth:`verify_in_place` then gives
        the verdict (and the precise error)."""
        if (self._ring is not None or type(header) is not bytes or len(header) != HEADER_BYTES
                or payload_bytes != out.nbytes or header[4] != self._version):
            return False
        fixed = self._parts.get((self._version, len(key), payload_bytes))
        if fixed is None or not header.startswith(b"".join((fixed, key,
                                                            self._pad_tail[len(key)]))):
            return False
        if self._layout is FrameLayout.TRAILER:
            hasher = xxhash.xxh3_64(out)
            hasher.update(header[:_CHECK_OFFSET])
        else:
            hasher = xxhash.xxh3_64(header[:_CHECK_OFFSET])
            hasher.update(out)
        return header.endswith(_CHECKSUM_PADDED.pack(hasher.intdigest(), 0))

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
