"""TieringManager semantics with in-process and file backends (real bytes, real files)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from kvtier.backends import Buffer, open_backend
from kvtier.backends.base import Backend
from kvtier.config import ConfigError
from kvtier.factory import open_manager
from kvtier.keys import BlockKey, RequestContext
from kvtier.policies import ARCPolicy
from kvtier.tiering.manager import (
    BlockPromoted,
    BlockRemoved,
    BlockStored,
    KeyNotResidentError,
    KeyStatus,
    ManagerClosedError,
    PromotionFailed,
    StoreMode,
    StoreShed,
    TieringManager,
)
from tiering.manager_helpers import BLOCK, Factory, FakeClock, data, k, read, step, store

HIT, PENDING, RETRY, MISS = (KeyStatus.HIT, KeyStatus.HIT_PENDING, KeyStatus.RETRY,
                             KeyStatus.MISS)






@pytest.fixture
def make(tmp_path: Path) -> Iterator[Factory]:
    managers: list[TieringManager] = []

    def factory(tiers: Sequence[Any] = ("memory://",), slots: int = 4, **config: Any
                ) -> TieringManager:
        clock = config.pop("clock", FakeClock())
        manager = open_manager({
            "block_bytes": BLOCK, "primary_bytes": BLOCK * slots,
            "namespace": {"model": f"test-{uuid4().hex}"},
            "secondary_tiers": list(tiers), **config}, clock=clock)
        managers.append(manager)
        return manager

    yield factory
    for manager in managers:
        manager.shutdown(10)





def assert_no_state(manager: TieringManager) -> None:
    stats = manager.get_stats()
    assert stats["tracked_keys"] == 0
    assert stats["pins"] == 0
    assert stats["outstanding_jobs"] == 0
    assert stats["pending_promotions"] == 0
    assert stats["manager"]["queued_transfers"] == 0
    assert stats["manager"]["requests_with_pins"] == 0


# ---- CPU-only -------------------------------------------------------------------------------


def test_cpu_only_store_lookup_load(make: Factory) -> None:
    m = make(tiers=[])
    ctx = RequestContext("a")
    assert m.lookup_prefix([k(1), k(2)], ctx) == 0
    store(m, [k(1), k(2)], ctx)
    assert m.lookup(k(1), ctx) is HIT
    assert m.lookup_prefix([k(1), k(2), k(3)], ctx) == 2
    assert read(m, [k(1), k(2)], ctx) == [data(k(1)), data(k(2))]
    m.on_request_finished(ctx)
    step(m)
    assert_no_state(m)
    assert m.take_events() == [BlockStored((k(1), k(2)), "primary")]


def test_pool_has_exactly_primary_bytes_over_block_bytes_slots(make: Factory) -> None:
    m = open_manager({"block_bytes": 100, "primary_bytes": 1050, "namespace": {"model": "m"}})
    try:
        assert m.num_slots == 10
        assert m.arena.nbytes == 1000
    finally:
        m.shutdown()


def test_prepare_store_skips_held_keys_reports_evictions_and_is_all_or_nothing(
        make: Factory) -> None:
    m = make(tiers=[], slots=3)
    ctx = RequestContext("a")
    store(m, [k(1), k(2)], ctx)
    plan = m.prepare_store([k(1), k(3), k(3)], ctx)
    assert plan is not None
    assert plan.keys == (k(3),) and plan.evicted == ()
    # k(1) is held and in this call: it must not be the victim even though it is LRU
    m.complete_store([k(3)], ctx)
    plan = m.prepare_store([k(1), k(4)], ctx)
    assert plan is not None and plan.keys == (k(4),) and plan.evicted == (k(2),)
    m.complete_store([k(4)], ctx, success=False)
    assert m.lookup(k(4), ctx) is MISS
    m.prepare_load([k(1), k(3)], ctx)  # pin two of three slots
    assert m.prepare_store([k(5), k(6)], ctx) is None
    plan = m.prepare_store([k(5)], ctx)
    assert plan is not None and plan.evicted == ()  # the slot freed by the failed store
    m.complete_store([k(5)], ctx)
    m.complete_store([k(5)], ctx)  # a second completion is counted, not fatal
    assert m.get_stats()["manager"]["unexpected_completions"] == 1
    events = m.take_events()
    assert BlockRemoved((k(2),), "primary") in events


def test_touch_counts_as_a_use_for_eviction(make: Factory) -> None:
    m = make(tiers=[], slots=2)
    ctx = RequestContext("a")
    store(m, [k(1)], ctx)
    store(m, [k(2)], ctx)
    m.touch([k(1)], ctx)
    plan = m.prepare_store([k(3)], ctx)
    assert plan is not None and plan.evicted == (k(2),)


def test_arc_from_config(make: Factory) -> None:
    m = make(tiers=[], eviction_policy="arc")
    assert isinstance(m.pool.policy, ARCPolicy)


def test_pins_protect_slots_and_a_full_pool_answers_miss(make: Factory) -> None:
    m = make(slots=2)
    ctx = RequestContext("a")
    store(m, [k(1), k(2)], ctx)
    step(m)
    m.prepare_load([k(1), k(2)], ctx)
    other = RequestContext("b")
    backend = m.tiers[0].backend
    backend.put_many([k(9)], [data(k(9))])
    assert m.lookup(k(9), other) is RETRY
    step(m)
    assert m.lookup(k(9), other) is MISS  # found in the tier, but every slot is pinned
    assert m.get_stats()["manager"]["promotions_no_slot"] == 1
    m.complete_load([k(1), k(2)], ctx)
    assert m.lookup(k(9), other) is PENDING
    step(m)
    assert m.lookup(k(9), other) is HIT
    assert read(m, [k(9)], other) == [data(k(9))]


def test_prepare_load_of_a_non_resident_key_names_it(make: Factory) -> None:
    m = make(tiers=[])
    ctx = RequestContext("a")
    store(m, [k(1)], ctx)
    with pytest.raises(KeyNotResidentError, match=rf"keys\[1\] = {k(2).hex()} is not resident"):
        m.prepare_load([k(1), k(2)], ctx)
    assert m.get_stats()["pins"] == 0  # nothing was pinned
    with pytest.raises(TypeError, match=r"keys\[0\] must be a BlockKey"):
        m.lookup_prefix(["nope"], ctx)  # type: ignore[list-item]


def test_on_request_finished_releases_leftover_pins(make: Factory) -> None:
    m = make(tiers=[])
    ctx = RequestContext("a")
    store(m, [k(1)], ctx)
    m.prepare_load([k(1)], ctx)
    m.prepare_load([k(1)], ctx)
    assert m.get_stats()["pins"] == 2
    m.on_request_finished(ctx)
    assert m.get_stats()["pins"] == 0
    assert m.get_stats()["manager"]["pins_released_at_finish"] == 2


# ---- promotion ------------------------------------------------------------------------------


def test_promotion_goes_retry_pending_hit_with_exact_bytes(make: Factory) -> None:
    m = make()
    backend = m.tiers[0].backend
    backend.put_many([k(1), k(2)], [data(k(1)), data(k(2))])
    ctx = RequestContext("a")
    keys = [k(1), k(2), k(3)]
    assert m.lookup_prefix(keys, ctx) is None
    assert m.lookup(k(1), ctx) is RETRY
    step(m)
    assert [m.lookup(key, ctx) for key in keys] == [PENDING, PENDING, MISS]
    assert m.lookup_prefix(keys, ctx) is None
    step(m)
    assert m.lookup_prefix(keys, ctx) == 2
    assert read(m, keys[:2], ctx) == [data(k(1)), data(k(2))]
    m.on_request_finished(ctx)
    step(m)
    assert_no_state(m)
    events = m.take_events()
    stored = events.index(BlockStored((k(1), k(2)), "primary"))
    assert events[stored + 1] == BlockPromoted((k(1), k(2)), "memory")


def test_a_landed_promotion_is_held_for_its_request_against_other_promotions(
        make: Factory) -> None:
    m = make(slots=4)
    backend = m.tiers[0].backend
    mine, theirs = [k(1), k(2)], [k(11), k(12), k(13)]
    backend.put_many(mine + theirs, [data(key) for key in mine + theirs])
    a, b = RequestContext("a"), RequestContext("b")
    assert m.lookup_prefix([*mine, k(99)], a) is None  # k(99) is unknown: RETRY
    step(m)
    assert m.lookup_prefix([*mine, k(99)], a) is None  # promotions in flight
    step(m)  # a's blocks landed and are held for a
    assert m.get_stats()["manager"]["held_blocks"] == 2
    assert m.lookup_prefix(theirs, b) is None
    step(m)
    assert m.lookup_prefix(theirs, b) is None  # b's promotions may not evict a's blocks
    assert m.pool.is_resident(k(1)) and m.pool.is_resident(k(2))
    assert m.lookup_prefix([*mine, k(99)], a) == 2
    assert read(m, mine, a) == [data(k(1)), data(k(2))]
    m.on_request_finished(a)
    m.on_request_finished(b)
    step(m)
    assert_no_state(m)


def test_holds_expire_when_a_request_never_comes_back(make: Factory) -> None:
    m = make(slots=4)
    m.tiers[0].backend.put_many([k(1)], [data(k(1))])
    a = RequestContext("a")
    m.lookup_prefix([k(1)], a)
    step(m)
    m.lookup_prefix([k(1)], a)
    step(m)
    assert m.get_stats()["pins"] == 1
    for _ in range(8):
        step(m)
    assert m.get_stats()["pins"] == 0
    assert m.get_stats()["manager"]["holds_expired"] == 1
    m.on_request_finished(a)


def test_lookup_prefix_stops_at_the_first_miss(make: Factory) -> None:
    m = make(tiers=[], slots=8)
    ctx = RequestContext("a")
    store(m, [k(1), k(3)], ctx)
    assert m.lookup_prefix([k(1), k(2), k(3)], ctx) == 1
    assert m.lookup_prefix([], ctx) == 0


def test_n_requests_coalesce_to_one_transfer_per_key(make: Factory) -> None:
    m = make(slots=8)
    backend = m.tiers[0].backend
    keys = [k(i) for i in range(4)]
    backend.put_many(keys, [data(key) for key in keys])
    ctxs = [RequestContext(f"r{i}") for i in range(10)]
    for ctx in ctxs:
        assert m.lookup_prefix(keys, ctx) is None
    step(m)
    for ctx in ctxs:
        assert m.lookup_prefix(keys, ctx) is None  # all HIT_PENDING, joined
    step(m)
    for ctx in ctxs:
        assert m.lookup_prefix(keys, ctx) == 4
    tier = m.get_stats()["tiers"]["memory"]
    assert tier["backend_calls"] == 1
    assert tier["loads_submitted"] == 1
    assert tier["load_keys"] == 4
    assert tier["backend_gets"] == 4
    assert m.get_stats()["manager"]["promotions_joined"] == 4 * 9


def corrupt_file_block(root: Path, key: bytes) -> None:
    [path] = list(root.rglob(f"{key.hex()}.kvb"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.chmod(0o600)
    path.write_bytes(bytes(raw))


def test_corrupt_promotion_recomputes_without_livelock(make: Factory, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    m = make(tiers=[f"file://{root}"], slots=4)
    ctx = RequestContext("writer")
    store(m, [k(1), k(2)], ctx)
    step(m)
    corrupt_file_block(root, k(2))
    m.pool.discard(k(1))
    m.pool.discard(k(2))
    reader = RequestContext("reader")
    keys = [k(1), k(2)]
    answers = []
    for _ in range(10):  # bounded: must settle within a few steps
        answers.append(m.lookup_prefix(keys, reader))
        if answers[-1] is not None:
            break
        step(m)
    assert answers[-1] == 1, answers
    assert len(answers) <= 4
    events = m.take_events()
    assert PromotionFailed((k(2),), "file") in events
    for _ in range(5):  # the doomed load is never retried while quarantined
        assert m.lookup_prefix(keys, reader) == 1
        step(m)
    tier = m.get_stats()["tiers"]["file"]
    assert tier["load_keys_failed"] == 1
    assert tier["backend_corrupt_objects"] == 1
    assert read(m, [k(1)], reader) == [data(k(1))]
    m.on_request_finished(reader)
    m.on_request_finished(ctx)
    step(m)
    assert_no_state(m)


def test_a_failed_load_in_one_tier_falls_through_to_the_next(make: Factory,
                                                            tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    m = make(tiers=[f"file://{first}", f"file://{second}"], slots=2)
    ctx = RequestContext("w")
    store(m, [k(1)], ctx)
    step(m)
    corrupt_file_block(first, k(1))
    m.pool.discard(k(1))
    reader = RequestContext("r")
    for _ in range(8):
        if m.lookup_prefix([k(1)], reader) is not None:
            break
        step(m)
    assert m.lookup_prefix([k(1)], reader) == 1
    assert read(m, [k(1)], reader) == [data(k(1))]
    stats = m.get_stats()["tiers"]
    assert stats["file"]["load_keys_failed"] == 1
    assert stats["file2"]["load_keys"] == 1 and stats["file2"]["load_keys_failed"] == 0
    events = m.take_events()
    assert PromotionFailed((k(1),), "file") in events
    assert [e for e in events if isinstance(e, BlockPromoted)] == [BlockPromoted((k(1),), "file2")]


# ---- cascade --------------------------------------------------------------------------------


def test_write_through_writes_every_tier_and_unpins_after(make: Factory, tmp_path: Path) -> None:
    m = make(tiers=["memory://", f"file://{tmp_path / 'f'}"])
    ctx = RequestContext("a")
    store(m, [k(1), k(2)], ctx)
    assert m.get_stats()["pins"] == 4  # one per block per tier until the writes land
    step(m)
    assert m.get_stats()["pins"] == 0
    for tier in m.tiers:
        assert tier.backend.exists([k(1), k(2)]) == [True, True]
    events = m.take_events()
    assert BlockStored((k(1), k(2)), "memory") in events
    assert BlockStored((k(1), k(2)), "file") in events


def test_write_back_writes_on_eviction_and_flushes_at_shutdown(make: Factory,
                                                               tmp_path: Path) -> None:
    root = tmp_path / "wb"
    m = make(tiers=[f"file://{root}"], slots=2, write_policy="write_back")
    ctx = RequestContext("a")
    store(m, [k(1), k(2)], ctx)
    step(m)
    backend = m.tiers[0].backend
    assert backend.exists([k(1), k(2)]) == [False, False]
    store(m, [k(3)], ctx)  # evicts k(1): copied out and written back
    step(m)
    assert backend.exists([k(1), k(2), k(3)]) == [True, False, False]
    m.on_request_finished(ctx)
    m.shutdown(10)
    reopened = make(tiers=[f"file://{root}"], slots=2,
                    namespace={"model": m.namespace.model})
    assert reopened.tiers[0].backend.exists([k(1), k(2), k(3)]) == [True, True, True]
    out = memoryview(bytearray(BLOCK))
    assert reopened.tiers[0].backend.get_many([k(1)], [out]) == [True]
    assert bytes(out) == data(k(1))


def test_a_block_evicted_before_its_write_back_lands_is_read_from_its_copy(
        make: Factory) -> None:
    """Between eviction and the tier's write, the block is in no tier: a lookup re-admits it
    from the manager's copy (a hit, no load, the same bytes) instead of missing. The held
    backend is an injected fault: a real backend cannot be made to stall on demand."""
    m = make(slots=2, write_policy="write_back")
    tier = m.tiers[0]
    held = HeldBackend(tier.backend)
    tier._backend = held  # inject the hold
    writer, reader = RequestContext("w"), RequestContext("r")
    try:
        store(m, [k(1), k(2)], writer)
        store(m, [k(3)], writer)  # evicts k(1): copied out, its write queued
        m.on_schedule_end()
        assert held.entered.wait(10)  # the write of k(1) is stuck in the backend
        assert m.get_stats()["manager"]["pending_copies"] == 1
        assert m.lookup(k(1), reader) is HIT  # re-admitted from the copy, evicting k(2)
        assert read(m, [k(1)], reader) == [data(k(1))]
        stats = m.get_stats()
        assert stats["manager"]["copies_readmitted"] == 1
        assert stats["tiers"]["memory"]["load_keys"] == 0  # nothing was loaded from the tier
    finally:
        held.release.set()
    step(m)
    assert m.get_stats()["manager"]["pending_copies"] == 0  # the write landed: copy dropped
    assert tier.backend.exists([k(1)]) == [True]
    m.on_request_finished(reader)
    m.on_request_finished(writer)


def test_write_back_flushes_every_tier_at_shutdown(make: Factory, tmp_path: Path) -> None:
    roots = [tmp_path / "one", tmp_path / "two"]
    m = make(tiers=[f"file://{root}" for root in roots], slots=4, write_policy="write_back")
    model = m.namespace.model
    ctx = RequestContext("a")
    store(m, [k(1), k(2)], ctx)
    step(m)
    m.on_request_finished(ctx)
    m.shutdown(10)
    stats = m.get_stats()
    assert stats["manager"]["cascades_stored"] == 4
    assert stats["manager"]["invariant_violations"] == 0
    for root in roots:
        again = make(tiers=[f"file://{root}"], namespace={"model": model})
        assert again.tiers[0].backend.exists([k(1), k(2)]) == [True, True]


def test_a_promoted_block_is_never_written_back_to_its_tier(make: Factory) -> None:
    m = make(slots=1, write_policy="write_back")
    backend = m.tiers[0].backend
    backend.put_many([k(1)], [data(k(1))])
    puts_before = backend.stats()["puts"]
    ctx = RequestContext("a")
    m.lookup(k(1), ctx)
    step(m)
    assert m.lookup(k(1), ctx) is PENDING
    step(m)
    assert m.lookup(k(1), ctx) is HIT
    store(m, [k(2)], ctx)  # evicts the promoted k(1)
    step(m)
    m.shutdown(10)  # flushes k(2) only
    assert backend.stats()["puts"] == puts_before + 1


class HeldBackend:
    """Fault injection (a real backend cannot be held on demand): every put waits on an Event;
    everything else goes to the real backend."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        self.entered.set()
        if not self.release.wait(30):
            raise TimeoutError("never released")
        return self.inner.put_many(keys, payloads)


