"""The backends' counters (:data:`STANDARD_COUNTERS`, :class:`BackendStats`) and their
rate-limited failure log (:class:`RateLimitedLog`).

State and owners:

- :class:`BackendStats` counters: written by any thread calling into the backend, guarded by the
  object's own lock.
- :class:`RateLimitedLog` timestamps: any thread, guarded by the object's own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

STANDARD_COUNTERS = (
    "puts",
    "puts_existing",
    "gets",
    "hits",
    "misses",
    "exists_calls",
    "deletes",
    "bytes_read",
    "bytes_written",
    "corrupt_objects",
    "size_mismatches",
    "auth_failures",
    "auth_old_key",
    "old_format",
    "errors",
    "round_trips",
)
"""Counters every backend reports under these exact names."""


class BackendStats:
    """Thread-safe integer counters; ``snapshot()`` always has every standard counter."""

    __slots__ = ("_counters", "_lock")

    def __init__(self, extra: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, int] = dict.fromkeys((*STANDARD_COUNTERS, *extra), 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + amount

    def add_many(self, amounts: Mapping[str, int]) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counters[name] = self._counters.get(name, 0) + amount

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._counters[name] = value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)


class RateLimitedLog:
    """Logs at most one warning per ``interval_s``; the ones in between are counted, not lost.

    A dead server can fail every call many times per second; one line per interval, carrying the
    number of suppressed messages, keeps the log readable.
    """

    __slots__ = ("_clock", "_interval_s", "_last", "_lock", "_logger", "_suppressed")

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log unless one was logged less than ``interval_s`` ago; True if it was logged."""
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last < self._interval_s:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message = f"{message} (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.warning(message, *args)
        return True
