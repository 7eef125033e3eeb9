"""The parts of a tier's transfer jobs waiting for an I/O thread: three queues, taken in order.

Thread ownership: the **scheduler thread** appends parts (:meth:`ReadyParts.push`) and moves a
prefetch part to the demand queue (:meth:`ReadyParts.expedite`); the tier's **I/O threads** pop
them (:meth:`ReadyParts.pop`). Every deque operation is atomic, so each part is popped exactly
once, by whichever thread gets it first.
"""

from __future__ import annotations

import enum
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
    """Waiting parts by :class:`ReadyQueue`."""

    __slots__ = ("_queues",)

    def __init__(self) -> None:
        self._queues: tuple[deque[P], ...] = tuple(deque() for _ in ReadyQueue)

    def push(self, queue: ReadyQueue, parts: Iterable[P]) -> None:
        self._queues[queue].extend(parts)

    def pop(self) -> P | None:
        """The oldest part of the first queue that has one (I/O thread); None if none waits."""
        for waiting in self._queues:
            try:
                return waiting.popleft()
            except IndexError:
                continue
        return None

    def drain(self) -> Iterator[P]:
        """Pop every waiting part (the executor is gone: their jobs fail)."""
        while (part := self.pop()) is not None:
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