def test_a_backlogged_tier_never_pins_the_pool_full_and_loses_nothing(make: Factory) -> None:
    """Write-through cascades pin at most half the pool; the rest stay resident and evictable
    (never a refused store), an evicted one waits as a copy that a lookup re-admits, and
    copies beyond half the pool make the step wait for the tier; a tier that finishes nothing
    for ``store_stall_s`` is stalled and only then is the excess shed, counted. The held
    backend is an injected fault: a real backend cannot be made to hang on demand."""
    m = make(tiers=[{"url": "memory://", "max_pending_store_jobs": 1, "io_threads": 1,
                     "store_stall_s": 0.2}], slots=8)
    tier = m.tiers[0]
    held = HeldBackend(tier.backend)
    tier._backend = held  # inject the hold
    ctx = RequestContext("a")
    try:
        store(m, [k(1)], ctx)
        m.on_schedule_end()
        assert held.entered.wait(10)
        store(m, [k(i) for i in range(2, 7)], ctx)
        m.on_schedule_end()  # k(2)..k(4) wait pinned; k(5), k(6) are past the pin budget
        assert [m.pool.pin_count(k(i)) for i in range(1, 7)] == [1, 1, 1, 1, 0, 0]
        assert m.get_stats()["manager"]["unwritten_blocks"] == 2
        store(m, [k(i) for i in range(7, 11)], ctx)  # fills the free slots, evicts k(5), k(6)
        stats = m.get_stats()["manager"]
        assert stats["pending_copies"] == 2 and stats["stores_rejected"] == 0
        reader = RequestContext("r")
        assert m.lookup(k(5), reader) is KeyStatus.HIT  # from its copy: no load, no miss
        assert read(m, [k(5)], reader) == [data(k(5))]
        assert m.get_stats()["manager"]["copies_readmitted"] == 1
        assert not [e for e in m.take_events() if isinstance(e, StoreShed)]
        store(m, [k(i) for i in range(11, 15)], ctx)  # more evicted copies wait ...
        m.on_schedule_end()  # ... beyond half the pool: waited for, stalled, oldest shed
        assert m.get_stats()["tiers"][tier.name]["store_stalls"] == 1
        shed = [e for e in m.take_events() if isinstance(e, StoreShed)]
        assert shed and shed[0].keys[0] == k(2)
        shed_keys = {key for event in shed for key in event.keys}
        assert m.get_stats()["manager"]["cascades_shed"] == len(shed_keys)
        metrics = m.metrics
        assert metrics is not None
        m.publish_metrics()
        assert metrics.value("kvtier_store_shed_blocks_total",
                             tier="1:memory") == len(shed_keys)
    finally:
        held.release.set()
    step(m)  # everything not shed reaches the tier once it has room
    m.on_request_finished(reader)
    assert m.get_stats()["pins"] == 0
    shed_keys |= {key for e in m.take_events() if isinstance(e, StoreShed) for key in e.keys}
    assert m.get_stats()["manager"]["cascades_shed"] == len(shed_keys)
    keys = [k(i) for i in range(1, 15)]
    missing = {key for key, ok in zip(keys, tier.backend.exists(keys), strict=True) if not ok}
    assert missing == shed_keys
    assert m.get_stats()["manager"]["pending_copies"] == 0


