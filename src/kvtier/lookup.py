"""The asynchronous, deduplicating lookup manager: "is this block in the slow tier?" without I/O.

Thread ownership
----------------
* **Scheduler thread** (the engine thread that calls :meth:`AsyncLookupManager.lookup`,
  ``flush``, ``drain_results``, ``cleanup``, ``mark_miss``, ``note_stored``, ``note_removed``,
  ``shutdown``) owns every piece of bookkeeping: the per-key states (``_states``), the per-request
  reference index (``_request_keys``), the keys waiting for the next flush (``_pending``), the
  table of submitted batches with their deadlines (``_inflight_batches``), the verdict cache
  (``_verdict_cache``), the quarantine map (``_quarantine``), the circuit breaker
  (``_breaker_*``), the statistics (``_counters``, ``_lookup_count``) and the lifecycle
  (``_lifecycle``, ``_gate``). None of it is locked; none of those methods is thread-safe.
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
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final

import numpy as np

from kvtier.backends.base import RateLimitedLog
from kvtier.keys import BlockKey, RequestContext, validate_keys

__all__ = [
    "AsyncLookupManager",
    "BreakerState",
    "LookupManagerClosedError",
    "LookupPhase",
    "LookupStats",
]

_log = logging.getLogger("kvtier.lookup")

_LOG_INTERVAL_S: Final = 10.0
_MAX_COOLDOWN_S: Final = 3600.0
_DEFAULT_SCOPE: Final = None


class LookupPhase(enum.Enum):
    """Lifecycle of one key's probe."""

    PENDING = "pending"  # looked up this step, waiting for the next flush
    IN_FLIGHT = "in_flight"  # handed to the probe worker, no answer applied yet
    RESOLVED = "resolved"  # a verdict is known


class BreakerState(enum.Enum):
    """Per-tier circuit breaker."""

    CLOSED = "closed"  # probes go to the backend
    OPEN = "open"  # new keys answer False at once, no probes
    HALF_OPEN = "half_open"  # one trial batch may go through; its outcome closes or reopens


class LookupManagerClosedError(RuntimeError):
    """A lookup manager was used after :meth:`AsyncLookupManager.shutdown`."""


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
_BREAKER_OPEN: Final = BreakerState.OPEN
_BREAKER_HALF_OPEN: Final = BreakerState.HALF_OPEN
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
    breaker_state: BreakerState = _BREAKER_CLOSED

    def as_dict(self) -> dict[str, int | str]:
        """Every field by name; ``breaker_state`` as its value string (``"closed"``, ...)."""
        result: dict[str, int | str] = asdict(self)
        result["breaker_state"] = self.breaker_state.value
        return result


