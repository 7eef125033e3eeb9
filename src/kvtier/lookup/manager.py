"""The asynchronous, deduplicating lookup manager: "is this block in the slow tier?" without I/O.

Thread ownership
----------------
* **Scheduler thread** (the *owner*: the first thread that calls :meth:`AsyncLookupManager.lookup`,
  ``flush``, ``drain_results``, ``cleanup``, ``mark_miss``, ``note_stored`` or ``note_removed``)
  owns every piece of bookkeeping: the per-key states (``_states``, which also hold the verdict
  cache: a released state with a cacheable verdict stays there, flagged ``cached``, queued in
  ``_idle``), the per-request index (``_request_keys``: request id -> the states it holds, and
  ``_cur_req_id`` / ``_cur_attached``, the map of the request the scheduler is scanning now), the
  keys waiting for the next flush (``_pending``), the table of submitted batches with their
  deadlines (``_inflight_batches``), the quarantine map (``_quarantine``), the circuit breaker
  (``_breaker``), the statistics (``_counters``, ``_lookup_count``, ``_idle_count``) and the
  lifecycle (``_lifecycle``, ``_gate``). None of it is locked; those methods are not
  thread-safe, and a call from another thread raises :class:`OwnerThreadError` before touching
  anything. ``shutdown`` may come from any thread once the owner stopped calling.
* **Probe worker thread** (one daemon thread per manager) owns only its local variables and its
  error-log rate limiter. It reads probe batches from ``_probe_queue`` and writes one result item
  per batch to ``_result_queue``; both are ``queue.SimpleQueue``. ``_posted`` and its condition
  exist only for the private test hook :meth:`AsyncLookupManager._wait_for_results`; the
  scheduler hot path never takes that lock.
"""

from __future__ import annotations

import abc
import enum
import itertools
import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Final

import numpy as np

from kvtier.backends.base import RateLimitedLog
from kvtier.errors import ClosedError, KvtierError
from kvtier.keys import BlockKey, RequestContext, validate_keys
from kvtier.lookup.breaker import BreakerState, CircuitBreaker
from kvtier.settings import Kind, Setting, SettingsTable

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

_LOG_INTERVAL_S: Final = 10.0
_MAX_SECONDS: Final = 3600.0
_DEFAULT_SCOPE: Final = None
_get_ident: Final = threading.get_ident


def _seconds(name: str, default: float, help_text: str, *, strict_min: bool) -> Setting:
    return Setting(name, Kind.FLOAT, default, help_text, minimum=0.0, maximum=_MAX_SECONDS,
                   strict_min=strict_min, unit="seconds", env=f"KVTIER_LOOKUP_{name.upper()}")


def _count(name: str, default: int, help_text: str) -> Setting:
    return Setting(name, Kind.INT, default, help_text, minimum=1, unit="count",
                   env=f"KVTIER_LOOKUP_{name.upper()}")


LOOKUP_SETTINGS: Final = SettingsTable("lookup", (
    _seconds("probe_timeout_s", 5.0, "a probe in flight longer than this answers False (the "
             "block is recomputed) at the next flush or lookup", strict_min=True),
    _seconds("verdict_ttl_s", 2.0, "how long a backend or note_* verdict is served from the cache "
             "after its last request finished, counted from when it was answered; 0 disables",
             strict_min=False),
    _count("max_cached_verdicts", 65536, "bound of the verdict cache and, separately, of the "
           "quarantine (the least recently released entries go first)"),
    _seconds("quarantine_s", 30.0, "after mark_miss (a failed load) the key answers False without "
             "probing for this long", strict_min=False),
    _count("max_batch_keys", 1024, "the most keys in one batch_lookup call"),
    _count("breaker_threshold", 5, "consecutive failed or timed-out backend calls that open the "
           "circuit breaker"),
    _seconds("breaker_cooldown_s", 10.0, "how long an open breaker answers False before one trial "
             "batch decides", strict_min=True),
))
"""The lookup manager's settings: the constructor, the config loader and the docs use this table."""


class LookupPhase(enum.Enum):
    """Lifecycle of one key's probe."""

    PENDING = "pending"  # looked up this step, waiting for the next flush
    IN_FLIGHT = "in_flight"  # handed to the probe worker, no answer applied yet
    RESOLVED = "resolved"  # a verdict is known


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