# ---- lifecycle, events, config --------------------------------------------------------------


def test_shutdown_is_idempotent_ends_threads_and_refuses_work(make: Factory) -> None:
    m = make(tiers=["memory://", "memory://"])
    ctx = RequestContext("a")
    store(m, [k(1)], ctx)
    m.lookup(k(2), ctx)
    m.on_schedule_end()
    m.shutdown(10)
    m.shutdown(10)
    names = [thread.name for thread in threading.enumerate()]
    assert not [n for n in names if n.startswith(("kvtier-io-memory", "kvtier-lookup-memory"))]
    with pytest.raises(ManagerClosedError, match="lookup"):
        m.lookup(k(1), ctx)
    stats = m.get_stats()
    assert stats["manager"]["state"] == "closed"
    assert stats["pins"] == 0


def test_events_are_bounded(make: Factory) -> None:
    m = make(tiers=[], slots=8, max_events=2)
    ctx = RequestContext("a")
    for i in range(4):
        store(m, [k(i)], ctx)
    assert len(m.take_events()) == 2
    assert m.get_stats()["manager"]["events_dropped"] == 2
    assert m.take_events() == []


def test_open_manager_wraps_backend_errors_with_the_tier_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\]\.bogus"):
        open_manager({"block_bytes": 64, "primary_bytes": 128, "namespace": {"model": "m"},
                      "secondary_tiers": ["memory://", {"url": "memory://", "bogus": 1}]})
    names = [thread.name for thread in threading.enumerate()]
    assert not [n for n in names if n.startswith("kvtier-lookup-memory")]


