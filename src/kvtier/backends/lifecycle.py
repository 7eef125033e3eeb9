"""The open/closed :class:`Lifecycle` of one backend instance.

State and owners:

- :class:`Lifecycle` state: any thread; ``close()`` flips it once, under its lock.
"""

from __future__ import annotations

import enum
import threading

from kvtier.errors import ClosedError

BackendClosedError = ClosedError  # the one closed error; this name is kept for callers


class LifecycleState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Lifecycle:
    """Open/closed state of one backend instance."""

    __slots__ = ("_lock", "_name", "_state")

    def __init__(self, name: str) -> None:
        self._name = name
        self._state = LifecycleState.OPEN
        self._lock = threading.Lock()

    @property
    def state(self) -> LifecycleState:
        return self._state

    def check_open(self) -> None:
        if self._state is LifecycleState.CLOSED:
            raise BackendClosedError(f"{self._name} is closed")

    def close(self) -> bool:
        """Mark closed; True only for the call that actually closed it."""
        with self._lock:
            if self._state is LifecycleState.CLOSED:
                return False
            self._state = LifecycleState.CLOSED
            return True
