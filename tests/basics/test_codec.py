"""The block frame: layout, every kind of mismatch, and the one-copy encode."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import codec
from kvtier.keys import Namespace

NS = Namespace(model="codec-test").digest
OTHER_NS = Namespace(model="codec-test", dtype="float16").digest
KEY = hashlib.blake2b(b"key", digest_size=16).digest()


def decode(
    frame: bytes | bytearray, size: int | None = None, *, ns: bytes = NS, key: bytes = KEY
) -> bytes:
    out = bytearray(len(frame) - codec.HEADER_BYTES if size is None else size)
    codec.decode_into(frame, ns, key, memoryview(out))
    return bytes(out)


def test_header_size_is_constant_and_frame_size_adds_it() -> None:
    assert codec.HEADER_BYTES == 320
    for payload in (b"", b"x", bytes(5000)):
        assert len(codec.encode_header(NS, KEY, payload)) == codec.HEADER_BYTES
        assert len(codec.encode(NS, KEY, payload)) == codec.frame_size(len(payload))
    long_key = bytes(range(255))
    assert len(codec.encode_header(NS, long_key, b"abc")) == codec.HEADER_BYTES
    with pytest.raises(ValueError, match="payload_len"):
        codec.frame_size(-1)


@pytest.mark.parametrize("size", [0, 1, 319, 320, 4096, 1 << 20])
def test_roundtrip(size: int) -> None:
    payload = np.random.default_rng(size).bytes(size)
    frame = codec.encode(NS, KEY, payload)
    assert frame[: codec.HEADER_BYTES] == codec.encode_header(NS, KEY, payload)
    assert bytes(frame[codec.HEADER_BYTES :]) == payload
    assert decode(frame) == payload
    assert codec.payload_length(frame) == size


def test_encode_copies_the_payload_once_and_owns_its_bytes() -> None:
    payload = bytearray(np.random.default_rng(1).bytes(32 << 20))
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        frame = codec.encode(NS, KEY, memoryview(payload))
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # One frame-sized allocation (plus small change), never a second copy of the payload.
    assert peak < len(payload) + (1 << 20)
    expected = bytes(payload)
    payload[:] = bytes(len(payload))
    assert bytes(frame[codec.HEADER_BYTES :]) == expected


def test_numpy_and_multidimensional_payloads() -> None:
    array = np.arange(1024, dtype=np.float32).reshape(32, 32)
    frame = codec.encode(NS, KEY, array.data)
    target = np.zeros_like(array)
    codec.decode_into(frame, NS, KEY, target.data)
    assert np.array_equal(target, array)
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(NS, KEY, array[:, ::2].data)


def _expect(
    error: type[Exception], frame: bytes | bytearray, size: int = 100, **kwargs: bytes
) -> None:
    out = bytearray(b"\xa5") * size
    with pytest.raises(error):
        codec.decode_into(frame, kwargs.get("ns", NS), kwargs.get("key", KEY), memoryview(out))
    assert out == bytearray(b"\xa5") * size, "out must be untouched on error"


def test_each_mismatch_raises_its_own_error_and_leaves_out_untouched() -> None:
    payload = bytes(range(100))
    frame = bytes(codec.encode(NS, KEY, payload))

    _expect(codec.BadMagic, b"XXXX" + frame[4:])
    _expect(codec.UnsupportedVersion, frame[:4] + (99).to_bytes(2, "little") + frame[6:])
    _expect(codec.NamespaceMismatch, frame, ns=OTHER_NS)
    _expect(codec.KeyMismatch, frame, key=KEY[:-1] + bytes([KEY[-1] ^ 1]))
    _expect(codec.KeyMismatch, frame, key=KEY + b"\x00")
    _expect(codec.LengthMismatch, frame + b"\x00", size=100)
    _expect(codec.TruncatedFrame, frame[:-1], size=100)
    _expect(codec.TruncatedFrame, frame[: codec.HEADER_BYTES - 1], size=100)
    _expect(codec.TruncatedFrame, b"", size=100)
    flipped = bytearray(frame)
    flipped[-1] ^= 0x40
    _expect(codec.ChecksumMismatch, flipped)
    for error in (
        codec.BadMagic,
        codec.UnsupportedVersion,
        codec.NamespaceMismatch,
        codec.KeyMismatch,
        codec.LengthMismatch,
        codec.TruncatedFrame,
        codec.ChecksumMismatch,
    ):
        assert issubclass(error, codec.FrameError)


def test_wrong_size_out_is_a_caller_error_not_a_frame_error() -> None:
    frame = codec.encode(NS, KEY, bytes(100))
    assert not issubclass(codec.OutputSizeMismatch, codec.FrameError)
    _expect(codec.OutputSizeMismatch, frame, size=99)
    _expect(codec.OutputSizeMismatch, frame, size=101)


def test_every_single_byte_flip_is_detected() -> None:
    """Exhaustive over a small frame: a flip anywhere (header, padding, payload) is caught."""
    payload = bytes(range(64))
    frame = bytes(codec.encode(NS, KEY, payload))
    out = bytearray(64)
    for position in range(len(frame)):
        for bit in (0x01, 0x80):
            corrupt = bytearray(frame)
            corrupt[position] ^= bit
            with pytest.raises((codec.FrameError, codec.OutputSizeMismatch)):
                codec.decode_into(corrupt, NS, KEY, memoryview(out))
    assert out == bytearray(64)


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=255),
    payload=st.binary(max_size=2048),
    position=st.integers(min_value=0),
    bit=st.integers(min_value=0, max_value=7),
)
def test_property_roundtrip_and_flip_detection(
    key: bytes, payload: bytes, position: int, bit: int
) -> None:
    frame = codec.encode(NS, key, payload)
    out = bytearray(len(payload))
    codec.decode_into(frame, NS, key, memoryview(out))
    assert bytes(out) == payload
    corrupt = bytearray(frame)
    corrupt[position % len(corrupt)] ^= 1 << bit
    with pytest.raises((codec.FrameError, codec.OutputSizeMismatch)):
        codec.decode_into(corrupt, NS, key, memoryview(bytearray(len(payload))))


def test_bad_arguments_name_what_was_expected() -> None:
    with pytest.raises(ValueError, match="namespace_digest must be 16 bytes"):
        codec.encode(b"short", KEY, b"")
    with pytest.raises(ValueError, match=r"1\.\.255 bytes"):
        codec.encode(NS, b"", b"")
    with pytest.raises(ValueError, match=r"1\.\.255 bytes"):
        codec.encode(NS, bytes(256), b"")
    with pytest.raises(TypeError, match="BlockKey"):
        codec.encode(NS, "text-key", b"")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="payload must be bytes"):
        codec.encode(NS, KEY, "text")  # type: ignore[arg-type]
    frame = codec.encode(NS, KEY, b"abc")
    with pytest.raises(TypeError, match="writable"):
        codec.decode_into(frame, NS, KEY, memoryview(b"xyz"))


def test_verify_frame_checks_everything_and_returns_the_length() -> None:
    key = b"k" * 16
    frame = codec.encode(NS, key, b"p" * 777)
    assert codec.verify_frame(frame, NS, key) == 777
    for offset in (9, 100, codec.HEADER_BYTES + 5, len(frame) - 1):
        damaged = bytearray(frame)
        damaged[offset] ^= 0x01
        with pytest.raises(codec.FrameError):
            codec.verify_frame(damaged, NS, key)
    with pytest.raises(codec.KeyMismatch):
        codec.verify_frame(frame, NS, b"x" * 16)


# --------------------------------------------------------------------------- format 3, keys

OLD = b"old-secret-key-0123456789abcdef"
NEW = b"new-secret-key-fedcba9876543210"


def format_2_frame(namespace_digest: bytes, key: bytes, payload: bytes,
                   auth_key: bytes | None = None) -> bytes:
    """A frame exactly as kvtier wrote it before format 3 (xxh3 at 312, or HMAC-SHA256/128 at
    288 over bytes [0, 288) and the payload)."""
    import hmac
    import struct

    import xxhash

    prefix = (struct.pack("<4sHHQ16s", b"KVTB", 2, len(key), len(payload), namespace_digest)
              + key + bytes(255 - len(key)) + bytes((0 if auth_key is None else 1,)))
    if auth_key is None:
        hasher = xxhash.xxh3_64(prefix + bytes(24))
        hasher.update(payload)
        return prefix + bytes(24) + struct.pack("<Q", hasher.intdigest()) + payload
    mac = hmac.new(auth_key, prefix, hashlib.sha256)
    mac.update(payload)
    return prefix + mac.digest()[:16] + bytes(16) + payload


def _keyed(ring: list[bytes]) -> codec.FrameCodec:
    return codec.FrameCodec(NS, codec.KeyRing(ring))


def _encode_with(frame_codec: codec.FrameCodec, payload: bytes, key: bytes = KEY) -> bytes:
    view = memoryview(payload)
    return frame_codec.encode_header(key, view) + payload


def _decode_with(frame_codec: codec.FrameCodec, frame: bytes, size: int,
                 key: bytes = KEY) -> tuple[codec.Provenance, bytes]:
    out = bytearray(b"\xa5") * size
    provenance = frame_codec.decode(memoryview(frame), key, memoryview(out))
    return provenance, bytes(out)


def test_format_3_header_names_its_algorithm_and_signing_key() -> None:
    """Before: a mode byte (0/1) and no key id; HMAC-SHA256 was the only MAC."""
    payload = bytes(range(200))
    unkeyed = codec.encode(NS, KEY, payload)
    assert codec.frame_info(unkeyed) == codec.FrameInfo(3, codec.Algorithm.XXH3, bytes(8))
    ring = codec.KeyRing([NEW, OLD])
    keyed = _encode_with(codec.FrameCodec(NS, ring), payload)
    info = codec.frame_info(keyed)
    assert (info.version, info.algorithm, info.key_id) == (3, codec.Algorithm.BLAKE3,
                                                           ring.key_ids[0])
    assert len(set(ring.key_ids)) == 2 and all(len(i) == codec.KEY_ID_BYTES for i in ring.key_ids)
    assert NEW not in keyed and hashlib.sha256(NEW).digest()[:8] not in keyed
    assert repr(ring) == "KeyRing(2 keys)"


def test_every_key_of_the_ring_verifies_and_the_first_signs() -> None:
    payload = b"rotation" * 100
    old_frame = _encode_with(_keyed([OLD]), payload)
    rotated = _keyed([NEW, OLD])
    assert _decode_with(rotated, old_frame, len(payload)) == (codec.Provenance.OLDER_KEY, payload)
    new_frame = _encode_with(rotated, payload)
    assert _decode_with(rotated, new_frame, len(payload)) == (codec.Provenance.CURRENT, payload)
    assert _decode_with(_keyed([OLD, NEW]), new_frame, len(payload))[0] is (
        codec.Provenance.OLDER_KEY)
    # A reader that holds only the old key refuses the new frames as foreign, never serves them.
    out = bytearray(b"\xa5") * len(payload)
    with pytest.raises(codec.ForeignKey, match="none of this tier's 1 auth key"):
        _keyed([OLD]).decode(memoryview(new_frame), KEY, memoryview(out))
    assert out == bytearray(b"\xa5") * len(payload)
    assert issubclass(codec.ForeignKey, codec.AuthenticationError)
    assert issubclass(codec.ForeignKey, codec.ForeignFrame)


def test_a_tag_forged_under_a_held_key_id_is_an_authentication_error_not_foreign() -> None:
    payload = b"x" * 64
    frame = bytearray(_encode_with(_keyed([OLD]), payload))
    frame[codec.HEADER_BYTES - 1] ^= 0x01  # the tag
    with pytest.raises(codec.AuthenticationError) as caught:
        _decode_with(_keyed([NEW, OLD]), bytes(frame), len(payload))
    assert not isinstance(caught.value, codec.ForeignFrame)


@pytest.mark.parametrize("algorithm", [1, 3, 7, 255])
def test_an_unknown_algorithm_id_is_refused_never_served(algorithm: int) -> None:
    """Format 3 knows algorithms 0 and 2; anything else (HMAC-SHA256 in format 3 included) is
    a frame this kvtier cannot judge: refused as foreign, ``out`` untouched."""
    payload = b"a" * 100
    for frame_codec in (codec.FrameCodec(NS), _keyed([OLD])):
        frame = bytearray(_encode_with(frame_codec, payload))
        frame[287] = algorithm
        out = bytearray(b"\xa5") * 100
        with pytest.raises(codec.UnknownAlgorithm, match=f"algorithm {algorithm}"):
            frame_codec.decode(memoryview(bytes(frame)), KEY, memoryview(out))
        assert out == bytearray(b"\xa5") * 100
    assert issubclass(codec.UnknownAlgorithm, codec.ForeignFrame)


def test_a_newer_format_is_foreign_and_format_1_is_corrupt() -> None:
    frame = bytes(codec.encode(NS, KEY, bytes(100)))
    _expect(codec.NewerVersion, frame[:4] + (5).to_bytes(2, "little") + frame[6:])
    assert issubclass(codec.NewerVersion, codec.ForeignFrame)
    with pytest.raises(codec.UnsupportedVersion, match="older kvtier") as caught:
        codec.decode_into(frame[:4] + (1).to_bytes(2, "little") + frame[6:], NS, KEY,
                          memoryview(bytearray(100)))
    assert not isinstance(caught.value, codec.ForeignFrame)


def test_format_2_frames_of_the_previous_kvtier_still_verify() -> None:
    """Unkeyed (xxh3) and keyed (HMAC-SHA256) frames of format 2 are served and reported as
    OLDER_FORMAT (so the next store rewrites them); under a ring's later key, OLDER_KEY."""
    payload = bytes(range(256)) * 9
    plain = format_2_frame(NS, KEY, payload)
    assert _decode_with(codec.FrameCodec(NS), plain, len(payload)) == (
        codec.Provenance.OLDER_FORMAT, payload)
    assert codec.payload_length(plain) == len(payload)
    assert codec.frame_info(plain) == codec.FrameInfo(2, 0, bytes(8))
    signed = format_2_frame(NS, KEY, payload, auth_key=OLD)
    assert _decode_with(_keyed([OLD]), signed, len(payload)) == (
        codec.Provenance.OLDER_FORMAT, payload)
    assert _decode_with(_keyed([NEW, OLD]), signed, len(payload)) == (
        codec.Provenance.OLDER_KEY, payload)
    with pytest.raises(codec.AuthenticationError, match="none of this tier's 1"):
        _decode_with(_keyed([NEW]), signed, len(payload))
    with pytest.raises(codec.AuthenticationError):
        _decode_with(codec.FrameCodec(NS), signed, len(payload))
    with pytest.raises(codec.AuthenticationError):
        _decode_with(_keyed([OLD]), plain, len(payload))
    for position in (8, 100, 290, 315, codec.HEADER_BYTES + 3):
        for frame, frame_codec in ((plain, codec.FrameCodec(NS)), (signed, _keyed([OLD]))):
            damaged = bytearray(frame)
            damaged[position] ^= 0x04
            with pytest.raises((codec.FrameError, codec.OutputSizeMismatch)):
                _decode_with(frame_codec, bytes(damaged), len(payload))