def test_context_manager_and_kvtier_exports() -> None:
    import kvtier

    assert kvtier.TieringManager is TieringManager
    assert kvtier.KeyStatus is KeyStatus
    with kvtier.open_manager({"block_bytes": 64, "primary_bytes": 128,
                              "namespace": {"model": "m"}}) as m:
        assert m.lookup(k(1), RequestContext("a")) is MISS
    with pytest.raises(ManagerClosedError):
        m.on_schedule_end()


def test_metrics_count_lookups_hits_and_transfers(make: Factory) -> None:
    m = make()
    ctx = RequestContext("a")
    store(m, [k(1)], ctx)
    m.tiers[0].backend.put_many([k(2)], [data(k(2))])
    m.lookup(k(1), ctx)
    m.lookup(k(2), ctx)
    step(m)
    m.lookup(k(2), ctx)
    step(m)
    m.publish_metrics()
    metrics = m.metrics
    assert metrics is not None
    assert metrics.value("kvtier_lookups_total", tier="0:primary") == 3
    assert metrics.value("kvtier_lookup_hits_total", tier="0:primary") == 1
    assert metrics.value("kvtier_lookup_hits_total", tier="1:memory") == 1
    assert metrics.value("kvtier_write_bytes_total", tier="1:memory") == BLOCK
    assert metrics.value("kvtier_read_bytes_total", tier="1:memory") == BLOCK
    assert metrics.value("kvtier_probe_calls_total", tier="1:memory") == 1
    assert metrics.value("kvtier_probe_duration_seconds_count", tier="1:memory") == 1
    assert metrics.value("kvtier_primary_slots", state="resident") == 2
    assert b"kvtier_breaker_state" in metrics.render()


