"""The backend contract (issue 3), run against every backend kind.

Empty (0-byte) payloads are allowed: the frame carries the length, so an empty block round-trips
like any other.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import numpy as np
import pytest

from backends.conftest import PERSISTENT_KINDS, BackendHarness, fresh_namespace
from kvtier import codec
from kvtier.backends import STANDARD_COUNTERS, Backend, BackendClosedError
from kvtier.keys import BlockKey

SENTINEL = 0xA5


def payload_for(key: BlockKey, size: int, salt: bytes = b"") -> bytes:
    """Deterministic, key-specific bytes (so a block served under the wrong key is visible)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(key + salt + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:size])


def sentinel_buffer(size: int) -> bytearray:
    return bytearray([SENTINEL]) * size


def keys_for(count: int, tag: str = "") -> list[BlockKey]:
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(count)]


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 65536 + 7, 1 << 20])
def test_roundtrip_exact_bytes(backend: Backend, size: int) -> None:
    keys = keys_for(3, f"rt{size}")
    payloads = [payload_for(key, size) for key in keys]
    assert backend.put_many(keys, payloads) == [True, True, True]
    assert backend.exists(keys) == [True, True, True]
    outs = [sentinel_buffer(size) for _ in keys]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True, True, True]
    assert [bytes(out) for out in outs] == payloads
    stats = backend.stats()
    assert stats["bytes_written"] >= 3 * size
    assert stats["bytes_read"] >= 3 * size
    assert stats["corrupt_objects"] == 0


def test_payload_types_numpy_and_memoryview(backend: Backend) -> None:
    array = np.arange(4096, dtype=np.float16).reshape(64, 64)
    keys = keys_for(2, "types")
    assert backend.put_many(keys, [memoryview(array), bytearray(array.tobytes())]) == [True] * 2
    target = np.zeros_like(array)
    other = bytearray(array.nbytes)
    assert backend.get_many(keys, [memoryview(target), memoryview(other)]) == [True, True]
    assert target.tobytes() == array.tobytes() == bytes(other)


def test_exists_batch_semantics(backend: Backend) -> None:
    present = keys_for(3, "present")
    absent = keys_for(2, "absent")
    assert backend.exists([]) == []
    assert backend.put_many(present, [payload_for(key, 100) for key in present]) == [True] * 3
    query = [present[0], absent[0], present[0], present[2], absent[1], absent[0], present[1]]
    assert backend.exists(query) == [True, False, True, True, False, False, True]
    # A healthy backend's probe answers exactly like exists.
    assert backend.probe(query) == [True, False, True, True, False, False, True]
    assert backend.probe([]) == []


def test_put_if_absent_never_overwrites(backend: Backend) -> None:
    [key] = keys_for(1, "pia")
    first, second = payload_for(key, 1000, b"first"), payload_for(key, 1000, b"second")
    assert backend.put_many([key], [first]) == [True]
    assert backend.put_many([key], [second]) == [True]
    out = sentinel_buffer(1000)
    assert backend.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) == first


def test_duplicate_key_in_one_put_batch_stores_one_whole_payload(backend: Backend) -> None:
    [key] = keys_for(1, "dup")
    first, second = payload_for(key, 5000, b"a"), payload_for(key, 5000, b"b")
    assert backend.put_many([key, key], [first, second]) == [True, True]
    out = sentinel_buffer(5000)
    assert backend.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) in (first, second)


def test_wrong_size_out_answers_false_and_leaves_out_untouched(backend: Backend) -> None:
    [key] = keys_for(1, "size")
    payload = payload_for(key, 4096)
    assert backend.put_many([key], [payload]) == [True]
    small, large = sentinel_buffer(4095), sentinel_buffer(4097)
    assert backend.get_many([key, key], [memoryview(small), memoryview(large)]) == [False, False]
    if backend.FRAME_LAYOUT is codec.FrameLayout.HEADER:
        # (the file tier reads a payload straight into out, then judges it: out unspecified)
        assert small == sentinel_buffer(4095)
        assert large == sentinel_buffer(4097)
    # Removed, so that a store replaces it (see the test of a frame of another length).
    assert backend.exists([key]) == [False]
    assert backend.put_many([key], [payload]) == [True]
    out = sentinel_buffer(4096)
    assert backend.get_many([key], [memoryview(out)]) == [True]
    assert bytes(out) == payload
    assert backend.stats()["corrupt_objects"] == 0


def _layout(frame: bytes) -> codec.FrameLayout:
    """The layout of a stored frame: a format-4 trailer (the file tier), else a header."""
    return codec.FrameLayout.TRAILER if codec.record_offset(frame) else codec.FrameLayout.HEADER


