"""The tier's lookup side: its backend-probing lookup manager and its recent load failures.

Thread ownership: :class:`BackendLookupManager` is an
:class:`~kvtier.lookup.manager.AsyncLookupManager` (its scheduler-side state belongs to the
scheduler thread; :meth:`BackendLookupManager.batch_lookup` runs on its probe worker, which
calls ``backend.probe`` and observes its duration through ``metrics``, thread-safe).
:class:`RecentLoadFailures` (the tier's ``_load_failures``) belongs to the **scheduler thread**.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvtier.backends.base import Backend
from kvtier.keys import BlockKey, RequestContext
from kvtier.lookup.manager import AsyncLookupManager
from kvtier.lru import BoundedLRU
from kvtier.ops.metrics import ProbeMetrics

__all__ = ["BackendLookupManager", "RecentLoadFailures"]


class BackendLookupManager(AsyncLookupManager):
    """The tier's lookup manager: one ``backend.probe`` call per probe batch.

    ``probe`` raises when the medium fails (where ``exists`` would answer False), so the lookup
    manager counts the failure as a probe error, never caches it, and feeds its circuit breaker.
    """

    def __init__(self, tier_name: str, backend: Backend, metrics: ProbeMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 options: Mapping[str, Any] | None = None) -> None:
        self._backend = backend
        self._observe_probe = None if metrics is None else metrics.probe_observer(tier_name)
        super().__init__(tier_name, clock=clock, **(options or {}))

    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        started = time.perf_counter()
        try:
            return self._backend.probe(keys)
        finally:
            if self._observe_probe is not None:
                self._observe_probe(time.perf_counter() - started)


class RecentLoadFailures:
    """Keys whose load from one tier failed recently; owned by the scheduler thread.

    ``put_many`` answers True both for "written" and for "already present", so a store of a key
    whose load just failed proves nothing by itself: the backend may be keeping the very object
    that could not be loaded (a file that stats but cannot be read; a frame of another size or
    a corrupt one is removed by the failed load, so the store does write it again). Lifting the
    key's quarantine with ``note_stored`` then would restart the same doomed
    promotion for every later request, the livelock class. So a store job of such a key reads
    the object back on its I/O thread (a full, verified ``get``): when the read-back succeeds
    the tier really holds a good block again and the quarantine is lifted (:meth:`discard`);
    when it fails (the damaged object is still there) the key stays quarantined until it ends.
    """

    __slots__ = ("_clock", "_hold_s", "_until")

    def __init__(self, hold_s: float, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 65536) -> None:
        self._hold_s = hold_s
        self._clock = clock
        self._until: BoundedLRU[BlockKey, float] = BoundedLRU(max_keys)  # in expiry order

    def __len__(self) -> int:
        return len(self._until)

    def add(self, keys: Iterable[BlockKey]) -> None:
        if self._hold_s <= 0:
            return
        until = self._clock() + self._hold_s
        for key in keys:
            self._until.put(key, until)

    def without(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """``keys`` less those whose load failed within the hold time."""
        if not self._until:
            return list(keys)
        now = self._clock()
        while self._until:
            oldest = next(iter(self._until))
            until = self._until.get(oldest)
            if until is not None and until > now:
                break
            self._until.pop(oldest)
        return [key for key in keys if key not in self._until]

    def contains(self, key: BlockKey) -> bool:
        return key in self._until

    def discard(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self._until.pop(key)