@pytest.mark.parametrize(("write_policy", "eviction_policy"),
                         [("write_through", "lru"), ("write_back", "arc")])
def test_randomized_soak_serves_only_exact_bytes_and_ends_empty(
        make: Factory, tmp_path: Path, write_policy: str, eviction_policy: str) -> None:
    """Random requests over a small pool and two tiers: every loaded slot holds exactly its
    key's bytes, nothing is pinned by mistake, and the end state is empty."""
    import random

    rng = random.Random(1234)
    m = make(tiers=["memory://", f"file://{tmp_path / 'soak'}"], slots=12,
             write_policy=write_policy, eviction_policy=eviction_policy)
    universe = [k(i) for i in range(60)]
    live: dict[str, tuple[RequestContext, list[bytes]]] = {}
    served = 0
    for step_no in range(2000):
        if len(live) < 6 and rng.random() < 0.5:
            start = rng.randrange(0, 50)
            ctx = RequestContext(f"req-{step_no}")
            live[ctx.req_id] = (ctx, universe[start : start + rng.randint(1, 8)])
        for req_id in list(live):
            ctx, keys = live[req_id]
            answer = m.lookup_prefix(keys, ctx)
            if answer is None:
                continue
            if answer:
                loaded = keys[:answer]
                plan = m.prepare_load(loaded, ctx)
                m.touch(loaded, ctx)
                for key, slot in zip(plan.keys, plan.slots, strict=True):
                    assert bytes(m.primary_view(slot)) == data(key)
                served += answer
                m.complete_load(loaded, ctx)
            rest = keys[answer:]
            if rest:
                plan_store = m.prepare_store(rest, ctx)
                if plan_store is not None:
                    for key, slot in zip(plan_store.keys, plan_store.slots, strict=True):
                        m.primary_view(slot)[:] = data(key)
                    m.complete_store(list(plan_store.keys), ctx,
                                     success=rng.random() > 0.05)
            m.on_request_finished(ctx)
            del live[req_id]
        m.on_schedule_end()
        if rng.random() < 0.3:
            m.wait_idle(10)
        m.take_events()
    for ctx, _ in live.values():
        m.on_request_finished(ctx)
    step(m)
    step(m)
    assert served > 100
    assert_no_state(m)
    stats = m.get_stats()
    assert stats["manager"]["invariant_violations"] == 0
    assert stats["manager"]["promotions_succeeded"] > 0
    assert stats["primary"]["filling_slots"] == 0