def _payload(frame: bytes) -> bytes:
    record = codec.record_offset(frame)
    return frame[:record] if record else frame[codec.HEADER_BYTES:]


def _flip_payload_byte(frame: bytes, _key: BlockKey) -> bytes:
    corrupt = bytearray(frame)
    corrupt[(0 if codec.record_offset(frame) else codec.HEADER_BYTES) + 17] ^= 0x01
    return bytes(corrupt)


def _flip_header_byte(frame: bytes, _key: BlockKey) -> bytes:
    corrupt = bytearray(frame)
    # a reserved record byte: only the checksum can notice
    corrupt[codec.record_offset(frame) + 300] ^= 0x80
    return bytes(corrupt)


def _truncate(frame: bytes, _key: BlockKey) -> bytes:
    return frame[:-100]


def _truncate_into_header(frame: bytes, _key: BlockKey) -> bytes:
    return frame[:10]


def _empty_object(_frame: bytes, _key: BlockKey) -> bytes:
    return b""


def _garbage(frame: bytes, key: BlockKey) -> bytes:
    return payload_for(key, len(frame), b"garbage")


def _other_namespace(frame: bytes, key: BlockKey) -> bytes:
    return bytes(codec.encode(fresh_namespace().digest, key, _payload(frame), _layout(frame)))


def _other_key(frame: bytes, key: BlockKey) -> bytes:
    record = codec.record_offset(frame)
    return bytes(codec.encode(frame[record + 16:record + 32], hashlib.blake2b(key).digest()[:16],
                              _payload(frame), _layout(frame)))


def _future_version(frame: bytes, _key: BlockKey) -> bytes:
    corrupt = bytearray(frame)
    corrupt[codec.record_offset(frame) + 4] = 99
    return bytes(corrupt)


CORRUPTIONS: dict[str, Callable[[bytes, BlockKey], bytes]] = {
    "flipped_payload_byte": _flip_payload_byte,
    "flipped_header_byte": _flip_header_byte,
    "truncated": _truncate,
    "truncated_into_header": _truncate_into_header,
    "empty_object": _empty_object,
    "garbage": _garbage,
    "other_namespace": _other_namespace,
    "other_key": _other_key,
}


def _unknown_algorithm(frame: bytes, _key: BlockKey) -> bytes:
    corrupt = bytearray(frame)
    corrupt[codec.record_offset(frame) + 287] = 9
    return bytes(corrupt)


FOREIGN: dict[str, Callable[[bytes, BlockKey], bytes]] = {
    "future_version": _future_version,
    "unknown_algorithm": _unknown_algorithm,
}
"""Frames of a newer kvtier: refused and counted, but left for it (not proof of damage)."""


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_object_is_counted_deleted_and_never_served(
    harness: BackendHarness, backend: Backend, corruption: str
) -> None:
    keys = keys_for(2, f"corrupt-{corruption}")
    size = 8192
    payloads = [payload_for(key, size) for key in keys]
    assert backend.put_many(keys, payloads) == [True, True]
    raw = harness.raw(backend)
    stored = raw.read(keys[0])
    assert stored is not None
    assert len(stored) >= codec.HEADER_BYTES + size
    raw.write(keys[0], CORRUPTIONS[corruption](stored[: codec.HEADER_BYTES + size], keys[0]))
    before = backend.stats()

    outs = [sentinel_buffer(size), sentinel_buffer(size)]
    # False: out[0]'s contents are unspecified (a medium may read into it before verifying),
    # and the caller never publishes it; the block is counted as a miss, never as a hit.
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [False, True]
    assert bytes(outs[1]) == payloads[1]
    after = backend.stats()
    assert after["corrupt_objects"] == before["corrupt_objects"] + 1
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"] + 1
    assert after["bytes_read"] == before["bytes_read"] + size
    assert backend.exists(keys) == [False, True], "a corrupt object must be deleted"
    assert raw.read(keys[0]) is None
    # The key can be stored again, and then it is served.
    assert backend.put_many([keys[0]], [payloads[0]]) == [True]
    assert backend.get_many([keys[0]], [memoryview(outs[0])]) == [True]
    assert bytes(outs[0]) == payloads[0]