def test_every_single_byte_flip_of_a_keyed_frame_is_detected() -> None:
    frame_codec = _keyed([NEW, OLD])
    payload = bytes(range(64))
    frame = _encode_with(frame_codec, payload)
    for position in range(len(frame)):
        corrupt = bytearray(frame)
        corrupt[position] ^= 0x01
        with pytest.raises((codec.FrameError, codec.OutputSizeMismatch)):
            _decode_with(frame_codec, bytes(corrupt), len(payload))


@pytest.mark.parametrize("size", [0, 1000, codec.PARALLEL_MIN_BYTES, 3 << 20])
def test_keyed_round_trip_on_the_threaded_and_the_inline_path(size: int) -> None:
    payload = np.random.default_rng(size).bytes(size)
    frame_codec = _keyed([NEW])
    frame = _encode_with(frame_codec, payload)
    assert _decode_with(frame_codec, frame, size) == (codec.Provenance.CURRENT, payload)
    out = bytearray(size)
    memoryview(out)[:] = payload
    assert frame_codec.verify_in_place(frame[: codec.HEADER_BYTES], KEY, memoryview(out),
                                       size) is codec.Provenance.CURRENT
    if size:
        out[size // 2] ^= 1
        with pytest.raises(codec.AuthenticationError):
            frame_codec.verify_in_place(frame[: codec.HEADER_BYTES], KEY, memoryview(out), size)


def test_a_key_ring_refuses_bad_keys_without_showing_them() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        codec.KeyRing([])
    with pytest.raises(ValueError, match="auth key 2 must be non-empty bytes"):
        codec.KeyRing([OLD, b""])
    with pytest.raises(ValueError, match="auth key 3 repeats key 1") as caught:
        codec.KeyRing([OLD, NEW, OLD])
    assert OLD.decode() not in str(caught.value)
    assert codec.KeyRing.of(OLD).key_ids == codec.KeyRing([OLD]).key_ids


@pytest.mark.parametrize("layout", list(codec.FrameLayout))
@pytest.mark.parametrize("auth_key", [None, b"k" * 32])
def test_a_batch_encodes_each_record_as_one_at_a_time(layout: codec.FrameLayout,
                                                      auth_key: bytes | None) -> None:
    """encode_records (the store path's batch) gives encode_record's bytes for every item,
    keys and payload sizes mixed."""
    coder = codec.FrameCodec(NS, auth_key, layout)
    keys = [b"a" * 16, b"b" * 16, b"c" * 3, b"d" * 255, b"e" * 16]
    payloads = [memoryview(bytes([i]) * size) for i, size in
                enumerate((4096, 4096, 4096, 17, 0))]
    assert coder.encode_records(keys, payloads) == [
        coder.encode_record(key, payload) for key, payload in zip(keys, payloads, strict=True)]
    with pytest.raises(ValueError):
        coder.encode_records(keys, payloads[:-1])
