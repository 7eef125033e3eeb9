"""An expiry map: entries that lapse at a fixed time, bounded by :class:`~kvtier.lru.BoundedLRU`.

Owner thread: the lookup manager's scheduler thread (the verdict cache and the quarantine are
two instances); nothing is locked. Entries are kept in the order they were last put (oldest
first): the bound drops the least recently put entries and counts them in ``evictions``;
``sweep`` drops lapsed entries from the oldest end and stops at the first live one, so it is
exact when every entry lives equally long (the quarantine) and lazy otherwise (a cached
verdict's expiry is checked again when it is read).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from kvtier.lru import BoundedLRU

__all__ = ["ExpiryMap"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ExpiryMap(Generic[K, V]):
    """``key -> (value, expiry)``, at most ``capacity`` entries; an entry is live while
    ``now < expiry``."""

    __slots__ = ("_lru", "evictions")

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ExpiryMap capacity must be an int >= 1, got {capacity!r}")
        self._lru: BoundedLRU[K, tuple[V, float]] = BoundedLRU(capacity)
        self.evictions = 0  # entries dropped for the bound, ever (clear() keeps the count)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def put(self, key: K, value: V, expiry: float) -> list[V]:
        """Insert or replace ``key`` as the newest entry; return the values evicted for the
        bound (oldest first)."""
        evicted = self._lru.put(key, (value, expiry))
        if not evicted:  # the common case: no list to build
            return []
        self.evictions += len(evicted)
        return [entry.value[0] for entry in evicted]

    def get(self, key: K) -> V | None:
        """The value, live or lapsed (see :meth:`expiry`), without changing its age."""
        entry = self._lru.get(key)
        return None if entry is None else entry[0]

    def expiry(self, key: K) -> float | None:
        """When ``key`` lapses; None when it has no entry."""
        entry = self._lru.get(key)
        return None if entry is None else entry[1]

    def pop(self, key: K) -> V | None:
        entry = self._lru.pop(key)
        return None if entry is None else entry[0]

    def sweep(self, now: float) -> list[V]:
        """Drop lapsed entries from the oldest end, up to the first live one; return them."""
        lapsed: list[K] = []
        for key, (_value, expiry) in self._lru.items():
            if expiry > now:
                break
            lapsed.append(key)
        dropped: list[V] = []
        for key in lapsed:
            entry = self._lru.pop(key)
            if entry is not None:
                dropped.append(entry[0])
        return dropped

    def clear(self) -> None:
        self._lru.clear()
