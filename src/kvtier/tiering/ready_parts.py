"""The parts of a tier's transfer jobs waiting for an I/O thread: three queues, taken in order.

Thread ownership: the **scheduler thread** appends parts (:meth:`ReadyParts.push`) and moves a
prefetch part to the demand queue (:meth:`ReadyParts.expedite`); the tier's **I/O threads** pop
them (:meth:`ReadyParts.pop`). Every deque operation is atomic, so each part is popped exactly
once, by whichever thread gets it first.

With a ``store_limit`` at most that many store parts run at once: ``_stores_running`` and
``_owed`` (I/O tasks that found only stores over the limit and returned) are guarded by
``_lock``, which every ``pop`` then takes. A task that returns owed leaves its part to the
next thread that finishes one (:meth:`ReadyParts.done`), so no part waits without a thread
that will take it.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["ReadyParts", "ReadyQueue"]

P = TypeVar("P")


class ReadyQueue(enum.IntEnum):
    """Which queue a part waits in; an I/O thread takes the lowest first."""

    LOAD = 0      # a request's load: first in line, never behind a backlog of cascades
    STORE = 1
    PREFETCH = 2  # only when no load and no store waits


class ReadyParts(Generic[P]):
    """Waiting parts by :class:`ReadyQueue`; at most ``store_limit`` store parts running (None:
    no limit)."""

    __slots__ = ("_lock", "_owed", "_queues", "_store_limit", "_stores_running")

    def __init__(self, store_limit: int | None = None) -> None:
        if store_limit is not None and (isinstance(store_limit, bool)
                                        or not isinstance(store_limit, int) or store_limit < 1):
            raise ValueError(f"store_limit must be None or an int >= 1, got {store_limit!r}")
        self._queues: tuple[deque[P], ...] = tuple(deque() for _ in ReadyQueue)
        self._store_limit = store_limit
        self._stores_running = 0
        self._owed = 0
        self._lock = threading.Lock()

    @property
    def store_limit(self) -> int | None:
        return self._store_limit

    def push(self, queue: ReadyQueue, parts: Iterable[P]) -> None:
        self._queues[queue].extend(parts)

    def pop(self) -> P | None:
        """The oldest part of the first queue that has one (I/O thread); None if none waits, or
        if a store waits while ``store_limit`` of them run (the task is then owed)."""
        if self._store_limit is None:
            return self._first(self._queues)
        with self._lock:
            load, store, prefetch = self._queues
            part = self._first((load,))
            if part is None and store:
                if self._stores_running >= self._store_limit:
                    self._owed += 1
                    return None  # prefetch waits behind waiting stores, as without a limit
                part = self._first((store,))
                if part is not None:
                    self._stores_running += 1
            return part if part is not None else self._first((prefetch,))

    def done(self, store: bool) -> bool:
        """A part this popped has finished (I/O thread; ``store``: from the store queue). True:
        a task was owed, and the caller pops again in its place. One lock for both, so a task
        owed while the store ran is always seen by the thread that ends that store."""
        if self._store_limit is None:
            return False
        with self._lock:
            if store:
                self._stores_running -= 1
            if not self._owed:
                return False
            self._owed -= 1
            return True

    @staticmethod
    def _first(queues: Iterable[deque[P]]) -> P | None:
        for waiting in queues:
            try:
                return waiting.popleft()
            except IndexError:  # empty, or emptied by another thread since
                continue
        return None

    def drain(self) -> Iterator[P]:
        """Pop every waiting part, whatever the limit (the executor is gone: their jobs fail)."""
        while (part := self._first(self._queues)) is not None:
            yield part

    def expedite(self, belongs: Callable[[P], bool]) -> None:
        """The waiting prefetch parts ``belongs`` picks go to the end of the load queue
        (scheduler thread), unless an I/O thread takes one meanwhile (it is running then)."""
        prefetch = self._queues[ReadyQueue.PREFETCH]
        for part in [part for part in prefetch if belongs(part)]:
            try:
                prefetch.remove(part)
            except ValueError:
                continue
            self._queues[ReadyQueue.LOAD].append(part)