@pytest.mark.parametrize("foreign", sorted(FOREIGN))
def test_a_newer_kvtiers_frame_is_never_served_left_in_place_and_replaced_by_a_store(
    harness: BackendHarness, backend: Backend, foreign: str
) -> None:
    """Before: a newer format version was removed at once (a rolling upgrade lost blocks)."""
    keys = keys_for(2, f"foreign-{foreign}")
    size = 8192
    payloads = [payload_for(key, size) for key in keys]
    assert backend.put_many(keys, payloads) == [True, True]
    raw = harness.raw(backend)
    stored = raw.read(keys[0])
    assert stored is not None
    planted = FOREIGN[foreign](stored[: codec.HEADER_BYTES + size], keys[0])
    raw.write(keys[0], planted)
    before = backend.stats()
    outs = [sentinel_buffer(size), sentinel_buffer(size)]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [False, True]
    after = backend.stats()
    assert after["corrupt_objects"] == before["corrupt_objects"] + 1
    assert after["hits"] == before["hits"] + 1
    assert after["bytes_read"] == before["bytes_read"] + size
    assert backend.exists(keys) == [True, True]
    assert (raw.read(keys[0]) or b"")[: codec.HEADER_BYTES] == planted[: codec.HEADER_BYTES]
    assert backend.put_many([keys[0]], [payloads[0]]) == [True]
    assert backend.get_many([keys[0]], [memoryview(outs[0])]) == [True]
    assert bytes(outs[0]) == payloads[0]


def test_delete(backend: Backend) -> None:
    keys = keys_for(3, "delete")
    backend.delete(keys)  # absent keys: no-op
    backend.delete([])
    assert backend.put_many(keys, [payload_for(key, 64) for key in keys]) == [True] * 3
    backend.delete([keys[0], keys[2], keys[0]])
    assert backend.exists(keys) == [False, True, False]
    out = sentinel_buffer(64)
    assert backend.get_many([keys[0]], [memoryview(out)]) == [False]
    assert out == sentinel_buffer(64)


def test_caller_may_reuse_buffers_after_put(backend: Backend) -> None:
    keys = keys_for(2, "reuse")
    buffer = bytearray(payload_for(keys[0], 70000))
    original = bytes(buffer)
    assert backend.put_many([keys[0]], [memoryview(buffer)]) == [True]
    buffer[:] = payload_for(keys[1], 70000)
    assert backend.put_many([keys[1]], [buffer]) == [True]
    buffer[:] = bytes(70000)
    outs = [sentinel_buffer(70000), sentinel_buffer(70000)]
    assert backend.get_many(keys, [memoryview(out) for out in outs]) == [True, True]
    assert bytes(outs[0]) == original
    assert bytes(outs[1]) == payload_for(keys[1], 70000)


def test_namespaces_are_isolated(harness: BackendHarness, backend: Backend) -> None:
    other = harness.open(fresh_namespace(dtype="float16"))
    keys = keys_for(2, "iso")
    assert backend.put_many(keys, [payload_for(key, 256) for key in keys]) == [True, True]
    assert other.exists(keys) == [False, False]
    out = sentinel_buffer(256)
    assert other.get_many([keys[0]], [memoryview(out)]) == [False]
    assert out == sentinel_buffer(256)
    assert other.stats()["corrupt_objects"] == 0


@pytest.mark.parametrize("backend_kind", PERSISTENT_KINDS, indirect=True)
def test_new_instance_sees_stored_blocks(harness: BackendHarness, backend: Backend) -> None:
    keys = keys_for(4, "reopen")
    payloads = [payload_for(key, 3000 + i) for i, key in enumerate(keys)]
    assert backend.put_many(keys, payloads) == [True] * 4
    backend.close()
    reopened = harness.open()
    assert reopened.exists(keys) == [True] * 4
    outs = [sentinel_buffer(len(payload)) for payload in payloads]
    assert reopened.get_many(keys, [memoryview(out) for out in outs]) == [True] * 4
    assert [bytes(out) for out in outs] == payloads


def test_closed_backend_raises(backend: Backend) -> None:
    [key] = keys_for(1, "closed")
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(BackendClosedError):
        backend.exists([key])
    with pytest.raises(BackendClosedError):
        backend.put_many([key], [b"x"])
    with pytest.raises(BackendClosedError):
        backend.get_many([key], [memoryview(bytearray(1))])
    with pytest.raises(BackendClosedError):
        backend.delete([key])


