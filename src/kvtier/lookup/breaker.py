"""The per-tier circuit breaker of the lookup manager.

Thread ownership: a :class:`CircuitBreaker` belongs to its lookup manager's scheduler thread (the
manager's owner thread); every field (``state``, the consecutive-failure count, the open-until
time, the trial batch, ``opens``) is read and written only there. It is not locked.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Final

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.Enum):
    """Per-tier circuit breaker."""

    CLOSED = "closed"  # probes go to the backend
    OPEN = "open"  # new keys answer False at once, no probes
    HALF_OPEN = "half_open"  # one trial batch may go through; its outcome closes or reopens


_CLOSED: Final = BreakerState.CLOSED
_OPEN: Final = BreakerState.OPEN
_HALF_OPEN: Final = BreakerState.HALF_OPEN


class CircuitBreaker:
    """``threshold`` consecutive failed calls open it for ``cooldown_s``; then the first batch
    sent (the trial) decides: all its calls succeed -> CLOSED, otherwise OPEN again.

    ``state`` is a plain attribute so the hot path can test ``breaker.state is CLOSED`` without a
    call. ``on_open(cooldown_s)`` and ``on_close()`` are told about transitions (logging).
    """

    __slots__ = ("_cooldown_s", "_failures", "_on_close", "_on_open", "_open_until",
                 "_threshold", "_trial_batch", "opens", "state")

    def __init__(self, threshold: int, cooldown_s: float, *,
                 on_open: Callable[[float], None], on_close: Callable[[], None]) -> None:
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._on_open = on_open
        self._on_close = on_close
        self.state = _CLOSED
        self.opens = 0
        self._failures = 0
        self._open_until = 0.0
        self._trial_batch: int | None = None

    def admits(self, now: float) -> bool:
        """Whether new keys may be probed now; moves OPEN to HALF_OPEN after the cool-down."""
        state = self.state
        if state is _CLOSED:
            return True
        if state is _OPEN:
            if now < self._open_until:
                return False
            self.state = _HALF_OPEN
            self._trial_batch = None
            return True
        return self._trial_batch is None  # HALF_OPEN: only until the trial is sent

    def sent(self, batch_id: int) -> None:
        """A batch went to the backend; in HALF_OPEN it is the trial."""
        if self.state is _HALF_OPEN:
            self._trial_batch = batch_id

    def record(self, batch_id: int, outcomes: Sequence[bool], now: Callable[[], float]) -> None:
        """The calls of batch ``batch_id`` finished (True = succeeded); ``now`` is read only
        when the breaker opens."""
        state = self.state
        if state is _HALF_OPEN:
            if batch_id != self._trial_batch:
                return  # batches sent before the breaker opened do not decide the trial
            if all(outcomes):
                self.state = _CLOSED
                self._failures = 0
                self._trial_batch = None
                self._on_close()
            else:
                self._open(now())
            return
        if state is _OPEN:
            return
        for succeeded in outcomes:
            if succeeded:
                self._failures = 0
                continue
            self._failures += 1
            if self._failures >= self._threshold:
                self._open(now())
                return

    def forget_trial(self) -> None:
        self._trial_batch = None

    def _open(self, now: float) -> None:
        self.state = _OPEN
        self._open_until = now + self._cooldown_s
        self._trial_batch = None
        self._failures = 0
        self.opens += 1
        self._on_open(self._cooldown_s)
