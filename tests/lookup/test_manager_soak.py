"""Randomized soak of the lookup manager against a live probe worker (seeded decisions).

Thousands of engine steps with random request overlap, backend latency, errors, malformed
results, calls held past their deadline (the clock is a FakeClock the scheduler moves, so a held
call really times out), failed loads (mark_miss), our own stores/evictions (note_*), and
cleanups. Checked every step: an answer is never True for a key the tier does not hold, a
quarantined key (``mark_miss`` less than ``quarantine_s`` ago, no ``note_stored`` since) always
answers False, a key whose last event was ``note_stored`` less than ``verdict_ttl_s`` ago always
answers True, no probe outlives its deadline after a flush, and no invariant is violated; at the
end nothing is left.

The worker really runs concurrently, so the interleaving differs from run to run; every
decision (which keys, which faults, when time jumps) comes from the seeded generators.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kvtier.keys import BlockKey, RequestContext
from kvtier.lookup.manager import AsyncLookupManager, BreakerState

WAIT_S = 10.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _ChaosTier(AsyncLookupManager):
    """Answers from ``present`` (mutated only by the scheduler thread) with seeded chaos."""

    def __init__(self, seed: int, clock: _Clock) -> None:
        self.present: set[BlockKey] = set()
        # The scheduler replaces ``gate`` to hold later calls; at the end it sets ``calm`` and the
        # current gate, so a call that read ``calm`` too early still gets a released gate.
        self.gate = threading.Event()
        self.calm = threading.Event()
        self.stick = threading.Event()  # set: the next calls hang on ``gate`` (a stuck backend)
        self.stuck = threading.Event()  # set by a call that hangs because of ``stick``
        self._chaos = random.Random(seed)  # used on the worker thread only
        super().__init__(
            "soak",
            probe_timeout_s=1.0,
            verdict_ttl_s=2.0,
            max_cached_verdicts=512,
            quarantine_s=5.0,
            max_batch_keys=64,
            breaker_threshold=3,
            breaker_cooldown_s=1.0,
            clock=clock,
        )

    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        roll = self._chaos.random()
        if self.stick.is_set() and not self.calm.is_set():
            gate = self.gate
            self.stuck.set()
            gate.wait(WAIT_S)
        elif roll < 0.02 and not self.calm.is_set():
            self.gate.wait(WAIT_S)
        elif roll < 0.10:
            time.sleep(self._chaos.random() * 0.0005)
        answers = [key in self.present for key in keys]
        roll = self._chaos.random()
        if roll < 0.04:
            raise ConnectionError("chaos: backend error")
        if roll < 0.06:
            return answers[:-1]
        if roll < 0.07:
            return [*answers[:-1], "maybe"]  # type: ignore[list-item]
        if roll < 0.08:
            return _explode_after_first(answers)  # type: ignore[return-value]
        return answers


def _explode_after_first(answers: list[bool]) -> Any:
    yield answers[0]
    raise RuntimeError("chaos: error while iterating")


def _stuck_backend_episode(tier: _ChaosTier, clock: _Clock, step_index: int) -> None:
    """A backend call hangs past the probe timeout: the probes behind it time out (a fault),
    unlike a slow queue, whose probes wait."""
    tier.gate.set()
    tier.gate = threading.Event()
    tier.stuck.clear()
    tier.stick.set()
    context = RequestContext(f"stuck-{step_index}")
    tier.lookup(_key(10_000 + step_index), context)
    tier.flush()
    assert tier.stuck.wait(WAIT_S)  # the worker is inside the hanging call
    clock.now += 1.5
    tier.flush()
    tier.stick.clear()
    tier.gate.set()
    tier.cleanup(context.req_id)


def _key(index: int) -> BlockKey:
    return index.to_bytes(16, "big")


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.timeout(60)
def test_soak_ends_empty_and_never_claims_a_missing_block(seed: int) -> None:
    rng = random.Random(seed)
    clock = _Clock()
    tier = _ChaosTier(seed * 7919, clock)
    tier.present.update(_key(i) for i in range(0, 400, 2))
    active: dict[str, tuple[RequestContext, list[BlockKey], int]] = {}
    next_request = 0
    true_answers = 0
    # the soak's own model of the last event per key: ("miss" | "stored" | "removed", when)
    last_event: dict[BlockKey, tuple[str, float]] = {}
    try:
        for step_index in range(4000):
            if step_index % 500 == 250:
                _stuck_backend_episode(tier, clock, step_index)
            for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
                start = rng.choice((0, 0, 16, 32, rng.randrange(400)))  # shared prefixes
                length = rng.randrange(1, 24)
                keys = [_key((start + i) % 400) for i in range(length)]
                context = RequestContext(f"req-{next_request}")
                active[context.req_id] = (context, keys, rng.randrange(2, 12))
                next_request += 1
            for req_id, (context, keys, steps_left) in list(active.items()):
                for block in keys:
                    verdict = tier.lookup(block, context)
                    kind, when = last_event.get(block, ("", -1e9))
                    if kind == "miss" and clock.now < when + 5.0:
                        assert verdict is False, "a quarantined key was not answered False"
                    if kind == "stored" and clock.now < when + 2.0:
                        assert verdict is True, "note_stored was not honoured within its TTL"
                    if verdict is True:
                        true_answers += 1
                        assert block in tier.present, "True for a block the tier lacks"
                    else:
                        assert verdict is False or verdict is None
                if steps_left <= 1:
                    tier.cleanup(req_id)
                    del active[req_id]
                else:
                    active[req_id] = (context, keys, steps_left - 1)
            action = rng.random()
            if action < 0.05:
                missed = rng.sample(sorted(tier.present), 2)
                tier.mark_miss(missed)
                last_event.update((block, ("miss", clock.now)) for block in missed)
            elif action < 0.08:
                stored = _key(rng.randrange(400))
                tier.present.add(stored)
                tier.note_stored([stored])
                last_event[stored] = ("stored", clock.now)
            elif action < 0.11:
                removed = _key(rng.randrange(400))
                tier.present.discard(removed)
                tier.note_removed([removed])
                last_event[removed] = ("removed", clock.now)
            pace = rng.random()
            if pace < 0.5:  # a fast backend this step: release holds, let the worker catch up
                tier.gate.set()
                assert tier._wait_for_results(WAIT_S)
                tier.gate = threading.Event()
            elif pace < 0.65:  # release held calls without waiting for them
                tier.gate.set()
                tier.gate = threading.Event()
            clock.now += 1.5 if rng.random() < 0.015 else rng.choice((0.0, 0.01, 0.05, 0.1, 0.2))
            tier.flush()
            if active and rng.random() < 0.15:  # a request aborted right after its keys went out
                aborted = f"req-{next_request - 1}" if rng.random() < 0.5 else rng.choice(
                    sorted(active))
                tier.cleanup(aborted)
                active.pop(aborted, None)
            # Past its deadline only while the worker still makes progress (back-pressure).
            assert tier._worker.is_progressing(clock.now, 1.0) or all(
                batch.deadline > clock.now for batch in tier._inflight_batches.values())
        for req_id in list(active):
            tier.cleanup(req_id)
        tier.calm.set()
        tier.gate.set()
        assert tier._wait_for_results(WAIT_S)
        tier.flush()
        assert tier.tracked_keys == 0
        assert tier._request_keys == {} and tier._pending == []
        assert tier._inflight_batches == {}
        stats = tier.stats
        assert stats.invariant_violations == 0
        assert stats.cached_verdicts <= 512 and stats.quarantined_keys <= 512
        # the soak really exercised every path
        assert true_answers > 0
        for counter in ("probe_errors", "probe_timeouts", "probes_delayed",
                        "stale_results_dropped",
                        "orphans_reclaimed", "verdict_cache_hits", "quarantine_hits",
                        "inflight_reuses", "breaker_opens", "breaker_short_circuits"):
            assert getattr(stats, counter) > 0, counter
        assert stats.breaker_state in set(BreakerState)
    finally:
        tier.calm.set()
        tier.gate.set()
        tier.shutdown(timeout=WAIT_S)
    assert tier.tracked_keys == 0