class _VerdictSource(enum.Enum):
    """Where a resolved verdict came from; only BACKEND and NOTED verdicts are ever cached."""

    BACKEND = "backend"
    NOTED = "noted"  # note_stored / note_removed
    FAULT = "fault"  # probe error, malformed result, timeout, breaker short-circuit
    MISS_MARKED = "miss_marked"  # mark_miss / quarantine


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
_SOURCE_BACKEND: Final = _VerdictSource.BACKEND
_SOURCE_NOTED: Final = _VerdictSource.NOTED
_SOURCE_FAULT: Final = _VerdictSource.FAULT
_SOURCE_MISS_MARKED: Final = _VerdictSource.MISS_MARKED

@dataclass(slots=True)
class LookupStats:
    """A snapshot of one manager's counters.

    ``lookups``: ``lookup()`` calls. ``backend_calls``: ``batch_lookup`` calls answered.
    ``probes_submitted``: keys sent to the worker. ``inflight_reuses``: a request attached to a
    probe another request had already started (PENDING or IN_FLIGHT). ``verdict_cache_hits``,
    ``quarantine_hits``: new keys answered from the cache / the quarantine.
    ``stale_results_dropped``: answers for a superseded generation or a timed-out batch.
    ``orphans_reclaimed``: answers nobody waited for any more (state deleted, verdict cached).
    ``probe_errors`` / ``probe_timeouts``: keys (not calls) resolved False by a fault / a
    timeout. ``failed_calls``: failed calls plus timed-out batches. ``breaker_short_circuits``:
    keys answered False because the breaker was open. ``breaker_opens``: transitions to OPEN.
    ``invariant_violations``: broken internal invariants (each also logged; the safe verdict is
    kept). ``cached_verdicts``, ``quarantined_keys``, ``inflight_batches``: current sizes.
    """

    lookups: int = 0
    backend_calls: int = 0
    probes_submitted: int = 0
    inflight_reuses: int = 0
    verdict_cache_hits: int = 0
    quarantine_hits: int = 0
    stale_results_dropped: int = 0
    orphans_reclaimed: int = 0
    probe_errors: int = 0
    probe_timeouts: int = 0
    failed_calls: int = 0
    breaker_short_circuits: int = 0
    breaker_opens: int = 0
    invariant_violations: int = 0
    verdict_cache_evictions: int = 0
    quarantine_evictions: int = 0
    cached_verdicts: int = 0
    quarantined_keys: int = 0
    inflight_batches: int = 0
    breaker_state: BreakerState = BreakerState.CLOSED

    def as_dict(self) -> dict[str, int | str]:
        """Every field by name; ``breaker_state`` as its value string (``"closed"``, ...)."""
        result: dict[str, int | str] = asdict(self)
        result["breaker_state"] = self.breaker_state.value
        return result


@dataclass(slots=True, eq=False)
class _KeyState:
    """One key's probe and verdict. ``refs``: requests holding it (each request's map in
    ``_request_keys`` points here). A released state (``refs == 0``) with a cacheable verdict is
    the verdict cache entry: ``cached`` is True and it sits in ``_idle`` (``queued`` counts its
    entries there; all but the newest are stale and skipped)."""

    key: BlockKey
    generation: int
    phase: LookupPhase
    refs: int = 1
    verdict: bool | None = None
    source: _VerdictSource | None = None
    deadline: float = math.inf  # when an IN_FLIGHT probe times out
    cache_expiry: float | None = None  # fixed when the verdict was answered; None = not cacheable
    cached: bool = False
    queued: int = 0


@dataclass(slots=True)
class _InFlightBatch:
    deadline: float
    entries: list[tuple[BlockKey, int, RequestContext]]


@dataclass(slots=True)
class _ProbeBatch:
    batch_id: int
    entries: list[tuple[BlockKey, int, RequestContext]]


@dataclass(slots=True)
class _ProbeResult:
    batch_id: int
    answers: list[tuple[BlockKey, int, bool, bool]]  # key, generation, verdict, trusted
    call_outcomes: list[bool]  # one per backend call, True = succeeded
    error_keys: int
    answered_at: float


class _RateLimitedLog:
    """One :class:`RateLimitedLog` per kind of message, each line prefixed with the tier name;
    owned by a single thread."""

    __slots__ = ("_clock", "_logs", "_tier")

    def __init__(self, tier: str, clock: Callable[[], float]) -> None:
        self._tier = tier
        self._clock = clock
        self._logs: dict[str, RateLimitedLog] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        log = self._logs.get(kind)
        if log is None:
            log = self._logs[kind] = RateLimitedLog(_log, _LOG_INTERVAL_S, self._clock)
        log.warning("tier %s: " + message, self._tier, *args)


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


