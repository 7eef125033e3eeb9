"""The per-tier transfer traffic: submitting the step's queued loads and stores, applying the
jobs the tiers finish, yielding to their I/O threads, and draining everything.

Owns no state of its own: it routes between the tiers and the scheduler thread's tables
(:class:`~kvtier.tiering.promotions.PromotionTable` for loads,
:class:`~kvtier.tiering.writeback.WriteBack` for stores). Every method runs on the
**scheduler thread**; the tiers' probe and I/O threads hand results back only through their
queues, drained here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvtier.tiering.promotions import PromotionTable
from kvtier.tiering.tier import IO_YIELD_S, JobKind, SecondaryTier, TierJob
from kvtier.tiering.writeback import Backlog, WriteBack

__all__ = ["IO_YIELD_MAX_S", "Transfers"]

_log = logging.getLogger("kvtier.tiering.manager")
IO_YIELD_MAX_S = 0.05  # the longest end-of-step wait for in-flight I/O: a step stays short


class Transfers:
    """Loads and stores between the tiers and the manager's tables."""

    __slots__ = ("_promotions", "_tiers", "_writeback")

    def __init__(self, tiers: tuple[SecondaryTier, ...], promotions: PromotionTable,
                 writeback: WriteBack) -> None:
        self._tiers = tiers
        self._promotions = promotions
        self._writeback = writeback

    def apply(self, tier_index: int, job: TierJob) -> None:
        name = self._tiers[tier_index].name
        if job.kind is JobKind.LOAD:
            self._promotions.apply_load(tier_index, name, job)
        else:
            self._writeback.apply_store(tier_index, name, job)

    def submit(self, backlog: Backlog = Backlog.WAIT_NEXT_STEP,
               timeout: float | None = None) -> None:
        """Submit the step's queued loads and stores. ``Backlog.WAIT_FOR_ROOM`` (shutdown)
        waits, up to ``timeout`` s in all, for room instead of shedding."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for index, tier in enumerate(self._tiers):
            self._promotions.submit(index, tier)
            self._writeback.submit(index, tier, backlog=backlog, deadline=deadline,
                                   apply=self.apply)

    def poll(self, *, wait: bool = False, timeout: float | None = None) -> None:
        """Apply every finished job; reclaim the slots of abandoned loads whose I/O ended."""
        for index, tier in enumerate(self._tiers):
            for job in tier.get_finished_jobs(wait=wait, timeout=timeout):
                self.apply(index, job)
            if self._promotions.has_retired:
                self._promotions.reclaim(index, tier)

    def yield_to_io(self, step_busy_s: float = 0.0) -> None:
        """With transfers or probes in flight, wait for them (applying what finishes) for at
        most the scheduler thread's CPU time since the last step ``step_busy_s`` (at least
        ``IO_YIELD_S``, at most ``IO_YIELD_MAX_S``), which hands the GIL to the tiers' threads.

        A scheduler thread that steps back to back in pure Python holds the GIL for the
        switch interval (5 ms) each time an I/O thread returns from a system call, and a
        file probe or transfer makes one or more per block: a 1,024-key probe took 5 s that
        way. Waiting as long as the step ran (only while the tiers have work) gives their
        threads at least half of the scheduler's time, uncontended."""
        budget = min(IO_YIELD_MAX_S, max(IO_YIELD_S, step_busy_s))
        deadline = time.monotonic() + budget
        for index, tier in enumerate(self._tiers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for job in tier.yield_to_io(remaining):
                self.apply(index, job)

    def wait_idle(self, timeout: float, *, write_through: bool) -> bool:
        """Block until every probe answered and every transfer landed (cascading what waits
        for the pin budget under ``write_through``), applying them; True if all within
        ``timeout``. Probes are not flushed."""
        deadline = time.monotonic() + timeout
        idle = True
        for tier in self._tiers:
            remaining = max(0.0, deadline - time.monotonic())
            idle = tier.lookup_manager._wait_for_results(remaining) and idle
        writeback = self._writeback
        while True:  # cascades waiting for a backlogged tier (or the pin budget) go as jobs land
            if write_through and writeback.has_unwritten:
                writeback.cascade_unwritten()
            self.submit()
            for index, tier in enumerate(self._tiers):
                remaining = max(0.0, deadline - time.monotonic())
                for job in tier.get_finished_jobs(wait=True, timeout=remaining):
                    self.apply(index, job)
            unsent = writeback.has_queued or (write_through and writeback.has_unwritten)
            if not unsent or time.monotonic() >= deadline:
                break
        for index, tier in enumerate(self._tiers):
            if self._promotions.has_retired:  # abandoned loads count until their call ends
                self._promotions.reclaim(index, tier, max(0.0, deadline - time.monotonic()))
            idle = idle and tier.outstanding_jobs == 0
            tier.lookup_manager.drain_results()
        return idle and not unsent and not self._promotions.has_retired

    def shutdown_tiers(self, left: Callable[[], float | None]) -> None:
        """Shut every tier down (within ``left()`` s each), applying its last jobs."""
        for index, tier in enumerate(self._tiers):
            try:
                for job in tier.shutdown(left()):
                    self.apply(index, job)
            except Exception as exc:
                _log.warning("tier %s: shutdown failed: %r", tier.name, exc)
