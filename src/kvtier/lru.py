"""A bounded least-recently-used map: the one place where kvtier drops the oldest entries.

Not thread-safe: its owner is whoever holds the map (the scheduler thread for lookup and
tiering tables; a backend's own lock for its index). Each entry has a weight (1 by default:
a bound on the number of entries; a byte size: a bound on bytes). ``put`` and ``trim`` evict
oldest-first until the total weight fits and return what they evicted, so the caller can
count it or release what the entries held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["BoundedLRU", "Evicted"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True, frozen=True)
class Evicted(Generic[K, V]):
    key: K
    value: V
    weight: int


class BoundedLRU(Generic[K, V]):
    """Oldest-first eviction once the summed weights exceed ``capacity`` (``None``: unbounded)."""

    __slots__ = ("_capacity", "_entries", "_total")

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"BoundedLRU capacity must be >= 0 or None, got {capacity!r}")
        self._capacity = capacity
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._total = 0

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def total_weight(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value without changing its age."""
        entry = self._entries.get(key)
        return default if entry is None else entry[0]

    def touch(self, key: K) -> bool:
        """Make ``key`` the newest entry; False when it is absent."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def put(self, key: K, value: V, weight: int = 1) -> list[Evicted[K, V]]:
        """Insert or replace ``key`` as the newest entry, then evict down to the capacity.

        The new entry itself is never evicted by its own ``put`` while others remain.
        """
        if weight < 0:
            raise ValueError(f"BoundedLRU weight must be >= 0, got {weight!r}")
        old = self._entries.pop(key, None)
        if old is not None:
            self._total -= old[1]
        self._entries[key] = (value, weight)
        self._total += weight
        return self._evict(keep=1)

    def put_many(self, entries: Iterable[tuple[K, int]], value: V) -> list[Evicted[K, V]]:
        """:meth:`put` of each ``(key, weight)`` with ``value``, in order (the last newest), in
        one loop, then one eviction pass that keeps the newest entry."""
        table = self._entries
        total = self._total
        try:
            for key, weight in entries:
                if weight < 0:
                    raise ValueError(f"BoundedLRU weight must be >= 0, got {weight!r}")
                old = table.pop(key, None)
                if old is not None:
                    total -= old[1]
                table[key] = (value, weight)
                total += weight
        finally:
            self._total = total
        return self._evict(keep=1)

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._total -= entry[1]
        return entry[0]

    def pop_oldest(self) -> Evicted[K, V] | None:
        if not self._entries:
            return None
        key, (value, weight) = self._entries.popitem(last=False)
        self._total -= weight
        return Evicted(key, value, weight)

    def trim(self, capacity: int | None = None, *, keep: int = 0) -> list[Evicted[K, V]]:
        """Evict oldest-first until the total fits ``capacity`` (default: the map's own),
        keeping at least ``keep`` entries."""
        if capacity is not None:
            self._capacity = capacity
        return self._evict(keep=keep)

    def clear(self) -> None:
        self._entries.clear()
        self._total = 0

    def items(self) -> Iterator[tuple[K, V]]:
        for key, (value, _weight) in self._entries.items():
            yield key, value

    def _evict(self, *, keep: int) -> list[Evicted[K, V]]:
        evicted: list[Evicted[K, V]] = []
        if self._capacity is None:
            return evicted
        while self._total > self._capacity and len(self._entries) > keep:
            oldest = self.pop_oldest()
            if oldest is None:
                break
            evicted.append(oldest)
        return evicted
