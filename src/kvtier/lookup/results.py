"""Applying the probe worker's answers and timing out stuck batches (scheduler side).

Owner threads:

* **Scheduler thread** (the lookup manager's owner) runs every method here, unlocked, on the
  state of :class:`~kvtier.lookup.manager.AsyncLookupManager` it mixes into: the per-key table
  ``_keys`` (states and verdict cache, lookup/states.py), the submitted batches and their
  deadlines (``_inflight_batches``, ``_next_batch_id``), the breaker (``_breaker``), the counters
  and logs (``_counters``, ``_logs``).
* **Probe worker thread** (``_worker``, lookup/worker.py) only posts results to its queue, which
  :meth:`ProbeResults._drain` empties here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvtier.backends.stats import RateLimitedLog
from kvtier.keys import BlockKey
from kvtier.lookup.breaker import CircuitBreaker
from kvtier.lookup.states import KeyState, KeyTable, LookupPhase, VerdictSource
from kvtier.lookup.stats import LookupStats
from kvtier.lookup.worker import Entry, ProbeResult, ProbeWorker

__all__ = ["InFlightBatch", "ProbeResults", "clock_reader"]

# Enum members as module constants (see lookup/manager.py): this code runs once per probed key.
_PHASE_IN_FLIGHT: Final = LookupPhase.IN_FLIGHT
_PHASE_RESOLVED: Final = LookupPhase.RESOLVED
_SOURCE_BACKEND: Final = VerdictSource.BACKEND
_SOURCE_FAULT: Final = VerdictSource.FAULT


@dataclass(slots=True)
class InFlightBatch:
    deadline: float
    entries: list[Entry]


def clock_reader(clock: Callable[[], float], now: float | None) -> Callable[[], float]:
    return clock if now is None else (lambda: now)


class ProbeResults:
    """The result side of :class:`~kvtier.lookup.manager.AsyncLookupManager` (a mixin: the
    attributes below are the manager's, set in its ``__init__``)."""

    _tier_name: str
    _clock: Callable[[], float]
    _probe_timeout_s: float
    _verdict_ttl_s: float
    _keys: KeyTable
    _states: dict[BlockKey, KeyState]
    _inflight_batches: dict[int, InFlightBatch]
    _next_batch_id: int
    _breaker: CircuitBreaker
    _counters: LookupStats
    _logs: dict[str, RateLimitedLog]
    _worker: ProbeWorker

    def _drain(self, now: float | None) -> None:
        # One consumer (this thread): empty() then get_nowait() never blocks, and an empty
        # queue costs no exception (drained up to three times per step).
        result_queue = self._worker.results
        while not result_queue.empty():
            self._apply(result_queue.get_nowait(), now)

    def _apply(self, result: ProbeResult, now: float | None) -> None:
        counters = self._counters
        counters.backend_calls += len(result.call_outcomes)
        batch = self._inflight_batches.pop(result.batch_id, None)
        if batch is None:
            if result.batch_id >= self._next_batch_id:
                self._violation("result for batch %d that was never sent", result.batch_id)
            # Timed out earlier: every answer is late; the timeout already fed the breaker and
            # was counted (failed_calls, probe_timeouts), so its errors are not counted again.
            counters.stale_results_dropped += len(result.keys)
            return
        counters.failed_calls += result.call_outcomes.count(False)
        counters.probe_errors += result.error_keys
        self._breaker.record(result.batch_id, result.call_outcomes,
                             clock_reader(self._clock, now))
        ttl = self._verdict_ttl_s
        states = self._states
        trusted_expiry = result.answered_at + ttl if ttl > 0 else None
        for key, generation, verdict in zip(result.keys, result.generations, result.verdicts,
                                            strict=True):
            state = states.get(key)
            if state is None or state.generation != generation:
                counters.stale_results_dropped += 1
                continue
            if state.phase is not _PHASE_IN_FLIGHT:
                self._violation("one-result-per-generation: key %s of generation %d is %s",
                                key.hex(), generation, state.phase.name)
                continue
            # KeyState.resolve() inlined: this loop runs once per probed key
            state.phase = _PHASE_RESOLVED
            if verdict is not None:
                state.verdict = verdict
                state.source = _SOURCE_BACKEND
                state.cache_expiry = trusted_expiry
            else:
                state.verdict = False
                state.source = _SOURCE_FAULT
                state.cache_expiry = None
            if not state.refs:  # an orphan: nobody waits for it any more
                counters.orphans_reclaimed += 1
                self._keys.release(state)

    def _expire_timed_out(self, now: float) -> None:
        """Resolve False every probe whose batch passed its deadline (batches are in order) -
        unless the worker is still making progress: a backend call started less than
        ``probe_timeout_s`` ago means the batches behind it are queued, not lost, and they wait
        (back-pressure, counted in ``probes_delayed``); only a call that runs past the timeout
        (a stuck or dead backend) times them out and feeds the breaker."""
        inflight = self._inflight_batches
        if not inflight or next(iter(inflight.values())).deadline > now:
            return
        if self._worker.is_progressing(now, self._probe_timeout_s):
            self._counters.probes_delayed += 1
            return
        expired: list[int] = []
        for batch_id, batch in inflight.items():
            if batch.deadline > now:
                break
            expired.append(batch_id)
        states = self._states
        timed_out = 0
        for batch_id in expired:
            for key, generation, _ in inflight.pop(batch_id).entries:
                state = states.get(key)
                if (state is None or state.generation != generation
                        or state.phase is not _PHASE_IN_FLIGHT):
                    continue
                timed_out += 1
                if state.refs:
                    self._keys.supersede(state)
                    state.resolve(False, _SOURCE_FAULT, None)
                else:
                    del states[key]
            self._breaker.record(batch_id, (False,), clock_reader(self._clock, now))
        self._counters.probe_timeouts += timed_out
        self._counters.failed_calls += len(expired)
        if timed_out:
            self._logs["timeout"].warning(
                "tier %s: %d probes timed out after %.3fs; answering False",
                self._tier_name, timed_out, self._probe_timeout_s)

    def _violation(self, message: str, *args: object) -> None:
        self._counters.invariant_violations += 1
        self._logs["invariant"].warning("tier %s: invariant violated: " + message,
                                        self._tier_name, *args)
