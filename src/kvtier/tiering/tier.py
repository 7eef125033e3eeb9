"""A secondary tier: one backend, its lookup manager, and a pool of I/O threads for transfers.

Thread ownership:

- **Scheduler thread** (the thread that owns the :class:`~kvtier.tiering.TieringManager`) owns
  the job table (``_outstanding``), the outstanding-store accounting (``_store_bytes``,
  ``_store_jobs``), the recent load failures (``_load_failures``), the counters (``_counters``,
  which :meth:`SecondaryTier.stats` copies into a frozen ``TierStats``), the measured load cost
  (``_load_rate``, observed as load jobs are collected), the lifecycle (``_state``) and
  everything in the lookup manager. It submits jobs, and collects finished
  ones with :meth:`get_finished_jobs`.
- **I/O threads** (``io_threads`` per tier, a ``ThreadPoolExecutor``) run one part of a
  :class:`TierJob` at a time (a store is one part; a load is split into parts so that its
  reads run in parallel), taken from the ready queues (``ready``, a
  :class:`~kvtier.tiering.ready_parts.ReadyParts`: loads, then stores, then prefetch loads;
  appended by the scheduler, each part popped exactly once by an I/O thread). They call the
  backend and record the part's answers in the job under ``_settle_lock`` (``running``,
  ``parts_left``, ``partial``, ``first_error``); the
  thread that finishes the last part fills in ``results``, ``error`` and ``seconds`` and posts
  the job to ``_finished`` (a ``queue.SimpleQueue``). After posting no I/O thread touches the
  job again; before posting the scheduler never reads those fields.
- **Probe worker** (inside the lookup manager) calls ``backend.probe`` and observes its
  duration (``metrics``: thread-safe).
- The backend is thread-safe by contract. The settings (``_settings``, a frozen
  :class:`~kvtier.tiering.tier_settings.TierSettings`) are read by every thread.

Transfers, deadlines and backpressure: see :class:`SecondaryTier`. The jobs are in
tiering/jobs.py, their I/O-thread half (parts, backend calls, settling) in tiering/tier_io.py,
the lookup manager and the recent load failures in tiering/tier_lookup.py.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvtier.backends.base import Backend, Buffer
from kvtier.backends.stats import RateLimitedLog
from kvtier.errors import ClosedError
from kvtier.keys import BlockKey, RequestContext
from kvtier.lookup.manager import AsyncLookupManager
from kvtier.lookup.settings import LOOKUP_SETTINGS
from kvtier.ops.metrics import ProbeMetrics
from kvtier.settings import Kind, Setting
from kvtier.tiering.io_pool import IoThreadPool
from kvtier.tiering.jobs import JobKind, Part, TierJob
from kvtier.tiering.load_rate import LoadRate
from kvtier.tiering.payoff import blocks_worth_loading
from kvtier.tiering.plans import LoadPriority
from kvtier.tiering.ready_parts import ReadyParts
from kvtier.tiering.tier_io import TierIo
from kvtier.tiering.tier_lookup import BackendLookupManager, RecentLoadFailures
from kvtier.tiering.tier_settings import LookupConfig, TierSettings
from kvtier.tiering.tier_stats import TierCounters, TierStats

# JobKind and TierJob (tiering/jobs.py) are re-exported: the tier's callers name them from here.
__all__ = ["IO_YIELD_S", "JobKind", "LookupFactory", "SecondaryTier", "TierClosedError",
           "TierJob"]

_MAX_KEYS_PER_CALL = Setting("max_keys_per_call", Kind.INT, None,
                             "keys per backend get/put call (None: no limit)", minimum=1)

_log = logging.getLogger("kvtier.tiering.tier")
# How long an engine's scheduler thread waits, at the end of a step with transfers or probes in
# flight, so that they get the GIL: a thread that never blocks keeps it for Python's whole switch
# interval (5 ms) each time an I/O thread returns from a system call, and a file transfer makes
# several per block. Used by the TieringManager and by the vLLM KvtierTier.
IO_YIELD_S = 0.0005
_PROBE_SHUTDOWN_WAIT_S = 2.0


def _within_block_lifetime(options: Mapping[str, Any], backend: Backend) -> Mapping[str, Any]:
    """``options`` with ``stored_verdict_ttl_s`` no longer than the blocks live in ``backend``
    (a verdict of our own store must not outlive the block it vouches for)."""
    lifetime = backend.block_lifetime_s
    if lifetime is None:
        return options
    trusted = options.get("stored_verdict_ttl_s",
                          LOOKUP_SETTINGS["stored_verdict_ttl_s"].default)
    return {**options, "stored_verdict_ttl_s": min(trusted, lifetime)}


LookupFactory = Callable[[str, Backend, Mapping[str, Any]], AsyncLookupManager]


TierClosedError = ClosedError  # the one closed error; this name is kept for callers


class _TierState(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"


class SecondaryTier(TierIo):
    """A backend + its :class:`AsyncLookupManager` + transfer jobs on I/O threads.

    A load job reads straight into caller-provided ``memoryview``s (primary slots that the caller
    keeps out of reach of eviction while the job runs) and the backend verifies the frame there
    (namespace, key, length, checksum): one pass over the bytes, no scratch copy. On failure the
    buffers' contents are unspecified; the caller must not publish them. A load past its deadline is
    settled at once: the keys of its parts that finished are delivered, the others fail, and the
    job is marked ``abandoned`` when a part still runs: its stuck backend call may still write the
    buffers of its keys, so the caller keeps the failed keys' buffers out of use until
    :meth:`SecondaryTier.take_released_loads` returns the job (its I/O ended; I/O threads post
    it to ``_released``, a ``queue.SimpleQueue``).
    A store job reads caller-provided buffers that must stay unchanged until the job is collected.

    Backpressure: a tier accepts at most ``max_pending_store_jobs`` outstanding store jobs and
    ``max_pending_store_bytes`` of outstanding store payload (one job is always accepted when none
    is outstanding). :meth:`submit_store` sheds (returns None, counts) what does not fit, so a slow
    or dead tier never stalls the engine. Loads are never shed, and they go first: an idle I/O
    thread takes the oldest waiting load before any waiting store, so a promotion a request waits
    for never queues behind a backlog of cascades.

    A load of more than ``MIN_LOAD_PART_KEYS`` keys is split into up to ``io_threads`` parts that
    run side by side (with ``max_keys_per_call``, parts of at most that many keys); a store runs its
    keys in consecutive calls of at most ``max_keys_per_call`` (one I/O thread, in order). A call
    that raises or answers short fails its keys and the rest of its part; keys moved by other calls
    stay moved.
    """

    def __init__(
        self,
        name: str,
        backend: Backend,
        settings: TierSettings | None = None,
        *,
        lookup: LookupConfig | Mapping[str, Any] | None = None,
        metrics: ProbeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        lookup_factory: LookupFactory | None = None,
        max_keys_per_call: int | None = None,
        on_evicted: Callable[[list[BlockKey]], None] | None = None,
        **settings_values: Any,
    ) -> None:
        """``settings``: the tier's I/O settings (None: the defaults). ``settings_values``
        (``io_threads=2``, ...) is the keyword spelling of the same record, for callers that
        have no record (``open_manager`` today); it cannot be combined with ``settings``.
        ``lookup_factory(name, backend, options)`` replaces the default lookup manager (one
        ``backend.probe`` call per probe batch); ``options`` are the configured lookup settings
        plus ``clock``, which also times quarantines and load deadlines. ``max_keys_per_call``
        (None: no limit) splits each job's backend calls. The keys the backend evicts itself
        are ``note_removed`` at the next flush or collection, then passed to ``on_evicted``.
        Bad settings raise :class:`~kvtier.settings.ConfigError` (a ValueError) naming them."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"tier name must be a non-empty str, got {name!r}")
        if settings is not None and settings_values:
            raise TypeError(f"tier {name!r}: pass settings or {sorted(settings_values)}, not both")
        if settings is None:
            settings = TierSettings.parse(settings_values, f"tier {name!r}")
        if max_keys_per_call is not None:
            _MAX_KEYS_PER_CALL.parse(max_keys_per_call, f"tier {name!r}: max_keys_per_call")
        if isinstance(lookup, LookupConfig):
            lookup_options: Mapping[str, Any] = lookup.as_kwargs()
        elif lookup is None:
            lookup_options = {}
        else:
            lookup_options = LookupConfig.from_dict(lookup, f"tier {name}: lookup").as_kwargs()
        lookup_options = _within_block_lifetime(lookup_options, backend)
        self._name = name
        self._backend = backend
        self._evicted = backend.evicted  # one attribute read, not a wrapper's __getattr__ a step
        self._on_evicted = on_evicted
        self._clock = clock  # lookups, quarantines and load deadlines
        self._lookup: AsyncLookupManager = (
            BackendLookupManager(name, backend, metrics, clock, lookup_options)
            if lookup_factory is None
            else lookup_factory(name, backend, {**lookup_options, "clock": clock})
        )
        self._load_failures = RecentLoadFailures(self._lookup.quarantine_s, clock)
        self._settings = settings
        self.io_threads = settings.io_threads  # read-only: the prefetcher's I/O budget
        self._max_keys_per_call = max_keys_per_call
        self._executor = IoThreadPool(settings.io_threads, f"kvtier-io-{name}")
        self._load_deadlines: deque[TierJob] = deque()  # loads in submission order
        self._settle_lock = threading.Lock()  # a job's results are settled exactly once
        self._finished: queue.SimpleQueue[TierJob] = queue.SimpleQueue()
        self._released: queue.SimpleQueue[TierJob] = queue.SimpleQueue()  # abandoned, I/O over
        self._abandoned = 0  # abandoned loads not yet released (scheduler thread)
        self._loads_outstanding = 0  # load jobs submitted and not yet collected
        self._prefetch_outstanding = 0  # of them, prefetch loads (nobody waits for those)
        self._outstanding: dict[int, TierJob] = {}
        stores = settings.store_threads or backend.parallel_stores
        self.ready: ReadyParts[Part] = ReadyParts(  # public: a prefetch load is expedited
            stores if stores is not None and stores < settings.io_threads else None)
        self._job_ids = itertools.count()
        self._store_bytes = 0
        self._store_jobs = 0
        self._counters = TierCounters()
        self._load_rate = LoadRate(clock=clock)  # measured on collect, asked on lookups
        self._state = _TierState.RUNNING
        self._io_log = RateLimitedLog(_log)

    # ---- identity ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def lookup_manager(self) -> AsyncLookupManager:
        return self._lookup

    @property
    def store_stall_s(self) -> float:
        """How long a store backlog is waited for without a finished job (back-pressure)."""
        return self._settings.store_stall_s

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` has stopped the tier."""
        return self._state is _TierState.CLOSED

    # ---- lookups (scheduler thread) -----------------------------------------------------------
    def lookup(self, key: BlockKey, req_context: RequestContext) -> bool | None:
        verdict = self._lookup.lookup(key, req_context)
        if verdict is not None:
            self._counters.lookup_answers += 1
            self._counters.lookup_hits += verdict
        return verdict

    def flush(self) -> None:
        self._forget_evicted()
        self._lookup.flush()

    def _forget_evicted(self) -> None:
        """Stop vouching for the blocks the backend evicted itself. Run before a collection
        applies its stores, so a key evicted, then stored again, ends up present. An eviction
        noted after that point whose key's new store is collected in the same call is applied
        at the next flush and leaves the key absent although it is stored: a lost hit (the
        block is recomputed and stored again), never a wrong block."""
        evicted = self._evicted.take()
        if not evicted or self._state is not _TierState.RUNNING:
            return
        self._lookup.note_removed(evicted)
        if self._on_evicted is not None:
            self._on_evicted(evicted)

    def blocks_worth_loading(self, blocks: int, block_bytes: int) -> int:
        """How many of ``blocks`` leading blocks of ``block_bytes`` each are worth loading from
        this tier rather than recomputing (:func:`~kvtier.tiering.payoff.blocks_worth_loading`
        on this tier's measured cost, its load deadline and ``prefill_tokens_per_s``; all of
        them while that is unset). The caller counts what it declines (:meth:`count_declined`).
        A tier declined on an estimate older than a minute lets one block through, once a
        minute, so it measures itself again (:class:`~kvtier.tiering.load_rate.LoadRate`).
        """
        prefill = self._settings.prefill_tokens_per_s
        if prefill is None:
            return blocks
        rate = self._load_rate
        worth = blocks_worth_loading(
            blocks, block_bytes=block_bytes,
            tokens_per_block=self._backend.namespace.block_size, cost=rate.cost(),
            prefill_tokens_per_s=prefill, deadline_s=self._settings.load_timeout_s)
        if worth == 0 and blocks and rate.stale:
            rate.remeasure()
            return 1
        return worth

    def count_declined(self, blocks: int) -> None:
        """``blocks`` hits of this tier were answered absent: loading them would not pay."""
        self._counters.loads_declined += blocks

    @property
    def load_rate(self) -> LoadRate:
        return self._load_rate

    def cleanup(self, req_id: str) -> None:
        self._lookup.cleanup(req_id)

    def remove(self, keys: Sequence[BlockKey]) -> None:
        """Delete ``keys`` from the backend (blocking) and tell the lookup manager at once."""
        self._require_running("remove")
        self._backend.delete(keys)
        self._lookup.note_removed(keys)

    # ---- transfers (scheduler thread) ---------------------------------------------------------
    def submit_load(self, keys: Sequence[BlockKey], outs: Sequence[memoryview],
                    priority: LoadPriority = LoadPriority.DEMAND) -> TierJob:
        """Start loading ``keys`` into ``outs`` on an I/O thread; never blocks, never sheds.
        A ``PREFETCH`` load is one part, run when no other part waits (``ready.expedite``)."""
        self._require_running("submit_load")
        if len(keys) != len(outs):
            raise ValueError(f"submit_load got {len(keys)} keys but {len(outs)} buffers")
        job = TierJob(next(self._job_ids), JobKind.LOAD, tuple(keys), tuple(outs),
                          sum(out.nbytes for out in outs),
                          deadline=self._clock() + self._settings.load_timeout_s,
                          priority=priority)
        self._load_deadlines.append(job)
        self._loads_outstanding += 1
        if priority is LoadPriority.PREFETCH:
            self._prefetch_outstanding += 1
        self._counters.loads_submitted += 1
        self._counters.load_keys += len(keys)
        self._start(job)
        return job

    def can_accept_store(self, nbytes: int) -> bool:
        """Whether a store job of ``nbytes`` would be accepted now (backpressure)."""
        if self._store_jobs >= self._settings.max_pending_store_jobs:
            return False
        limit = self._settings.max_pending_store_bytes
        return self._store_jobs == 0 or self._store_bytes + nbytes <= limit

    def submit_store(self, keys: Sequence[BlockKey],
                     payloads: Sequence[Buffer]) -> TierJob | None:
        """Start storing on an I/O thread; None (shed, counted) when the tier is backlogged."""
        self._require_running("submit_store")
        if len(keys) != len(payloads):
            raise ValueError(f"submit_store got {len(keys)} keys but {len(payloads)} payloads")
        nbytes = sum(memoryview(payload).nbytes for payload in payloads)
        if not self.can_accept_store(nbytes):
            self._counters.stores_shed += 1
            self._counters.store_keys_shed += len(keys)
            return None
        job = TierJob(next(self._job_ids), JobKind.STORE, tuple(keys), tuple(payloads),
                          nbytes)
        if len(self._load_failures):
            failures = self._load_failures
            job.suspects = tuple(i for i, key in enumerate(job.keys) if failures.contains(key))
        self._store_bytes += nbytes
        self._store_jobs += 1
        self._counters.stores_submitted += 1
        self._counters.store_keys += len(keys)
        self._start(job)
        return job

    def count_store_wait(self, seconds: float, *, stalled: bool) -> None:
        """The scheduler waited ``seconds`` for this tier's store backlog (back-pressure);
        ``stalled``: the wait ended because the tier finished nothing within its stall time."""
        self._counters.store_waits += 1
        self._counters.store_wait_seconds += seconds
        self._counters.store_stalls += stalled

    def count_shed(self, keys: int) -> None:
        """``keys`` cascades to this tier were shed by the manager before submission."""
        self._counters.stores_shed += 1
        self._counters.store_keys_shed += keys

    def get_finished_jobs(self, *, wait: bool = False, timeout: float | None = None,
                          prefetch: bool = True) -> list[TierJob]:
        """Collect finished jobs and apply their effects on the lookup manager.

        A failed load key is ``mark_miss``-ed (quarantined); a stored key is ``note_stored``.
        ``wait=True`` blocks until no job is outstanding (or ``timeout`` s passed) — for
        shutdown and tests, never on the engine's hot path; with ``prefetch=False`` it stops
        waiting once only prefetch loads are outstanding.
        """
        finished: list[TierJob] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        self._forget_evicted()
        self._expire_loads()
        while True:
            try:
                job = self._finished.get_nowait()
            except queue.Empty:
                if not wait or len(self._outstanding) <= (0 if prefetch
                                                          else self._prefetch_outstanding):
                    break
                now = time.monotonic()
                if deadline is not None and deadline <= now:
                    break
                # Wake up for the next load deadline too: an expired load is finished.
                wait_s = min(float("inf") if deadline is None else deadline - now,
                             self._load_deadlines[0].deadline - self._clock()
                             if self._load_deadlines else float("inf"))
                try:
                    job = self._finished.get(timeout=None if wait_s == float("inf")
                                             else max(0.0, wait_s))
                except queue.Empty:
                    self._expire_loads()
                    continue
            self._collect(job)
            finished.append(job)
        return finished

    def _expire_loads(self) -> None:
        """Settle every load job past its deadline (scheduler thread): the keys of the parts
        that finished keep their answers (delivered), the others fail. One still running is
        ``abandoned``: its buffers stay the caller's to keep out of use until it is released."""
        pending = self._load_deadlines
        now = self._clock()
        while pending and (pending[0].settled or pending[0].deadline <= now):
            job = pending.popleft()
            limit = self._settings.load_timeout_s
            if self._settle(job, None, f"load timed out after {limit:g} s", abandon=True):
                self._load_rate.observe(job.nbytes, limit)  # at least this slow
                self._io_log.warning("tier %s: load job of %d keys timed out after %g s; %d "
                                     "keys of finished parts delivered", self._name,
                                     len(job.keys), limit, sum(job.results))

    def take_released_loads(self, wait_s: float = 0.0) -> list[TierJob]:
        """Abandoned load jobs whose backend call has ended since the last call (scheduler
        thread): their buffers will not be written any more and may be reused. ``wait_s``:
        wait up to that long for every abandoned load to end (shutdown and tests)."""
        released: list[TierJob] = []
        deadline = time.monotonic() + wait_s
        while len(released) < self._abandoned:  # each released job was counted abandoned
            remaining = deadline - time.monotonic()
            try:
                released.append(self._released.get(timeout=remaining) if remaining > 0
                                else self._released.get_nowait())
            except queue.Empty:
                break
        self._abandoned -= len(released)
        return released

    def yield_to_io(self, timeout: float, *, stores: bool = True) -> list[TierJob]:
        """With transfers (loads only, ``stores=False``) or else probes in flight, wait at most
        ``timeout`` for them, which hands the GIL to their threads (see :data:`IO_YIELD_S`);
        returns the jobs collected meanwhile (scheduler thread). Prefetch loads are not waited
        for: nobody waits for them, and a step that waited for them would be as long as their
        I/O (they run in the time the scheduler leaves idle anyway). With loads only, a load is
        waited for only once one is due within ``timeout`` by the measured load rate (or
        overdue: starved of the GIL, it gets the wait every step), so a load that spans many
        steps does not lengthen each of them; until then, probes in flight are."""
        background = self._prefetch_outstanding
        if stores and len(self._outstanding) > background:
            return self.get_finished_jobs(wait=True, timeout=timeout, prefetch=False)
        if self._loads_outstanding > background and self._a_load_is_due(timeout):
            return self.get_finished_jobs(wait=True, timeout=timeout, prefetch=False)
        if self._lookup.probes_in_flight:
            self._lookup.wait_for_probes(timeout)
        return []

    def _a_load_is_due(self, within_s: float) -> bool:
        """Whether a demand load job in flight should end within ``within_s`` by the measured
        load rate (one that has not begun counts from now; unmeasured, every load is due)."""
        cost = self._load_rate.cost()
        now = time.perf_counter()
        for job in self._outstanding.values():
            if job.kind is JobKind.LOAD and job.priority is not LoadPriority.PREFETCH:
                began = job.first_began or now  # a float set once by an I/O thread
                if began + cost.seconds(job.nbytes) - now <= within_s:
                    return True
        return False

    def _collect(self, job: TierJob) -> None:
        if self._outstanding.pop(job.job_id, None) is None:
            self._counters.invariant_violations += 1
            _log.warning("tier %s: finished job %d was not outstanding", self._name, job.job_id)
            return
        if len(job.results) != len(job.keys):
            self._counters.invariant_violations += 1
            job.results = (False,) * len(job.keys)
        if job.error is not None:
            self._counters.job_errors += 1
        moved = sum(memoryview(buffer).nbytes
                    for buffer, ok in zip(job.buffers, job.results, strict=True) if ok)
        if job.kind is JobKind.LOAD:
            self._loads_outstanding -= 1
            failed = job.failed
            self._counters.loaded_keys += len(job.keys) - len(failed)
            self._counters.read_bytes += moved
            self._counters.read_seconds += job.seconds
            if job.priority is LoadPriority.PREFETCH:
                self._prefetch_outstanding -= 1  # its wall time includes its wait: no rate
            elif job.error is None:
                self._load_rate.observe(moved, job.wall_s)
            if failed:
                self._counters.load_keys_failed += len(failed)
                if self._state is _TierState.RUNNING:
                    self._lookup.mark_miss(failed)
                    self._load_failures.add(failed)
        else:
            self._store_bytes -= job.nbytes
            self._store_jobs -= 1
            stored = job.succeeded
            if job.suspects:
                self._counters.store_keys_read_back += sum(1 for p in job.suspects
                                                           if job.results[p])
            if job.verified:
                good = [job.keys[position] for position in job.verified]
                self._load_failures.discard(good)  # a verified new object: quarantine ends
                self._counters.quarantines_lifted += len(good)
            if stored and self._state is _TierState.RUNNING:
                self._lookup.note_stored(self._load_failures.without(stored))
            self._counters.stored_keys += len(stored)
            self._counters.store_keys_failed += len(job.keys) - len(stored)
            self._counters.write_bytes += moved
            self._counters.write_seconds += job.seconds

    # ---- introspection ------------------------------------------------------------------------
    @property
    def outstanding_jobs(self) -> int:
        return len(self._outstanding)

    def stats(self) -> TierStats:
        """A typed snapshot: lookup counters, transfer counters, the backend's counters."""
        backend_stats: Mapping[str, Any] | None
        try:
            backend_stats = dict(self._backend.stats())  # a copy: asdict() deep-copies it
        except Exception as exc:
            backend_stats = None
            _log.debug("tier %s: backend stats unavailable: %r", self._name, exc)
        return TierStats(
            lookup=self._lookup.stats, counters=replace(self._counters),
            tracked_keys=self._lookup.tracked_keys, outstanding_jobs=len(self._outstanding),
            outstanding_store_bytes=self._store_bytes, abandoned_loads=self._abandoned,
            backend=backend_stats)

    # ---- lifecycle ----------------------------------------------------------------------------
    def _require_running(self, operation: str) -> None:
        if self._state is _TierState.CLOSED:
            raise TierClosedError(f"tier {self._name!r} is shut down; {operation}() is not "
                                  "allowed any more")

    def shutdown(self, timeout: float | None = None) -> list[TierJob]:
        """Wait for outstanding jobs (up to ``timeout`` s), stop every thread, close the backend.

        Returns the jobs collected while waiting. Idempotent.
        """
        if self._state is _TierState.CLOSED:
            return []
        finished = self.get_finished_jobs(wait=True, timeout=timeout)
        self._state = _TierState.CLOSED
        # A probe stuck in the backend is abandoned quickly: its answer would be discarded
        # anyway, and the probe worker is a daemon thread.
        probe_wait = _PROBE_SHUTDOWN_WAIT_S if timeout is None else min(timeout,
                                                                         _PROBE_SHUTDOWN_WAIT_S)
        self._lookup.shutdown(probe_wait)
        self._executor.shutdown(probe_wait if not self._outstanding else 0.0)
        if self._outstanding:
            _log.warning("tier %s: %d transfer jobs still running at shutdown; abandoned",
                         self._name, len(self._outstanding))
        try:
            self._backend.close()
        except Exception as exc:
            _log.warning("tier %s: backend close failed: %r", self._name, exc)
        return finished
