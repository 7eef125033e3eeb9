"""A tier's measured load cost: a moving fit of its load jobs' time against their bytes.

Thread ownership: a :class:`LoadRate` belongs to one :class:`~kvtier.tiering.tier.SecondaryTier`
and to its **scheduler thread**: :meth:`LoadRate.observe` runs where finished jobs are collected,
:meth:`LoadRate.cost` where lookups ask whether a load pays. The I/O threads only time the jobs
(``TierJob.wall_s``); they never touch this state.

Each finished load job is one observation (payload bytes, wall seconds from its first backend
call to its last). The fit is an exponentially weighted least-squares line ``seconds =
seconds_per_job + bytes * seconds_per_byte``, so the estimate follows a tier that slows down or
recovers within a few jobs; where the jobs are all about one size (the line's slope cannot be
told from its intercept), the whole time is charged to the bytes, which overstates the cost of a
long prefix a little and never understates a short one's.

Before the first measurement the cost is :data:`~kvtier.tiering.payoff.FREE` (optimistic: the
first loads happen, and are measured). A tier whose loads are all declined is never measured
again, so an estimate older than ``remeasure_after_s`` (on the injectable ``clock``) is
:attr:`LoadRate.stale`: the tier then lets one small load through to measure itself
(:meth:`LoadRate.remeasure` restarts the timer, so it is one per period, and the next
measurement replaces the old history instead of being averaged into it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvtier.tiering.payoff import FREE, LoadCost

__all__ = ["REMEASURE_AFTER_S", "LoadRate"]

REMEASURE_AFTER_S = 60.0
"""An estimate this old (no load measured since) is stale: one measuring load goes through."""
_WEIGHT = 0.25  # weight of the newest job: the estimate follows a change within ~4-8 jobs
_SAME_SIZE_SPREAD = 0.05  # bytes' spread below this share of their mean: no slope is fitted


class LoadRate:
    """An exponentially weighted fit of one tier's load jobs (see the module docstring)."""

    __slots__ = ("_bytes", "_bytes_sq", "_bytes_time", "_clock", "_last", "_prior",
                 "_remeasure_after_s", "_restart", "_samples", "_time", "_weight",
                 "_weight_sum")

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 prior: LoadCost = FREE, weight: float = _WEIGHT,
                 remeasure_after_s: float = REMEASURE_AFTER_S) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"LoadRate weight: expected a number in (0, 1], got {weight!r}")
        if not remeasure_after_s > 0:
            raise ValueError(f"LoadRate remeasure_after_s: expected a number > 0 (seconds), "
                             f"got {remeasure_after_s!r}")
        self._clock = clock
        self._prior = prior
        self._weight = weight
        self._remeasure_after_s = remeasure_after_s
        self._last = -math.inf
        self._restart = False  # the next observation replaces the history (a re-measurement)
        self._reset()

    def _reset(self) -> None:
        self._samples = 0
        self._weight_sum = 0.0
        self._bytes = 0.0
        self._time = 0.0
        self._bytes_sq = 0.0
        self._bytes_time = 0.0

    @property
    def samples(self) -> int:
        """Jobs in the current estimate (0: the prior applies)."""
        return self._samples

    @property
    def stale(self) -> bool:
        """Measured, but not within ``remeasure_after_s``: worth one measuring load."""
        return bool(self._samples) and self._clock() - self._last > self._remeasure_after_s

    def remeasure(self) -> None:
        """A measuring load was let through: not stale again for another period, and its
        measurement replaces the old history (which no longer describes the tier)."""
        self._last = self._clock()
        self._restart = True

    def observe(self, nbytes: int, seconds: float) -> None:
        """One finished load job: ``nbytes`` of payload moved in ``seconds`` of wall time.
        Observations without bytes or with a time that is not a finite number >= 0 are
        ignored (they say nothing about the rate)."""
        if nbytes <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        if self._restart or self.stale:  # the old history no longer describes the tier
            self._restart = False
            self._reset()
        self._last = self._clock()
        keep = 1.0 - self._weight if self._samples else 0.0
        self._samples += 1
        self._weight_sum = self._weight_sum * keep + 1.0
        self._bytes = self._bytes * keep + nbytes
        self._time = self._time * keep + seconds
        self._bytes_sq = self._bytes_sq * keep + float(nbytes) * nbytes
        self._bytes_time = self._bytes_time * keep + nbytes * seconds

    def cost(self) -> LoadCost:
        """The current estimate (the prior before the first job is measured)."""
        if not self._samples:
            return self._prior
        mean_bytes = self._bytes / self._weight_sum
        mean_time = self._time / self._weight_sum
        variance = self._bytes_sq / self._weight_sum - mean_bytes * mean_bytes
        covariance = self._bytes_time / self._weight_sum - mean_bytes * mean_time
        per_job = 0.0
        if variance > (_SAME_SIZE_SPREAD * mean_bytes) ** 2 and covariance > 0:
            per_job = min(mean_time, max(0.0, mean_time - covariance / variance * mean_bytes))
        return LoadCost(per_job, (mean_time - per_job) / mean_bytes)
