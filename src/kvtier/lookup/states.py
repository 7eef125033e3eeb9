"""The lookup manager's per-key table: one :class:`KeyState` per key, and the verdict cache.

Owner thread: the manager's scheduler thread owns the whole :class:`KeyTable` (``states``, the
verdict cache: its release batches, counts and eviction count, ``noted``; the generation
counter); nothing is locked. A released state (``refs == 0``) whose verdict is cacheable stays
in ``states`` as a cached verdict (its ``cache_batch`` names the release batch it is in; its
``cache_expiry`` is when it lapses), until it lapses, is evicted for the bound, is read again by
a new request, or is overridden. So a state in ``states`` with ``refs == 0`` is either cached
(RESOLVED) or an orphan probe still in flight; nothing else is kept.

Releasing is what every finished request does for every key it asked, so the cache costs no
dict per release: the states released together (one ``cleanup``, one ``note_stored``) are one
batch, a list appended to a queue in release order. A state released again later is in the
newer batch only (``cache_batch`` says which); its place in the older one is dead and skipped.
A note of states that are in the newest batch (the stores of the request released last) sets
them where they are and moves that batch's lapse time, so it leaves no dead places.

A verdict from our own store or eviction (``note_stored`` / ``note_removed``) for a key that no
request holds is not a state: it is one entry in ``noted`` (lookup/noted.py), so a store costs
no object per key. A key is in ``states`` or in ``noted``, never in both: the manager turns a
noted entry into a state when a request asks for the key, and a note of a key that has a state
updates that state. The cached states and ``noted`` together are the verdict cache, bounded by
``capacity`` entries.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Final

from kvtier.keys import BlockKey
from kvtier.lookup.noted import NotedVerdicts

__all__ = ["NOT_CACHED", "KeyState", "KeyTable", "LookupPhase", "VerdictSource"]


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


NOT_CACHED: Final = -1  # KeyState.cache_batch of a state that is not a cached verdict
_COMPACT_SLACK: Final = 64  # dead places the release batches may hold beyond twice the live

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
    cache_batch: int = NOT_CACHED  # the release batch holding it while it is a cached verdict

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

    The cache is the released states (``cached`` of them, in release batches, oldest first;
    the manager's hot path and ``cleanup`` read and write ``cache_batch`` and ``cached``
    directly) and ``noted`` (verdicts of our own stores and evictions for keys without a state,
    in note order). A bound of ``capacity`` entries in all drops, of the two oldest entries, the
    one that lapses first (a probed verdict before a noted one on a tie), counted in
    ``evictions``; ``sweep`` drops the batches that lapsed from the oldest end of each and stops
    at the first live one (a lapsed entry further in is caught when it is read).
    """

    __slots__ = ("_queued", "batches", "cached", "capacity", "evictions", "generations",
                 "next_batch", "noted", "states")

    def __init__(self, max_cached_verdicts: int) -> None:
        if (isinstance(max_cached_verdicts, bool) or not isinstance(max_cached_verdicts, int)
                or max_cached_verdicts < 1):
            raise ValueError(
                f"max_cached_verdicts must be an int >= 1, got {max_cached_verdicts!r}")
        self.states: dict[BlockKey, KeyState] = {}
        self.cached = 0  # states that are cached verdicts now
        # per release batch: when all of it has lapsed, its id, its states (newest last)
        self.batches: deque[tuple[float, int, list[KeyState]]] = deque()
        self._queued = 0  # places in batches, live or dead
        self.next_batch = 0  # the id of the next release batch
        self.noted = NotedVerdicts()
        self.capacity = max_cached_verdicts
        self.evictions = 0  # entries dropped for the bound, ever (clear() keeps the count)
        self.generations = itertools.count()  # next(generations): a fresh generation

    @property
    def cached_count(self) -> int:
        """Entries in the verdict cache (released states and noted verdicts)."""
        return self.cached + len(self.noted)

    @property
    def queued(self) -> int:
        """Places in the release batches, live or dead (bounded: dead ones are compacted)."""
        return self._queued

    @property
    def tracked(self) -> int:
        """Live states (cached verdicts not counted)."""
        return len(self.states) - self.cached

    def is_cached(self, key: BlockKey) -> bool:
        """Whether ``key``'s state is a cached verdict (a noted entry is not a state)."""
        state = self.states.get(key)
        return state is not None and state.cache_batch != NOT_CACHED

    def supersede(self, state: KeyState) -> None:
        """A new generation: whatever the worker still answers for the old one is stale."""
        state.generation = next(self.generations)

    def add_batch(self, batch_id: int, states: list[KeyState], newly_cached: int,
                  lapses_at: float) -> None:
        """``states`` (each with ``cache_batch == batch_id``, ``next_batch`` taken) are the
        newest cached verdicts, ``newly_cached`` of them not cached before; every one lapses at
        ``lapses_at`` at the latest. Then the bound is kept."""
        self.batches.append((lapses_at, batch_id, states))
        self._queued += len(states)
        self.cached += newly_cached
        if self._queued > 2 * self.cached + _COMPACT_SLACK:
            self._compact()
        if self.cached + len(self.noted.entries) > self.capacity:
            self.evict_over_capacity()

    def extend_newest(self, lapses_at: float) -> None:
        """States of the newest release batch were set again in place (with a later expiry):
        the batch lapses at ``lapses_at`` at the latest now. A state whose ``cache_batch`` is
        the newest id is in it, so the batch is there."""
        old_lapse, batch_id, members = self.batches[-1]
        if lapses_at > old_lapse:
            self.batches[-1] = (lapses_at, batch_id, members)

    def release(self, state: KeyState) -> None:
        """Nobody holds ``state`` and no probe of it is in flight: cache its verdict or drop it."""
        expiry = state.cache_expiry
        if expiry is None:
            self.forget(state)
            return
        newly = state.cache_batch == NOT_CACHED  # a re-release (override) becomes the newest
        state.cache_batch = batch_id = self.next_batch
        self.next_batch += 1
        self.add_batch(batch_id, [state], int(newly), expiry)

    def evict_over_capacity(self) -> None:
        """Drop the oldest entries until the bound holds: of the oldest released state and the
        oldest noted verdict, the one that lapses first."""
        noted, batches = self.noted, self.batches
        while self.cached + len(noted) > self.capacity:
            oldest_noted = noted.oldest_expiry()
            if (oldest_noted is not None and (not self.cached or batches[0][0] > oldest_noted)
                    and noted.drop_oldest()):
                self.evictions += 1
                continue
            if not self._drop_oldest_cached():
                return  # nothing left to drop (cannot happen while the counts are right)
            self.evictions += 1

    def _drop_oldest_cached(self) -> bool:
        batches, states = self.batches, self.states
        while batches:
            _, batch_id, members = batches[0]
            while members:
                state = members.pop()
                self._queued -= 1
                if state.cache_batch == batch_id:
                    self._uncache(state)
                    if states.get(state.key) is state:
                        del states[state.key]
                    return True
            batches.popleft()
        return False

    def _uncache(self, state: KeyState) -> None:
        state.cache_batch = NOT_CACHED
        self.cached -= 1

    def forget(self, state: KeyState) -> None:
        """Drop a state that nobody holds, and its cache entry."""
        if state.cache_batch != NOT_CACHED:
            self._uncache(state)
        if self.states.get(state.key) is state:
            del self.states[state.key]

    def reuse_cached(self, state: KeyState, now: float) -> bool:
        """A new request reads a cached verdict: True (taken out of the cache) while it is
        live; False when it lapsed (the state is forgotten)."""
        expiry = state.cache_expiry
        if expiry is None or now >= expiry or state.cache_batch == NOT_CACHED:
            self.forget(state)
            return False
        self._uncache(state)
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

    def lapsed_first(self, now: float) -> bool:
        """Whether the oldest release batch or note lapsed (one test each, so that a flush with
        nothing to sweep costs no pass)."""
        batches, notes = self.batches, self.noted.batches
        return bool((batches and batches[0][0] <= now) or (notes and notes[0][0][1] <= now))

    def sweep(self, now: float) -> None:
        """Drop the batches and notes that lapsed, oldest first, up to the first live one."""
        self.noted.sweep(now)
        batches, states = self.batches, self.states
        dropped = 0
        while batches and batches[0][0] <= now:
            _, batch_id, members = batches.popleft()
            self._queued -= len(members)
            for state in members:
                if state.cache_batch == batch_id:
                    state.cache_batch = NOT_CACHED
                    dropped += 1
                    # One probe of the large dict, not two: a cached state is the key's entry
                    # (put back what is not, as forget() would leave it).
                    entry = states.pop(state.key, None)
                    if entry is not state and entry is not None:
                        states[state.key] = entry
        self.cached -= dropped

    def clear(self) -> None:
        self.states.clear()
        self.batches.clear()
        self._queued = self.cached = 0
        self.noted.clear()

    def _compact(self) -> None:
        """Drop the dead places from the release batches (amortised: at most once per as many
        releases as there are cached states, plus a slack)."""
        kept: deque[tuple[float, int, list[KeyState]]] = deque()
        for lapses_at, batch_id, members in self.batches:
            live = [state for state in members if state.cache_batch == batch_id]
            if live:
                kept.append((lapses_at, batch_id, live))
        self.batches = kept
        self._queued = sum(len(members) for _, _, members in kept)
