"""SecondaryTier: lookups through the backend, transfer jobs on I/O threads, backpressure."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any
from uuid import uuid4

import pytest

from kvtier import codec
from kvtier.backends import BackendUnavailableError, Buffer, open_backend
from kvtier.backends.base import Backend
from kvtier.keys import BlockKey, Namespace, RequestContext
from kvtier.ops.metrics import KvtierMetrics
from kvtier.tiering.tier import JobKind, SecondaryTier, TierClosedError
from kvtier.tiering.tier_settings import TierSettings
from servers.valkey import ValkeyServer
from tiering.manager_helpers import FakeClock

BLOCK = 256


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def payload(i: int) -> bytes:
    return bytes([i % 251]) * BLOCK


class Gate:
    """Fault injection a real backend cannot do on demand: hold put/get calls on an Event,
    or make them raise. Everything else goes to a real memory backend."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Semaphore(0)
        self.fail_with: Exception | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _gate(self) -> None:
        self.entered.release()
        if not self.release.wait(30):
            raise TimeoutError("test gate never opened")
        if self.fail_with is not None:
            raise self.fail_with

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        self._gate()
        return self.inner.put_many(keys, payloads)

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        self._gate()
        return self.inner.get_many(keys, outs)


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model=f"test-{uuid4().hex}")


@pytest.fixture
def tier(namespace: Namespace) -> Iterator[SecondaryTier]:
    t = SecondaryTier("mem", open_backend("memory://", namespace),
                      lookup={"quarantine_s": 60.0})
    yield t
    t.shutdown(10)


def test_store_then_lookup_knows_at_once_without_a_probe(tier: SecondaryTier) -> None:
    job = tier.submit_store([k(1), k(2)], [payload(1), payload(2)])
    assert job is not None and job.kind is JobKind.STORE
    finished = tier.get_finished_jobs(wait=True, timeout=10)
    assert finished == [job]
    assert job.results == (True, True)
    ctx = RequestContext("r")
    assert tier.lookup(k(1), ctx) is True
    assert tier.stats().lookup.backend_calls == 0
    tier.cleanup("r")
    assert tier.lookup_manager.tracked_keys == 0


def test_load_writes_exact_bytes_and_failed_keys_are_quarantined(tier: SecondaryTier) -> None:
    tier.submit_store([k(1)], [payload(1)])
    tier.get_finished_jobs(wait=True, timeout=10)
    outs = [memoryview(bytearray(BLOCK)) for _ in range(2)]
    job = tier.submit_load([k(1), k(2)], outs)
    tier.get_finished_jobs(wait=True, timeout=10)
    assert job.results == (True, False)
    assert job.succeeded == [k(1)] and job.failed == [k(2)]
    assert bytes(outs[0]) == payload(1)
    assert bytes(outs[1]) == bytes(BLOCK)  # untouched
    ctx = RequestContext("r")
    assert tier.lookup(k(2), ctx) is False  # quarantined: answered without a probe
    assert tier.stats().lookup.quarantine_hits == 1
    stats = tier.stats()
    assert stats["load_keys_failed"] == 1
    assert stats["backend_gets"] >= 1


def test_lookup_probes_the_backend_once_per_step(tier: SecondaryTier) -> None:
    tier.submit_store([k(5)], [payload(5)])
    tier.get_finished_jobs(wait=True, timeout=10)
    tier.lookup_manager.note_removed([k(5)])  # forget what the store taught it
    tier.lookup_manager.drain_results()
    fresh = SecondaryTier("mem2", tier.backend)  # a second view of the same backend
    try:
        ctxs = [RequestContext(f"r{i}") for i in range(5)]
        assert all(fresh.lookup(key, ctx) is None for ctx in ctxs for key in (k(5), k(6)))
        fresh.flush()
        assert fresh.lookup_manager._wait_for_results(10)
        fresh.lookup_manager.drain_results()
        assert fresh.lookup(k(5), ctxs[0]) is True
        assert fresh.lookup(k(6), ctxs[0]) is False
        assert fresh.stats().lookup.backend_calls == 1
    finally:
        fresh.lookup_manager.shutdown()


