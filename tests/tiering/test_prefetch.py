"""Session-aware prefetch (kvtier.tiering.prefetch) through a real TieringManager over a real
memory tier: a chain evicted during a session's pause is back before its next lookup, within
the budgets, cancelled when the pool needs the room, never ahead of a demand load, and its
counters add up. Timing is pinned with wait_idle and threading.Event gates, never sleeps."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any
from uuid import uuid4

import pytest

from kvtier.backends import Buffer, open_backend
from kvtier.backends.base import Backend
from kvtier.factory import open_manager
from kvtier.keys import BlockKey, Namespace, RequestContext
from kvtier.settings import ConfigError
from kvtier.tiering.manager import (
    BlockPrefetched,
    BlockPromoted,
    KeyStatus,
    NextTurn,
    StoreMode,
    TieringManager,
)
from kvtier.tiering.plans import LoadPriority
from kvtier.tiering.tier import SecondaryTier
from kvtier.tiering.tier_settings import PrefetchSettings, TierSettings
from tiering.manager_helpers import BLOCK, Factory, FakeClock, data, k, read, step, store


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model=f"test-{uuid4().hex}")


@pytest.fixture
def make() -> Iterator[Factory]:
    managers: list[TieringManager] = []

    def factory(slots: int = 8, prefetch: dict[str, Any] | None = None,
                tier: dict[str, Any] | None = None, clock: FakeClock | None = None
                ) -> TieringManager:
        manager = open_manager({
            "block_bytes": BLOCK, "primary_bytes": BLOCK * slots,
            "namespace": {"model": f"test-{uuid4().hex}"},
            "secondary_tiers": [{"url": "memory://", **(tier or {})}],
            "prefetch": {"mode": "on", "pool_fraction": 0.5, **(prefetch or {})}},
            clock=clock or FakeClock())
        managers.append(manager)
        return manager

    yield factory
    for manager in managers:
        manager.shutdown(10)





def turn(manager: TieringManager, keys: Sequence[bytes], req_id: str,
         session: str | None) -> RequestContext:
    """One finished request that computed and stored ``keys``, cascaded to the tier."""
    ctx = RequestContext(req_id, session_id=session)
    store(manager, keys, ctx)
    manager.on_request_finished(ctx)
    step(manager)
    return ctx


def evict_with_one_off_request(manager: TieringManager, first: int, count: int) -> None:
    """Another request stores ``count`` blocks (evicting older ones) and finishes with no
    chain to keep (an engine passes ``chain=()``), so its blocks are the cheapest victims;
    their cascades land (``wait_idle``: no step, so no prefetch yet)."""
    ctx = RequestContext(f"other-{first}")
    store(manager, [k(i) for i in range(first, first + count)], ctx)
    manager.on_request_finished(ctx, chain=())
    assert manager.wait_idle(10)


def prefetch_stats(manager: TieringManager) -> dict[str, Any]:
    stats: dict[str, Any] = manager.get_stats()["prefetch"]
    return stats


def assert_counters_add_up(stats: dict[str, Any]) -> None:
    assert stats["started_blocks"] == (stats["prefetched_blocks"] + stats["cancelled_blocks"]
                                       + stats["failed_blocks"] + stats["in_flight_blocks"])
    assert stats["prefetched_blocks"] == (stats["used_blocks"] + stats["wasted_blocks"]
                                          + stats["unused_blocks"])
    assert stats["steps"] == (stats["cooldown_steps"] + stats["waited_steps"]
                              + stats["budget_steps"] + stats["open_steps"])


def test_a_chain_evicted_during_the_pause_is_back_before_the_next_lookup(make: Factory) -> None:
    m = make()
    chain = [k(i) for i in range(1, 4)]
    turn(m, chain, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 8)  # the whole pool: the chain left it
    assert not any(m.pool.is_resident(key) for key in chain)
    m.take_events()
    step(m)  # the pause: prefetch brings the chain back from the tier
    events = m.take_events()
    prefetched = {key for e in events if isinstance(e, BlockPrefetched) for key in e.keys}
    assert prefetched == set(chain)
    assert not [e for e in events if isinstance(e, BlockPromoted)]
    nxt = RequestContext("s1-turn1", session_id="s1")
    assert m.lookup_prefix(chain, nxt) == 3  # at once: no probe, no load to wait for
    assert read(m, chain, nxt) == [data(key) for key in chain]
    m.on_request_finished(nxt)
    stats = prefetch_stats(m)
    assert (stats["started_blocks"], stats["prefetched_blocks"], stats["used_blocks"]) == (3, 3, 3)
    assert stats["wasted_blocks"] == stats["cancelled_blocks"] == 0
    assert_counters_add_up(stats)


def test_without_a_session_id_the_finished_chain_is_the_session(make: Factory) -> None:
    """No session id: a request whose keys start like a finished chain continues it."""
    m = make()
    chain = [k(i) for i in range(1, 4)]
    turn(m, chain, "a", None)
    evict_with_one_off_request(m, 100, 8)
    step(m)
    assert all(m.pool.is_resident(key) for key in chain)
    nxt = RequestContext("b")
    assert m.lookup_prefix(chain, nxt) == 3
    read(m, chain, nxt)
    assert prefetch_stats(m)["used_blocks"] == 3


def test_prefetch_off_leaves_an_evicted_chain_to_demand(make: Factory) -> None:
    m = make(prefetch={"mode": "off"})
    chain = [k(i) for i in range(1, 4)]
    turn(m, chain, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 8)
    step(m)
    assert not any(m.pool.is_resident(key) for key in chain)
    assert m.get_stats()["prefetch"]["started_blocks"] == 0
    assert m.get_stats()["prefetch"]["mode"] == "off"


def test_the_pool_budget_is_respected(make: Factory) -> None:
    """pool_fraction 0.25 of 16 slots: at most 4 prefetched blocks unused or in flight."""
    m = make(slots=16, prefetch={"pool_fraction": 0.25})
    chain = [k(i) for i in range(1, 11)]
    turn(m, chain, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 16)
    for _ in range(5):
        step(m)
        stats = prefetch_stats(m)
        assert stats["unused_blocks"] + stats["in_flight_blocks"] <= 4
    assert stats["budget_blocks"] == 4
    assert [m.pool.is_resident(key) for key in chain] == [True] * 4 + [False] * 6
    nxt = RequestContext("s1-turn1", session_id="s1")
    read(m, chain[:4], nxt)  # used: the budget frees, the next blocks come
    step(m)
    assert [m.pool.is_resident(key) for key in chain] == [True] * 8 + [False] * 2
    assert_counters_add_up(prefetch_stats(m))


def test_a_newer_chain_is_never_evicted_for_an_older_one(make: Factory) -> None:
    """Two paused sessions, pool full of their chains: the older one is not brought back at
    the expense of the newer (it would cost the newer session's next turn)."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    old = [k(i) for i in range(1, 5)]
    turn(m, old, "s1-turn0", "s1")
    new = [k(i) for i in range(10, 18)]
    turn(m, new, "s2-turn0", "s2")  # evicts the old chain
    for _ in range(3):
        step(m)
    assert all(m.pool.is_resident(key) for key in new)
    assert prefetch_stats(m)["started_blocks"] == 0


class HeldGets:
    """Fault injection a real backend cannot do on demand: hold every get on an Event and
    record the order of the backend calls. Everything else goes to the real backend."""

    def __init__(self, inner: Backend, only: set[BlockKey] | None = None) -> None:
        self.inner = inner
        self.only = only  # hold only calls that touch one of these keys (None: every call)
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Semaphore(0)
        self.calls: list[tuple[str, tuple[BlockKey, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _hold(self, what: str, keys: Sequence[BlockKey]) -> None:
        self.calls.append((what, tuple(keys)))
        if self.only is not None and not self.only.intersection(keys):
            return
        self.entered.release()
        if not self.release.wait(30):
            raise TimeoutError("test gate never opened")

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        self._hold("get", keys)
        return self.inner.get_many(keys, outs)

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        self._hold("put", keys)
        return self.inner.put_many(keys, payloads)


def test_prefetches_in_flight_are_cancelled_when_the_pool_needs_the_room(
        make: Factory) -> None:
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    chain = [k(i) for i in range(1, 5)]
    turn(m, chain, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 8)
    tier = m.tiers[0]
    held = HeldGets(tier.backend)
    tier._backend = held  # inject the hold
    held.release.clear()
    m.on_schedule_end()  # prefetch starts: 4 slots filling, their reads held
    assert held.entered.acquire(timeout=10)
    assert prefetch_stats(m)["in_flight_blocks"] == 4
    demand = RequestContext("s3-turn0", session_id="s3")
    plan = m.prepare_store([k(i) for i in range(200, 208)], demand, StoreMode.PREFIX)
    assert plan is not None and len(plan.deferred) == 4  # the filling slots are in the way
    for key, slot in zip(plan.keys, plan.slots, strict=True):
        m.primary_view(slot)[:] = data(key)
    m.complete_store(plan.keys, demand)
    m.on_schedule_end()  # the pool needed the room: nothing new starts
    held.release.set()
    assert m.wait_idle(10)
    m.on_schedule_end()  # the prefetches landed: they give their slots back at once
    stats = prefetch_stats(m)
    assert stats["cancelled_blocks"] == 4 and stats["prefetched_blocks"] == 0
    assert not any(m.pool.is_resident(key) for key in chain)
    rest = m.prepare_store(list(plan.deferred), demand, StoreMode.PREFIX)
    assert rest is not None and not rest.deferred  # the deferred stores now fit
    m.complete_store(rest.keys, demand)
    assert_counters_add_up(prefetch_stats(m))


def test_a_request_that_joins_a_prefetch_is_not_held_behind_its_priority(
        make: Factory) -> None:
    """One I/O thread, busy with a held store; a prefetch waits at prefetch priority behind a
    queued store. A request that now asks for the prefetched key moves its load to the demand
    queue: it runs before the store, and the block counts as a demand promotion."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9}, tier={"io_threads": 1})
    chain = [k(1)]
    turn(m, chain, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 8)
    tier = m.tiers[0]
    held = HeldGets(tier.backend)
    tier._backend = held
    held.release.clear()
    writer = RequestContext("w")
    store(m, [k(50)], writer)  # evicts a one-off block; its cascade holds the only thread
    m.on_schedule_end()  # also starts the prefetch of k(1), queued at prefetch priority
    assert held.entered.acquire(timeout=10)
    store(m, [k(51)], writer)
    m.on_schedule_end()  # a second store queues (ahead of the prefetch, behind nothing)
    nxt = RequestContext("s1-turn1", session_id="s1")
    assert m.lookup(k(1), nxt) is KeyStatus.HIT_PENDING  # joins the prefetch in flight
    held.release.set()
    assert m.wait_idle(10)
    order = list(held.calls)
    assert order[0] == ("put", (k(50),))
    assert order.index(("get", (k(1),))) < order.index(("put", (k(51),)))
    events = m.take_events()
    assert any(isinstance(e, BlockPromoted) and e.keys == (k(1),) for e in events)
    assert not any(isinstance(e, BlockPrefetched) for e in events)


def test_demand_loads_and_stores_run_before_prefetch_loads(namespace: Namespace) -> None:
    """On the tier's I/O threads a prefetch load is taken only when no demand load and no
    store waits."""
    held = HeldGets(open_backend("memory://", namespace))
    held.inner.put_many([k(8), k(9)], [data(k(8)), data(k(9))])
    tier = SecondaryTier("prio", held, TierSettings(io_threads=1))
    try:
        held.release.clear()
        assert tier.submit_store([k(1)], [data(k(1))]) is not None
        assert held.entered.acquire(timeout=10)  # the only I/O thread is busy
        out8, out9 = bytearray(BLOCK), bytearray(BLOCK)
        prefetch = tier.submit_load([k(8)], [memoryview(out8)], LoadPriority.PREFETCH)
        assert tier.submit_store([k(2)], [data(k(2))]) is not None
        demand = tier.submit_load([k(9)], [memoryview(out9)])
        held.release.set()
        done = tier.get_finished_jobs(wait=True, timeout=10)
        assert len(done) == 4
        assert held.calls == [("put", (k(1),)), ("get", (k(9),)), ("put", (k(2),)),
                              ("get", (k(8),))]
        assert prefetch.results == demand.results == (True,)
        assert bytes(out8) == data(k(8))
    finally:
        held.release.set()
        tier.shutdown(10)


def test_unused_prefetched_blocks_count_as_wasted(make: Factory) -> None:
    """Evicted before use, or still unused when the session's next request finished."""
    m = make(slots=8, prefetch={"pool_fraction": 0.5})
    chain = [k(i) for i in range(1, 4)]
    turn(m, chain, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 8)
    step(m)
    step(m)
    assert prefetch_stats(m)["prefetched_blocks"] == 3
    nxt = RequestContext("s1-turn1", session_id="s1")
    assert m.lookup_prefix(chain, nxt) == 3
    read(m, chain[:1], nxt)  # the engine had the rest itself (its own GPU cache)
    m.on_request_finished(nxt, chain=chain)
    stats = prefetch_stats(m)
    assert (stats["used_blocks"], stats["wasted_blocks"]) == (1, 2)
    assert_counters_add_up(stats)


def test_a_paused_chain_expires_after_its_ttl(make: Factory) -> None:
    clock = FakeClock()
    m = make(slots=8, prefetch={"chain_ttl_s": 5.0}, clock=clock)
    turn(m, [k(1), k(2)], "s1-turn0", "s1")
    assert prefetch_stats(m)["paused_chains"] == 1
    clock.now += 6.0
    step(m)
    assert prefetch_stats(m)["paused_chains"] == 0
    evict_with_one_off_request(m, 100, 8)
    step(m)
    assert prefetch_stats(m)["started_blocks"] == 0


def test_shutdown_settles_the_counters(make: Factory) -> None:
    m = make()
    chain = [k(i) for i in range(1, 4)]
    turn(m, chain, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 8)
    step(m)
    m.shutdown(10)
    stats = m.get_stats()["prefetch"]
    assert stats["prefetched_blocks"] == stats["wasted_blocks"] == 3
    assert_counters_add_up(stats)


@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "maybe"}, "prefetch.mode: expected one of 'off', 'on', got 'maybe'"),
    ({"pool_fraction": 0.95}, "prefetch.pool_fraction"),
    ({"io_fraction": -1}, "prefetch.io_fraction"),
    ({"pool_fractio": 0.5}, "did you mean pool_fraction"),
])
def test_bad_prefetch_settings_are_named(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        PrefetchSettings.parse(values)


def test_a_bad_session_id_is_refused() -> None:
    with pytest.raises(ValueError, match="session_id must be a non-empty str or None, got ''"):
        RequestContext("r", session_id="")


def test_a_chain_the_engine_lost_comes_back_whole(make: Factory) -> None:
    """A next turn that asks from past its chain's start says the engine held the chain (its
    own cache); the prefetcher learns how deep that cache reaches. A chain whose first block
    is deeper than that is loaded whole by its next turn (a prefix cache serves only a
    prefix), so all of it comes back, not only the blocks past the horizon."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    turn(m, [k(1), k(2), k(3)], "s1-turn0", "s1")
    nxt = RequestContext("s1-turn1", session_id="s1")
    m.lookup_prefix([k(4)], nxt)  # the engine had k(1)..k(3) itself
    assert prefetch_stats(m)["engine_horizon_blocks"] == 3
    store(m, [k(4)], nxt)
    m.on_request_finished(nxt, chain=[k(1), k(2), k(3), k(4)])
    step(m)
    evict_with_one_off_request(m, 100, 8)
    step(m)
    step(m)
    # 90 % of the 3-block horizon: the 4-block chain's first block is past it.
    assert [m.pool.is_resident(k(i)) for i in range(1, 5)] == [True] * 4


def finish_second_turn_of_s2(m: TieringManager, first_chain: list[bytes]) -> RequestContext:
    """Session s2's second turn asks only its new block k(14) (the engine holds the rest),
    stores it and finishes with the whole chain; returns the turn's context."""
    nxt = RequestContext("s2-turn1", session_id="s2")
    m.lookup_prefix([k(14)], nxt)
    store(m, [k(14)], nxt)
    m.on_request_finished(nxt, chain=[*first_chain, k(14)])
    step(m)
    return nxt


def test_the_pool_keeps_what_the_engine_lost_and_evicts_what_it_holds(make: Factory) -> None:
    """Pool full: a store takes the slot of the lowest-value block, one of the newest chain
    (which the engine holds), from its tail; not the LRU victim, a block of the older chain
    the engine lost. That chain is kept (no prefetch needed) and counted at its next turn."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    newer = [k(i) for i in range(10, 14)]
    turn(m, newer, "s2-turn0", "s2")
    older = [k(1), k(2), k(3)]
    turn(m, older, "s1-turn0", "s1")
    nxt = finish_second_turn_of_s2(m, newer)  # held: the engine reaches 7 blocks deep
    assert prefetch_stats(m)["engine_horizon_blocks"] == 7
    m.touch([*newer, k(14)], nxt)  # the older chain's k(1), k(2) are now the LRU victims
    evict_with_one_off_request(m, 100, 2)  # the pool is full: two blocks must go
    step(m)
    assert all(m.pool.is_resident(key) for key in older)  # kept: the engine lost them
    assert not m.pool.is_resident(k(14)) and not m.pool.is_resident(k(13))  # demoted
    assert m.pool.is_resident(k(100)) and m.pool.is_resident(k(101))
    back = RequestContext("s1-turn1", session_id="s1")
    assert m.lookup_prefix(older, back) == 3
    stats = prefetch_stats(m)
    assert (stats["demoted_blocks"], stats["kept_blocks"], stats["started_blocks"]) == (2, 3, 0)


def test_an_ended_session_is_evicted_first_and_never_prefetched(make: Factory) -> None:
    """NextTurn.NONE: the engine says the session ended; its blocks go before the LRU
    victims (an older paused chain) and nothing of it comes back."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    paused = [k(i) for i in range(10, 13)]
    turn(m, paused, "s2-turn0", "s2")
    ended = [k(1), k(2), k(3)]
    ctx = RequestContext("s1-last", session_id="s1")
    store(m, ended, ctx)
    m.on_request_finished(ctx, next_turn=NextTurn.NONE)
    step(m)
    evict_with_one_off_request(m, 100, 4)  # 2 free slots, then 2 evictions
    for _ in range(3):
        step(m)
    assert all(m.pool.is_resident(key) for key in paused)
    assert [m.pool.is_resident(key) for key in ended] == [False, False, True]
    stats = prefetch_stats(m)
    assert (stats["ended_sessions"], stats["started_blocks"], stats["paused_chains"]) == (1, 0, 1)
    with pytest.raises(ValueError, match="next_turn must be one of"):
        m.on_request_finished(ctx, next_turn="none")  # type: ignore[arg-type]


def test_the_end_of_step_wait_never_waits_for_a_prefetch_load(namespace: Namespace) -> None:
    """A held prefetch load and a demand load: the step's I/O yield collects the demand load
    and returns, the prefetch load still running (were it waited for, the yield's hour-long
    budget would hang the test into its timeout)."""
    held = HeldGets(open_backend("memory://", namespace), only={k(8)})
    held.inner.put_many([k(8), k(9)], [data(k(8)), data(k(9))])
    tier = SecondaryTier("yield", held, TierSettings(io_threads=2))
    try:
        held.release.clear()
        out8, out9 = bytearray(BLOCK), bytearray(BLOCK)
        tier.submit_load([k(8)], [memoryview(out8)], LoadPriority.PREFETCH)
        assert held.entered.acquire(timeout=10)  # the prefetch load is on a thread, held
        demand = tier.submit_load([k(9)], [memoryview(out9)])
        done = tier.yield_to_io(3600.0)
        assert done == [demand] and demand.results == (True,)
        assert tier.outstanding_jobs == 1  # the prefetch load, still held
    finally:
        held.release.set()
        tier.shutdown(10)


def test_no_prefetch_starts_in_a_step_in_which_a_request_waits(make: Factory) -> None:
    """Prefetch never costs a demand load: while a request's lookup must ask again (its
    probes or promotions are in flight), prefetch starts nothing, so its loads and probes
    never queue beside the demand's; once no request waits, the paused chain comes back."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    paused = [k(10), k(11)]
    turn(m, paused, "s2-turn0", "s2")
    wanted = [k(1), k(2)]
    turn(m, wanted, "s1-turn0", "s1")
    evict_with_one_off_request(m, 100, 8)  # both chains left the pool
    nxt = RequestContext("s1-turn1", session_id="s1")
    assert m.lookup_prefix(wanted, nxt) is None  # demand: it waits for its promotions
    m.on_schedule_end()
    stats = prefetch_stats(m)
    assert (stats["started_blocks"], stats["demand_steps"]) == (0, 1)
    assert m.wait_idle(10)
    assert m.lookup_prefix(wanted, nxt) == 2  # landed: it waits no more
    read(m, wanted, nxt)
    m.on_request_finished(nxt)
    step(m)  # no request waited in this step: the other session's chain comes back
    assert all(m.pool.is_resident(key) for key in paused)
    stats = prefetch_stats(m)
    assert (stats["started_blocks"], stats["demand_steps"]) == (2, 1)
    assert stats["waited_steps"] == 1 and stats["open_steps"] >= 1  # the step it started in
    assert_counters_add_up(stats)


def test_a_chain_that_finishes_later_is_given_up_before_an_older_held_one(
        make: Factory) -> None:
    """The victim order's held chains are rebuilt when a chain finishes: after an eviction
    took the tail of the newest held chain, a newer chain's tail goes next, not the older
    one's next block."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    newer = [k(i) for i in range(10, 14)]
    turn(m, newer, "s2-turn0", "s2")
    turn(m, [k(1), k(2)], "s1-turn0", "s1")
    finish_second_turn_of_s2(m, newer)  # held: the engine reaches 6 blocks deep
    assert prefetch_stats(m)["engine_horizon_blocks"] == 6
    running = RequestContext("r", session_id="s9")  # a request still running stores
    store(m, [k(100)], running)  # the free slot
    store(m, [k(101)], running)  # the held chain's tail goes
    assert not m.pool.is_resident(k(14)) and m.pool.is_resident(k(13))
    ctx = RequestContext("s3-turn0", session_id="s3")
    store(m, [k(20)], ctx)  # the held chain's next block goes
    m.on_request_finished(ctx)  # the newest held chain now (and s2's is deeper than 5)
    assert m.wait_idle(10)  # k(20) is written to the tier (no step: no prefetch)
    store(m, [k(102)], running)
    assert not m.pool.is_resident(k(20))
    assert m.pool.is_resident(k(12))


def test_the_held_chains_order_stops_when_their_next_turns_find_them_lost(
        make: Factory) -> None:
    """The value order gives up the tails of chains the engine held when they finished. When
    their next turns keep finding them lost (the engine's cache was swept meanwhile), what it
    gave up came back on demand: after enough such turns the order stops, and a store takes
    the pool's LRU victim instead of the newest held chain's tail."""
    m = make(slots=8, prefetch={"pool_fraction": 0.9})
    turn(m, [k(1)], "s0-turn0", "s0")
    turn(m, [k(2)], "s1-turn0", "s1")
    turn(m, [k(3)], "s2-turn0", "s2")
    back = RequestContext("s0-turn1", session_id="s0")
    m.lookup_prefix([k(4)], back)  # held 3 blocks deep: 1-block chains are held at first
    store(m, [k(4)], back)
    m.on_request_finished(back, chain=[k(1), k(4)])
    step(m)
    assert prefetch_stats(m)["engine_horizon_blocks"] == 3
    for i in range(8):
        turn(m, [k(20 + i)], f"t{i}-turn0", f"t{i}")  # deemed held when it finished
        turn(m, [k(40 + 3 * i + j) for j in range(3)], f"f{i}-turn0", f"f{i}")
        nxt = RequestContext(f"t{i}-turn1", session_id=f"t{i}")
        m.lookup_prefix([k(20 + i)], nxt)  # 4 blocks deep: asks from its start, lost
        assert m.wait_idle(10)
        m.on_request_finished(nxt, chain=[k(20 + i)])
        step(m)
        assert prefetch_stats(m)["held_order"] is (i < 7)  # 8 checks, all wrong: it stops
    stats = prefetch_stats(m)
    assert (stats["engine_horizon_blocks"], stats["held_order_switches"]) == (3, 1)
    newest = RequestContext("u-turn0", session_id="u")
    store(m, [k(90), k(91)], newest)
    m.on_request_finished(newest)  # the newest chain: held, 2 blocks deep
    assert m.wait_idle(10)
    m.touch([k(90), k(91)], newest)  # the rest of the pool is older
    evict_with_one_off_request(m, 200, m.pool.free_slots + 2)
    assert m.pool.is_resident(k(90)) and m.pool.is_resident(k(91))
