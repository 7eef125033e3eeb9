"""The asynchronous, deduplicating lookup manager: "is this block in the slow tier?" without I/O.

Owner threads:

* **Scheduler thread** (the *owner*: the first thread that calls ``lookup``, ``flush``,
  ``drain_results``, ``cleanup``, ``mark_miss``, ``note_stored`` or ``note_removed``; a call from
  any other thread raises :class:`OwnerThreadError` before touching anything) owns, unlocked:
  the per-key table ``_keys`` (states and verdict cache, lookup/states.py; ``_states`` and
  ``_noted`` are its dicts), the request index (``_request_keys``, ``_cur_req_id`` /
  ``_cur_attached``: the request being scanned; ``_last_released``: the map of the request
  released last, whose stores ``note_stored`` then finds without a probe of ``_states``), the keys
  waiting for the next flush (``_pending``), the submitted batches and their deadlines
  (``_inflight_batches``, ``_next_batch_id``), the quarantine (``_quarantine``, an
  :class:`~kvtier.lookup.expiry.ExpiryMap`), the breaker (``_breaker``), the counters and logs
  (``_counters``, ``_lookup_count``, ``_logs``) and the lifecycle (``_lifecycle``, ``_gate``).
  ``shutdown`` may come from any thread once the owner stopped calling.
* **Probe worker thread** (``_worker``, lookup/worker.py) owns only its locals and its logs; it
  talks to the scheduler through two ``queue.SimpleQueue`` (the results one is also
  ``_results``, the scheduler's handle) and a posted-results count under a condition, which
  only ``wait_for_probes`` / ``_wait_for_results`` wait on.

Applying the worker's results and timing out stuck batches: lookup/results.py (a mixin);
applying our own stores and evictions (``note_stored`` / ``note_removed``): lookup/own_stores.py.

The settings table lives in lookup/settings.py and is re-exported here.
"""

from __future__ import annotations

import abc
import enum
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from typing import Final

from kvtier.backends.stats import RateLimitedLog
from kvtier.errors import ClosedError, KvtierError
from kvtier.keys import MAX_KEY_BYTES, BlockKey, RequestContext, check_key, validate_keys
from kvtier.lookup.breaker import BreakerState, CircuitBreaker
from kvtier.lookup.expiry import ExpiryMap
from kvtier.lookup.own_stores import StoreNotes
from kvtier.lookup.results import InFlightBatch, ProbeResults
from kvtier.lookup.settings import LOOKUP_SETTINGS
from kvtier.lookup.states import NOT_CACHED, KeyState, KeyTable, LookupPhase, VerdictSource
from kvtier.lookup.stats import LookupStats
from kvtier.lookup.worker import Entry, ProbeBatch, ProbeWorker, rate_limited_logs

__all__ = [
    "LOOKUP_SETTINGS",
    "AsyncLookupManager",
    "BreakerState",
    "LookupManagerClosedError",
    "LookupPhase",
    "LookupStats",
    "OwnerThreadError",
]

_log = logging.getLogger("kvtier.lookup.manager")

_DEFAULT_SCOPE: Final = None
_get_ident: Final = threading.get_ident

LookupManagerClosedError = ClosedError  # the one closed error; this name is kept for callers


class OwnerThreadError(KvtierError, RuntimeError):
    """A scheduler-side method was called from a thread other than the manager's owner thread.

    The contract: ``lookup``, ``flush``, ``drain_results``, ``cleanup``, ``mark_miss``,
    ``note_stored`` and ``note_removed`` belong to one thread (the engine's scheduler thread, the
    first one to call any of them). The call is refused before it changes any state.
    """