# ---- liveness: long requests, small pools ---------------------------------------------------


def answer_within(m: TieringManager, requests: Sequence[tuple[RequestContext, list[bytes]]],
                  max_steps: int) -> tuple[list[int], int]:
    """Ask every request each step until all answered; (answers, steps taken). Steps, not time:
    ``step`` waits for the probes and transfers of the step to land."""
    answers: dict[str, int] = {}
    for steps in range(1, max_steps + 1):
        for ctx, keys in requests:
            if ctx.req_id not in answers:
                answer = m.lookup_prefix(keys, ctx)
                if answer is not None:  # the engine loads at once, as it would
                    answers[ctx.req_id] = answer
                    assert read(m, keys[:answer], ctx) == [data(key) for key in keys[:answer]]
        if len(answers) == len(requests):
            return [answers[ctx.req_id] for ctx, _ in requests], steps
        step(m)
    raise AssertionError(f"no answer within {max_steps} steps: {answers}")


def put_in_tier(m: TieringManager, keys: Sequence[bytes]) -> None:
    assert m.tiers[0].backend.put_many(keys, [data(key) for key in keys]) == [True] * len(keys)


def test_a_request_bigger_than_the_pool_answers_what_is_loadable(make: Factory,
                                                                  tmp_path: Path) -> None:
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=8)
    keys = [k(i) for i in range(40)]
    put_in_tier(m, keys)
    reader = RequestContext("long")
    [answer], steps = answer_within(m, [(reader, keys)], max_steps=6)
    assert steps <= 3  # probe, promote, answer
    assert 1 <= answer <= 8
    m.on_request_finished(reader)
    step(m)
    assert_no_state(m)


