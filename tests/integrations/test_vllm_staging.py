"""The vLLM tier's prefetch staging memory on its own (no vLLM needed): budget and value order,
memory-copy loads, cancellation by demand, the staleness rule, the digest check, expiry."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.backends.base import Backend
from kvtier.backends.file import FileBackend
from kvtier.backends.memory import MemoryBackend
from kvtier.integrations.vllm._staging import (
    EntryState,
    PrefetchStaging,
    StagedReads,
    chain_of,
    open_staging,
)
from kvtier.keys import Namespace
from kvtier.settings import ConfigError

BLOCK = 4096
WAIT_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _namespace() -> Namespace:
    return Namespace(model="staging-test", dtype="float32", kv_layout="test", block_size=16)


def _blocks(count: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(16) for _ in range(count)], [os.urandom(BLOCK) for _ in range(count)]


@pytest.fixture(params=["memory", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    opened: Backend = (MemoryBackend(_namespace()) if request.param == "memory"
                       else FileBackend(tmp_path / "tier", _namespace()))
    yield opened
    opened.close()


def _staging(backend: Backend, blocks: int, *, ttl_s: float = 60.0,
             clock: FakeClock | None = None) -> PrefetchStaging:
    return PrefetchStaging(backend, budget_bytes=blocks * BLOCK, block_bytes=BLOCK, ttl_s=ttl_s,
                           batch_blocks=2, clock=clock or FakeClock())


def _fill(staging: PrefetchStaging) -> None:
    """Step (idle tier) until every admitted block was read."""
    for _ in range(32):
        staging.step(idle=True)
        assert staging.wait_reader(WAIT_S)
    staging.step(idle=True)


def _outs(count: int) -> list[memoryview]:
    return [memoryview(bytearray(BLOCK)) for _ in range(count)]


def test_a_finished_chain_is_staged_and_its_load_is_a_memory_copy(backend: Backend) -> None:
    keys, payloads = _blocks(4)
    backend.put_many(keys, payloads)
    staging = _staging(backend, 8)
    try:
        assert staging.admit_chain(keys) == 4
        _fill(staging)
        assert staging.counts().prefetched_blocks == 4
        assert staging.staged_bytes() == 4 * BLOCK
        reads = backend.stats()["gets"]
        outs = _outs(4)
        assert StagedReads(backend, staging).get_many(keys, outs) == [True] * 4
        assert [bytes(out) for out in outs] == payloads
        assert backend.stats()["gets"] == reads  # no backend read
        counts = staging.counts()
        assert counts.used_blocks == 4 and counts.wasted_blocks == 0
        assert staging.staged_bytes() == 0  # used blocks leave (vLLM's CPU tier has them)
    finally:
        staging.shutdown()


def test_no_read_starts_while_the_tier_has_transfers_in_flight(backend: Backend) -> None:
    keys, payloads = _blocks(2)
    backend.put_many(keys, payloads)
    staging = _staging(backend, 4)
    try:
        staging.admit_chain(keys)
        reads = backend.stats()["gets"]
        staging.step(idle=False)
        assert staging.wait_reader(WAIT_S)
        assert backend.stats()["gets"] == reads
        assert staging.state_of(keys[0]) is EntryState.QUEUED
    finally:
        staging.shutdown()


def test_the_budget_holds_and_deeper_blocks_make_room_for_shallower_ones(
        backend: Backend) -> None:
    first, first_payloads = _blocks(5)
    second, second_payloads = _blocks(2)
    backend.put_many(first + second, first_payloads + second_payloads)
    staging = _staging(backend, 3)
    try:
        assert staging.admit_chain(first) == 3  # a chain stops at its first block that won't fit
        _fill(staging)
        assert staging.staged_bytes() == 3 * BLOCK
        assert staging.state_of(first[3]) is None
        # The second chain's blocks 0 and 1 are worth more than the first's block 2 (depth),
        # and block 1 ties with the first's block 1 (the later chain loses the tie).
        assert staging.admit_chain(second) == 1
        _fill(staging)
        assert staging.state_of(second[0]) is EntryState.STAGED
        assert staging.state_of(second[1]) is None
        assert staging.state_of(first[2]) is None
        counts = staging.counts()
        assert counts.wasted_blocks == 1 and counts.prefetched_blocks == 4
        assert staging.staged_bytes() == 3 * BLOCK
    finally:
        staging.shutdown()


def test_a_demand_load_of_a_queued_block_cancels_its_prefetch_and_reads_the_backend(
        backend: Backend) -> None:
    keys, payloads = _blocks(2)
    backend.put_many(keys, payloads)
    staging = _staging(backend, 4)
    try:
        staging.admit_chain(keys)
        outs = _outs(2)
        assert StagedReads(backend, staging).get_many(keys, outs) == [True, True]
        assert [bytes(out) for out in outs] == payloads
        counts = staging.counts()
        assert counts.cancelled_blocks == 2 and counts.used_blocks == 0
        _fill(staging)
        assert staging.counts().prefetched_blocks == 0  # nothing left to read
    finally:
        staging.shutdown()


def test_a_block_gone_from_the_backend_is_never_served_from_staging(backend: Backend) -> None:
    """The staleness rule: a probe that finds the block absent drops the staged copy, so the
    block another writer stores later under the key is read from the backend."""
    keys, payloads = _blocks(1)
    backend.put_many(keys, payloads)
    staging = _staging(backend, 2)
    reads = StagedReads(backend, staging)
    try:
        staging.admit_chain(keys)
        _fill(staging)
        backend.delete(keys)  # behind the tier's back (another instance)
        assert reads.probe(keys) == [False]
        assert staging.state_of(keys[0]) is None
        replacement = os.urandom(BLOCK)
        backend.put_many(keys, [replacement])
        outs = _outs(1)
        assert reads.get_many(keys, outs) == [True]
        assert bytes(outs[0]) == replacement
        counts = staging.counts()
        assert counts.wasted_blocks == 1 and counts.used_blocks == 0
    finally:
        staging.shutdown()


def test_a_store_or_delete_through_the_tier_drops_the_staged_copy(backend: Backend) -> None:
    keys, payloads = _blocks(2)
    backend.put_many(keys, payloads)
    staging = _staging(backend, 4)
    reads = StagedReads(backend, staging)
    try:
        staging.admit_chain(keys)
        _fill(staging)
        reads.put_many(keys[:1], payloads[:1])
        reads.delete(keys[1:])
        assert staging.state_of(keys[0]) is None and staging.state_of(keys[1]) is None
        assert staging.counts().wasted_blocks == 2
    finally:
        staging.shutdown()


def test_a_chain_admitted_while_its_own_store_runs_is_read_after_it_not_cancelled(
        backend: Backend) -> None:
    """vLLM finishes a request (its chain is admitted) while the stores of its last blocks may
    still be on the tier's I/O threads. A store of a queued block must not cancel it: the read
    waits for an idle tier, so it comes after the store and reads the stored copy. A store of a
    block already staged still drops it (wasted)."""
    keys, payloads = _blocks(3)
    backend.put_many(keys[:1], payloads[:1])
    staging = _staging(backend, 4)
    reads = StagedReads(backend, staging)
    try:
        assert staging.admit_chain(keys[:1]) == 1
        _fill(staging)
        assert staging.state_of(keys[0]) is EntryState.STAGED
        assert staging.admit_chain(keys) == 2  # the staged one is not admitted again
        staging.step(idle=False)  # the stores are in flight: nothing is read
        assert staging.wait_reader(WAIT_S)
        assert reads.put_many(keys, payloads) == [True] * 3  # the chain's stores land
        assert staging.state_of(keys[0]) is None  # staged before the store: dropped
        assert [staging.state_of(key) for key in keys[1:]] == [EntryState.QUEUED] * 2
        _fill(staging)
        counts = staging.counts()
        assert counts.cancelled_blocks == 0 and counts.wasted_blocks == 1
        assert counts.prefetched_blocks == 3
        outs = _outs(2)
        assert reads.get_many(keys[1:], outs) == [True, True]
        assert [bytes(out) for out in outs] == payloads[1:]
    finally:
        staging.shutdown()


def test_staged_bytes_that_changed_in_memory_are_not_served(backend: Backend) -> None:
    """Fault injection (a real part cannot flip a bit in our memory on demand): one staged
    buffer is overwritten; the digest check refuses it and the load reads the backend."""
    keys, payloads = _blocks(1)
    backend.put_many(keys, payloads)
    staging = _staging(backend, 2)
    try:
        staging.admit_chain(keys)
        _fill(staging)
        entry = staging._entries[keys[0]]
        assert entry.buffer is not None
        entry.buffer[0] ^= 0xFF
        outs = _outs(1)
        assert StagedReads(backend, staging).get_many(keys, outs) == [True]
        assert bytes(outs[0]) == payloads[0]
        counts = staging.counts()
        assert counts.corrupt_blocks == 1 and counts.used_blocks == 0
    finally:
        staging.shutdown()


def test_unused_blocks_expire_as_wasted(backend: Backend) -> None:
    keys, payloads = _blocks(2)
    backend.put_many(keys, payloads)
    clock = FakeClock()
    staging = _staging(backend, 4, ttl_s=30.0, clock=clock)
    try:
        staging.admit_chain(keys)
        _fill(staging)
        clock.now += 29.0
        staging.step(idle=True)
        assert staging.staged_bytes() == 2 * BLOCK
        clock.now += 2.0
        staging.step(idle=True)
        assert staging.staged_bytes() == 0
        assert staging.counts().wasted_blocks == 2
    finally:
        staging.shutdown()


def test_missing_blocks_are_counted_not_staged(backend: Backend) -> None:
    keys, _ = _blocks(2)
    staging = _staging(backend, 4)
    try:
        staging.admit_chain(keys)
        _fill(staging)
        counts = staging.counts()
        assert counts.missing_blocks == 2 and counts.prefetched_blocks == 0
        assert staging.state_of(keys[0]) is None
    finally:
        staging.shutdown()


def test_a_budget_below_one_block_is_named_in_the_error(backend: Backend) -> None:
    with pytest.raises(ConfigError, match=r"KvtierTier\.prefetch_bytes: 1000 bytes .* 4096"):
        open_staging(backend, prefetch_bytes=1000, ttl_s=1.0, block_bytes=BLOCK,
                     batch_blocks=1, where="KvtierTier")
    assert open_staging(backend, prefetch_bytes=0, ttl_s=1.0, block_bytes=BLOCK,
                        batch_blocks=1, where="KvtierTier") is None


def test_the_chain_is_read_from_vllms_key_positions_in_prefix_order() -> None:
    class Context:
        def __init__(self) -> None:
            self._offload_key_positions = {b"c": 48, b"a": 16, b"b": 32}

    assert chain_of(Context()) == [b"a", b"b", b"c"]
    assert chain_of(object()) == []