def test_backpressure_sheds_stores_while_the_backend_is_held(namespace: Namespace) -> None:
    gate = Gate(open_backend("memory://", namespace))
    metrics = KvtierMetrics()
    tier = SecondaryTier("held", gate, TierSettings(
        io_threads=1, max_pending_store_bytes=2 * BLOCK, max_pending_store_jobs=8),
        metrics=metrics)
    try:
        gate.release.clear()
        first = tier.submit_store([k(1)], [payload(1)])
        assert first is not None
        assert gate.entered.acquire(timeout=10)  # the I/O thread is inside put_many
        second = tier.submit_store([k(2)], [payload(2)])
        assert second is not None
        assert tier.stats().outstanding_store_bytes == 2 * BLOCK
        shed = tier.submit_store([k(3)], [payload(3)])
        assert shed is None
        assert tier.stats()["store_keys_shed"] == 1
        # loads are never shed
        load = tier.submit_load([k(1)], [memoryview(bytearray(BLOCK))])
        gate.release.set()
        done = tier.get_finished_jobs(wait=True, timeout=10)
        assert {job.job_id for job in done} == {first.job_id, second.job_id, load.job_id}
        assert tier.stats().outstanding_store_bytes == 0 and tier.outstanding_jobs == 0
        assert tier.can_accept_store(2 * BLOCK)
    finally:
        gate.release.set()
        tier.shutdown(10)


class OrderedGate(Gate):
    """Gate that also records the order in which the I/O thread enters the backend."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls: list[tuple[str, tuple[BlockKey, ...]]] = []

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        self.calls.append(("put", tuple(keys)))
        return super().put_many(keys, payloads)

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        self.calls.append(("get", tuple(keys)))
        return super().get_many(keys, outs)


def test_a_waiting_load_runs_before_waiting_stores(namespace: Namespace) -> None:
    """A promotion never queues behind a backlog of cascades on the tier's I/O threads."""
    gate = OrderedGate(open_backend("memory://", namespace))
    gate.inner.put_many([k(9)], [payload(9)])
    tier = SecondaryTier("prio", gate, TierSettings(io_threads=1))
    try:
        gate.release.clear()
        assert tier.submit_store([k(1)], [payload(1)]) is not None
        assert gate.entered.acquire(timeout=10)  # the only I/O thread is busy with store 1
        assert tier.submit_store([k(2)], [payload(2)]) is not None
        assert tier.submit_store([k(3)], [payload(3)]) is not None
        out = bytearray(BLOCK)
        load = tier.submit_load([k(9)], [memoryview(out)])
        gate.release.set()
        done = tier.get_finished_jobs(wait=True, timeout=10)
        assert len(done) == 4 and tier.outstanding_jobs == 0
        assert gate.calls == [("put", (k(1),)), ("get", (k(9),)), ("put", (k(2),)),
                              ("put", (k(3),))]
        assert load.results == (True,) and bytes(out) == payload(9)
    finally:
        gate.release.set()
        tier.shutdown(10)


