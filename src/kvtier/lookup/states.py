"""The lookup manager's per-key table: one :class:`KeyState` per key, and the verdict cache.

Owner thread: the manager's scheduler thread owns the whole :class:`KeyTable` (``states``, the
verdict cache ``cached``, its eviction count, the generation counter); nothing is locked. A
released state (``refs == 0``) whose verdict is cacheable stays in ``states`` and is also the
value of its entry in ``cached`` (oldest release first; the state's ``cache_expiry`` is the
entry's expiry), until it lapses, is evicted for the bound, is read again by a new request, or
is overridden. So a state in ``states`` with ``refs == 0`` is either cached (RESOLVED) or an
orphan probe still in flight; nothing else is kept.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from kvtier.keys import BlockKey

__all__ = ["KeyState", "KeyTable", "LookupPhase", "VerdictSource"]


class LookupPhase(enum.Enum):
    """Lifecycle of one key's probe."""

    PENDING = "pending"  # looked up this step, waiting for the next flush
    IN_FLIGHT = "in_flight"  # handed to the probe worker, no answer applied yet
    RESOLVED = "resolved"  # a verdict is known


class VerdictSource(enum.Enum):
    """Where a resolved verdict came from; only BACKEND and NOTED verdicts are ever cached."""

    BACKEND = "backend"
    NOTED = "noted"  # note_stored / note_removed
    FAULT = "fault"  # probe error, malformed result, timeout, breaker short-circuit
    MISS_MARKED = "miss_marked"  # mark_miss / quarantine


_PHASE_PENDING: Final = LookupPhase.PENDING
_PHASE_RESOLVED: Final = LookupPhase.RESOLVED


@dataclass(slots=True, eq=False)
class KeyState:
    """One key's probe and verdict. ``refs``: requests holding it (each request's map in the
    manager points here)."""

    key: BlockKey
    generation: int
    phase: LookupPhase
    refs: int = 1
    verdict: bool | None = None
    source: VerdictSource | None = None
    deadline: float = math.inf  # when an IN_FLIGHT probe times out
    cache_expiry: float | None = None  # fixed when the verdict was answered; None = not cacheable

    def resolve(self, verdict: bool, source: VerdictSource, cache_expiry: float | None) -> None:
        self.phase = _PHASE_RESOLVED
        self.verdict = verdict
        self.source = source
        self.cache_expiry = cache_expiry

    def restart(self, generation: int) -> None:
        """Probe again under a new generation (the old one's answers become stale)."""
        self.generation = generation
        self.phase = _PHASE_PENDING
        self.verdict = self.source = self.cache_expiry = None
        self.deadline = math.inf


class KeyTable:
    """``states`` (key -> its one live or cached :class:`KeyState`) and the verdict cache.

    The cache is an ``OrderedDict`` of states in release order, read by the manager's hot path
    directly (C calls, no wrapper): a bound of ``capacity`` entries drops the least recently
    released first (counted in ``evictions``); ``sweep`` drops lapsed entries from the oldest
    end and stops at the first live one (a lapsed entry further in is caught when it is read).
    """

    __slots__ = ("cached", "capacity", "evictions", "generations", "states")

    def __init__(self, max_cached_verdicts: int) -> None:
        if (isinstance(max_cached_verdicts, bool) or not isinstance(max_cached_verdicts, int)
                or max_cached_verdicts < 1):
            raise ValueError(
                f"max_cached_verdicts must be an int >= 1, got {max_cached_verdicts!r}")
        self.states: dict[BlockKey, KeyState] = {}
        self.cached: OrderedDict[BlockKey, KeyState] = OrderedDict()
        self.capacity = max_cached_verdicts
        self.evictions = 0  # entries dropped for the bound, ever (clear() keeps the count)
        self.generations = itertools.count()  # next(generations): a fresh generation

    @property
    def tracked(self) -> int:
        """Live states (cached verdicts not counted)."""
        return len(self.states) - len(self.cached)

    def supersede(self, state: KeyState) -> None:
        """A new generation: whatever the worker still answers for the old one is stale."""
        state.generation = next(self.generations)

    def release(self, state: KeyState) -> None:
        """Nobody holds ``state`` and no probe of it is in flight: cache its verdict or drop it."""
        if state.cache_expiry is None:
            self.forget(state)
            return
        cached = self.cached
        key = state.key
        cached.pop(key, None)  # a re-release (override of a cached state) becomes the newest
        cached[key] = state
        if len(cached) > self.capacity:
            self.evict_over_capacity()

    def evict_over_capacity(self) -> None:
        """Drop the least recently released entries until the bound holds."""
        cached, states, capacity = self.cached, self.states, self.capacity
        while len(cached) > capacity:
            key, state = cached.popitem(last=False)
            self.evictions += 1
            if states.get(key) is state:
                del states[key]

    def forget(self, state: KeyState) -> None:
        """Drop a state that nobody holds, and its cache entry."""
        key = state.key
        if self.cached.get(key) is state:
            del self.cached[key]
        if self.states.get(key) is state:
            del self.states[key]

    def reuse_cached(self, state: KeyState, now: float) -> bool:
        """A new request reads a cached verdict: True (taken out of the cache) while it is
        live; False when it lapsed (the state is forgotten)."""
        expiry = state.cache_expiry
        if expiry is None or now >= expiry or self.cached.get(state.key) is not state:
            self.forget(state)
            return False
        del self.cached[state.key]
        return True

    def override(self, state: KeyState, verdict: bool, source: VerdictSource,
                 cache_expiry: float | None) -> None:
        """Set a verdict now (note_*, mark_miss), superseding a probe still running."""
        if state.phase is not _PHASE_RESOLVED:
            state.generation = next(self.generations)
            state.phase = _PHASE_RESOLVED
        state.verdict = verdict
        state.source = source
        state.cache_expiry = cache_expiry
        if not state.refs:  # unclaimed (in flight or cached): nothing waits for it
            self.release(state)

    def sweep(self, now: float) -> None:
        """Drop lapsed entries from the oldest end, up to the first live one."""
        cached, states = self.cached, self.states
        while cached:
            state = next(iter(cached.values()))
            expiry = state.cache_expiry
            if expiry is not None and expiry > now:
                return
            del cached[state.key]
            if states.get(state.key) is state:
                del states[state.key]

    def clear(self) -> None:
        self.states.clear()
        self.cached.clear()