def test_argument_errors_raise_before_any_io(backend: Backend) -> None:
    keys = keys_for(2, "args")
    with pytest.raises(ValueError, match="len"):
        backend.put_many(keys, [b"only one"])
    with pytest.raises(ValueError, match="len"):
        backend.get_many(keys, [memoryview(bytearray(1))])
    with pytest.raises(TypeError, match=r"keys\[1\]"):
        backend.exists([keys[0], "not bytes"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"keys"):
        backend.exists(keys[0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"1\.\.255"):
        backend.put_many([b""], [b"x"])
    with pytest.raises(ValueError, match=r"1\.\.255"):
        backend.exists([bytes(256)])
    with pytest.raises(TypeError, match=r"payloads\[0\]"):
        backend.put_many([keys[0]], ["text"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"outs\[0\]"):
        backend.get_many([keys[0]], [bytearray(1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="writable"):
        backend.get_many([keys[0]], [memoryview(b"x")])
    assert backend.exists(keys) == [False, False], "a rejected call must not store anything"


def test_stats_has_standard_counters(backend: Backend) -> None:
    stats = backend.stats()
    for name in STANDARD_COUNTERS:
        assert isinstance(stats[name], int), name
    assert stats["errors"] == 0
    assert isinstance(backend.url, str)
    assert backend.url


def test_one_counter_vocabulary_payload_bytes_of_successful_transfers_only(
    harness: BackendHarness, backend: Backend
) -> None:
    """Every backend counts the same way (they drifted once: S3 counted frame bytes, and
    corrupt reads, in bytes_read / bytes_written)."""
    keys = keys_for(3, "vocabulary")
    sizes = (1000, 5000, 0)
    payloads = [payload_for(key, size) for key, size in zip(keys, sizes, strict=True)]
    assert backend.put_many(keys, payloads) == [True] * 3
    assert backend.put_many(keys[:1], payloads[:1]) == [True]  # already present: not written
    stats = backend.stats()
    assert stats["bytes_written"] == sum(sizes)
    assert (stats["puts"], stats["puts_existing"]) == (4, 1)
    raw = harness.raw(backend)
    stored = raw.read(keys[1]) or b""
    raw.write(keys[1], _flip_payload_byte(stored[: codec.HEADER_BYTES + 5000], keys[1]))
    outs = [bytearray(size) for size in sizes] + [bytearray(7)]
    answers = backend.get_many([*keys, keys[0]], [memoryview(out) for out in outs])
    assert answers == [True, False, True, False]
    stats = backend.stats()
    assert stats["bytes_read"] == 1000  # the corrupt read and the wrong-size read count nothing
    assert (stats["gets"], stats["hits"], stats["misses"]) == (4, 2, 2)
    assert (stats["corrupt_objects"], stats["size_mismatches"], stats["auth_failures"]) == (1, 1, 0)


def test_a_valid_frame_of_another_length_is_replaced_by_the_next_store(
    harness: BackendHarness, backend: Backend
) -> None:
    """The engine's block_bytes changed: a frame stored at the old size verifies, but is never
    served into a destination of the new size (counted), and the next store replaces it.
    Before: it was kept, and every later store found it "present": the key was locked for good.
    On a shared medium the engine that comes back with the new size is a second instance."""
    [key] = keys_for(1, "resized")
    old, new = payload_for(key, 4096, b"old"), payload_for(key, 8192, b"new")
    assert backend.put_many([key], [old]) == [True]
    resized = harness.open() if harness.kind in PERSISTENT_KINDS else backend
    out = bytearray(8192)
    assert resized.get_many([key], [memoryview(out)]) == [False]
    assert resized.stats()["size_mismatches"] == 1
    assert resized.put_many([key], [new]) == [True]
    assert resized.stats()["puts_existing"] == 0  # written, not found present
    assert resized.get_many([key], [memoryview(out)]) == [True] and bytes(out) == new
    assert resized.stats()["size_mismatches"] == 1


def test_concurrent_put_get_delete_serve_only_exact_blocks(backend: Backend) -> None:
    """Threads race put/get/delete on shared keys; every True read is the exact block.

    A barrier releases the threads together; no sleeps.
    """
    keys = keys_for(12, "race")
    size = 16384
    expected = {key: payload_for(key, size) for key in keys}
    threads_count, rounds = 4, 12
    barrier = threading.Barrier(threads_count)
    failures: list[str] = []
    hits = [0] * threads_count

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            outs = [bytearray(size) for _ in range(4)]
            for round_index in range(rounds):
                batch = [keys[(index * 3 + round_index + j) % len(keys)] for j in range(4)]
                stored = backend.put_many(batch, [expected[key] for key in batch])
                if not all(stored):
                    failures.append(f"thread {index}: put_many answered {stored}")
                answers = backend.get_many(batch, [memoryview(out) for out in outs])
                for key, out, answer in zip(batch, outs, answers, strict=True):
                    if answer:
                        hits[index] += 1
                        if bytes(out) != expected[key]:
                            failures.append(f"thread {index}: wrong bytes for {key.hex()}")
                if round_index % 4 == index % 4:
                    backend.delete(batch[:1])
        except Exception as exc:  # reported to the main thread
            failures.append(f"thread {index}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert sum(hits) > 0
    assert backend.stats()["corrupt_objects"] == 0
