"""The lookup manager's statistics snapshot (:class:`LookupStats`); a plain record, no state.

The manager's scheduler thread owns the live counters; :attr:`AsyncLookupManager.stats` hands
out copies of this record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvtier.lookup.breaker import BreakerState

__all__ = ["LookupStats"]


@dataclass(slots=True)
class LookupStats:
    """A snapshot of one manager's counters.

    ``lookups``: ``lookup()`` calls. ``backend_calls``: ``batch_lookup`` calls answered.
    ``probes_submitted``: keys sent to the worker. ``inflight_reuses``: a request attached to a
    probe another request had already started (PENDING or IN_FLIGHT). ``verdict_cache_hits``,
    ``quarantine_hits``: new keys answered from the cache / the quarantine.
    ``stale_results_dropped``: answers for a superseded generation or a timed-out batch.
    ``orphans_reclaimed``: answers nobody waited for any more (state deleted, verdict cached).
    ``probe_errors`` / ``probe_timeouts``: keys (not calls) resolved False by a fault / a
    timeout. ``probes_delayed``: checks that found batches past their deadline behind a worker
    still making progress (a slow queue waits; only a call stuck past the timeout times out).
    ``failed_calls``: failed calls plus timed-out batches. ``breaker_short_circuits``:
    keys answered False because the breaker was open. ``breaker_opens``: transitions to OPEN.
    ``invariant_violations``: broken internal invariants (each also logged; the safe verdict is
    kept). ``cached_verdicts``, ``quarantined_keys``, ``inflight_batches``: current sizes.
    """

    lookups: int = 0
    backend_calls: int = 0
    probes_submitted: int = 0
    inflight_reuses: int = 0
    verdict_cache_hits: int = 0
    quarantine_hits: int = 0
    stale_results_dropped: int = 0
    orphans_reclaimed: int = 0
    probe_errors: int = 0
    probe_timeouts: int = 0
    probes_delayed: int = 0
    failed_calls: int = 0
    breaker_short_circuits: int = 0
    breaker_opens: int = 0
    invariant_violations: int = 0
    verdict_cache_evictions: int = 0
    quarantine_evictions: int = 0
    cached_verdicts: int = 0
    quarantined_keys: int = 0
    inflight_batches: int = 0
    breaker_state: BreakerState = BreakerState.CLOSED

    def as_dict(self) -> dict[str, int | str]:
        """Every field by name; ``breaker_state`` as its value string (``"closed"``, ...)."""
        result: dict[str, int | str] = asdict(self)
        result["breaker_state"] = self.breaker_state.value
        return result