def test_a_pool_pinned_full_by_running_requests_answers_at_once(make: Factory,
                                                                 tmp_path: Path) -> None:
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=8)
    running = RequestContext("running")
    resident = [k(100 + i) for i in range(8)]
    store(m, resident, running)
    step(m)
    m.prepare_load(resident, running)  # the engine reads them: every slot is pinned
    assert m.pool.evictable_count() == 0
    wanted = [k(i) for i in range(5)]
    put_in_tier(m, wanted)
    other = RequestContext("other")
    [answer], steps = answer_within(m, [(other, wanted)], max_steps=6)
    assert (answer, steps) == (0, 2)  # one probe step, then MISS: no slot can be had
    plan = m.prepare_store(wanted, other, StoreMode.PREFIX)  # never None: all deferred
    assert plan is not None and plan.keys == () and plan.deferred == tuple(wanted)
    assert m.prepare_store(wanted, other) is None  # StoreMode.ALL: all or nothing
    m.complete_load(resident, running)
    for ctx in (running, other):
        m.on_request_finished(ctx)
    step(m)
    assert_no_state(m)


def test_concurrent_requests_each_over_half_the_pool_all_answer(make: Factory,
                                                                tmp_path: Path) -> None:
    """Three requests of 12 blocks on a 16-slot pool: their promotions evict each other's
    (the ping-pong that once never answered); each answers within a bounded number of steps."""
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=16)
    requests = [(RequestContext(f"r{r}"), [k(100 * r + i) for i in range(12)])
                for r in range(3)]
    for _, keys in requests:
        put_in_tier(m, keys)
    answers, steps = answer_within(m, requests, max_steps=12)
    assert steps <= 2 + 2 * 3  # the probe step, three promotion rounds, the answers
    for ctx, _ in requests:
        m.on_request_finished(ctx)
    assert sum(answers) >= 12
    step(m)
    assert_no_state(m)