def test_job_count_limit_and_one_oversized_job_is_accepted_when_idle(
        namespace: Namespace) -> None:
    gate = Gate(open_backend("memory://", namespace))
    tier = SecondaryTier("jobs", gate, TierSettings(
        io_threads=1, max_pending_store_bytes=BLOCK // 2, max_pending_store_jobs=1))
    try:
        gate.release.clear()
        big = tier.submit_store([k(1), k(2)], [payload(1), payload(2)])
        assert big is not None  # larger than the byte budget, but nothing is outstanding
        assert tier.submit_store([k(3)], [payload(3)]) is None
    finally:
        gate.release.set()
        tier.shutdown(10)


def test_a_raising_backend_fails_the_job_safely_and_the_tier_survives(
        namespace: Namespace) -> None:
    gate = Gate(open_backend("memory://", namespace))
    tier = SecondaryTier("boom", gate)
    try:
        gate.fail_with = ConnectionError("injected")
        out = memoryview(bytearray(BLOCK))
        job = tier.submit_load([k(1)], [out])
        tier.get_finished_jobs(wait=True, timeout=10)
        assert job.results == (False,)
        assert job.error is not None and "injected" in job.error
        gate.fail_with = None
        stored = tier.submit_store([k(1)], [payload(1)])
        tier.get_finished_jobs(wait=True, timeout=10)
        assert stored is not None and stored.results == (True,)
        assert tier.stats()["job_errors"] == 1
    finally:
        tier.shutdown(10)


class CountingGate(Gate):
    """Counts backend transfer calls and fails the call numbered ``fail_call`` (fault injection)."""

    def __init__(self, inner: Backend, fail_call: int | None = None) -> None:
        super().__init__(inner)
        self.calls: list[int] = []
        self.fail_call = fail_call

    def _gate(self) -> None:
        self.calls.append(len(self.calls))
        if len(self.calls) == self.fail_call:
            raise ConnectionError("injected")


def test_max_keys_per_call_splits_jobs_and_keeps_keys_moved_by_other_calls(
        namespace: Namespace) -> None:
    gate = CountingGate(open_backend("memory://", namespace))
    tier = SecondaryTier("split", gate, TierSettings(io_threads=1), max_keys_per_call=2)
    try:
        stored = tier.submit_store([k(i) for i in range(5)], [payload(i) for i in range(5)])
        tier.get_finished_jobs(wait=True, timeout=10)
        assert stored is not None and stored.results == (True,) * 5 and stored.error is None
        assert len(gate.calls) == 3  # 2 + 2 + 1 keys
        gate.calls.clear()
        gate.fail_call = 2
        outs = [memoryview(bytearray(BLOCK)) for _ in range(5)]
        job = tier.submit_load([k(i) for i in range(5)], outs)
        tier.get_finished_jobs(wait=True, timeout=10)
        # Parts of 2 + 2 + 1 keys (one thread here: in order); the second call fails only its
        # own part, the others load.
        assert job.results == (True, True, False, False, True)
        assert job.error is not None and "injected" in job.error
        assert len(gate.calls) == 3
        assert bytes(outs[1]) == payload(1) and bytes(outs[4]) == payload(4)
        assert tier.lookup(k(2), RequestContext("r")) is False  # failed keys are quarantined
    finally:
        tier.shutdown(10)
    with pytest.raises(ValueError, match="max_keys_per_call: expected an integer >= 1, got 0"):
        SecondaryTier("bad", open_backend("memory://", namespace), max_keys_per_call=0)


class BarrierGate(Gate):
    """Every get call waits until ``parties`` calls are inside at once (fault injection of
    timing: only concurrent calls can pass, so a serial load fails the barrier)."""

    def __init__(self, inner: Backend, parties: int) -> None:
        super().__init__(inner)
        self.barrier = threading.Barrier(parties, timeout=10)
        self.loading = False

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        if self.loading:
            self.barrier.wait()
        return self.inner.get_many(keys, outs)


def test_a_load_reads_its_parts_in_parallel_on_the_io_threads(namespace: Namespace) -> None:
    gate = BarrierGate(open_backend("memory://", namespace), parties=4)
    tier = SecondaryTier("parallel", gate, TierSettings(io_threads=4))  # type: ignore[arg-type]
    try:
        keys = [k(i) for i in range(32)]
        assert gate.inner.put_many(keys, [payload(i) for i in range(32)]) == [True] * 32
        gate.loading = True
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        job = tier.submit_load(keys, outs)
        tier.get_finished_jobs(wait=True, timeout=30)
        assert job.results == (True,) * 32, job.error  # four parts of 8 met at the barrier
        assert [bytes(out) for out in outs] == [payload(i) for i in range(32)]
    finally:
        tier.shutdown(10)


def test_remove_deletes_and_updates_the_verdict(tier: SecondaryTier) -> None:
    tier.submit_store([k(1)], [payload(1)])
    tier.get_finished_jobs(wait=True, timeout=10)
    tier.remove([k(1)])
    assert tier.backend.exists([k(1)]) == [False]
    assert tier.lookup(k(1), RequestContext("r")) is False


def test_bad_arguments(namespace: Namespace) -> None:
    backend = open_backend("memory://", namespace)
    with pytest.raises(ValueError, match="io_threads: expected an integer >= 1 and <= 256, got 0"):
        SecondaryTier("x", backend, io_threads=0)  # the keyword spelling: open_manager's
    with pytest.raises(ValueError, match="tier name"):
        SecondaryTier("", backend)
    tier = SecondaryTier("x", backend)
    try:
        with pytest.raises(ValueError, match="2 keys but 1 buffers"):
            tier.submit_load([k(1), k(2)], [memoryview(bytearray(1))])
    finally:
        tier.shutdown()


def test_shutdown_is_idempotent_and_ends_every_thread(namespace: Namespace) -> None:
    tier = SecondaryTier("bye", open_backend("memory://", namespace),
                         TierSettings(io_threads=3))
    tier.submit_store([k(1)], [payload(1)])
    tier.lookup(k(2), RequestContext("r"))
    tier.flush()
    tier.shutdown(10)
    tier.shutdown(10)
    names = [thread.name for thread in threading.enumerate()]
    assert not [n for n in names if n.startswith(("kvtier-io-bye", "kvtier-lookup-bye"))]
    assert tier.stats()["store_keys"] == 1
    with pytest.raises(TierClosedError, match="'bye' is shut down; submit_store"):
        tier.submit_store([k(1)], [payload(1)])


def test_lookup_factory_replaces_the_lookup_manager(namespace: Namespace) -> None:
    from kvtier.lookup.manager import AsyncLookupManager

    seen: dict[str, Any] = {}

    class Everything(AsyncLookupManager):
        def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> list[bool]:
            return [True] * len(keys)

    def factory(name: str, backend: Backend, options: Any) -> AsyncLookupManager:
        seen.update(name=name, options=dict(options))
        return Everything(name, **options)

    tier = SecondaryTier("custom", open_backend("memory://", namespace),
                         lookup={"quarantine_s": 7.0}, lookup_factory=factory)
    try:
        assert isinstance(tier.lookup_manager, Everything)
        assert seen["name"] == "custom" and seen["options"]["quarantine_s"] == 7.0
        assert "clock" in seen["options"]
        ctx = RequestContext("r")
        assert tier.lookup(k(1), ctx) is None
        tier.flush()
        assert tier.lookup_manager._wait_for_results(10)
        tier.lookup_manager.drain_results()
        assert tier.lookup(k(1), ctx) is True
    finally:
        tier.shutdown(10)


class FailingProbe:
    """Fault injection: a backend whose existence checks fail the way a lost connection makes
    real backends fail (``probe`` raises, ``exists`` answers False) — on demand, which a real
    server cannot do."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [False] * len(keys)

    def probe(self, keys: Sequence[BlockKey]) -> list[bool]:
        raise BackendUnavailableError(f"injected: {len(keys)} existence check(s) failed")


def test_a_failed_existence_check_counts_as_a_probe_error_and_feeds_the_breaker(
        namespace: Namespace) -> None:
    backend = FailingProbe(open_backend("memory://", namespace))
    tier = SecondaryTier("flaky", backend, lookup={"breaker_threshold": 1})
    try:
        ctx = RequestContext("r")
        assert tier.lookup(k(1), ctx) is None
        tier.flush()
        assert tier.lookup_manager._wait_for_results(10)
        tier.lookup_manager.drain_results()
        assert tier.lookup(k(1), ctx) is False
        stats = tier.stats().lookup
        assert stats.probe_errors == 1
        assert stats.breaker_state.value == "open"
    finally:
        tier.shutdown(10)


class Unreadable(Gate):
    """Loads of ``key`` fail while its object stays (a read error, EIO: a real disk cannot
    produce one on demand, so it is injected); everything else is a real backend's."""

    def __init__(self, inner: Backend, key: BlockKey) -> None:
        super().__init__(inner)
        self.key = key

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        answers = self.inner.get_many(keys, outs)
        return [ok and key != self.key for key, ok in zip(keys, answers, strict=True)]


def test_a_store_of_a_key_whose_load_failed_does_not_lift_its_quarantine(
    namespace: Namespace
) -> None:
    """The livelock class: the tier keeps an object under the key that cannot be loaded, so
    every load of it fails; the recompute's store answers True ("already present") but must not
    make the tier promise the key again."""
    backend = Unreadable(open_backend("memory://", namespace), k(1))
    assert backend.put_many([k(1)], [payload(1)]) == [True]
    tier = SecondaryTier("mem", backend, lookup={"quarantine_s": 60.0})  # type: ignore[arg-type]
    try:
        job = tier.submit_load([k(1)], [memoryview(bytearray(BLOCK))])
        assert job is not None
        tier.get_finished_jobs(wait=True, timeout=10)
        assert job.failed == [k(1)]
        store = tier.submit_store([k(1)], [payload(1)])  # the recompute, written through
        assert store is not None
        tier.get_finished_jobs(wait=True, timeout=10)
        assert store.results == (True,)  # put-if-absent: the old object is still there
        ctx = RequestContext("r")
        assert tier.lookup(k(1), ctx) is False  # still quarantined: no doomed promotion
        assert tier.stats().lookup.quarantine_hits == 1
        assert tier.stats()["store_keys_read_back"] == 1  # the read-back failed too
        assert tier.stats()["quarantines_lifted"] == 0
        tier.cleanup("r")
        other = k(2)  # a key whose load never failed is noted at once, as before
        assert tier.submit_store([other], [payload(2)]) is not None
        tier.get_finished_jobs(wait=True, timeout=10)
        assert tier.lookup(other, ctx) is True
        assert tier.stats().lookup.backend_calls == 0
    finally:
        tier.shutdown(10)


def test_a_block_of_another_size_is_replaced_by_the_recompute(
    tmp_path: Any, namespace: Namespace
) -> None:
    """The file tier holds a valid block of another size under the key (the engine's block
    size changed). Before: kept, so every store found it present and the key stayed
    quarantined for good. Now the failed load removes it and the recompute's store replaces
    it: read back, verified, the quarantine lifted, and the next load a hit."""
    backend = open_backend(f"file://{tmp_path}", namespace)
    assert backend.put_many([k(1)], [bytes(BLOCK // 2)]) == [True]  # another size
    tier = SecondaryTier("file", backend, lookup={"quarantine_s": 60.0})
    try:
        job = tier.submit_load([k(1)], [memoryview(bytearray(BLOCK))])
        tier.get_finished_jobs(wait=True, timeout=10)
        assert job.failed == [k(1)] and backend.stats()["size_mismatches"] == 1
        store = tier.submit_store([k(1)], [payload(1)])  # the recompute, written through
        assert store is not None
        tier.get_finished_jobs(wait=True, timeout=10)
        assert store.results == (True,) and store.verified == (0,)
        assert tier.stats()["quarantines_lifted"] == 1
        out = memoryview(bytearray(BLOCK))
        load = tier.submit_load([k(1)], [out])
        tier.get_finished_jobs(wait=True, timeout=10)
        assert load.results == (True,) and bytes(out) == payload(1)
    finally:
        tier.shutdown(10)


def test_a_verified_re_store_lifts_the_quarantine(tmp_path: Any, namespace: Namespace) -> None:
    """A block that failed to load (a corrupt frame, which the file tier drops when it reads it)
    is recomputed and stored again: the new object is written, read back and verified, so the
    key is loadable again at once rather than after the quarantine."""
    backend = open_backend(f"file://{tmp_path}", namespace)
    assert backend.put_many([k(1)], [payload(1)]) == [True]
    [path] = list(tmp_path.rglob(f"{k(1).hex()}.kvb"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a flipped bit: the frame's checksum fails
    path.write_bytes(bytes(raw))
    tier = SecondaryTier("file", backend, lookup={"quarantine_s": 60.0})
    try:
        job = tier.submit_load([k(1)], [memoryview(bytearray(BLOCK))])
        tier.get_finished_jobs(wait=True, timeout=10)
        assert job.failed == [k(1)]
        ctx = RequestContext("r")
        assert tier.lookup(k(1), ctx) is False  # quarantined
        tier.cleanup("r")
        store = tier.submit_store([k(1)], [payload(1)])  # the recompute, written through
        assert store is not None
        tier.get_finished_jobs(wait=True, timeout=10)
        assert store.results == (True,) and store.verified == (0,)
        stats = tier.stats()
        assert (stats["store_keys_read_back"], stats["quarantines_lifted"]) == (1, 1)
        assert tier.lookup(k(1), ctx) is True  # good again: no probe needed, no quarantine
        out = memoryview(bytearray(BLOCK))
        load = tier.submit_load([k(1)], [out])
        tier.get_finished_jobs(wait=True, timeout=10)
        assert load.results == (True,) and bytes(out) == payload(1)
    finally:
        tier.shutdown(10)


def test_recent_load_failures_expire_oldest_first_and_stay_bounded() -> None:
    from kvtier.tiering.tier_lookup import RecentLoadFailures

    now = [0.0]
    failures = RecentLoadFailures(10.0, clock=lambda: now[0], max_keys=2)
    failures.add([k(1)])
    now[0] = 5.0
    failures.add([k(2), k(3)])  # bounded: k(1), the oldest, is dropped
    assert len(failures) == 2 and not failures.contains(k(1))
    assert failures.without([k(1), k(2), k(4)]) == [k(1), k(4)]
    now[0] = 15.0  # k(2) and k(3) (until 15.0) expire
    assert failures.without([k(2), k(3)]) == [k(2), k(3)] and len(failures) == 0
    failures.add([k(5)])
    failures.discard([k(5), k(6)])
    assert not failures.contains(k(5))
    RecentLoadFailures(0.0).add([k(7)])  # a zero hold keeps nothing


def test_tier_stats_is_a_typed_snapshot_with_a_flat_view() -> None:
    from kvtier.lookup.manager import LookupStats
    from kvtier.tiering.tier_stats import TierCounters, TierStats

    counters = TierCounters(loaded_keys=3)
    stats = TierStats(LookupStats(backend_calls=2), counters, outstanding_jobs=1,
                      backend={"errors": 4})
    assert stats.value("counters.loaded_keys") == 3
    assert stats.value("lookup.backend_calls") == 2 and stats.value("outstanding_jobs") == 1
    assert stats.value("backend.errors") == 4 and stats.value("backend.blocks") is None
    assert stats["backend_errors"] == 4 and stats["backend_calls"] == 2
    assert TierStats(LookupStats(), TierCounters()).value("backend.errors") is None


def test_tier_stats_snapshots_do_not_move(tier: SecondaryTier) -> None:
    before = tier.stats()
    tier.submit_store([k(1)], [payload(1)])
    tier.get_finished_jobs(wait=True, timeout=10)
    assert before.counters.stored_keys == 0 and tier.stats().counters.stored_keys == 1
    assert tier.stats().backend is not None


def test_tier_takes_one_settings_record() -> None:
    backend = open_backend("memory://", Namespace(model="m"))
    tier = SecondaryTier("rec", backend, TierSettings(io_threads=1, max_pending_store_jobs=1))
    try:
        assert tier.can_accept_store(BLOCK)
    finally:
        tier.shutdown()
    with pytest.raises(TypeError, match="not both"):
        SecondaryTier("both", backend, TierSettings(), io_threads=2)


class StuckKeys(Gate):
    """A load call holding one of ``stuck`` blocks until ``release`` is set: a stuck NFS server
    (or a SIGSTOPped one) cannot be produced on demand, so the hang is injected. ``storing`` is
    set when a store call begins."""

    def __init__(self, inner: Backend, stuck: set[BlockKey]) -> None:
        super().__init__(inner)
        self.stuck = stuck
        self.release.clear()
        self.storing = threading.Event()

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        if self.stuck.intersection(keys) and not self.release.wait(30):
            raise TimeoutError("test gate never opened")
        return self.inner.get_many(keys, outs)

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        self.storing.set()
        return self.inner.put_many(keys, payloads)


def test_a_timed_out_load_delivers_its_finished_parts(namespace: Namespace) -> None:
    """40 keys in 4 parts of 10; the part of keys 10..19 is stuck. Before: the deadline failed
    all 40 (and mark_miss-ed them all). Now the 30 keys of finished parts are delivered and only
    the stuck 10 fail. The deadline runs on the tier's (injected) clock."""
    now = [0.0]
    stuck = {k(i) for i in range(10, 20)}
    gate = StuckKeys(open_backend("memory://", namespace), stuck)
    tier = SecondaryTier("nfs", gate, TierSettings(io_threads=2, load_timeout_s=5.0),  # type: ignore[arg-type]
                         max_keys_per_call=10, clock=lambda: now[0])
    try:
        keys = [k(i) for i in range(40)]
        assert gate.inner.put_many(keys, [payload(i) for i in range(40)]) == [True] * 40
        outs = [memoryview(bytearray(BLOCK)) for _ in keys]
        job = tier.submit_load(keys, outs)
        # One I/O thread is stuck in keys 10..19; the other runs the three other parts, and only
        # then (loads go first) this store: once it begins, every other part has finished.
        tier.submit_store([k(100)], [payload(100)])
        assert gate.storing.wait(30)
        now[0] += 5.0  # the load's deadline
        finished = [done for done in tier.get_finished_jobs() if done is job]
        assert finished == [job]
        delivered = [i for i, ok in enumerate(job.results) if ok]
        assert delivered == [*range(10), *range(20, 40)], job.error
        assert [bytes(outs[i]) for i in delivered] == [payload(i) for i in delivered]
        assert job.abandoned and "timed out" in (job.error or "")
        stats = tier.stats()
        assert (stats["loaded_keys"], stats["load_keys_failed"]) == (30, 10)
        # Only the stuck keys were marked missing (and count as recent load failures).
        assert tier.lookup(k(10), RequestContext("r")) is False
        retry = tier.submit_store([k(0), k(10)], [payload(0), payload(10)])
        assert retry is not None and retry.suspects == (1,)
    finally:
        gate.release.set()
        tier.shutdown(10)


class HeldStores(OrderedGate):
    """Fault injection of timing: every put call waits on ``release`` (a get does not), and
    the most put calls inside at once is kept."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.inside = 0
        self.most_inside = 0
        self._count_lock = threading.Lock()

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        with self._count_lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            return super().put_many(keys, payloads)
        finally:
            with self._count_lock:
                self.inside -= 1

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        self.calls.append(("get", tuple(keys)))
        return self.inner.get_many(keys, outs)


def test_store_threads_runs_one_store_at_a_time_and_loads_beside_it(
        namespace: Namespace) -> None:
    """``store_threads=1`` of three I/O threads: while a store is held, the other stores wait
    and a load runs on a free thread; once released every store lands, none left behind."""
    gate = HeldStores(open_backend("memory://", namespace))
    gate.inner.put_many([k(9)], [payload(9)])
    tier = SecondaryTier("one-store", gate,  # type: ignore[arg-type]
                         TierSettings(io_threads=3, store_threads=1))
    try:
        assert tier.ready.store_limit == 1
        gate.release.clear()
        stores = [tier.submit_store([k(i)], [payload(i)]) for i in (1, 2, 3)]
        assert gate.entered.acquire(timeout=10)  # store 1 is inside put_many
        out = bytearray(BLOCK)
        load = tier.submit_load([k(9)], [memoryview(out)])
        done = tier.get_finished_jobs(wait=True, timeout=10)
        assert [job.job_id for job in done] == [load.job_id] and bytes(out) == payload(9)
        assert gate.calls == [("put", (k(1),)), ("get", (k(9),))]  # stores 2 and 3 waited
        gate.release.set()
        finished = {job.job_id for job in done}
        while len(finished) < 4:
            batch = tier.get_finished_jobs(wait=True, timeout=10)
            assert batch, "a store was left without a thread"
            finished |= {job.job_id for job in batch}
        assert all(job is not None and job.results == (True,) for job in stores)
        assert gate.most_inside == 1
        assert [call for call in gate.calls if call[0] == "put"] == [
            ("put", (k(1),)), ("put", (k(2),)), ("put", (k(3),))]
    finally:
        gate.release.set()
        tier.shutdown(10)


def test_many_stores_through_one_store_thread_all_land(namespace: Namespace) -> None:
    """200 store jobs on 4 I/O threads, one store at a time: every job finishes (a task owed
    and never paid would leave a store waiting forever, and this would time out)."""
    backend = open_backend("memory://", namespace)
    tier = SecondaryTier("stream", backend, TierSettings(io_threads=4, store_threads=1))
    try:
        jobs = [tier.submit_store([k(i)], [payload(i)]) for i in range(200)]
        assert all(job is not None for job in jobs)
        finished = 0
        while finished < len(jobs):
            batch = tier.get_finished_jobs(wait=True, timeout=10)
            assert batch, f"{len(jobs) - finished} stores never ran"
            finished += len(batch)
        assert backend.exists([k(i) for i in range(200)]) == [True] * 200
    finally:
        tier.shutdown(10)


def test_the_store_limit_is_the_backends_choice_unless_configured(
        tmp_path: Any, namespace: Namespace) -> None:
    """A buffered file tier without fsync runs one store at a time; with fsync (the device's
    queue pays off), in memory, or at or above io_threads, there is no limit."""
    def limit(url: str, **settings: Any) -> int | None:
        tier = SecondaryTier("t", open_backend(url, namespace), TierSettings(**settings))
        try:
            return tier.ready.store_limit
        finally:
            tier.shutdown(10)

    assert limit(f"file://{tmp_path / 'a'}") == 1
    assert limit(f"file://{tmp_path / 'b'}?fsync=1") is None
    assert limit("memory://") is None
    assert limit("memory://", store_threads=2) == 2
    assert limit(f"file://{tmp_path / 'c'}", store_threads=3) == 3
    assert limit(f"file://{tmp_path / 'd'}", io_threads=2, store_threads=2) is None


def test_a_bad_store_threads_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="store_threads"):
        TierSettings(store_threads=0)


def test_a_block_the_backend_evicts_itself_is_no_longer_vouched_for(
        tmp_path: Any, namespace: Namespace) -> None:
    """Our own store is trusted for minutes (``stored_verdict_ttl_s``), so a block the file
    tier's own ``max_bytes`` evicts must stop answering True at the next flush or collection,
    not fail a load first; the tier's listener hears of it (vLLM's tier forgets it held it)."""
    backend = open_backend(f"file://{tmp_path}", namespace,
                           max_bytes=2 * codec.frame_size(BLOCK))
    evicted: list[BlockKey] = []
    clock = FakeClock()
    tier = SecondaryTier("file", backend, clock=clock, on_evicted=evicted.extend)
    try:
        tier.submit_store([k(1), k(2)], [payload(1), payload(2)])
        tier.get_finished_jobs(wait=True, timeout=10)
        tier.submit_store([k(3)], [payload(3)])  # the file tier evicts k(1), its oldest
        tier.get_finished_jobs(wait=True, timeout=10)
        tier.flush()  # the engine's end of step
        assert evicted == [k(1)]
        clock.now += 60.0  # well within the stored verdicts' lifetime
        ctx = RequestContext("r")
        assert [tier.lookup(key, ctx) for key in (k(1), k(2), k(3))] == [None, True, True]
        tier.flush()
        assert tier.lookup_manager.wait_for_probes(10)
        assert tier.lookup(k(1), ctx) is False
    finally:
        tier.shutdown(10)


def test_a_verdict_of_our_own_store_never_outlives_the_redis_ttl(
        redis_server: ValkeyServer, namespace: Namespace) -> None:
    """Redis expires every block ``ttl_s`` after its store: the lookup manager vouches for our
    own store that long at most, though ``stored_verdict_ttl_s`` is longer."""
    clock = FakeClock()
    backend = open_backend(f"redis://127.0.0.1:{redis_server.port}/3", namespace, ttl_s=5)
    tier = SecondaryTier("redis", backend, clock=clock,
                         lookup={"stored_verdict_ttl_s": 600.0})
    try:
        tier.submit_store([k(1)], [payload(1)])
        tier.get_finished_jobs(wait=True, timeout=10)
        clock.now += 4.9
        assert tier.lookup(k(1), RequestContext("before")) is True
        tier.cleanup("before")
        clock.now += 0.1
        assert tier.lookup(k(1), RequestContext("after")) is None  # asks Redis again
    finally:
        tier.shutdown(10)


def test_the_end_of_step_wait_skips_a_load_not_due_and_waits_for_one_that_is(
        namespace: Namespace) -> None:
    """The scheduler's end-of-step wait (``yield_to_io(stores=False)``, vLLM's tier) waits only
    for a load the measured rate says is due within it: a load that takes two hours is not
    waited for (were it, the hour-long budget would hang the test into its timeout); a load
    that is due is waited for and collected."""
    gate = Gate(open_backend("memory://", namespace))
    gate.inner.put_many([k(1), k(2)], [payload(1), payload(2)])
    tier = SecondaryTier("due", gate, TierSettings(io_threads=1))
    try:
        tier.load_rate.observe(BLOCK, 7200.0)  # measured: two hours a load
        gate.release.clear()
        slow = tier.submit_load([k(1)], [memoryview(bytearray(BLOCK))])
        assert gate.entered.acquire(timeout=10)  # on the I/O thread, held
        assert tier.yield_to_io(3600.0, stores=False) == []
        gate.release.set()
        assert tier.get_finished_jobs(wait=True, timeout=10) == [slow]
        tier.load_rate.remeasure()  # the tier measures itself fast again
        tier.load_rate.observe(BLOCK, 0.001)
        fast = tier.submit_load([k(2)], [memoryview(bytearray(BLOCK))])
        assert tier.yield_to_io(3600.0, stores=False) == [fast]
    finally:
        gate.release.set()
        tier.shutdown(10)
