"""The lookup manager's per-key table: one :class:`KeyState` per key, and the verdict cache.

Owner thread: the manager's scheduler thread owns the whole :class:`KeyTable` (``states``, the
verdict cache ``verdicts``, the generation counter); nothing is locked. A released state
(``refs == 0``) whose verdict is cacheable stays in ``states`` and is also the value of its
entry in ``verdicts`` (an :class:`~kvtier.lookup.expiry.ExpiryMap` in release order), until it
lapses, is evicted for the bound, is read again by a new request, or is overridden.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass
from typing import Final

from kvtier.keys import BlockKey
from kvtier.lookup.expiry import ExpiryMap

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
    """``states`` (key -> its one live or cached :class:`KeyState`) and the verdict cache."""

    __slots__ = ("generations", "states", "verdicts")

    def __init__(self, max_cached_verdicts: int) -> None:
        self.states: dict[BlockKey, KeyState] = {}
        self.verdicts: ExpiryMap[BlockKey, KeyState] = ExpiryMap(max_cached_verdicts)
        self.generations = itertools.count()  # next(generations): a fresh generation

    @property
    def tracked(self) -> int:
        """Live states (cached verdicts not counted)."""
        return len(self.states) - len(self.verdicts)

    def supersede(self, state: KeyState) -> None:
        """A new generation: whatever the worker still answers for the old one is stale."""
        state.generation = next(self.generations)

    def release(self, state: KeyState) -> None:
        """Nobody holds ``state`` and no probe of it is in flight: cache its verdict or drop it."""
        expiry = state.cache_expiry
        if expiry is None:
            self.forget(state)
            return
        for evicted in self.verdicts.put(state.key, state, expiry):
            self._drop(evicted)

    def forget(self, state: KeyState) -> None:
        """Drop a state that nobody holds, and its cache entry."""
        if self.verdicts.get(state.key) is state:
            self.verdicts.pop(state.key)
        self._drop(state)

    def reuse_cached(self, state: KeyState, now: float) -> bool:
        """A new request reads a cached verdict: True (taken out of the cache) while it is
        live; False when it lapsed (the state is forgotten)."""
        expiry = self.verdicts.expiry(state.key)
        if expiry is None or now >= expiry:
            self.forget(state)
            return False
        self.verdicts.pop(state.key)
        return True

    def override(self, state: KeyState, verdict: bool, source: VerdictSource,
                 cache_expiry: float | None) -> None:
        """Set a verdict now (note_*, mark_miss), superseding a probe still running."""
        if state.phase is not _PHASE_RESOLVED:
            self.supersede(state)
        state.resolve(verdict, source, cache_expiry)
        if not state.refs:  # unclaimed (in flight or cached): nothing waits for it
            self.release(state)

    def sweep(self, now: float) -> None:
        for state in self.verdicts.sweep(now):
            self._drop(state)

    def clear(self) -> None:
        self.states.clear()
        self.verdicts.clear()

    def _drop(self, state: KeyState) -> None:
        if self.states.get(state.key) is state:
            del self.states[state.key]
