"""Tests of the asynchronous lookup manager (issue 2).

The tier under test is real code answering from a Python set: there is no I/O to fake. Events
hold the probe worker inside ``batch_lookup`` where a test needs a probe to stay in flight, a
``FakeClock`` drives every time decision, and ``settle`` waits on the manager's private
``_wait_for_results`` hook (a condition, not polling) before applying results. Faults are
produced by the tier's own ``batch_lookup`` (raising, returning malformed results); the only
direct tampering with manager internals is the invariant test, which says so.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from kvtier.keys import BlockKey, RequestContext
from kvtier.lookup.manager import (
    LOOKUP_SETTINGS,
    AsyncLookupManager,
    BreakerState,
    LookupManagerClosedError,
    LookupPhase,
    LookupStats,
    OwnerThreadError,
)
from kvtier.settings import ConfigError

WAIT_S = 10.0



class FakeClock:
    """A clock the test moves by hand (read from both threads; float stores are atomic)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


Script = Callable[[list[BlockKey]], Any]


class SetTier(AsyncLookupManager):
    """Answers from ``present``; ``script`` entries (one per call) override the answer.

    ``hold`` (when not None) keeps the worker inside ``batch_lookup`` until it is set;
    ``entered`` is set when a call starts.
    """

    def __init__(
        self,
        present: Sequence[BlockKey] = (),
        *,
        hold: threading.Event | None = None,
        scope_param: str | None = None,
        **options: Any,
    ) -> None:
        self.present: set[BlockKey] = set(present)
        self.calls: list[tuple[list[BlockKey], RequestContext]] = []
        self.script: list[Script] = []
        self.hold = hold
        self.entered = threading.Event()
        self.scope_param = scope_param
        super().__init__(options.pop("tier_name", "test-tier"), **options)

    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        self.calls.append((list(keys), req_context))
        self.entered.set()
        if self.hold is not None and not self.hold.wait(WAIT_S):
            raise TimeoutError("test hold was never released")
        if self.script:
            result: Sequence[bool] = self.script.pop(0)(keys)
            return result
        return [key in self.present for key in keys]

    def lookup_scope(self, req_context: RequestContext) -> Hashable:
        if self.scope_param is None:
            return super().lookup_scope(req_context)
        return req_context.params[self.scope_param]


def ctx(req_id: str, **params: Any) -> RequestContext:
    return RequestContext(req_id, params)


def key(index: int) -> BlockKey:
    return index.to_bytes(16, "big")


def settle(manager: AsyncLookupManager) -> None:
    """Wait (no polling) until the worker answered every sent batch, then apply the answers."""
    if not manager._wait_for_results(WAIT_S):
        raise TimeoutError("probe worker did not answer in time")
    manager.drain_results()


def step(manager: AsyncLookupManager) -> None:
    """One engine step boundary: flush, wait for the worker, apply."""
    manager.flush()
    settle(manager)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make(clock: FakeClock) -> Iterator[Callable[..., SetTier]]:
    """Build SetTier managers on the test clock; release their holds and shut them down after."""
    created: list[SetTier] = []

    def factory(*present: BlockKey, **options: Any) -> SetTier:
        options.setdefault("clock", clock)
        manager = SetTier(present, **options)
        created.append(manager)
        return manager

    yield factory
    for manager in created:
        if manager.hold is not None:
            manager.hold.set()
        manager.shutdown(timeout=WAIT_S)


# --------------------------------------------------------------------------- phases and reuse


