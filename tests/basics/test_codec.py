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