@dataclass(slots=True)
class _KeyState:
    generation: int
    phase: LookupPhase
    verdict: bool | None = None
    source: _VerdictSource | None = None
    requests: set[str] = field(default_factory=set)
    deadline: float = math.inf  # when an IN_FLIGHT probe times out
    cache_expiry: float | None = None  # fixed when the verdict was answered; None = not cacheable


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


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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
    override :meth:`lookup_scope`. Every other method is for the scheduler thread only and is
    not thread-safe; none of them blocks on I/O.

    Per engine step the scheduler calls :meth:`lookup` for the keys it needs (True present,
    False absent, None "ask again next step"), then :meth:`flush` once. The flush hands every
    new key of the step to the worker as one batch; the worker unions them across requests and
    calls :meth:`batch_lookup` once per lookup scope, in chunks of at most ``max_batch_keys``.

    Defaults and their meaning:

    * ``probe_timeout_s=5.0`` — a probe in flight longer than this resolves False (the key is
      recomputed; recompute is always safe) at the next ``flush``/``lookup``.
    * ``verdict_ttl_s=2.0`` — how long a backend (or ``note_*``) verdict may be served from the
      cache after its last request finished, counted from when it was answered; 0 disables.
    * ``max_cached_verdicts=65536`` — bound of the verdict LRU and, separately, of the
      quarantine map (oldest entries go first).
    * ``quarantine_s=30.0`` — after :meth:`mark_miss` the key answers False without probing.
    * ``max_batch_keys=1024`` — the most keys in one ``batch_lookup`` call.
    * ``breaker_threshold=5`` consecutive failed or timed-out backend calls open the breaker for
      ``breaker_cooldown_s=10.0``; then one trial batch decides.
    * ``clock=time.monotonic`` — every time decision uses it.

    Cost model: a ``lookup`` of a key that already has a live state is two dict/set lookups and
    reads no clock. The clock is read once per flush, and in ``lookup`` only on the slow paths:
    a new key (verdict cache, quarantine and breaker checks) and a key still in flight (its
    deadline) — so a probe's timeout is detected at the latest at the next flush or at the next
    lookup of any of its keys.

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
        probe_timeout_s: float = 5.0,
        verdict_ttl_s: float = 2.0,
        max_cached_verdicts: int = 65536,
        quarantine_s: float = 30.0,
        max_batch_keys: int = 1024,
        breaker_threshold: int = 5,
        breaker_cooldown_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(tier_name, str) or not tier_name:
            raise ValueError(f"tier_name must be a non-empty str, got {tier_name!r}")
        self._tier_name = tier_name
        self._probe_timeout_s = _check_number(
            "probe_timeout_s", probe_timeout_s, minimum=0.0, minimum_inclusive=False,
            maximum=_MAX_COOLDOWN_S)
        self._verdict_ttl_s = _check_number(
            "verdict_ttl_s", verdict_ttl_s, minimum=0.0, maximum=_MAX_COOLDOWN_S)
        self._max_cached_verdicts = _check_int(
            "max_cached_verdicts", max_cached_verdicts, minimum=1)
        self._quarantine_s = _check_number(
            "quarantine_s", quarantine_s, minimum=0.0, maximum=_MAX_COOLDOWN_S)
        self._max_batch_keys = _check_int("max_batch_keys", max_batch_keys, minimum=1)
        self._breaker_threshold = _check_int("breaker_threshold", breaker_threshold, minimum=1)
        self._breaker_cooldown_s = _check_number(
            "breaker_cooldown_s", breaker_cooldown_s, minimum=0.0, minimum_inclusive=False,
            maximum=_MAX_COOLDOWN_S)
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self._clock = clock

        # Scheduler-thread state.
        self._states: dict[BlockKey, _KeyState] = {}
        self._request_keys: dict[str, set[BlockKey]] = {}
        self._pending: list[tuple[BlockKey, int, RequestContext]] = []
        self._inflight_batches: dict[int, _InFlightBatch] = {}
        self._verdict_cache: OrderedDict[BlockKey, tuple[bool, float]] = OrderedDict()
        self._quarantine: OrderedDict[BlockKey, float] = OrderedDict()
        self._next_generation = 0
        self._next_batch_id = 0
        self._breaker_state = _BREAKER_CLOSED
        self._breaker_failures = 0
        self._breaker_open_until = 0.0
        self._breaker_trial_batch: int | None = None
        self._counters = LookupStats()
        self._lookup_count = 0
        self._lifecycle = _LIFECYCLE_RUNNING
        self._gate = _GATE_READY
        self._scheduler_log = _RateLimitedLog(tier_name, clock)

        # Cross-thread channels.
        self._probe_queue: queue.SimpleQueue[_ProbeBatch | None] = queue.SimpleQueue()
        self._result_queue: queue.SimpleQueue[_ProbeResult] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._posted_cond = threading.Condition()
        self._posted = 0  # guarded by _posted_cond; test hook only
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
        if self._gate is not _GATE_READY:
            self._pass_gate()
        self._lookup_count += 1
        try:
            req_id = req_context.req_id
        except AttributeError:
            raise TypeError(
                f"req_context must be a RequestContext, got {type(req_context).__name__}"
            ) from None
        state = self._states.get(key)
        if state is None:
            return self._lookup_untracked(key, req_context)
        requests = state.requests
        if req_id not in requests:  # first time this request asks for this key (inlined: hot)
            if state.source is _SOURCE_FAULT:
                return self._reprobe_after_fault(key, state, req_context)
            requests.add(req_id)
            request_keys = self._request_keys.get(req_id)
            if request_keys is None:
                self._request_keys[req_id] = {key}
            else:
                request_keys.add(key)
            if state.phase is not _PHASE_RESOLVED:
                self._counters.inflight_reuses += 1
        verdict = state.verdict
        if verdict is None and state.phase is _PHASE_IN_FLIGHT:
            now = self._clock()
            if now >= state.deadline:
                # An answer already posted by the worker is not a timeout (as in flush).
                self._drain(now)
                self._expire_timed_out(now)
                return state.verdict
        return verdict

    def flush(self) -> None:
        """Once per engine step: apply finished results, then send the step's new keys."""
        self._require_running("flush")
        now = self._clock()
        self._drain(now)
        self._expire_timed_out(now)
        self._sweep_expired(now)
        self._gate = _GATE_DRAIN_FIRST
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        admit = self._breaker_admits(now)
        entries: list[tuple[BlockKey, int, RequestContext]] = []
        states = self._states
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
            state.deadline = now + self._probe_timeout_s
            entries.append(entry)
        if not entries:
            return
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        self._inflight_batches[batch_id] = _InFlightBatch(now + self._probe_timeout_s, entries)
        if self._breaker_state is _BREAKER_HALF_OPEN:
            self._breaker_trial_batch = batch_id
        self._counters.probes_submitted += len(entries)
        self._probe_queue.put(_ProbeBatch(batch_id, entries))

    def drain_results(self) -> None:
        """Apply every result the worker has posted (stale ones are dropped)."""
        if self._lifecycle is _LIFECYCLE_CLOSED:
            return
        self._drain(None)
        self._gate = _GATE_READY

    def cleanup(self, req_id: str) -> None:
        """The request finished: release its keys; in-flight probes stay for reuse."""
        if self._lifecycle is _LIFECYCLE_CLOSED:
            return
        keys = self._request_keys.pop(req_id, None)
        if not keys:
            return
        now: float | None = None
        states = self._states
        for key in keys:
            state = states.get(key)
            if state is None:
                self._violation("request %s referenced untracked key %s", req_id, key.hex())
                continue
            state.requests.discard(req_id)
            if state.requests or state.phase is _PHASE_IN_FLIGHT:
                continue
            del states[key]
            if state.cache_expiry is not None:
                if now is None:
                    now = self._clock()
                self._cache_verdict(key, state.verdict is True, state.cache_expiry, now)

    def mark_miss(self, keys: Iterable[BlockKey]) -> None:
        """A load failed: force False now and quarantine the keys for ``quarantine_s``."""
        checked = validate_keys(keys, "keys")
        if self._lifecycle is _LIFECYCLE_CLOSED or not checked:
            return
        now = self._clock()
        until = now + self._quarantine_s
        for key in checked:
            self._verdict_cache.pop(key, None)
            if self._quarantine_s > 0:
                self._quarantine[key] = until
                self._quarantine.move_to_end(key)
            state = self._states.get(key)
            if state is not None:
                self._override(key, state, False, _SOURCE_MISS_MARKED, None, now)
        self._counters.quarantine_evictions += self._bound(self._quarantine)

    def note_stored(self, keys: Iterable[BlockKey]) -> None:
        """This tier now holds ``keys`` (our own store): True at once; lifts quarantine."""
        self._note(keys, True)

    def note_removed(self, keys: Iterable[BlockKey]) -> None:
        """This tier dropped ``keys`` (our own eviction): False at once."""
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
        self._pending.clear()
        self._inflight_batches.clear()
        self._verdict_cache.clear()
        self._quarantine.clear()
        self._breaker_trial_batch = None

    # ------------------------------------------------------------------ introspection

    def phase(self, key: BlockKey) -> LookupPhase | None:
        state = self._states.get(key)
        return None if state is None else state.phase

    @property
    def tracked_keys(self) -> int:
        """Number of live per-key states."""
        return len(self._states)

    @property
    def stats(self) -> LookupStats:
        """A snapshot copy; readable after shutdown."""
        return replace(
            self._counters,
            lookups=self._lookup_count,
            cached_verdicts=len(self._verdict_cache),
            quarantined_keys=len(self._quarantine),
            inflight_batches=len(self._inflight_batches),
            breaker_state=self._breaker_state,
        )

    # ------------------------------------------------------------------ scheduler internals

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

    def _new_state(self, key: BlockKey, req_id: str, phase: LookupPhase) -> _KeyState:
        state = _KeyState(self._next_generation, phase, requests={req_id})
        self._next_generation += 1
        self._states[key] = state
        self._index_request(req_id, key)
        return state

    def _index_request(self, req_id: str, key: BlockKey) -> None:
        request_keys = self._request_keys.get(req_id)
        if request_keys is None:
            self._request_keys[req_id] = {key}
        else:
            request_keys.add(key)

    def _lookup_untracked(self, key: BlockKey, req_context: RequestContext) -> bool | None:
        if not isinstance(key, bytes):
            raise TypeError(f"key must be a BlockKey (bytes), got {type(key).__name__}")
        if not isinstance(req_context, RequestContext):
            raise TypeError(
                f"req_context must be a RequestContext, got {type(req_context).__name__}"
            )
        req_id = req_context.req_id
        now: float | None = None
        if self._quarantine:
            until = self._quarantine.get(key)
            if until is not None:
                now = self._clock()
                if now < until:
                    self._counters.quarantine_hits += 1
                    state = self._new_state(key, req_id, _PHASE_RESOLVED)
                    state.verdict, state.source = False, _SOURCE_MISS_MARKED
                    return False
                del self._quarantine[key]
        if self._verdict_cache:
            cached = self._verdict_cache.get(key)
            if cached is not None:
                if now is None:
                    now = self._clock()
                verdict, expiry = cached
                if now < expiry:
                    self._counters.verdict_cache_hits += 1
                    self._verdict_cache.move_to_end(key)
                    state = self._new_state(key, req_id, _PHASE_RESOLVED)
                    state.verdict, state.source = verdict, _SOURCE_BACKEND
                    state.cache_expiry = expiry
                    return verdict
                del self._verdict_cache[key]
        if self._breaker_state is not _BREAKER_CLOSED:
            if now is None:
                now = self._clock()
            if not self._breaker_admits(now):
                self._counters.breaker_short_circuits += 1
                state = self._new_state(key, req_id, _PHASE_RESOLVED)
                state.verdict, state.source = False, _SOURCE_FAULT
                return False
        state = self._new_state(key, req_id, _PHASE_PENDING)
        self._pending.append((key, state.generation, req_context))
        return None

    def _reprobe_after_fault(self, key: BlockKey, state: _KeyState,
                             req_context: RequestContext) -> bool | None:
        """A request joins a key whose False came from a fault: faults are never served to later
        requests, so the key is probed again (if the breaker admits it) for everyone."""
        req_id = req_context.req_id
        state.requests.add(req_id)
        self._index_request(req_id, key)
        if self._breaker_state is not _BREAKER_CLOSED and not self._breaker_admits(self._clock()):
            self._counters.breaker_short_circuits += 1
            return False
        self._supersede(state)
        state.phase = _PHASE_PENDING
        state.verdict = state.source = state.cache_expiry = None
        state.deadline = math.inf
        self._pending.append((key, state.generation, req_context))
        return None

    def _breaker_admits(self, now: float) -> bool:
        """Whether new keys may be probed now; moves OPEN to HALF_OPEN after the cool-down."""
        breaker = self._breaker_state
        if breaker is _BREAKER_CLOSED:
            return True
        if breaker is _BREAKER_OPEN:
            if now < self._breaker_open_until:
                return False
            self._breaker_state = _BREAKER_HALF_OPEN
            self._breaker_trial_batch = None
            return True
        return self._breaker_trial_batch is None  # HALF_OPEN: only until the trial is sent

    def _breaker_record(self, batch_id: int, outcomes: Sequence[bool], now: float | None) -> None:
        if self._breaker_state is _BREAKER_HALF_OPEN:
            if batch_id != self._breaker_trial_batch:
                return  # batches sent before the breaker opened do not decide the trial
            if all(outcomes):
                self._breaker_state = _BREAKER_CLOSED
                self._breaker_failures = 0
                self._breaker_trial_batch = None
                _log.info("tier %s: circuit breaker closed", self._tier_name)
            else:
                self._open_breaker(now)
            return
        if self._breaker_state is _BREAKER_OPEN:
            return
        for succeeded in outcomes:
            if succeeded:
                self._breaker_failures = 0
                continue
            self._breaker_failures += 1
            if self._breaker_failures >= self._breaker_threshold:
                self._open_breaker(now)
                return

    def _open_breaker(self, now: float | None) -> None:
        if now is None:
            now = self._clock()
        self._breaker_state = _BREAKER_OPEN
        self._breaker_open_until = now + self._breaker_cooldown_s
        self._breaker_trial_batch = None
        self._breaker_failures = 0
        self._counters.breaker_opens += 1
        self._scheduler_log.warning(
            "breaker", "circuit breaker open for %.1fs after failed backend calls",
            self._breaker_cooldown_s)

    def _drain(self, now: float | None) -> None:
        result_queue = self._result_queue
        while True:
            try:
                result = result_queue.get_nowait()
            except queue.Empty:
                return
            self._apply(result, now)

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
        self._breaker_record(result.batch_id, result.call_outcomes, now)
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
            expiry = trusted_expiry if trusted else None
            if not state.requests:
                del states[key]
                counters.orphans_reclaimed += 1
                if expiry is not None:
                    if now is None:
                        now = self._clock()
                    self._cache_verdict(key, verdict, expiry, now)
                continue
            # _resolve() inlined: this loop runs once per probed key
            state.phase = _PHASE_RESOLVED
            state.cache_expiry = expiry
            if trusted:
                state.verdict = verdict
                state.source = _SOURCE_BACKEND
            else:
                state.verdict = False
                state.source = _SOURCE_FAULT

    def _expire_timed_out(self, now: float) -> None:
        """Resolve False every probe whose batch passed its deadline (batches are in order)."""
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
                if state.requests:
                    self._supersede(state)
                    self._resolve(state, False, _SOURCE_FAULT, None)
                else:
                    del states[key]
            self._breaker_record(batch_id, (False,), now)
        self._counters.probe_timeouts += timed_out
        self._counters.failed_calls += len(expired)
        if timed_out:
            self._scheduler_log.warning(
                "timeout", "%d probes timed out after %.3fs; answering False",
                timed_out, self._probe_timeout_s)

    def _sweep_expired(self, now: float) -> None:
        cache = self._verdict_cache
        while cache:
            key, (_, expiry) = next(iter(cache.items()))
            if expiry > now:
                break
            del cache[key]
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

    def _override(self, key: BlockKey, state: _KeyState, verdict: bool, source: _VerdictSource,
                  cache_expiry: float | None, now: float) -> None:
        if state.phase is not _PHASE_RESOLVED:
            self._supersede(state)
        self._resolve(state, verdict, source, cache_expiry)
        if not state.requests:  # an unclaimed probe in flight: nothing waits for it any more
            del self._states[key]
            if cache_expiry is not None:
                self._cache_verdict(key, verdict, cache_expiry, now)

    def _note(self, keys: Iterable[BlockKey], verdict: bool) -> None:
        checked = validate_keys(keys, "keys")
        if self._lifecycle is _LIFECYCLE_CLOSED or not checked:
            return
        now = self._clock()
        ttl = self._verdict_ttl_s
        expiry = now + ttl if ttl > 0 else None
        for key in checked:
            if verdict:
                self._quarantine.pop(key, None)
            state = self._states.get(key)
            if state is not None:
                self._override(key, state, verdict, _SOURCE_NOTED, expiry, now)
            if expiry is not None:
                self._cache_verdict(key, verdict, expiry, now)
            else:
                self._verdict_cache.pop(key, None)

    def _cache_verdict(self, key: BlockKey, verdict: bool, expiry: float, now: float) -> None:
        if expiry <= now:
            self._verdict_cache.pop(key, None)
            return
        self._verdict_cache[key] = (verdict, expiry)
        self._verdict_cache.move_to_end(key)
        self._counters.verdict_cache_evictions += self._bound(self._verdict_cache)

    def _bound(self, table: OrderedDict[BlockKey, Any]) -> int:
        """Drop the oldest entries beyond ``max_cached_verdicts``; return how many."""
        overflow = max(0, len(table) - self._max_cached_verdicts)
        for _ in range(overflow):
            table.popitem(last=False)
        return overflow

    def _violation(self, message: str, *args: object) -> None:
        self._counters.invariant_violations += 1
        self._scheduler_log.warning("invariant", "invariant violated: " + message, *args)

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

    # ------------------------------------------------------------------ test hook

    def _wait_for_results(self, timeout: float) -> bool:
        """Private, for tests: block until the worker posted a result for every sent batch."""
        target = self._next_batch_id
        with self._posted_cond:
            return self._posted_cond.wait_for(lambda: self._posted >= target, timeout)