def test_a_scheduler_that_outruns_a_real_slow_tier_waits_and_loses_nothing(
        make: Factory, tmp_path: Path) -> None:
    """The engine stores 40 blocks a step, never waiting, into a pool of 16 over a real file
    tier that fsyncs every block on the real disk, one job at a time: evicted unwritten blocks
    pile up as copies past half the pool, and the step waits for the tier (back-pressure)
    instead of shedding them. Every block reaches the tier; nothing is shed or stalled."""
    m = make(tiers=[{"url": (tmp_path / "f").as_uri() + "?fsync=true", "io_threads": 1,
                     "max_pending_store_jobs": 1}], slots=16, write_policy="write_back")
    ctx = RequestContext("fast")
    keys = [k(i) for i in range(400)]
    for start in range(0, len(keys), 40):
        backlog = keys[start : start + 40]
        while backlog:
            plan = m.prepare_store(backlog, ctx, StoreMode.PREFIX)
            assert plan is not None
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                m.primary_view(slot)[:] = data(key)
            m.complete_store(plan.keys, ctx)
            backlog = list(plan.deferred)
            m.on_schedule_end()
    tier_stats = m.get_stats()["tiers"][m.tiers[0].name]
    assert tier_stats["store_waits"] > 0 and tier_stats["store_wait_seconds"] > 0
    assert tier_stats["store_stalls"] == 0
    assert m.get_stats()["manager"]["cascades_shed"] == 0
    m.on_request_finished(ctx)
    m.shutdown(30)  # write-back: what is still resident is flushed at shutdown
    tier = m.tiers[0]
    reopened = open_backend((tmp_path / "f").as_uri(), m.namespace)
    try:
        assert reopened.exists(keys) == [True] * len(keys)
    finally:
        reopened.close()
    assert tier.closed


def test_a_store_bigger_than_the_pool_streams_to_the_tier(make: Factory,
                                                          tmp_path: Path) -> None:
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=8)
    ctx = RequestContext("prefill")
    backlog = [k(i) for i in range(50)]
    steps = 0
    while backlog:
        steps += 1
        plan = m.prepare_store(backlog, ctx, StoreMode.PREFIX)
        assert plan is not None and len(plan.keys) + len(plan.deferred) == len(backlog)
        for key, slot in zip(plan.keys, plan.slots, strict=True):
            m.primary_view(slot)[:] = data(key)
        m.complete_store(plan.keys, ctx)
        backlog = list(plan.deferred)
        step(m)  # the cascades land and release their slots
    assert steps == 7  # ceil(50 / 8): the pool is the only limit
    assert m.tiers[0].backend.exists([k(i) for i in range(50)]) == [True] * 50
    stats = m.get_stats()
    assert stats["manager"]["cascades_shed"] == 0 and stats["manager"]["stores_deferred"] > 0
    m.on_request_finished(ctx)
    assert_no_state(m)


def test_the_end_of_step_wait_counts_the_schedulers_cpu_time_not_wall_time(
        make: Factory) -> None:
    """An engine waiting for its model between steps spends no CPU and is not made to wait;
    a scheduler that burned CPU hands the tiers' threads as much time (recorded by replacing
    the tier's yield, an observation, not a fault)."""
    m = make()
    asked: list[float] = []

    def record(timeout: float, *, stores: bool = True) -> list[object]:
        asked.append(timeout)
        return []

    m.tiers[0].yield_to_io = record  # type: ignore[method-assign,assignment]
    m.on_schedule_end()
    time.sleep(0.05)  # wall time, no CPU
    m.on_schedule_end()
    started = time.thread_time()
    while time.thread_time() - started < 0.03:  # CPU, as a busy scheduler
        pass
    m.on_schedule_end()
    assert asked[1] < 0.02 and asked[2] >= 0.03