class _Lifecycle(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"


class _Gate(enum.Enum):
    """What ``lookup`` must do before serving: a single identity test on the hot path."""

    READY = "ready"
    DRAIN_FIRST = "drain_first"  # a flush happened since the last drain
    CLOSED = "closed"


# Enum members as module constants: in Python 3.11 `Enum.MEMBER` costs ~150 ns per access,
# far more than the whole hot path of lookup() may spend.
_PHASE_PENDING: Final = LookupPhase.PENDING
_PHASE_IN_FLIGHT: Final = LookupPhase.IN_FLIGHT
_PHASE_RESOLVED: Final = LookupPhase.RESOLVED
_BREAKER_CLOSED: Final = BreakerState.CLOSED
_LIFECYCLE_RUNNING: Final = _Lifecycle.RUNNING
_LIFECYCLE_CLOSED: Final = _Lifecycle.CLOSED
_GATE_READY: Final = _Gate.READY
_GATE_DRAIN_FIRST: Final = _Gate.DRAIN_FIRST
_GATE_CLOSED: Final = _Gate.CLOSED
_SOURCE_NOTED: Final = VerdictSource.NOTED
_SOURCE_FAULT: Final = VerdictSource.FAULT
_SOURCE_MISS_MARKED: Final = VerdictSource.MISS_MARKED
_NOT_CACHED: Final = NOT_CACHED


def _check_number(name: str, value: object, *, minimum: float, maximum: float = math.inf,
                  minimum_inclusive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    too_small = number < minimum if minimum_inclusive else number <= minimum
    if math.isnan(number) or too_small or number > maximum:
        low = "[" if minimum_inclusive else "("
        raise ValueError(f"{name} must be in {low}{minimum:g}, {maximum:g}], got {value!r}")
    return number


def _checked_keys(keys: Iterable[BlockKey]) -> list[BlockKey]:
    """``keys`` as a list of block keys; one type and length test per key on the good path,
    :func:`~kvtier.keys.validate_keys` (which names the first bad key) otherwise."""
    checked = keys if type(keys) is list else list(keys)
    for key in checked:
        if key.__class__ is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            return validate_keys(checked, "keys")
    return checked


def _not_a_context(req_context: object) -> TypeError:
    return TypeError(f"req_context must be a RequestContext, got {type(req_context).__name__}")


def _closed_error(tier_name: str, operation: str) -> ClosedError:
    return LookupManagerClosedError(
        f"lookup manager for tier {tier_name!r} is shut down; {operation}() is not allowed any more"
    )


class AsyncLookupManager(StoreNotes, ProbeResults, abc.ABC):
    """Non-blocking, deduplicating existence probes for one slow tier.

    Subclasses implement :meth:`batch_lookup` (called on the probe worker thread) and may
    override :meth:`lookup_scope`. Every other method is for the scheduler thread only (the
    owner thread, see :class:`OwnerThreadError`); none of them blocks on I/O.

    Per engine step the scheduler calls :meth:`lookup` for the keys it needs (True present,
    False absent, None "ask again next step"), then :meth:`flush` once. The flush hands every
    new key of the step to the worker as one batch; the worker unions them across requests and
    calls :meth:`batch_lookup` once per lookup scope, in chunks of at most ``max_batch_keys``.

    The settings, their defaults, bounds and meaning are :data:`LOOKUP_SETTINGS`
    (``probe_timeout_s=5.0``, ``verdict_ttl_s=2.0``, ``stored_verdict_ttl_s=300.0``,
    ``max_cached_verdicts=65536``,
    ``quarantine_s=30.0``, ``max_batch_keys=1024``, ``breaker_threshold=5``,
    ``breaker_cooldown_s=10.0``); a bad value raises :class:`~kvtier.settings.ConfigError`.
    ``clock=time.monotonic``: every time decision uses it.

    Cost model: ``lookup`` of a key the calling request already holds is one identity test (the
    request being scanned) and one dict lookup, and reads no clock. The clock is read once per
    flush, and in ``lookup`` only on slow paths: a verdict-cache hit (its expiry), the
    quarantine and breaker checks of a new key, and a key still in flight (its deadline) — so a
    probe's timeout is detected at the latest at the next flush or at the next lookup of any of
    its keys. The common first lookups (a new key, a key other requests hold, a cached verdict)
    and the released-verdict paths of ``cleanup`` and ``note_stored`` make no method call per
    key. Releasing a request (``cleanup``) is one pass over its keys; a released verdict stays
    in place as the cache entry, and the stores of that request, noted next, set those entries
    where they are (in its release batch). ``flush`` costs what the step brought (new keys,
    answers, lapsed entries): each piece of upkeep with nothing to do is skipped by one test
    (the quarantine and the breaker by one between them, ``_check_new_keys``).

    Verdicts from faults (errors, malformed results, timeouts, an open breaker) are False and are
    shared by the requests attached to that key while they live, but are never cached for
    requests that arrive after the last of them finished. When several requests in different
    scopes need the same key in one step, the key is probed once, in the scope of the request
    that first asked; ``batch_lookup`` receives the context of the first request of each scope.
    """

    def __init__(
        self,
        tier_name: str,
        *,
        probe_timeout_s: float = LOOKUP_SETTINGS["probe_timeout_s"].default,
        verdict_ttl_s: float = LOOKUP_SETTINGS["verdict_ttl_s"].default,
        stored_verdict_ttl_s: float = LOOKUP_SETTINGS["stored_verdict_ttl_s"].default,
        max_cached_verdicts: int = LOOKUP_SETTINGS["max_cached_verdicts"].default,
        quarantine_s: float = LOOKUP_SETTINGS["quarantine_s"].default,
        max_batch_keys: int = LOOKUP_SETTINGS["max_batch_keys"].default,
        breaker_threshold: int = LOOKUP_SETTINGS["breaker_threshold"].default,
        breaker_cooldown_s: float = LOOKUP_SETTINGS["breaker_cooldown_s"].default,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(tier_name, str) or not tier_name:
            raise ValueError(f"tier_name must be a non-empty str, got {tier_name!r}")
        settings = LOOKUP_SETTINGS.parse({
            "probe_timeout_s": probe_timeout_s, "verdict_ttl_s": verdict_ttl_s,
            "stored_verdict_ttl_s": stored_verdict_ttl_s,
            "max_cached_verdicts": max_cached_verdicts, "quarantine_s": quarantine_s,
            "max_batch_keys": max_batch_keys, "breaker_threshold": breaker_threshold,
            "breaker_cooldown_s": breaker_cooldown_s,
        })
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self._tier_name = tier_name
        self._probe_timeout_s: float = settings["probe_timeout_s"]
        self._verdict_ttl_s: float = settings["verdict_ttl_s"]
        # Our own store is better news than a probe: it is kept at least as long, and goes
        # with the cache when the cache is off.
        self._stored_verdict_ttl_s: float = (
            max(settings["stored_verdict_ttl_s"], self._verdict_ttl_s)
            if self._verdict_ttl_s > 0 else 0.0)
        self._max_cached_verdicts: int = settings["max_cached_verdicts"]
        self._quarantine_s: float = settings["quarantine_s"]
        self._max_batch_keys: int = settings["max_batch_keys"]
        self._breaker_threshold: int = settings["breaker_threshold"]
        self._breaker_cooldown_s: float = settings["breaker_cooldown_s"]
        self._clock = clock

        # Scheduler-thread state.
        self._owner: int | None = None  # thread id, bound by the first scheduler-side call
        self._keys = KeyTable(self._max_cached_verdicts)
        self._states = self._keys.states  # the same dicts, read on the hot path
        self._noted = self._keys.noted.entries
        self._generations = self._keys.generations
        self._request_keys: dict[str, dict[BlockKey, KeyState]] = {}
        self._cur_req_id: str | None = None
        self._cur_attached: dict[BlockKey, KeyState] = {}
        # The map of the request released last: the stores that land when a request finishes
        # are of keys it asked, so _note finds their states here, not in the large _states.
        self._last_released: dict[BlockKey, KeyState] = {}
        self._pending: list[Entry] = []
        self._inflight_batches: dict[int, InFlightBatch] = {}
        self._quarantine: ExpiryMap[BlockKey, None] = ExpiryMap(self._max_cached_verdicts)
        # True whenever the quarantine has entries or the breaker is not closed (so new keys
        # take the slow path that may refuse them); set by mark_miss and the breaker's opening,
        # recomputed by the flushes while it is True (so False: nothing to sweep or check).
        self._check_new_keys = False
        self._next_batch_id = 0
        self._logs: dict[str, RateLimitedLog] = rate_limited_logs(
            clock, "timeout", "invariant", "breaker")
        self._breaker = CircuitBreaker(
            self._breaker_threshold, self._breaker_cooldown_s, on_open=self._breaker_opened,
            on_close=functools.partial(_log.info, "tier %s: circuit breaker closed", tier_name))
        self._counters = LookupStats()
        self._lookup_count = 0
        self._lifecycle = _LIFECYCLE_RUNNING
        self._gate = _GATE_READY
        # The default scope (one for every request) spares the worker a call per key.
        scoped = type(self).lookup_scope is not AsyncLookupManager.lookup_scope
        self._worker = ProbeWorker(tier_name, self.batch_lookup,
                                   self.lookup_scope if scoped else None,
                                   self._max_batch_keys, clock)
        self._results = self._worker.results  # read every step: one attribute, not two

    # ------------------------------------------------------------------ subclass API

    @abc.abstractmethod
    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        """Return, for each key, whether the tier holds it. Runs on the probe worker thread."""

    def lookup_scope(self, req_context: RequestContext) -> Hashable:
        """Keys of requests with equal scopes share one backend call (default: one scope)."""
        return _DEFAULT_SCOPE

    # ------------------------------------------------------------------ scheduler API

    @property
    def tier_name(self) -> str:
        return self._tier_name

    @property
    def quarantine_s(self) -> float:
        """How long :meth:`mark_miss` keeps a key answering False."""
        return self._quarantine_s

    def lookup(self, key: BlockKey, req_context: RequestContext) -> bool | None:
        """True present, False absent, None not yet known (ask again next step). Never blocks."""
        # The hot path of the whole manager: a scheduler calls this for every key of every
        # waiting request every step. The common cases are inlined (a method call costs about
        # as much as the rest of a call), and only slow or rare cases leave this function.
        if _get_ident() != self._owner:
            self._claim("lookup")
        if self._gate is not _GATE_READY:
            if self._lifecycle is _LIFECYCLE_CLOSED:
                raise _closed_error(self._tier_name, "lookup")
            self.drain_results()
        self._lookup_count += 1
        try:
            req_id = req_context.req_id
        except AttributeError:
            raise _not_a_context(req_context) from None
        if req_id is self._cur_req_id:  # the request being scanned (identity: the same str)
            attached = self._cur_attached
        else:  # the scan moved to another request: its map (registered at its first key)
            if not isinstance(req_context, RequestContext):
                raise _not_a_context(req_context)
            known = self._request_keys.get(req_id)
            attached = {} if known is None else known
            self._cur_req_id = req_id
            self._cur_attached = attached
        state = attached.get(key)
        if state is None:  # the first lookup of this key by this request
            state = self._states.get(key)
            if state is None:
                if key in self._noted:  # our own store or eviction, not asked since
                    return self._reuse_noted(key, req_context, attached)
                if self._check_new_keys:
                    return self._attach(key, None, req_context, attached)
                # A key nobody holds, nothing refusing new keys: start its probe.
                if key.__class__ is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
                    check_key(key)  # raises naming what was expected (or passes a subclass)
                generation = next(self._generations)
                state = self._states[key] = KeyState(key, generation, _PHASE_PENDING)
                if not attached:
                    self._request_keys[req_id] = attached
                attached[key] = state
                self._pending.append((key, generation, req_context))
                return None
            if state.refs:
                if state.source is _SOURCE_FAULT:
                    return self._reprobe_after_fault(state, req_context, attached)
                # Held by other requests: join their probe or verdict.
                if state.phase is not _PHASE_RESOLVED:
                    self._counters.inflight_reuses += 1
            elif state.phase is _PHASE_RESOLVED:
                # Nobody holds it and it is resolved: a cached verdict (KeyTable's invariant).
                expiry = state.cache_expiry
                if expiry is None or self._clock() >= expiry:
                    return self._attach(key, state, req_context, attached)  # lapsed: forget it
                if state.cache_batch == _NOT_CACHED:
                    self._violation("cached verdict of key %s is not in the cache", key.hex())
                else:  # KeyTable.reuse_cached() inlined
                    state.cache_batch = _NOT_CACHED
                    self._keys.cached -= 1
                self._counters.verdict_cache_hits += 1
            else:
                self._counters.inflight_reuses += 1  # an orphan probe in flight: adopt it
            if not attached:
                self._request_keys[req_id] = attached
            attached[key] = state
            state.refs += 1
        verdict = state.verdict
        if (verdict is None and state.phase is _PHASE_IN_FLIGHT
                and (now := self._clock()) >= state.deadline):
            return self._past_deadline(state, now)
        return verdict

    def flush(self) -> None:
        """Once per engine step: apply finished results, then send the step's new keys."""
        if _get_ident() != self._owner:
            self._claim("flush")
        if self._lifecycle is _LIFECYCLE_CLOSED:
            raise _closed_error(self._tier_name, "flush")
        now = self._clock()
        # Each piece of per-step upkeep is skipped by one test when it has nothing to do, so
        # a flush costs what the step brought (new keys, answers, lapsed entries), not a
        # pass over the manager's state.
        if not self._results.empty():
            self._drain(now)
        inflight = self._inflight_batches
        if inflight and next(iter(inflight.values())).deadline <= now:
            self._expire_timed_out(now)
        if self._keys.lapsed_first(now):
            self._keys.sweep(now)
        if self._check_new_keys:  # False: the quarantine is empty and the breaker closed
            if self._quarantine:
                self._quarantine.sweep(now)
            self._check_new_keys = (bool(self._quarantine)
                                    or self._breaker.state is not _BREAKER_CLOSED)
        self._gate = _GATE_DRAIN_FIRST
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        admit = self._breaker.admits(now)
        entries: list[Entry] = []
        states = self._states
        deadline = now + self._probe_timeout_s
        for entry in pending:
            key, generation = entry[0], entry[1]
            state = states.get(key)
            if state is None or state.generation != generation:
                continue  # removed or superseded before the flush
            if state.phase is not _PHASE_PENDING:
                self._violation("enqueue-once: key %s of generation %d is %s at flush",
                                key.hex(), generation, state.phase.name)
                continue
            if not admit:
                state.resolve(False, _SOURCE_FAULT, None)
                self._counters.breaker_short_circuits += 1
                continue
            state.phase = _PHASE_IN_FLIGHT
            state.deadline = deadline
            entries.append(entry)
        if not entries:
            return
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self._inflight_batches[batch_id] = InFlightBatch(deadline, entries)
        self._breaker.sent(batch_id)
        self._counters.probes_submitted += len(entries)
        self._worker.submit(ProbeBatch(batch_id, entries))

    def drain_results(self) -> None:
        """Apply every result the worker has posted (stale ones are dropped)."""
        if _get_ident() != self._owner:
            self._claim("drain_results")
        if self._lifecycle is _LIFECYCLE_CLOSED:
            return
        if not self._results.empty():
            self._drain(None)
        self._gate = _GATE_READY

    def cleanup(self, req_id: str) -> None:
        """The request finished: release its keys; in-flight probes stay for reuse, released
        verdicts stay as the verdict cache."""
        if _get_ident() != self._owner:
            self._claim("cleanup")
        if self._lifecycle is _LIFECYCLE_CLOSED:
            return
        if req_id == self._cur_req_id:
            self._cur_req_id = None
            self._cur_attached = {}
        attached = self._request_keys.pop(req_id, None)
        if not attached:
            return
        self._last_released = attached  # its stores are noted next (see _note)
        # KeyTable.release() inlined: this loop runs once per key of every finished request.
        # A state held until now is not in the cache; the ones cached here are one batch.
        table, states = self._keys, self._states
        batch_id = table.next_batch
        released: list[KeyState] = []
        stored_lapse = 0.0  # the latest expiry of our own stores' verdicts released here
        for state in attached.values():
            refs = state.refs - 1
            state.refs = refs
            if refs or state.phase is _PHASE_IN_FLIGHT:
                if refs < 0:
                    self._violation("request %s released key %s twice", req_id,
                                    state.key.hex())
                    state.refs = 0
                continue
            if state.cache_expiry is None:
                if states.get(state.key) is state:
                    del states[state.key]
            else:
                state.cache_batch = batch_id
                released.append(state)
                if state.cache_expiry > stored_lapse:
                    stored_lapse = state.cache_expiry
        if released:  # a probed verdict lapses at answered_at + ttl, so by now + ttl at the latest
            table.next_batch = batch_id + 1
            table.add_batch(batch_id, released, len(released),
                            max(self._clock() + self._verdict_ttl_s, stored_lapse))

    def mark_miss(self, keys: Iterable[BlockKey]) -> None:
        """A load failed: force False now and quarantine the keys for ``quarantine_s``."""
        if _get_ident() != self._owner:
            self._claim("mark_miss")
        checked = _checked_keys(keys)
        if self._lifecycle is _LIFECYCLE_CLOSED or not checked:
            return
        until = self._clock() + self._quarantine_s
        if self._quarantine_s > 0:
            self._check_new_keys = True
        table = self._keys
        for key in checked:
            if self._quarantine_s > 0:
                self._quarantine.put(key, None, until)
            state = self._states.get(key)
            if state is None:
                self._noted.pop(key, None)
                continue
            if state.cache_batch != _NOT_CACHED:
                table.forget(state)
            else:
                table.override(state, False, _SOURCE_MISS_MARKED, None)

    def note_stored(self, keys: Iterable[BlockKey]) -> None:
        """This tier now holds ``keys`` (our own store): True at once; lifts quarantine."""
        if _get_ident() != self._owner:
            self._claim("note_stored")
        self._note(keys, True)

    def note_removed(self, keys: Iterable[BlockKey]) -> None:
        """This tier dropped ``keys`` (our own eviction): False at once."""
        if _get_ident() != self._owner:
            self._claim("note_removed")
        self._note(keys, False)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the worker (waiting up to ``timeout`` s for a call in progress), drain, forget."""
        if timeout is not None:
            _check_number("timeout", timeout, minimum=0.0)
        if self._lifecycle is _LIFECYCLE_CLOSED:
            return
        if not self._worker.stop(timeout):
            _log.warning("tier %s: probe worker still busy after %ss; abandoning its call",
                         self._tier_name, timeout)
        self._drain(None)
        self._lifecycle = _LIFECYCLE_CLOSED
        self._gate = _GATE_CLOSED
        self._keys.clear()
        self._request_keys.clear()
        self._cur_req_id = None
        self._cur_attached = {}
        self._last_released = {}
        self._pending.clear()
        self._inflight_batches.clear()
        self._quarantine.clear()
        self._breaker.forget_trial()

    # ------------------------------------------------------------------ introspection

    def phase(self, key: BlockKey) -> LookupPhase | None:
        """The phase of ``key``'s live probe; None when it has none (a cached verdict is not a
        live probe)."""
        state = self._states.get(key)
        return None if state is None or state.cache_batch != _NOT_CACHED else state.phase

    @property
    def tracked_keys(self) -> int:
        """Number of live per-key states (cached verdicts not counted)."""
        return self._keys.tracked

    @property
    def stats(self) -> LookupStats:
        """A snapshot copy; readable after shutdown."""
        return replace(
            self._counters,
            lookups=self._lookup_count,
            verdict_cache_evictions=self._keys.evictions,
            quarantine_evictions=self._quarantine.evictions,
            cached_verdicts=self._keys.cached_count,
            quarantined_keys=len(self._quarantine),
            inflight_batches=len(self._inflight_batches),
            breaker_state=self._breaker.state,
            breaker_opens=self._breaker.opens,
        )

    @property
    def probes_in_flight(self) -> bool:
        """Whether a probe batch was sent whose result has not been applied yet."""
        return bool(self._inflight_batches)

    def wait_for_probes(self, timeout: float) -> bool:
        """Block at most ``timeout`` s until the worker posted a result for every batch sent so
        far (True) — it applies nothing (the next ``flush`` or ``lookup`` does). For an engine
        that would otherwise spin its scheduler thread while waiting on probes: the wait
        releases the GIL, so the probe worker is not starved (see ``KvtierTier``)."""
        return self._worker.wait_posted(self._next_batch_id, timeout)

    _wait_for_results = wait_for_probes  # the private name tests and the tiering manager use

    # ------------------------------------------------------------------ scheduler internals

    def _claim(self, operation: str) -> None:
        """Bind the owner thread on the first scheduler-side call; refuse any other thread."""
        caller = _get_ident()
        if self._owner is None:
            self._owner = caller
            return
        raise OwnerThreadError(
            f"lookup manager for tier {self._tier_name!r}: {operation}() was called from thread "
            f"{threading.current_thread().name!r}, but lookup, flush, drain_results, cleanup, "
            "mark_miss, note_stored and note_removed belong to the scheduler thread that first "
            "called one of them (they are not thread-safe); nothing was changed"
        )

    def _attach(self, key: BlockKey, state: KeyState | None, req_context: RequestContext,
                attached: dict[BlockKey, KeyState]) -> bool | None:
        """First lookup of ``key`` by this request, when the key has a state (a probe, a verdict,
        a cached verdict) or new keys may be refused (quarantine entries, breaker not closed)."""
        if state is not None and state.cache_batch != _NOT_CACHED:
            if self._keys.reuse_cached(state, self._clock()):
                self._counters.verdict_cache_hits += 1
            else:
                state = None
        elif state is not None and state.source is _SOURCE_FAULT:
            return self._reprobe_after_fault(state, req_context, attached)
        elif state is not None and state.phase is not _PHASE_RESOLVED:
            self._counters.inflight_reuses += 1
        if not attached:
            self._request_keys[req_context.req_id] = attached
        if state is None:
            check_key(key)
            generation = next(self._generations)
            source = self._refuse_new(key)
            if source is None:
                state = KeyState(key, generation, _PHASE_PENDING)
                self._pending.append((key, generation, req_context))
            else:
                state = KeyState(key, generation, _PHASE_RESOLVED, 1, False, source)
            self._states[key] = state
            attached[key] = state
            return state.verdict
        attached[key] = state
        state.refs += 1
        verdict = state.verdict
        if (verdict is None and state.phase is _PHASE_IN_FLIGHT
                and (now := self._clock()) >= state.deadline):
            return self._past_deadline(state, now)
        return verdict

    def _refuse_new(self, key: BlockKey) -> VerdictSource | None:
        """Why a new key answers False at once (quarantine, open breaker), or None to probe."""
        now: float | None = None
        until = self._quarantine.expiry(key) if self._quarantine else None
        if until is not None:
            now = self._clock()
            if now < until:
                self._counters.quarantine_hits += 1
                return _SOURCE_MISS_MARKED
            self._quarantine.pop(key)
        breaker = self._breaker
        if (breaker.state is not _BREAKER_CLOSED
                and not breaker.admits(self._clock() if now is None else now)):
            self._counters.breaker_short_circuits += 1
            return _SOURCE_FAULT
        return None

    def _past_deadline(self, state: KeyState, now: float) -> bool | None:
        """A key in flight past its deadline: an answer the worker already posted is applied
        (not a timeout, as in flush); otherwise the batch times out if the worker is stuck."""
        self._drain(now)
        self._expire_timed_out(now)
        return state.verdict

    def _reprobe_after_fault(self, state: KeyState, req_context: RequestContext,
                             attached: dict[BlockKey, KeyState]) -> bool | None:
        """A request joins a key whose False came from a fault: faults are never served to later
        requests, so the key is probed again (if the breaker admits it) for everyone."""
        if not attached:
            self._request_keys[req_context.req_id] = attached
        attached[state.key] = state
        state.refs += 1
        if (self._breaker.state is not _BREAKER_CLOSED
                and not self._breaker.admits(self._clock())):
            self._counters.breaker_short_circuits += 1
            return False
        state.restart(next(self._generations))
        self._pending.append((state.key, state.generation, req_context))
        return None

    def _closed(self) -> bool:
        return self._lifecycle is _LIFECYCLE_CLOSED

    def _breaker_opened(self, cooldown_s: float) -> None:
        self._check_new_keys = True
        self._logs["breaker"].warning(
            "tier %s: circuit breaker open for %.1fs after failed backend calls",
            self._tier_name, cooldown_s)
