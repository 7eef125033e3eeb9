"""The file tier's capacity index: which blocks this process knows, their sizes, LRU order.

Thread-safe: every method takes the index's own lock (any caller thread of the backend). It
only decides; the backend removes the files of the victims it returns. With several writers on
one directory the bound is per process (each indexes the blocks it found, wrote or read).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvtier.keys import BlockKey
from kvtier.lru import BoundedLRU

__all__ = ["CapacityIndex"]


class CapacityIndex:
    """Bytes used and reserved under ``max_bytes`` (0: unbounded), least recently used first."""

    __slots__ = ("_lock", "_lru", "_max_bytes", "_reserved")

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: BoundedLRU[BlockKey, None] = BoundedLRU(None)
        self._reserved = 0

    @property
    def bounded(self) -> bool:
        return self._max_bytes > 0

    def gauges(self) -> dict[str, int]:
        with self._lock:
            return {"blocks": len(self._lru), "used_bytes": self._lru.total_weight,
                    "max_bytes": self._max_bytes}

    def reserve(self, size: int) -> tuple[bool, list[BlockKey]]:
        """Reserve ``size`` bytes, evicting least recently used blocks: (fits, victims)."""
        if not self._max_bytes:
            return True, []
        if size > self._max_bytes:
            return False, []
        victims: list[BlockKey] = []
        with self._lock:
            while self._lru.total_weight + self._reserved + size > self._max_bytes:
                oldest = self._lru.pop_oldest()
                if oldest is None:  # the rest is reserved by writes in flight
                    break
                victims.append(oldest.key)
            fits = self._lru.total_weight + self._reserved + size <= self._max_bytes
            if fits:
                self._reserved += size
        return fits, victims

    def release(self, reserved: int, *, key: BlockKey | None, stored: int = 0) -> None:
        """Return a reservation; with ``key``, record it as stored (``stored`` bytes, newest)."""
        with self._lock:
            if self._max_bytes:
                self._reserved -= reserved
            if key is not None:
                self._record(key, stored)

    def commit(self, stored: list[tuple[BlockKey, int]]) -> None:
        """Record a batch of published blocks (each had reserved its size) under one lock."""
        if not stored:
            return
        with self._lock:
            if self._max_bytes:
                self._reserved -= sum(size for _key, size in stored)
            # Each published block the newest, at the size it was written with (a name a
            # no-replace publish took held no file: an entry for it was stale).
            self._lru.put_many(stored, None)

    def adopt(self, key: BlockKey, size: int) -> list[BlockKey]:
        """Index a block found on disk (another writer's, or ours); the victims over capacity."""
        with self._lock:
            self._record(key, size)
            return self._shrink()

    def load(self, found: Iterable[tuple[BlockKey, int]]) -> list[BlockKey]:
        """Index the blocks of a scan, oldest first; the victims over capacity."""
        with self._lock:
            for key, size in found:
                self._lru.put(key, None, size)
            return self._shrink()

    def forget(self, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._lru.pop(key)

    def _record(self, key: BlockKey, size: int) -> None:
        if not self._lru.touch(key):
            self._lru.put(key, None, size)

    def _shrink(self) -> list[BlockKey]:
        victims: list[BlockKey] = []
        while self._max_bytes and len(self._lru) > 1 and self._lru.total_weight > self._max_bytes:
            oldest = self._lru.pop_oldest()
            if oldest is None:
                break
            victims.append(oldest.key)
        return victims
