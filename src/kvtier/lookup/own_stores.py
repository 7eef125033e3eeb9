"""Our own stores and evictions (``note_stored`` / ``note_removed``) on the scheduler side.

Owner thread: the lookup manager's scheduler thread runs every method here, unlocked, on the
state of :class:`~kvtier.lookup.manager.AsyncLookupManager` it mixes into: the per-key table
``_keys`` (``_states``, the verdict cache, ``_noted``: lookup/states.py, lookup/noted.py), the
request index (``_request_keys``, ``_last_released``), the quarantine (``_quarantine``) and the
counters (``_counters``). No other thread touches any of it.

A store is what every finished request brings, so it is cheap: the keys nobody asked for become
noted entries (no object per key), and the cached states of the request released last are
found in its small map, not by a probe of the large ``_states``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from kvtier.keys import MAX_KEY_BYTES, BlockKey, RequestContext, validate_keys
from kvtier.lookup.expiry import ExpiryMap
from kvtier.lookup.states import NOT_CACHED, KeyState, KeyTable, LookupPhase, VerdictSource
from kvtier.lookup.stats import LookupStats

__all__ = ["StoreNotes"]

_PHASE_RESOLVED: Final = LookupPhase.RESOLVED
_SOURCE_NOTED: Final = VerdictSource.NOTED
_NOT_CACHED: Final = NOT_CACHED


class StoreNotes:
    """The note side of :class:`~kvtier.lookup.manager.AsyncLookupManager` (a mixin: the
    attributes below are the manager's, set in its ``__init__``)."""

    _clock: Callable[[], float]
    _verdict_ttl_s: float
    _stored_verdict_ttl_s: float
    _keys: KeyTable
    _states: dict[BlockKey, KeyState]
    _noted: dict[BlockKey, tuple[bool, float]]
    _generations: Iterator[int]
    _request_keys: dict[str, dict[BlockKey, KeyState]]
    _last_released: dict[BlockKey, KeyState]
    _quarantine: ExpiryMap[BlockKey, None]
    _check_new_keys: bool
    _counters: LookupStats

    def _closed(self) -> bool:
        """Whether the manager was shut down (the manager's)."""
        raise NotImplementedError

    def _attach(self, key: BlockKey, state: KeyState | None, req_context: RequestContext,
                attached: dict[BlockKey, KeyState]) -> bool | None:
        """First lookup of a key that has a state or may be refused (the manager's)."""
        raise NotImplementedError

    def _note(self, keys: Iterable[BlockKey], verdict: bool) -> None:
        checked = keys if type(keys) is list else list(keys)
        # One pass validates and sorts the keys: the cached states of the request released
        # last (a finished request's stores: found in its small map, no probe of the large
        # _states; a cached state is in _states by KeyTable's invariant), and the rest.
        recent = self._last_released
        refresh: list[KeyState] = []
        rest: list[BlockKey] = []
        for key in checked:
            if key.__class__ is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
                validate_keys(checked, "keys")  # raises naming the first bad key
            state = recent.get(key)
            if state is not None and state.cache_batch != _NOT_CACHED:
                refresh.append(state)
            else:
                rest.append(key)
        if self._closed() or not checked:
            return
        ttl = self._stored_verdict_ttl_s if verdict else self._verdict_ttl_s
        expiry = self._clock() + ttl if ttl > 0 else None
        if verdict and self._check_new_keys and self._quarantine:  # False: none quarantined
            for key in checked:
                self._quarantine.pop(key)
        table, states = self._keys, self._states
        # Keys nobody asked for (with --scan stop, most of a store) become noted entries, no
        # state each; the ones with a state (held, or released by an earlier request) are set.
        held = states.keys() & rest if rest and states else ()
        if expiry is not None and len(held) < len(rest):
            table.noted.add([key for key in rest if key not in held] if held else rest,
                            verdict, expiry)
        overridden: list[KeyState] = []
        for key in held:  # sorted before any override: an override may evict a cached state
            state = states[key]
            if state.refs or state.cache_batch == _NOT_CACHED:  # held, or an orphan in flight
                overridden.append(state)
            else:
                refresh.append(state)
        for state in overridden:
            table.override(state, verdict, _SOURCE_NOTED, expiry)
        if not refresh:
            return
        if expiry is None:  # the cache is off: the released states are dropped
            for state in refresh:
                table.forget(state)
            return
        # Cached verdicts: set in place (KeyTable.override() inlined). Those in the newest
        # release batch (the request released last, as a cleanup then its stores go) stay in
        # it, which then lapses later; the others move to a new batch, the newest.
        newest = table.next_batch - 1
        moved: list[KeyState] = []
        in_place = 0
        for state in refresh:
            batch = state.cache_batch
            if batch == _NOT_CACHED:  # dropped for the bound by an override above: stays so
                continue
            state.verdict, state.source, state.cache_expiry = verdict, _SOURCE_NOTED, expiry
            if batch == newest:
                in_place += 1
            else:
                moved.append(state)
        if in_place:
            table.extend_newest(expiry)
        if moved:
            batch_id = table.next_batch
            table.next_batch += 1
            for state in moved:
                state.cache_batch = batch_id
            table.add_batch(batch_id, moved, 0, expiry)

    def _reuse_noted(self, key: BlockKey, req_context: RequestContext,
                     attached: dict[BlockKey, KeyState]) -> bool | None:
        """First lookup of a key whose last news is our own note: a cached verdict while it is
        live (it becomes the key's state), else a new key."""
        verdict, expiry = self._noted.pop(key)
        if self._clock() >= expiry:
            return self._attach(key, None, req_context, attached)
        state = KeyState(key, next(self._generations), _PHASE_RESOLVED, 1, verdict,
                         _SOURCE_NOTED, math.inf, expiry)
        self._states[key] = state
        if not attached:
            self._request_keys[req_context.req_id] = attached
        attached[key] = state
        self._counters.verdict_cache_hits += 1
        return verdict