def _as_verdict(item: object) -> bool | None:
    """A trusted verdict, or None when ``item`` is not bool, numpy.bool_ or the int 0/1."""
    if item is True or item is False:
        return bool(item)
    if isinstance(item, np.bool_):
        return bool(item)
    if isinstance(item, (int, np.integer)) and not isinstance(item, bool) and item in (0, 1):
        return bool(item)
    return None


class AsyncLookupManager(abc.ABC):
    """Non-blocking, deduplicating existence probes for one slow tier.

    Subclasses implement :meth:`batch_lookup` (called on the probe worker thread) and may
    override :meth:`lookup_scope`. Every other method is for the scheduler thread only (the
    owner thread, see :class:`OwnerThreadError`); none of them blocks on I/O.

    Per engine step the scheduler calls :meth:`lookup` for the keys it needs (True present,
    False absent, None "ask again next step"), then :meth:`flush` once. The flush hands every
    new key of the step to the worker as one batch; the worker unions them across requests and
    calls :meth:`batch_lookup` once per lookup scope, in chunks of at most ``max_batch_keys``.

    The settings, their defaults, bounds and meaning are :data:`LOOKUP_SETTINGS`
    (``probe_timeout_s=5.0``, ``verdict_ttl_s=2.0``, ``max_cached_verdicts=65536``,
    ``quarantine_s=30.0``, ``max_batch_keys=1024``, ``breaker_threshold=5``,
    ``breaker_cooldown_s=10.0``); a bad value raises :class:`~kvtier.settings.ConfigError`.
    ``clock=time.monotonic``: every time decision uses it.

    Cost model: ``lookup`` of a key the calling request already holds is one identity test (the
    request being scanned) and one dict lookup, and reads no clock. The clock is read once per
    flush, and in ``lookup`` only on slow paths: a verdict-cache hit (its expiry), the
    quarantine and breaker checks of a new key, and a key still in flight (its deadline) — so a
    probe's timeout is detected at the latest at the next flush or at the next lookup of any of
    its keys. Releasing a request (``cleanup``) is one pass over its keys; a released verdict
    stays in place as the cache entry.

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
            "max_cached_verdicts": max_cached_verdicts, "quarantine_s": quarantine_s,
            "max_batch_keys": max_batch_keys, "breaker_threshold": breaker_threshold,
            "breaker_cooldown_s": breaker_cooldown_s,
        })
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self._tier_name = tier_name
        self._probe_timeout_s: float = settings["probe_timeout_s"]
        self._verdict_ttl_s: float = settings["verdict_ttl_s"]
        self._max_cached_verdicts: int = settings["max_cached_verdicts"]
        self._quarantine_s: float = settings["quarantine_s"]
        self._max_batch_keys: int = settings["max_batch_keys"]
        self._breaker_threshold: int = settings["breaker_threshold"]
        self._breaker_cooldown_s: float = settings["breaker_cooldown_s"]
        self._clock = clock

        # Scheduler-thread state.
        self._owner: int | None = None  # thread id, bound by the first scheduler-side call
        self._states: dict[BlockKey, _KeyState] = {}
        self._request_keys: dict[str, dict[BlockKey, _KeyState]] = {}
        self._cur_req_id: str | None = None
        self._cur_attached: dict[BlockKey, _KeyState] = {}
        self._pending: list[tuple[BlockKey, int, RequestContext]] = []
        self._inflight_batches: dict[int, _InFlightBatch] = {}
        self._idle: deque[_KeyState] = deque()
        self._idle_count = 0
        self._quarantine: OrderedDict[BlockKey, float] = OrderedDict()
        # True whenever the quarantine has entries or the breaker is not closed (so new keys
        # take the slow path that may refuse them); recomputed at every flush.
        self._check_new_keys = False
        self._next_generation = 0
        self._next_batch_id = 0
        self._scheduler_log = _RateLimitedLog(tier_name, clock)
        self._breaker = CircuitBreaker(
            self._breaker_threshold, self._breaker_cooldown_s,
            on_open=self._breaker_opened, on_close=self._breaker_closed)
        self._counters = LookupStats()
        self._lookup_count = 0
        self._lifecycle = _LIFECYCLE_RUNNING
        self._gate = _GATE_READY

        # Cross-thread channels.
        self._probe_queue: queue.SimpleQueue[_ProbeBatch | None] = queue.SimpleQueue()
        self._result_queue: queue.SimpleQueue[_ProbeResult] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._posted_cond = threading.Condition()
        self._posted = 0  # guarded by _posted_cond; read by wait_for_probes
        self._worker = threading.Thread(
            target=self._worker_main, name=f"kvtier-lookup-{tier_name}", daemon=True
        )
        self._worker.start()

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
        if _get_ident() != self._owner:
            self._claim("lookup")
        if self._gate is not _GATE_READY:
            self._pass_gate()
        self._lookup_count += 1
        try:
            req_id = req_context.req_id
        except AttributeError:
            raise TypeError(
                f"req_context must be a RequestContext, got {type(req_context).__name__}"
            ) from None
        if req_id is self._cur_req_id:  # the request being scanned (identity: the same str)
            attached = self._cur_attached
        else:
            attached = self._switch_request(req_id, req_context)
        state = attached.get(key)
        if state is not None:  # this request already holds the key: the common scan
            verdict = state.verdict
            if verdict is None and state.phase is _PHASE_IN_FLIGHT:
                return self._in_flight_verdict(state)
            return verdict
        state = self._states.get(key)
        if state is not None or self._check_new_keys:
            return self._attach(key, state, req_context, attached)
        # A key nobody holds, nothing refusing new keys: start its probe (inlined: hot).
        if not isinstance(key, bytes):
            raise TypeError(f"key must be a BlockKey (bytes), got {type(key).__name__}")
        generation = self._next_generation
        self._next_generation = generation + 1
        state = self._states[key] = _KeyState(key, generation, _PHASE_PENDING)
        if not attached:
            self._request_keys[req_id] = attached
        attached[key] = state
        self._pending.append((key, generation, req_context))
        return None

    def flush(self) -> None:
        """Once per engine step: apply finished results, then send the step's new keys."""
        if _get_ident() != self._owner:
            self._claim("flush")
        self._require_running("flush")
        now = self._clock()
        self._drain(now)
        self._expire_timed_out(now)
        self._sweep_expired(now)
        self._check_new_keys = bool(self._quarantine) or self._breaker.state is not _BREAKER_CLOSED
        self._gate = _GATE_DRAIN_FIRST
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        admit = self._breaker.admits(now)
        entries: list[tuple[BlockKey, int, RequestContext]] = []
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
                self._resolve(state, False, _SOURCE_FAULT, None)
                self._counters.breaker_short_circuits += 1
                continue
            state.phase = _PHASE_IN_FLIGHT
            state.deadline = deadline
            entries.append(entry)
        if not entries:
            return
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self._inflight_batches[batch_id] = _InFlightBatch(deadline, entries)
        self._breaker.sent(batch_id)
        self._counters.probes_submitted += len(entries)
        self._probe_queue.put(_ProbeBatch(batch_id, entries))

    def drain_results(self) -> None:
        """Apply every result the worker has posted (stale ones are dropped)."""
        if _get_ident() != self._owner:
            self._claim("drain_results")
        if self._lifecycle is _LIFECYCLE_CLOSED:
            return
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
        idle = self._idle
        for state in attached.values():
            refs = state.refs - 1
            state.refs = refs
            if refs or state.phase is _PHASE_IN_FLIGHT:
                if refs < 0:
                    self._violation("request %s released key %s twice", req_id,
                                    state.key.hex())
                    state.refs = 0
                continue
            if state.cache_expiry is None or state.cached:
                self._release(state)
                continue
            # _release() inlined for the common case: a fresh verdict joins the cache
            state.cached = True
            state.queued += 1
            idle.append(state)
            self._idle_count += 1
        if self._idle_count > self._max_cached_verdicts:
            self._evict_idle()
        elif len(idle) > 2 * self._max_cached_verdicts + 64:
            self._compact_idle()

    def mark_miss(self, keys: Iterable[BlockKey]) -> None:
        """A load failed: force False now and quarantine the keys for ``quarantine_s``."""
        if _get_ident() != self._owner:
            self._claim("mark_miss")
        checked = validate_keys(keys, "keys")
        if self._lifecycle is _LIFECYCLE_CLOSED or not checked:
            return
        now = self._clock()
        until = now + self._quarantine_s
        if self._quarantine_s > 0:
            self._check_new_keys = True
        for key in checked:
            if self._quarantine_s > 0:
                self._quarantine[key] = until
                self._quarantine.move_to_end(key)
            state = self._states.get(key)
            if state is None:
                continue
            if state.cached:
                self._forget(state)
            else:
                self._override(state, False, _SOURCE_MISS_MARKED, None)
        self._counters.quarantine_evictions += self._bound(self._quarantine)

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
        self._stop.set()
        self._probe_queue.put(None)
        self._worker.join(timeout)
        if self._worker.is_alive():
            _log.warning("tier %s: probe worker still busy after %ss; abandoning its call",
                         self._tier_name, timeout)
        self._drain(None)
        self._lifecycle = _LIFECYCLE_CLOSED
        self._gate = _GATE_CLOSED
        self._states.clear()
        self._request_keys.clear()
        self._cur_req_id = None
        self._cur_attached = {}
        self._pending.clear()
        self._inflight_batches.clear()
        self._idle.clear()
        self._idle_count = 0
        self._quarantine.clear()
        self._breaker.forget_trial()

    # ------------------------------------------------------------------ introspection

    def phase(self, key: BlockKey) -> LookupPhase | None:
        """The phase of ``key``'s live probe; None when it has none (a cached verdict is not a
        live probe)."""
        state = self._states.get(key)
        return None if state is None or state.cached else state.phase

    @property
    def tracked_keys(self) -> int:
        """Number of live per-key states (cached verdicts not counted)."""
        return len(self._states) - self._idle_count

    @property
    def stats(self) -> LookupStats:
        """A snapshot copy; readable after shutdown."""
        return replace(
            self._counters,
            lookups=self._lookup_count,
            cached_verdicts=self._idle_count,
            quarantined_keys=len(self._quarantine),
            inflight_batches=len(self._inflight_batches),
            breaker_state=self._breaker.state,
            breaker_opens=self._breaker.opens,
        )

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

    def _require_running(self, operation: str) -> None:
        if self._lifecycle is _LIFECYCLE_CLOSED:
            raise LookupManagerClosedError(
                f"lookup manager for tier {self._tier_name!r} is shut down; {operation}() "
                "is not allowed any more"
            )

    def _pass_gate(self) -> None:
        self._require_running("lookup")
        self._drain(None)
        self._gate = _GATE_READY

    def _switch_request(self, req_id: str,
                        req_context: RequestContext) -> dict[BlockKey, _KeyState]:
        """The map of the request the scheduler now scans (registered at its first key)."""
        if not isinstance(req_context, RequestContext):
            raise TypeError(
                f"req_context must be a RequestContext, got {type(req_context).__name__}"
            )
        attached = self._request_keys.get(req_id)
        if attached is None:
            attached = {}
        self._cur_req_id = req_id
        self._cur_attached = attached
        return attached

    def _attach(self, key: BlockKey, state: _KeyState | None, req_context: RequestContext,
                attached: dict[BlockKey, _KeyState]) -> bool | None:
        """First lookup of ``key`` by this request, when the key has a state (a probe, a verdict,
        a cached verdict) or new keys may be refused (quarantine entries, breaker not closed)."""
        if state is not None and state.cached:
            expiry = state.cache_expiry
            if expiry is None or self._clock() >= expiry:
                self._forget(state)
                state = None
            else:
                state.cached = False
                self._idle_count -= 1
                self._counters.verdict_cache_hits += 1
        elif state is not None and state.source is _SOURCE_FAULT:
            return self._reprobe_after_fault(state, req_context, attached)
        elif state is not None and state.phase is not _PHASE_RESOLVED:
            self._counters.inflight_reuses += 1
        if not attached:
            self._request_keys[req_context.req_id] = attached
        if state is None:
            if not isinstance(key, bytes):
                raise TypeError(f"key must be a BlockKey (bytes), got {type(key).__name__}")
            generation = self._next_generation
            self._next_generation = generation + 1
            source = self._refuse_new(key)
            if source is None:
                state = _KeyState(key, generation, _PHASE_PENDING)
                self._pending.append((key, generation, req_context))
            else:
                state = _KeyState(key, generation, _PHASE_RESOLVED, 1, False, source)
            self._states[key] = state
            attached[key] = state
            return state.verdict
        attached[key] = state
        state.refs += 1
        verdict = state.verdict
        if verdict is None and state.phase is _PHASE_IN_FLIGHT:
            return self._in_flight_verdict(state)
        return verdict

    def _refuse_new(self, key: BlockKey) -> _VerdictSource | None:
        """Why a new key answers False at once (quarantine, open breaker), or None to probe."""
        now: float | None = None
        until = self._quarantine.get(key) if self._quarantine else None
        if until is not None:
            now = self._clock()
            if now < until:
                self._counters.quarantine_hits += 1
                return _SOURCE_MISS_MARKED
            del self._quarantine[key]
        breaker = self._breaker
        if (breaker.state is not _BREAKER_CLOSED
                and not breaker.admits(self._clock() if now is None else now)):
            self._counters.breaker_short_circuits += 1
            return _SOURCE_FAULT
        return None

    def _in_flight_verdict(self, state: _KeyState) -> bool | None:
        now = self._clock()
        if now >= state.deadline:
            # An answer already posted by the worker is not a timeout (as in flush).
            self._drain(now)
            self._expire_timed_out(now)
        return state.verdict

    def _reprobe_after_fault(self, state: _KeyState, req_context: RequestContext,
                             attached: dict[BlockKey, _KeyState]) -> bool | None:
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
        self._supersede(state)
        state.phase = _PHASE_PENDING
        state.verdict = state.source = state.cache_expiry = None
        state.deadline = math.inf
        self._pending.append((state.key, state.generation, req_context))
        return None

    def _release(self, state: _KeyState) -> None:
        """Nobody holds ``state`` and no probe of it is in flight: cache its verdict or drop it."""
        if state.cache_expiry is None:
            self._forget(state)
            return
        if not state.cached:
            state.cached = True
            self._idle_count += 1
        state.queued += 1
        idle = self._idle
        idle.append(state)
        if self._idle_count > self._max_cached_verdicts:
            self._evict_idle()
        elif len(idle) > 2 * self._max_cached_verdicts + 64:
            self._compact_idle()

    def _forget(self, state: _KeyState) -> None:
        """Drop a state that nobody holds (its stale ``_idle`` entries are skipped later)."""
        if state.cached:
            state.cached = False
            self._idle_count -= 1
        if self._states.get(state.key) is state:
            del self._states[state.key]

    def _evict_idle(self) -> None:
        """Drop the least recently released cached verdicts beyond ``max_cached_verdicts``."""
        idle = self._idle
        while self._idle_count > self._max_cached_verdicts and idle:
            state = idle.popleft()
            state.queued -= 1
            if state.queued or not state.cached:
                continue  # a newer entry exists, or it is no longer a cached verdict
            self._forget(state)
            self._counters.verdict_cache_evictions += 1

    def _compact_idle(self) -> None:
        """Rebuild ``_idle`` with one entry per cached verdict, oldest release first."""
        live: list[_KeyState] = []
        for state in self._idle:
            state.queued -= 1
            if state.cached and not state.queued:
                live.append(state)
        for state in live:
            state.queued = 1
        self._idle = deque(live)

    def _drain(self, now: float | None) -> None:
        # One consumer (this thread): empty() then get_nowait() never blocks, and an empty
        # queue costs no exception (drained up to three times per step).
        result_queue = self._result_queue
        while not result_queue.empty():
            self._apply(result_queue.get_nowait(), now)

    def _clock_reader(self, now: float | None) -> Callable[[], float]:
        return self._clock if now is None else (lambda: now)

    def _apply(self, result: _ProbeResult, now: float | None) -> None:
        counters = self._counters
        counters.backend_calls += len(result.call_outcomes)
        batch = self._inflight_batches.pop(result.batch_id, None)
        if batch is None:
            if result.batch_id >= self._next_batch_id:
                self._violation("result for batch %d that was never sent", result.batch_id)
            # Timed out earlier: every answer is late; the timeout already fed the breaker and
            # was counted (failed_calls, probe_timeouts), so its errors are not counted again.
            counters.stale_results_dropped += len(result.answers)
            return
        counters.failed_calls += result.call_outcomes.count(False)
        counters.probe_errors += result.error_keys
        self._breaker.record(result.batch_id, result.call_outcomes, self._clock_reader(now))
        ttl = self._verdict_ttl_s
        states = self._states
        trusted_expiry = result.answered_at + ttl if ttl > 0 else None
        for key, generation, verdict, trusted in result.answers:
            state = states.get(key)
            if state is None or state.generation != generation:
                counters.stale_results_dropped += 1
                continue
            if state.phase is not _PHASE_IN_FLIGHT:
                self._violation("one-result-per-generation: key %s of generation %d is %s",
                                key.hex(), generation, state.phase.name)
                continue
            # _resolve() inlined: this loop runs once per probed key
            state.phase = _PHASE_RESOLVED
            if trusted:
                state.verdict = verdict
                state.source = _SOURCE_BACKEND
                state.cache_expiry = trusted_expiry
            else:
                state.verdict = False
                state.source = _SOURCE_FAULT
                state.cache_expiry = None
            if not state.refs:  # an orphan: nobody waits for it any more
                counters.orphans_reclaimed += 1
                self._release(state)

    def _expire_timed_out(self, now: float) -> None:
        """Resolve False every probe whose batch passed its deadline (batches are in order)."""
        inflight = self._inflight_batches
        if not inflight or next(iter(inflight.values())).deadline > now:
            return
        expired: list[int] = []
        for batch_id, batch in self._inflight_batches.items():
            if batch.deadline > now:
                break
            expired.append(batch_id)
        if not expired:
            return
        states = self._states
        timed_out = 0
        for batch_id in expired:
            batch = self._inflight_batches.pop(batch_id)
            for key, generation, _ in batch.entries:
                state = states.get(key)
                if (state is None or state.generation != generation
                        or state.phase is not _PHASE_IN_FLIGHT):
                    continue
                timed_out += 1
                if state.refs:
                    self._supersede(state)
                    self._resolve(state, False, _SOURCE_FAULT, None)
                else:
                    del states[key]
            self._breaker.record(batch_id, (False,), self._clock_reader(now))
        self._counters.probe_timeouts += timed_out
        self._counters.failed_calls += len(expired)
        if timed_out:
            self._scheduler_log.warning(
                "timeout", "%d probes timed out after %.3fs; answering False",
                timed_out, self._probe_timeout_s)

    def _sweep_expired(self, now: float) -> None:
        idle = self._idle
        while idle:
            state = idle[0]
            if state.queued > 1 or not state.cached:  # a stale entry
                idle.popleft()
                state.queued -= 1
                continue
            expiry = state.cache_expiry
            if expiry is not None and expiry > now:
                break
            idle.popleft()
            state.queued -= 1
            self._forget(state)
        quarantine = self._quarantine
        while quarantine:
            key, until = next(iter(quarantine.items()))
            if until > now:
                break
            del quarantine[key]

    def _supersede(self, state: _KeyState) -> None:
        """A new generation: whatever the worker still answers for the old one is stale."""
        state.generation = self._next_generation
        self._next_generation += 1

    @staticmethod
    def _resolve(state: _KeyState, verdict: bool, source: _VerdictSource,
                 cache_expiry: float | None) -> None:
        state.phase = _PHASE_RESOLVED
        state.verdict = verdict
        state.source = source
        state.cache_expiry = cache_expiry

    def _override(self, state: _KeyState, verdict: bool, source: _VerdictSource,
                  cache_expiry: float | None) -> None:
        if state.phase is not _PHASE_RESOLVED:
            self._supersede(state)
        self._resolve(state, verdict, source, cache_expiry)
        if not state.refs:  # unclaimed (in flight or cached): nothing waits for it
            self._release(state)

    def _note(self, keys: Iterable[BlockKey], verdict: bool) -> None:
        checked = validate_keys(keys, "keys")
        if self._lifecycle is _LIFECYCLE_CLOSED or not checked:
            return
        now = self._clock()
        ttl = self._verdict_ttl_s
        expiry = now + ttl if ttl > 0 else None
        states = self._states
        for key in checked:
            if verdict:
                self._quarantine.pop(key, None)
            state = states.get(key)
            if state is None:
                if expiry is None:
                    continue
                state = _KeyState(key, self._next_generation, _PHASE_RESOLVED, 0)
                self._next_generation += 1
                states[key] = state
            self._override(state, verdict, _SOURCE_NOTED, expiry)

    def _bound(self, table: OrderedDict[BlockKey, Any]) -> int:
        """Drop the oldest entries beyond ``max_cached_verdicts``; return how many."""
        overflow = max(0, len(table) - self._max_cached_verdicts)
        for _ in range(overflow):
            table.popitem(last=False)
        return overflow

    def _violation(self, message: str, *args: object) -> None:
        self._counters.invariant_violations += 1
        self._scheduler_log.warning("invariant", "invariant violated: " + message, *args)

    def _breaker_opened(self, cooldown_s: float) -> None:
        self._check_new_keys = True
        self._scheduler_log.warning(
            "breaker", "circuit breaker open for %.1fs after failed backend calls", cooldown_s)

    def _breaker_closed(self) -> None:
        _log.info("tier %s: circuit breaker closed", self._tier_name)

    # ------------------------------------------------------------------ probe worker

    def _worker_main(self) -> None:
        error_log = _RateLimitedLog(self._tier_name, self._clock)
        while True:
            batch = self._probe_queue.get()
            if batch is None or self._stop.is_set():
                return
            try:
                result = self._probe(batch, error_log)
            except BaseException as exc:  # the worker survives everything, even odd scopes
                error_log.warning("worker", "probe worker error %r; answering False", exc)
                result = _ProbeResult(
                    batch.batch_id,
                    [(key, generation, False, False) for key, generation, _ in batch.entries],
                    [False], len(batch.entries), self._safe_now())
            self._result_queue.put(result)
            with self._posted_cond:
                self._posted += 1
                self._posted_cond.notify_all()

    def _safe_now(self) -> float:
        try:
            return float(self._clock())
        except Exception:
            return -math.inf

    def _probe(self, batch: _ProbeBatch, error_log: _RateLimitedLog) -> _ProbeResult:
        groups: dict[Hashable, tuple[RequestContext, list[tuple[BlockKey, int]]]] = {}
        for key, generation, req_context in batch.entries:
            scope = self.lookup_scope(req_context)
            group = groups.get(scope)
            if group is None:
                groups[scope] = (req_context, [(key, generation)])
            else:
                group[1].append((key, generation))
        answers: list[tuple[BlockKey, int, bool, bool]] = []
        outcomes: list[bool] = []
        error_keys = 0
        chunk_size = self._max_batch_keys
        for req_context, members in groups.values():
            for start in range(0, len(members), chunk_size):
                chunk = members[start : start + chunk_size]
                verdicts = self._call_backend([key for key, _ in chunk], req_context, error_log)
                if verdicts is None:
                    outcomes.append(False)
                    error_keys += len(chunk)
                    answers.extend((key, generation, False, False) for key, generation in chunk)
                else:
                    outcomes.append(True)
                    answers.extend(
                        (key, generation, verdict, True)
                        for (key, generation), verdict in zip(chunk, verdicts, strict=True)
                    )
        return _ProbeResult(batch.batch_id, answers, outcomes, error_keys, self._clock())

    def _call_backend(self, keys: list[BlockKey], req_context: RequestContext,
                      error_log: _RateLimitedLog) -> list[bool] | None:
        """The validated verdicts, or None when the call or its result is faulty."""
        try:
            raw = self.batch_lookup(keys, req_context)
            # One more than expected is enough to detect a result that is too long.
            items = list(itertools.islice(raw, len(keys) + 1))
        except Exception as exc:
            error_log.warning("error", "batch_lookup of %d keys failed: %r", len(keys), exc)
            return None
        if len(items) != len(keys):
            error_log.warning("length", "batch_lookup returned %s items for %d keys",
                              f"{len(items)}" if len(items) <= len(keys) else "too many",
                              len(keys))
            return None
        verdicts: list[bool] = []
        for index, item in enumerate(items):
            verdict = _as_verdict(item)
            if verdict is None:
                error_log.warning("type", "batch_lookup result[%d] is %s %r, expected a bool",
                                  index, type(item).__name__, item)
                return None
            verdicts.append(verdict)
        return verdicts

    # ------------------------------------------------------------------ in-flight probes

    @property
    def probes_in_flight(self) -> bool:
        """Whether a probe batch was sent whose result has not been applied yet."""
        return bool(self._inflight_batches)

    def wait_for_probes(self, timeout: float) -> bool:
        """Block at most ``timeout`` s until the worker posted a result for every batch sent so
        far (True) — it applies nothing (the next ``flush`` or ``lookup`` does). For an engine
        that would otherwise spin its scheduler thread while waiting on probes: the wait
        releases the GIL, so the probe worker is not starved (see ``KvtierTier``)."""
        return self._wait_for_results(timeout)

    # ------------------------------------------------------------------ test hook

    def _wait_for_results(self, timeout: float) -> bool:
        """Private, for tests: block until the worker posted a result for every sent batch."""
        target = self._next_batch_id
        with self._posted_cond:
            return self._posted_cond.wait_for(lambda: self._posted >= target, timeout)