def test_found_key_goes_pending_in_flight_resolved(make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(key(1), hold=hold)
    assert tier.lookup(key(1), ctx("r1")) is None
    assert tier.phase(key(1)) is LookupPhase.PENDING
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    assert tier.phase(key(1)) is LookupPhase.IN_FLIGHT
    assert tier.lookup(key(1), ctx("r1")) is None
    hold.set()
    settle(tier)
    assert tier.lookup(key(1), ctx("r1")) is True
    assert tier.phase(key(1)) is LookupPhase.RESOLVED
    assert tier.lookup(key(2), ctx("r1")) is None
    step(tier)
    assert tier.lookup(key(2), ctx("r1")) is False
    stats = tier.stats
    assert (stats.backend_calls, stats.probes_submitted, stats.lookups) == (2, 2, 5)


def test_wait_for_probes_is_bounded_and_returns_once_the_worker_answered(
        make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(key(1), hold=hold)
    assert not tier.probes_in_flight
    assert tier.wait_for_probes(0.0)  # nothing sent: nothing to wait for
    assert tier.lookup(key(1), ctx("r1")) is None
    assert not tier.probes_in_flight  # pending, not sent yet
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    assert tier.probes_in_flight
    assert not tier.wait_for_probes(0.01)  # the backend call is held: the wait gives up
    hold.set()
    assert tier.wait_for_probes(WAIT_S)
    assert tier.probes_in_flight  # posted, not applied: the wait applies nothing
    # The first lookup after the flush applies it: the next step has its answer.
    assert tier.lookup(key(1), ctx("r1")) is True
    assert not tier.probes_in_flight


def test_results_are_applied_by_first_lookup_after_flush(make: Callable[..., SetTier]) -> None:
    tier = make(key(1))
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier._wait_for_results(WAIT_S)
    assert tier.lookup(key(1), ctx("r1")) is True  # no explicit drain_results()


def test_request_arriving_while_probe_in_flight_reuses_it(make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(key(7), hold=hold)
    tier.lookup(key(7), ctx("first"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.cleanup("first")
    assert tier.phase(key(7)) is LookupPhase.IN_FLIGHT  # kept for reuse
    assert tier.lookup(key(7), ctx("second")) is None
    tier.flush()  # nothing new to send
    hold.set()
    settle(tier)
    assert tier.lookup(key(7), ctx("second")) is True
    assert len(tier.calls) == 1
    assert tier.stats.inflight_reuses == 1
    tier.cleanup("second")
    assert tier.tracked_keys == 0


def test_unclaimed_finished_probe_is_reclaimed_by_flush(make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(key(1), hold=hold, verdict_ttl_s=0)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.cleanup("r1")
    assert tier.tracked_keys == 1
    hold.set()
    assert tier._wait_for_results(WAIT_S)
    tier.flush()
    assert tier.tracked_keys == 0
    assert tier.stats.orphans_reclaimed == 1
    assert tier.stats.cached_verdicts == 0


def test_unclaimed_finished_probe_is_reclaimed_by_shutdown(make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(key(1), hold=hold)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.cleanup("r1")
    hold.set()
    assert tier._wait_for_results(WAIT_S)
    tier.shutdown(timeout=WAIT_S)
    stats = tier.stats
    assert tier.tracked_keys == 0
    assert stats.orphans_reclaimed == 1
    assert (stats.cached_verdicts, stats.quarantined_keys, stats.inflight_batches) == (0, 0, 0)


def test_stale_result_after_cleanup_and_key_reuse_is_ignored(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    hold = threading.Event()
    tier = make(hold=hold, probe_timeout_s=1.0)
    tier.script = [lambda keys: [True] * len(keys), lambda keys: [False] * len(keys)]
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.cleanup("r1")
    clock.advance(1.0)
    tier.flush()  # the unclaimed probe timed out: its state is gone
    assert tier.tracked_keys == 0
    assert tier.lookup(key(1), ctx("r2")) is None  # a new state, a new generation
    tier.flush()
    hold.set()
    settle(tier)
    assert tier.lookup(key(1), ctx("r2")) is False  # the old True answer was not applied
    stats = tier.stats
    assert stats.stale_results_dropped == 1
    assert stats.probe_timeouts == 1
    assert stats.invariant_violations == 0


def test_keys_removed_or_superseded_before_flush_are_not_sent(
    make: Callable[..., SetTier],
) -> None:
    tier = make()
    tier.lookup(key(1), ctx("r1"))
    tier.lookup(key(2), ctx("r1"))
    tier.lookup(key(3), ctx("r2"))
    tier.cleanup("r1")
    tier.mark_miss([key(3)])
    step(tier)
    assert tier.calls == []
    assert tier.stats.probes_submitted == 0
    # removed, then asked again in the same step: sent once, for the new state only
    tier.lookup(key(4), ctx("r3"))
    tier.cleanup("r3")
    tier.lookup(key(4), ctx("r4"))
    step(tier)
    assert [keys for keys, _ in tier.calls] == [[key(4)]]
    assert tier.stats.invariant_violations == 0


# --------------------------------------------------------------------------- batching


def test_fifty_requests_two_hundred_keys_cost_one_backend_call(
    make: Callable[..., SetTier],
) -> None:
    keys = [key(i) for i in range(200)]
    tier = make(*keys[::2])
    for request in range(50):
        for index in range(200):
            # every request sees every key, starting at a different offset
            tier.lookup(keys[(index + request * 7) % 200], ctx(f"req-{request}"))
    step(tier)
    assert len(tier.calls) == 1
    assert sorted(tier.calls[0][0]) == keys
    for request in range(50):
        verdicts = [tier.lookup(k, ctx(f"req-{request}")) for k in keys]
        assert verdicts == [i % 2 == 0 for i in range(200)]
    assert tier.stats.probes_submitted == 200


def test_batches_are_chunked_to_max_batch_keys(make: Callable[..., SetTier]) -> None:
    tier = make(max_batch_keys=256)
    for request in range(10):
        for index in range(100):
            tier.lookup(key(request * 100 + index), ctx(f"req-{request}"))
    step(tier)
    assert [len(keys) for keys, _ in tier.calls] == [256, 256, 256, 232]
    assert tier.stats.backend_calls == 4


def test_one_backend_call_per_lookup_scope(make: Callable[..., SetTier]) -> None:
    tier = make(key(1), scope_param="tenant")
    tier.lookup(key(1), ctx("a1", tenant="a"))
    tier.lookup(key(2), ctx("a2", tenant="a"))
    tier.lookup(key(3), ctx("b1", tenant="b"))
    tier.lookup(key(1), ctx("b1", tenant="b"))  # already pending in scope a: probed once
    step(tier)
    by_scope = {c.params["tenant"]: sorted(keys) for keys, c in tier.calls}
    assert by_scope == {"a": [key(1), key(2)], "b": [key(3)]}
    assert tier.lookup(key(1), ctx("b1", tenant="b")) is True


def test_worker_survives_a_failing_lookup_scope(make: Callable[..., SetTier]) -> None:
    tier = make(key(1), scope_param="tenant")
    tier.lookup(key(1), ctx("no-tenant"))  # lookup_scope raises KeyError on the worker
    step(tier)
    assert tier.lookup(key(1), ctx("no-tenant")) is False
    assert tier.stats.probe_errors == 1
    # A later request never gets a fault's False: the key is probed again, for everyone.
    assert tier.lookup(key(1), ctx("ok", tenant="t")) is None
    assert tier.phase(key(1)) is LookupPhase.PENDING
    step(tier)
    assert tier.lookup(key(1), ctx("ok", tenant="t")) is True
    assert tier.lookup(key(1), ctx("no-tenant")) is True  # the first request sees the answer
    tier.cleanup("no-tenant")
    tier.cleanup("ok")
    assert tier.lookup(key(1), ctx("later", tenant="t")) is True  # a backend answer is cached
    assert tier.stats.probe_errors == 1


def test_a_fault_verdict_is_not_served_to_a_request_that_joins_it(
    make: Callable[..., SetTier]
) -> None:
    """Faults resolve False for the requests that saw them, never for a later request."""
    tier = make(key(1))
    tier.script = [lambda keys: 1 / 0]
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    assert tier.lookup(key(1), ctx("r1")) is False
    assert tier.stats.probe_errors == 1
    assert tier.lookup(key(1), ctx("r2")) is None  # re-probed, not the fault's False
    step(tier)
    assert tier.lookup(key(1), ctx("r2")) is True
    assert tier.lookup(key(1), ctx("r1")) is True
    assert tier.stats.backend_calls == 2


# --------------------------------------------------------------------------- verdict cache


def test_verdict_cache_serves_until_expiry_fixed_at_answer_time(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    tier = make(key(1), verdict_ttl_s=2.0)
    tier.lookup(key(1), ctx("r1"))
    step(tier)  # answered at t0
    clock.advance(1.5)
    assert tier.lookup(key(1), ctx("r1")) is True
    tier.cleanup("r1")
    assert tier.tracked_keys == 0
    assert tier.stats.cached_verdicts == 1
    clock.advance(0.4)  # t0 + 1.9
    assert tier.lookup(key(1), ctx("r2")) is True  # served from cache, no probe
    assert tier.stats.verdict_cache_hits == 1
    tier.cleanup("r2")
    clock.advance(0.15)  # t0 + 2.05: a cache hit did not extend the expiry
    assert tier.lookup(key(1), ctx("r3")) is None
    step(tier)
    assert len(tier.calls) == 2


def test_orphan_result_is_cached(make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(key(1), hold=hold)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.cleanup("r1")
    hold.set()
    step(tier)
    assert tier.tracked_keys == 0
    assert tier.lookup(key(1), ctx("r2")) is True
    assert len(tier.calls) == 1


def test_zero_ttl_disables_the_verdict_cache(make: Callable[..., SetTier]) -> None:
    tier = make(key(1), verdict_ttl_s=0)
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    tier.cleanup("r1")
    assert tier.stats.cached_verdicts == 0
    assert tier.lookup(key(1), ctx("r2")) is None


def test_verdict_cache_is_bounded_lru(make: Callable[..., SetTier]) -> None:
    tier = make(*[key(i) for i in range(10)], max_cached_verdicts=4, verdict_ttl_s=60)
    for i in range(10):
        tier.lookup(key(i), ctx(f"r{i}"))
    step(tier)
    for i in range(10):
        tier.cleanup(f"r{i}")
    stats = tier.stats
    assert (stats.cached_verdicts, stats.verdict_cache_evictions) == (4, 6)
    assert tier.tracked_keys == 0


def test_cache_hits_refresh_recency_and_the_release_queue_stays_bounded(
    make: Callable[..., SetTier]
) -> None:
    tier = make(*[key(i) for i in range(3)], max_cached_verdicts=2, verdict_ttl_s=60)
    for i in range(2):
        tier.lookup(key(i), ctx(f"r{i}"))
    step(tier)
    tier.cleanup("r0")
    tier.cleanup("r1")
    for round_ in range(500):  # key 0 is served from the cache and released again and again
        assert tier.lookup(key(0), ctx(f"again{round_}")) is True
        tier.cleanup(f"again{round_}")
    assert tier._keys.cached <= 2 and tier._keys.queued <= 2 * 2 + 64  # dead places compacted
    tier.lookup(key(2), ctx("r2"))
    step(tier)
    tier.cleanup("r2")  # evicts the least recently released verdict: key 1, not key 0
    stats = tier.stats
    assert (stats.cached_verdicts, stats.verdict_cache_evictions) == (2, 1)
    assert stats.verdict_cache_hits == 500
    assert tier.lookup(key(0), ctx("r3")) is True
    assert tier.lookup(key(1), ctx("r3")) is None
    assert len(tier.calls) == 2


def test_errors_are_never_cached(make: Callable[..., SetTier]) -> None:
    tier = make(key(1))
    tier.script = [lambda keys: 1 / 0]
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    assert tier.lookup(key(1), ctx("r1")) is False
    tier.cleanup("r1")
    assert tier.stats.cached_verdicts == 0
    assert tier.lookup(key(1), ctx("r2")) is None
    step(tier)
    assert tier.lookup(key(1), ctx("r2")) is True


# --------------------------------------------------------------------------- mark_miss, note_*


def test_mark_miss_quarantines_even_after_requests_finish(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    tier = make(key(1), quarantine_s=30.0)
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    assert tier.lookup(key(1), ctx("r1")) is True
    tier.mark_miss([key(1)])
    assert tier.lookup(key(1), ctx("r1")) is False
    assert tier.phase(key(1)) is LookupPhase.RESOLVED
    tier.cleanup("r1")
    assert tier.tracked_keys == 0
    clock.advance(29.0)
    assert tier.lookup(key(1), ctx("r2")) is False  # quarantined: no probe
    tier.flush()
    assert tier.stats.quarantine_hits == 1
    assert len(tier.calls) == 1
    tier.cleanup("r2")
    clock.advance(1.0)
    assert tier.lookup(key(1), ctx("r3")) is None  # quarantine over: probe again
    step(tier)
    assert tier.lookup(key(1), ctx("r3")) is True
    tier.cleanup("r3")
    tier.flush()
    assert tier.stats.quarantined_keys == 0


def test_mark_miss_wins_over_a_late_result(make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(key(1), hold=hold)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.mark_miss([key(1)])
    assert tier.lookup(key(1), ctx("r1")) is False
    hold.set()
    settle(tier)
    assert tier.lookup(key(1), ctx("r1")) is False
    assert tier.stats.stale_results_dropped == 1
    assert tier.stats.invariant_violations == 0


def test_mark_miss_of_pending_and_unknown_keys(make: Callable[..., SetTier]) -> None:
    tier = make(key(1), key(2))
    tier.lookup(key(1), ctx("r1"))
    tier.mark_miss([key(1), key(2)])
    assert tier.lookup(key(1), ctx("r1")) is False
    assert tier.lookup(key(2), ctx("r1")) is False
    step(tier)
    assert tier.calls == []


def test_note_stored_and_removed_update_live_and_cached_verdicts(
    make: Callable[..., SetTier],
) -> None:
    tier = make()
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    assert tier.lookup(key(1), ctx("r1")) is False
    tier.note_stored([key(1), key(2)])
    assert tier.lookup(key(1), ctx("r1")) is True
    assert tier.lookup(key(2), ctx("r2")) is True  # created a cached verdict
    tier.note_removed([key(1), key(2)])
    assert tier.lookup(key(1), ctx("r1")) is False
    assert tier.lookup(key(2), ctx("r2")) is False
    tier.cleanup("r1")
    tier.cleanup("r2")
    assert tier.lookup(key(2), ctx("r3")) is False  # the removal is cached too
    step(tier)
    assert len(tier.calls) == 1


def test_note_stored_lifts_quarantine_and_beats_in_flight_probe(
    make: Callable[..., SetTier],
) -> None:
    hold = threading.Event()
    tier = make(hold=hold)
    tier.mark_miss([key(1)])
    tier.note_stored([key(1)])
    assert tier.lookup(key(1), ctx("r1")) is True
    assert tier.stats.quarantined_keys == 0
    tier.lookup(key(2), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.note_stored([key(2)])
    assert tier.lookup(key(2), ctx("r1")) is True
    hold.set()
    settle(tier)
    assert tier.lookup(key(2), ctx("r1")) is True  # the backend's late False is stale


def test_note_on_unclaimed_in_flight_probe_drops_its_state(make: Callable[..., SetTier]) -> None:
    hold = threading.Event()
    tier = make(hold=hold)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.cleanup("r1")
    tier.note_removed([key(1)])
    assert tier.tracked_keys == 0
    hold.set()
    step(tier)
    assert tier.stats.stale_results_dropped == 1
    assert tier.lookup(key(1), ctx("r2")) is False


def test_quarantine_is_bounded(make: Callable[..., SetTier]) -> None:
    tier = make(max_cached_verdicts=8)
    tier.mark_miss([key(i) for i in range(20)])
    assert tier.stats.quarantined_keys == 8
    assert tier.stats.quarantine_evictions == 12


# --------------------------------------------------------------------------- faults


def _raise_mid_iteration(keys: list[BlockKey]) -> Iterator[bool]:
    yield True
    raise ConnectionError("connection reset while streaming")


FAULTS: dict[str, Callable[[list[BlockKey]], Any]] = {
    "exception": lambda keys: (_ for _ in ()).throw(OSError("backend down")),
    "exception-during-iteration": _raise_mid_iteration,
    "too-short": lambda keys: [True] * (len(keys) - 1),
    "too-long": lambda keys: [True] * (len(keys) + 1),
    "endless-generator": lambda keys: iter(lambda: True, None),
    "none-item": lambda keys: [True] * (len(keys) - 1) + [None],
    "int-2": lambda keys: [True] * (len(keys) - 1) + [2],
    "float-1": lambda keys: [True] * (len(keys) - 1) + [1.0],
    "string": lambda keys: ["yes"] * len(keys),
    "numpy-int-2": lambda keys: [np.int64(2)] * len(keys),
    "not-iterable": lambda keys: 42,
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_fault_resolves_every_key_of_the_call_false(
    make: Callable[..., SetTier], fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [key(i) for i in range(3)]
    tier = make(*keys, tier_name="flaky-tier")
    tier.script = [FAULTS[fault]]
    for k in keys:
        tier.lookup(k, ctx("r1"))
    with caplog.at_level(logging.WARNING, logger="kvtier.lookup.manager"):
        step(tier)
    assert [tier.lookup(k, ctx("r1")) for k in keys] == [False, False, False]
    assert tier.stats.probe_errors == 3
    assert tier.stats.failed_calls == 1
    assert any("flaky-tier" in r.getMessage() for r in caplog.records)
    # the worker survived and the next call is trusted
    tier.cleanup("r1")
    for k in keys:
        assert tier.lookup(k, ctx("r2")) is None
    step(tier)
    assert [tier.lookup(k, ctx("r2")) for k in keys] == [True, True, True]


@pytest.mark.parametrize(
    "answer",
    [
        lambda n: [True, False] * (n // 2),
        lambda n: [1, 0] * (n // 2),
        lambda n: np.array([True, False] * (n // 2)),
        lambda n: [np.bool_(True), np.bool_(False)] * (n // 2),
        lambda n: (bool(i % 2 == 0) for i in range(n)),
        lambda n: [np.int8(1), np.uint64(0)] * (n // 2),
    ],
    ids=["bool", "int-0-1", "numpy-array", "numpy-bool", "generator", "numpy-int-0-1"],
)
def test_accepted_result_types(make: Callable[..., SetTier], answer: Callable[[int], Any]) -> None:
    keys = [key(i) for i in range(4)]
    tier = make()
    tier.script = [lambda ks: answer(len(ks))]
    for k in keys:
        tier.lookup(k, ctx("r1"))
    step(tier)
    sent = tier.calls[0][0]
    expected = dict(zip(sent, [True, False, True, False], strict=True))
    assert [tier.lookup(k, ctx("r1")) for k in keys] == [expected[k] for k in keys]
    assert tier.stats.probe_errors == 0


def test_fault_logging_is_rate_limited(
    make: Callable[..., SetTier], caplog: pytest.LogCaptureFixture
) -> None:
    tier = make(tier_name="noisy", breaker_threshold=100)
    tier.script = [lambda keys: 1 / 0] * 5
    with caplog.at_level(logging.WARNING, logger="kvtier.lookup.manager"):
        for i in range(5):
            tier.lookup(key(i), ctx("r1"))
            step(tier)
    assert tier.stats.probe_errors == 5
    assert len([r for r in caplog.records if "noisy" in r.getMessage()]) == 1


def test_fault_in_one_chunk_does_not_poison_other_chunks(make: Callable[..., SetTier]) -> None:
    keys = [key(i) for i in range(4)]
    tier = make(*keys, max_batch_keys=2)
    tier.script = [lambda ks: 1 / 0, lambda ks: [True] * len(ks)]
    for k in keys:
        tier.lookup(k, ctx("r1"))
    step(tier)
    first, second = (keys_ for keys_, _ in tier.calls)
    assert [tier.lookup(k, ctx("r1")) for k in first] == [False, False]
    assert [tier.lookup(k, ctx("r1")) for k in second] == [True, True]
    assert tier.stats.probe_errors == 2


# --------------------------------------------------------------------------- timeouts


def test_probe_timeout_resolves_false_at_next_lookup_and_late_result_is_stale(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    hold = threading.Event()
    keys = [key(i) for i in range(3)]
    tier = make(*keys, hold=hold, probe_timeout_s=5.0)
    for k in keys:
        tier.lookup(k, ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    clock.advance(4.9)
    assert tier.lookup(keys[0], ctx("r1")) is None
    clock.advance(0.1)
    assert tier.lookup(keys[0], ctx("r1")) is False  # detected by lookup, no flush needed
    assert tier.stats.probe_timeouts == 3  # the whole batch, counted in keys
    assert tier.phase(keys[2]) is LookupPhase.RESOLVED
    hold.set()
    settle(tier)
    assert [tier.lookup(k, ctx("r1")) for k in keys] == [False, False, False]
    assert tier.stats.stale_results_dropped == 3
    tier.cleanup("r1")
    assert tier.stats.cached_verdicts == 0  # timeouts are never cached
    assert tier.tracked_keys == 0


def test_probe_timeout_detected_at_flush(make: Callable[..., SetTier], clock: FakeClock) -> None:
    hold = threading.Event()
    tier = make(hold=hold, probe_timeout_s=1.0)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    clock.advance(2.0)
    tier.flush()
    assert tier.phase(key(1)) is LookupPhase.RESOLVED
    assert tier.stats.probe_timeouts == 1


def test_a_probe_queued_behind_a_slow_call_waits_instead_of_timing_out(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """Overload is back-pressure, not a fault: a batch past its deadline while the worker is in
    a call that started less than probe_timeout_s ago answers None (wait), never False, and
    feeds no breaker; it times out only once that call itself runs past the timeout."""
    hold = threading.Event()
    second_entered, release_second = threading.Event(), threading.Event()

    def slow_second(keys: list[BlockKey]) -> list[bool]:
        second_entered.set()
        release_second.wait(WAIT_S)
        return [True] * len(keys)

    tier = make(hold=hold, probe_timeout_s=5.0, breaker_threshold=1)
    tier.script = [lambda keys: [False] * len(keys), slow_second]
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)  # t=0: the first call starts and is held
    clock.advance(1.0)
    tier.lookup(key(2), ctx("r2"))
    tier.flush()  # t=1: the second batch is queued behind it, deadline t=6
    clock.advance(3.0)
    hold.set()  # t=4: the first call ends; the worker starts the second one
    assert second_entered.wait(WAIT_S)
    clock.advance(3.0)  # t=7: past the second batch's deadline, its call 3 s old
    assert tier.lookup(key(2), ctx("r2")) is None
    tier.flush()
    stats = tier.stats
    assert (stats.probe_timeouts, stats.failed_calls) == (0, 0) and stats.probes_delayed >= 1
    assert stats.breaker_state is BreakerState.CLOSED
    release_second.set()
    settle(tier)
    assert tier.lookup(key(2), ctx("r2")) is True
    assert tier.stats.probe_timeouts == 0


def test_answer_posted_before_the_deadline_is_not_a_timeout_at_lookup(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """The worker answered in time but nobody drained yet: a lookup past the deadline must apply
    that answer, not time the probe out (and not feed the breaker with a phantom failure)."""
    tier = make(key(1), probe_timeout_s=5.0, breaker_threshold=1)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.lookup(key(1), ctx("r1")) is None  # the post-flush drain found nothing yet
    assert tier._wait_for_results(WAIT_S)  # answered at t0, well before the deadline
    clock.advance(5.0)
    assert tier.lookup(key(1), ctx("r1")) is True
    stats = tier.stats
    assert (stats.probe_timeouts, stats.failed_calls, stats.stale_results_dropped) == (0, 0, 0)
    assert stats.breaker_state is BreakerState.CLOSED


def test_late_failing_result_of_a_timed_out_probe_is_not_counted_twice(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    keys = [key(1), key(2)]
    hold = threading.Event()
    tier = make(hold=hold, probe_timeout_s=1.0)
    tier.script = [lambda ks: 1 / 0]
    for k in keys:
        tier.lookup(k, ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    clock.advance(1.0)
    tier.flush()  # timed out: 2 keys, 1 failed call
    hold.set()
    step(tier)  # the late result is an error: dropped as stale, not a second failure
    stats = tier.stats
    assert (stats.probe_timeouts, stats.probe_errors) == (2, 0)
    assert (stats.failed_calls, stats.backend_calls, stats.stale_results_dropped) == (1, 1, 2)


# --------------------------------------------------------------------------- circuit breaker


def _fail_calls(tier: SetTier, count: int) -> None:
    for _ in range(count):
        tier.script.append(lambda keys: 1 / 0)
        tier.lookup(key(10_000 + tier.stats.lookups), ctx("failing"))
        step(tier)


def test_breaker_opens_short_circuits_then_trial_closes(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    tier = make(key(1), key(2), breaker_threshold=3, breaker_cooldown_s=10.0)
    _fail_calls(tier, 2)
    assert tier.stats.breaker_state is BreakerState.CLOSED
    _fail_calls(tier, 1)
    assert tier.stats.breaker_state is BreakerState.OPEN
    calls = len(tier.calls)
    assert tier.lookup(key(1), ctx("r1")) is False  # at once, no probe
    step(tier)
    assert len(tier.calls) == calls
    tier.cleanup("r1")
    clock.advance(10.0)
    assert tier.lookup(key(1), ctx("r2")) is None  # cool-down over: this step is the trial
    assert tier.lookup(key(2), ctx("r3")) is None
    assert tier.stats.breaker_state is BreakerState.HALF_OPEN
    hold = threading.Event()
    tier.hold = hold
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    assert tier.lookup(key(3), ctx("r4")) is False  # trial in flight: others get False
    hold.set()
    settle(tier)
    assert tier.stats.breaker_state is BreakerState.CLOSED
    assert tier.lookup(key(1), ctx("r2")) is True
    assert tier.lookup(key(2), ctx("r3")) is True
    assert len(tier.calls[-1][0]) == 2  # exactly one trial batch
    assert tier.lookup(key(4), ctx("r5")) is None  # closed: probing again
    assert tier.stats.breaker_opens == 1
    assert tier.stats.breaker_short_circuits == 2


def test_breaker_failed_trial_reopens(make: Callable[..., SetTier], clock: FakeClock) -> None:
    tier = make(key(1), breaker_threshold=2, breaker_cooldown_s=5.0)
    _fail_calls(tier, 2)
    assert tier.stats.breaker_state is BreakerState.OPEN
    clock.advance(5.0)
    tier.script.append(lambda keys: 1 / 0)
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    assert tier.stats.breaker_state is BreakerState.OPEN
    assert tier.stats.breaker_opens == 2
    clock.advance(4.9)
    assert tier.lookup(key(2), ctx("r2")) is False


def test_success_resets_the_consecutive_failure_count(make: Callable[..., SetTier]) -> None:
    tier = make(breaker_threshold=2)
    for _ in range(3):
        _fail_calls(tier, 1)
        tier.lookup(key(len(tier.calls)), ctx("ok"))
        step(tier)
    assert tier.stats.breaker_state is BreakerState.CLOSED


def test_timeouts_feed_the_breaker(make: Callable[..., SetTier], clock: FakeClock) -> None:
    hold = threading.Event()
    tier = make(hold=hold, breaker_threshold=2, probe_timeout_s=1.0)
    for index in range(2):
        tier.lookup(key(index), ctx("r1"))
        tier.flush()
        assert tier.entered.wait(WAIT_S)  # the first call is stuck from now on
        clock.advance(1.0)
    tier.flush()
    assert tier.stats.probe_timeouts == 2
    assert tier.stats.breaker_state is BreakerState.OPEN
    assert tier.lookup(key(99), ctx("r2")) is False
    hold.set()


def test_breaker_open_resolves_keys_pending_at_flush_false(
    make: Callable[..., SetTier],
) -> None:
    tier = make(key(5), breaker_threshold=1)
    tier.script.append(lambda keys: 1 / 0)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    tier.lookup(key(5), ctx("r1"))  # pending while the failing result is on its way
    assert tier._wait_for_results(WAIT_S)
    tier.flush()  # applies the failure (opens), then must not send key 5
    assert tier.lookup(key(5), ctx("r1")) is False
    assert len(tier.calls) == 1


# --------------------------------------------------------------------------- invariants


def test_duplicate_result_is_counted_and_safe_verdict_kept(
    make: Callable[..., SetTier], caplog: pytest.LogCaptureFixture
) -> None:
    """Fault injection: a second result for an answered generation cannot happen with a correct
    worker, so the test re-posts a copy of a real result straight into the private queue."""
    tier = make()
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier._wait_for_results(WAIT_S)
    result = tier._worker.results.get_nowait()
    tier._worker.results.put(result)
    tier.drain_results()
    assert tier.lookup(key(1), ctx("r1")) is False
    forged = type(result)(result.batch_id, [key(1)], result.generations[:1], [True],
                          [True], 0, result.answered_at)
    tier._inflight_batches[result.batch_id] = object()  # type: ignore[assignment]
    tier._worker.results.put(forged)
    with caplog.at_level(logging.WARNING, logger="kvtier.lookup.manager"):
        tier.drain_results()
    assert tier.stats.invariant_violations == 1
    assert tier.lookup(key(1), ctx("r1")) is False
    assert any("invariant" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- memory


def test_memory_is_bounded_after_requests_finish(make: Callable[..., SetTier]) -> None:
    tier = make(*[key(i) for i in range(0, 3000, 3)], max_cached_verdicts=100)
    for round_ in range(20):
        for request in range(8):
            name = f"r{round_}-{request}"
            for index in range(request * 10, request * 10 + 50):
                tier.lookup(key(round_ * 100 + index), ctx(name))
        tier.flush()
        if round_ % 2:
            for request in range(8):
                tier.cleanup(f"r{round_}-{request}")
        settle(tier)
    for round_ in range(0, 20, 2):
        for request in range(8):
            tier.cleanup(f"r{round_}-{request}")
    tier.flush()
    stats = tier.stats
    assert tier.tracked_keys == 0
    assert stats.cached_verdicts <= 100
    assert tier._request_keys == {} and tier._pending == [] and tier._inflight_batches == {}


# --------------------------------------------------------------------------- lifecycle, API


def test_shutdown_is_idempotent_and_leaves_nothing(make: Callable[..., SetTier]) -> None:
    tier = make(key(1), tier_name="closing")
    tier.lookup(key(1), ctx("r1"))
    tier.lookup(key(2), ctx("r2"))
    step(tier)
    tier.mark_miss([key(3)])
    tier.lookup(key(4), ctx("r2"))
    tier.shutdown(timeout=WAIT_S)
    tier.shutdown()
    assert tier.tracked_keys == 0
    stats = tier.stats
    assert isinstance(stats, LookupStats) and stats.lookups == 3
    assert (stats.cached_verdicts, stats.quarantined_keys) == (0, 0)
    assert not tier._worker.thread.is_alive()
    with pytest.raises(LookupManagerClosedError, match=r"closing.*shut down"):
        tier.lookup(key(1), ctx("r1"))
    with pytest.raises(LookupManagerClosedError):
        tier.flush()
    tier.cleanup("r1")  # releasing after shutdown is harmless
    tier.drain_results()


def test_shutdown_does_not_wait_past_timeout_for_a_stuck_call(
    make: Callable[..., SetTier],
) -> None:
    hold = threading.Event()
    tier = make(hold=hold)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.shutdown(timeout=0.05)
    assert tier.tracked_keys == 0
    assert tier._worker.thread.is_alive()
    hold.set()
    tier._worker.thread.join(WAIT_S)
    assert not tier._worker.thread.is_alive()


def test_stats_is_a_snapshot(make: Callable[..., SetTier]) -> None:
    tier = make()
    before = tier.stats
    tier.lookup(key(1), ctx("r1"))
    assert before.lookups == 0 and tier.stats.lookups == 1


def test_bad_lookup_arguments_are_rejected_clearly(make: Callable[..., SetTier]) -> None:
    tier = make()
    with pytest.raises(TypeError, match="key must be a BlockKey"):
        tier.lookup("abc", ctx("r1"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="req_context must be a RequestContext"):
        tier.lookup(key(1), "r1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keys\[1\] must be a BlockKey"):
        tier.mark_miss([key(1), "x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"keys\[0\]"):
        tier.note_stored([1])  # type: ignore[list-item]
    assert tier.tracked_keys == 0


class _Minimal(AsyncLookupManager):
    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        return [False] * len(keys)


_NUMBER = "expected a finite number"
_INTEGER = "expected an integer >= 1"


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        ("probe_timeout_s", 0, ConfigError, f"probe_timeout_s: {_NUMBER} > 0.0 .* got 0"),
        ("probe_timeout_s", math.nan, ConfigError, f"probe_timeout_s: {_NUMBER}"),
        ("probe_timeout_s", "soon", ConfigError, "probe_timeout_s: expected .* got 'soon'"),
        ("verdict_ttl_s", -1, ConfigError, f"verdict_ttl_s: {_NUMBER} >= 0.0 .* got -1"),
        ("max_cached_verdicts", 0, ConfigError, rf"max_cached_verdicts: {_INTEGER} \(count\)"),
        ("max_cached_verdicts", 1.5, ConfigError, f"max_cached_verdicts: {_INTEGER} .* 1.5"),
        ("quarantine_s", math.inf, ConfigError, f"quarantine_s: {_NUMBER} .* got inf"),
        ("max_batch_keys", 0, ConfigError, f"max_batch_keys: {_INTEGER}"),
        ("breaker_threshold", True, ConfigError, f"breaker_threshold: {_INTEGER} .* True"),
        ("breaker_threshold", 0, ConfigError, f"breaker_threshold: {_INTEGER} .* got 0"),
        ("breaker_cooldown_s", 7200, ConfigError, "breaker_cooldown_s: expected .*<= 3600"),
        ("clock", 3.0, TypeError, "clock must be a callable"),
    ],
)
def test_constructor_rejects_bad_options(
    option: str, value: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _Minimal("t", **{option: value})


def test_lookup_settings_table_is_what_the_constructor_uses() -> None:
    """One table: names, defaults, env names; strings (env / URL values) parse as numbers."""
    assert LOOKUP_SETTINGS.names == (
        "probe_timeout_s", "verdict_ttl_s", "stored_verdict_ttl_s", "max_cached_verdicts",
        "quarantine_s", "max_batch_keys", "breaker_threshold", "breaker_cooldown_s")
    assert LOOKUP_SETTINGS["probe_timeout_s"].env == "KVTIER_LOOKUP_PROBE_TIMEOUT_S"
    assert all(setting.help and setting.unit for setting in LOOKUP_SETTINGS)
    from_env = LOOKUP_SETTINGS.parse(
        LOOKUP_SETTINGS.from_env({"KVTIER_LOOKUP_MAX_BATCH_KEYS": "64"}))
    assert from_env == {**LOOKUP_SETTINGS.defaults(), "max_batch_keys": 64}
    manager = _Minimal("t", **{**from_env, "probe_timeout_s": "2.5"})  # type: ignore[arg-type]
    try:
        assert manager._max_batch_keys == 64 and manager._probe_timeout_s == 2.5
        assert manager._verdict_ttl_s == LOOKUP_SETTINGS["verdict_ttl_s"].default
    finally:
        manager.shutdown()


@pytest.mark.parametrize("name", ["", None, 3])
def test_constructor_rejects_bad_tier_name(name: object) -> None:
    with pytest.raises(ValueError, match="tier_name must be a non-empty str"):
        _Minimal(name)  # type: ignore[arg-type]


def test_defaults_are_sensible() -> None:
    manager = _Minimal("defaults")
    try:
        assert manager._max_batch_keys >= 256
        assert manager._breaker_threshold >= 2
        assert 0 < manager._breaker_cooldown_s < 3600
        assert manager.tier_name == "defaults"
    finally:
        manager.shutdown()


def test_shutdown_rejects_negative_timeout(make: Callable[..., SetTier]) -> None:
    tier = make()
    with pytest.raises(ValueError, match="timeout must be in"):
        tier.shutdown(timeout=-1)


def test_top_level_exports() -> None:
    import kvtier

    assert kvtier.AsyncLookupManager is AsyncLookupManager
    assert kvtier.LookupPhase is LookupPhase
    assert kvtier.LookupStats is LookupStats
    assert issubclass(OwnerThreadError, RuntimeError)


# --------------------------------------------------------------------------- owner thread


def _call_from_another_thread(calls: dict[str, Callable[[], object]]) -> dict[str, str]:
    """Run each call on one second thread (wall-clock bounded); the OwnerThreadError texts."""
    errors: dict[str, str] = {}

    def foreign() -> None:
        for name, call in calls.items():
            try:
                call()
            except OwnerThreadError as exc:
                errors[name] = str(exc)

    thread = threading.Thread(target=foreign, name="intruder")
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    return errors


def test_scheduler_calls_from_another_thread_raise_and_change_nothing(
    make: Callable[..., SetTier]
) -> None:
    tier = make(key(1))
    assert tier.lookup(key(1), ctx("r1")) is None  # this thread is now the owner
    step(tier)
    assert tier.lookup(key(1), ctx("r1")) is True
    tier.lookup(key(3), ctx("r1"))  # pending: a foreign flush would send it
    before = tier.stats
    calls: dict[str, Callable[[], object]] = {
        "lookup of a new key": lambda: tier.lookup(key(2), ctx("r2")),
        "lookup of a held key": lambda: tier.lookup(key(1), ctx("r1")),
        "flush": tier.flush,
        "drain_results": tier.drain_results,
        "cleanup": lambda: tier.cleanup("r1"),
        "mark_miss": lambda: tier.mark_miss([key(1)]),
        "note_stored": lambda: tier.note_stored([key(4)]),
        "note_removed": lambda: tier.note_removed([key(1)]),
    }
    errors = _call_from_another_thread(calls)
    assert sorted(errors) == sorted(calls)
    for name, message in errors.items():
        operation = name.split()[0]
        assert f"{operation}() was called from thread 'intruder'" in message
        assert "belong to the scheduler thread" in message and "test-tier" in message
    assert tier.stats == before and tier.tracked_keys == 2
    assert tier.phase(key(2)) is None and tier.phase(key(3)) is LookupPhase.PENDING
    assert len(tier.calls) == 1
    # the owner carries on, and leaves nothing behind
    assert tier.lookup(key(1), ctx("r1")) is True
    step(tier)
    tier.cleanup("r1")
    assert tier.tracked_keys == 0 and tier._request_keys == {}


def test_the_owner_is_the_first_caller_not_the_constructor(clock: FakeClock) -> None:
    built: list[SetTier] = []
    builder = threading.Thread(target=lambda: built.append(SetTier([key(1)], clock=clock)))
    builder.start()
    builder.join(WAIT_S)
    tier = built[0]
    try:
        assert tier.lookup(key(1), ctx("r1")) is None  # the test thread claims it
        errors = _call_from_another_thread({"flush": tier.flush})
        assert "flush() was called from thread 'intruder'" in errors["flush"]
        step(tier)
        assert tier.lookup(key(1), ctx("r1")) is True
    finally:
        tier.shutdown(timeout=WAIT_S)


_ = Hashable  # re-exported type used by SetTier


def test_lookup_of_a_resolved_key_does_not_read_the_clock(make: Callable[..., SetTier]) -> None:
    reads = [0]
    base = FakeClock()

    def counting_clock() -> float:
        reads[0] += 1
        return base()

    tier = make(key(1), clock=counting_clock)
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    tier.lookup(key(1), ctx("r1"))  # first lookup after the flush drains
    reads[0] = 0
    for _ in range(100):
        assert tier.lookup(key(1), ctx("r1")) is True
        assert tier.lookup(key(1), ctx("r2")) is True
    assert reads[0] == 0


# --------------------------------------------------------------------------- hot-path shortcuts


class _OneScopeTier(AsyncLookupManager):
    """Keeps the default ``lookup_scope``: the worker then skips its per-key scope calls."""

    def __init__(self, present: set[BlockKey], **options: Any) -> None:
        self.present = present
        self.calls: list[tuple[list[BlockKey], str]] = []
        super().__init__("one-scope", **options)

    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        self.calls.append((list(keys), req_context.req_id))
        return [key in self.present for key in keys]


def test_default_scope_is_one_call_in_chunks_with_the_first_requests_context(
    clock: FakeClock,
) -> None:
    tier = _OneScopeTier({key(0), key(3)}, clock=clock, max_batch_keys=2)
    try:
        tier.lookup(key(0), ctx("first"))
        tier.lookup(key(1), ctx("second"))
        tier.lookup(key(2), ctx("third"))
        step(tier)
        assert tier.calls == [([key(0), key(1)], "first"), ([key(2)], "first")]
        assert [tier.lookup(key(i), ctx("second")) for i in range(3)] == [True, False, False]
    finally:
        tier.shutdown(timeout=WAIT_S)


def test_note_stored_flips_a_released_verdict_in_place_and_makes_it_the_newest(
    make: Callable[..., SetTier],
) -> None:
    """The finish of a request: cleanup caches its False verdicts, then its stores land."""
    tier = make(key(9), max_cached_verdicts=2, verdict_ttl_s=60)
    tier.lookup(key(1), ctx("r1"))
    tier.lookup(key(9), ctx("r9"))
    step(tier)
    tier.cleanup("r1")  # key 1 released first (False), then key 9 (True)
    tier.cleanup("r9")
    tier.note_stored([key(1)])  # key 1: True now, and the most recently released
    tier.lookup(key(5), ctx("r5"))
    step(tier)
    tier.cleanup("r5")  # a third verdict evicts the oldest: key 9, not key 1
    stats = tier.stats
    assert (stats.cached_verdicts, stats.verdict_cache_evictions) == (2, 1)
    assert tier.lookup(key(1), ctx("r6")) is True  # served from the cache, no probe
    assert tier.lookup(key(9), ctx("r6")) is None
    assert stats.invariant_violations == 0
    assert [sorted(keys) for keys, _ in tier.calls] == [[key(1), key(9)], [key(5)]]


def test_note_stored_with_the_cache_disabled_drops_a_released_state(
    make: Callable[..., SetTier],
) -> None:
    tier = make(verdict_ttl_s=0)
    tier.lookup(key(1), ctx("r1"))
    step(tier)
    tier.cleanup("r1")
    tier.note_stored([key(1), key(2)])
    assert (tier.tracked_keys, tier.stats.cached_verdicts) == (0, 0)
    assert tier.lookup(key(1), ctx("r2")) is None  # nothing cached: probed again


def test_a_lapsed_cached_verdict_is_probed_again_and_the_quarantine_still_refuses(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    tier = make(key(1), key(2), verdict_ttl_s=1.0)
    tier.lookup(key(1), ctx("r1"))
    tier.lookup(key(2), ctx("r1"))
    step(tier)
    tier.cleanup("r1")
    clock.advance(1.0)  # both cached verdicts lapse (not swept yet: no flush)
    tier.mark_miss([key(2)])
    assert tier.lookup(key(1), ctx("r2")) is None  # lapsed: a new probe
    assert tier.lookup(key(2), ctx("r2")) is False  # quarantined, not probed
    step(tier)
    assert tier.lookup(key(1), ctx("r2")) is True
    assert [sorted(keys) for keys, _ in tier.calls] == [[key(1), key(2)], [key(1)]]
    assert tier.stats.verdict_cache_hits == 0


def test_bad_keys_in_a_long_note_are_named_and_nothing_changes(
    make: Callable[..., SetTier],
) -> None:
    tier = make()
    good = [key(i) for i in range(5)]
    with pytest.raises(ValueError, match=r"keys\[5\] must be 1..255 bytes long, got 0"):
        tier.note_stored([*good, b""])
    with pytest.raises(TypeError, match=r"keys\[2\] must be a BlockKey \(bytes\), got str"):
        tier.note_removed(iter([key(1), key(2), "x"]))  # type: ignore[list-item]
    assert tier.stats.cached_verdicts == 0


def test_stores_nobody_asked_for_are_noted_without_a_state_and_lapse(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """A note of keys no request holds keeps no per-key state; reading one is a cache hit,
    the verdict lapses after stored_verdict_ttl_s, and mark_miss drops it."""
    tier = make(verdict_ttl_s=1.0, stored_verdict_ttl_s=1.0)
    tier.note_stored([key(1), key(2), key(3), key(4)])
    assert (tier.tracked_keys, tier.stats.cached_verdicts) == (0, 4)
    assert tier.phase(key(1)) is None
    assert tier.lookup(key(1), ctx("r1")) is True  # no probe: our own store
    assert (tier.tracked_keys, tier.stats.verdict_cache_hits) == (1, 1)
    tier.mark_miss([key(2)])
    assert tier.lookup(key(2), ctx("r1")) is False  # quarantined, the note is gone
    clock.advance(1.0)
    assert tier.lookup(key(3), ctx("r1")) is None  # lapsed: probed again
    assert tier.stats.cached_verdicts == 1  # key 4: lapsed, not read, not swept yet
    step(tier)  # the flush sweeps it
    assert [keys for keys, _ in tier.calls] == [[key(3)]]
    assert tier.stats.cached_verdicts == 0


def test_a_finished_request_s_stores_flip_its_cached_verdicts(
    make: Callable[..., SetTier],
) -> None:
    """The finish of a request (cleanup, then its stores land), and a store of keys an earlier
    request released: every cached False becomes True, none is probed again."""
    tier = make(verdict_ttl_s=60)
    for i in range(3):
        tier.lookup(key(i), ctx("early" if i == 0 else "last"))
    step(tier)
    tier.cleanup("early")
    tier.cleanup("last")  # released last: key 1 and key 2
    tier.note_stored([key(2), key(1), key(0), key(7)])
    assert [tier.lookup(key(i), ctx("next")) for i in (0, 1, 2, 7)] == [True] * 4
    stats = tier.stats
    assert (stats.verdict_cache_hits, stats.invariant_violations, len(tier.calls)) == (4, 0, 1)


def test_a_finished_request_s_stores_are_set_in_its_release_batch_and_lapse_with_the_note(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """Cleanup caches a request's verdicts in one release batch; its stores, noted next, set
    them where they are (no dead places left behind) and move the batch's lapse to the note's
    expiry: the sweep keeps them past the release's lapse and drops them at the note's."""
    tier = make(verdict_ttl_s=1.0, stored_verdict_ttl_s=1.0)
    for i in range(3):
        tier.lookup(key(i), ctx("r1"))
    step(tier)  # all False, answered at 1000.0
    tier.cleanup("r1")  # cached until 1001.0 at the latest
    clock.advance(0.5)
    tier.note_stored([key(0), key(1), key(2)])  # True until 1001.5
    assert tier._keys.queued == 3  # the three places of the release batch, all live
    clock.advance(0.7)  # 1001.2: past the release's lapse, not the note's
    tier.flush()
    assert tier.stats.cached_verdicts == 3
    clock.advance(0.3)  # 1001.5: the note lapses
    tier.flush()
    assert tier.stats.cached_verdicts == 0
    assert tier.lookup(key(0), ctx("r2")) is None  # probed again
    assert (len(tier.calls), tier.stats.invariant_violations) == (1, 0)


def test_our_own_store_is_trusted_for_stored_verdict_ttl_s_a_probe_for_verdict_ttl_s(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """A returning prompt minutes later needs no probe: the True of our own store lasts
    stored_verdict_ttl_s; a probed verdict and our own eviction still last verdict_ttl_s."""
    tier = make(key(9), verdict_ttl_s=1.0, stored_verdict_ttl_s=60.0)
    tier.lookup(key(9), ctx("probe"))
    step(tier)
    tier.cleanup("probe")  # a probed True, cached until 1001.0
    tier.note_stored([key(1), key(2)])
    tier.note_removed([key(3)])
    clock.advance(30.0)
    assert [tier.lookup(k, ctx("later")) for k in (key(1), key(2))] == [True, True]
    assert tier.lookup(key(3), ctx("later")) is None  # our eviction lapsed: probed
    assert tier.lookup(key(9), ctx("later")) is None  # the probed True lapsed: probed
    step(tier)
    assert [sorted(keys) for keys, _ in tier.calls] == [[key(9)], sorted([key(3), key(9)])]
    tier.cleanup("later")
    clock.advance(30.0)  # 1060.0: the store's verdict lapses
    assert tier.lookup(key(1), ctx("after")) is None


def test_a_request_that_read_a_stored_verdict_leaves_it_cached_until_the_store_s_lapse(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """Cleanup's release batch lapses with the longest verdict in it: a stored verdict a
    request read and released is not swept at the release's verdict_ttl_s."""
    tier = make(verdict_ttl_s=1.0, stored_verdict_ttl_s=60.0)
    tier.note_stored([key(1)])  # True until 1060.0
    tier.lookup(key(2), ctx("turn1"))  # probed: False until 1001.0
    assert tier.lookup(key(1), ctx("turn1")) is True
    step(tier)
    tier.cleanup("turn1")
    clock.advance(10.0)
    tier.flush()  # sweeps what lapsed
    assert tier.lookup(key(1), ctx("turn2")) is True
    assert tier.lookup(key(2), ctx("turn2")) is None
    tier.cleanup("turn2")
    clock.advance(50.0)  # 1060.0
    tier.flush()
    assert tier.lookup(key(1), ctx("turn3")) is None
    assert tier.stats.invariant_violations == 0


@pytest.mark.parametrize(("verdict_ttl", "stored_ttl", "trusted_for"),
                         [(0.0, 60.0, 0.0), (5.0, 1.0, 5.0), (1.0, 0.0, 1.0)])
def test_stored_verdict_ttl_s_is_never_below_verdict_ttl_s_and_off_with_the_cache(
    make: Callable[..., SetTier], clock: FakeClock,
    verdict_ttl: float, stored_ttl: float, trusted_for: float,
) -> None:
    tier = make(verdict_ttl_s=verdict_ttl, stored_verdict_ttl_s=stored_ttl)
    tier.note_stored([key(1)])
    if trusted_for:
        clock.advance(trusted_for - 0.001)
        assert tier.lookup(key(1), ctx("r1")) is True
        tier.cleanup("r1")
        clock.advance(0.001)
    assert tier.lookup(key(1), ctx("r2")) is None


def test_stores_of_the_request_released_last_and_of_an_earlier_one_in_one_note(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """One note of keys released by the last request (set in its batch) and by an earlier one
    (moved to a new batch): all are served True from the cache until the note lapses."""
    tier = make(verdict_ttl_s=1.0)
    tier.lookup(key(0), ctx("early"))
    tier.lookup(key(1), ctx("last"))
    step(tier)
    tier.cleanup("early")
    tier.cleanup("last")
    clock.advance(0.5)
    tier.note_stored([key(1), key(0)])
    clock.advance(0.7)  # past both releases' lapse
    tier.flush()
    assert tier.stats.cached_verdicts == 2
    assert [tier.lookup(key(i), ctx("next")) for i in (0, 1)] == [True, True]
    stats = tier.stats
    assert (stats.verdict_cache_hits, len(tier.calls), stats.invariant_violations) == (2, 1, 0)


def test_a_lapsed_quarantine_is_swept_by_a_flush_and_a_later_mark_miss_still_refuses(
    make: Callable[..., SetTier], clock: FakeClock
) -> None:
    """Flushes sweep the quarantine while it has entries; once it is empty they skip it, and a
    later mark_miss makes new keys take the refusing path again."""
    tier = make(key(1), key(2), key(3), quarantine_s=5.0)
    tier.mark_miss([key(1), key(2)])
    tier.flush()
    assert tier.stats.quarantined_keys == 2
    assert tier.lookup(key(1), ctx("r1")) is False  # refused, not probed
    clock.advance(5.0)
    tier.flush()  # both lapsed: swept without being asked
    assert tier.stats.quarantined_keys == 0
    assert tier.lookup(key(2), ctx("r2")) is None  # probed now
    step(tier)
    assert tier.lookup(key(2), ctx("r2")) is True
    tier.mark_miss([key(3)])
    assert tier.lookup(key(3), ctx("r3")) is False
    tier.flush()
    assert tier.stats.quarantined_keys == 1
    assert [keys for keys, _ in tier.calls] == [[key(2)]]


def test_a_note_whose_orphan_evicts_a_cached_key_of_the_same_note_keeps_the_bound(
    make: Callable[..., SetTier],
) -> None:
    """One note of a cached key and of an orphan still in flight, with room for one verdict:
    caching the orphan's note evicts the older cached state, which stays evicted (not revived
    outside the table), and the counts stay right."""
    hold = threading.Event()
    tier = make(hold=hold, max_cached_verdicts=1, verdict_ttl_s=60)
    tier.lookup(key(1), ctx("r1"))
    tier.flush()
    hold.set()
    settle(tier)
    tier.cleanup("r1")  # key 1: a cached False
    hold.clear()
    tier.lookup(key(2), ctx("r2"))
    tier.flush()
    assert tier.entered.wait(WAIT_S)
    tier.cleanup("r2")  # key 2: an orphan in flight
    tier.note_stored([key(1), key(2)])
    stats = tier.stats
    assert (stats.cached_verdicts, stats.verdict_cache_evictions, tier.tracked_keys) == (1, 1, 0)
    hold.set()
    settle(tier)  # the orphan's late answer is stale: its note superseded it
    assert tier.lookup(key(2), ctx("r3")) is True  # the note, from the cache
    assert tier.lookup(key(1), ctx("r3")) is None  # evicted: probed again
    step(tier)
    stats = tier.stats
    assert (stats.stale_results_dropped, stats.invariant_violations) == (1, 0)
    assert [keys for keys, _ in tier.calls] == [[key(1)], [key(2)], [key(1)]]
