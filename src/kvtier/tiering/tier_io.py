"""A tier's transfer jobs on its I/O threads: splitting a job into parts, running the parts,
settling the job exactly once.

Thread ownership (the state is :class:`~kvtier.tiering.tier.SecondaryTier`'s; :class:`TierIo`
is its I/O half, mixed in):

- **Scheduler thread** starts jobs (:meth:`TierIo._start`: ``_outstanding``, the ready queues'
  appends, ``_executor.submit``) and settles expired loads (``_abandoned``, ``_counters``).
- **I/O threads** (``io_threads`` per tier, a ``ThreadPoolExecutor``) run one part of a
  :class:`~kvtier.tiering.jobs.TierJob` at a time (a store is one part; a load is split into parts
  so that its reads run in parallel), taken from the ready queues (``ready``, a
  :class:`~kvtier.tiering.ready_parts.ReadyParts`: demand loads, then stores, then prefetch
  loads; appended by the scheduler, popped by I/O threads, each part popped exactly once).
  They call the backend and record the part's answers in the job under ``_settle_lock``
  (``running``, ``parts_left``, ``partial``, ``first_error``); the thread that finishes the
  last part fills in ``results``, ``error`` and ``seconds`` and posts the job to ``_finished``
  (a ``queue.SimpleQueue``). After posting no I/O thread touches the job again; before posting
  the scheduler never reads those fields.
- The backend is thread-safe by contract. The settings (``_settings``) are read by every thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import cast

from kvtier.backends.base import Backend
from kvtier.backends.stats import RateLimitedLog
from kvtier.tiering.io_pool import IoThreadPool
from kvtier.tiering.jobs import JobKind, Part, TierJob, so_far
from kvtier.tiering.plans import LoadPriority
from kvtier.tiering.ready_parts import ReadyParts, ReadyQueue
from kvtier.tiering.tier_settings import TierSettings
from kvtier.tiering.tier_stats import TierCounters

__all__ = ["MIN_LOAD_PART_KEYS", "TierIo"]

MIN_LOAD_PART_KEYS = 8  # a load is split across I/O threads in parts of at least this many


class TierIo:
    """The I/O half of :class:`~kvtier.tiering.tier.SecondaryTier` (a mixin: the attributes
    below are the tier's, set in its ``__init__``)."""

    _name: str
    _backend: Backend
    _settings: TierSettings
    _max_keys_per_call: int | None
    _executor: IoThreadPool
    _settle_lock: threading.Lock
    _finished: queue.SimpleQueue[TierJob]
    _released: queue.SimpleQueue[TierJob]
    _abandoned: int
    _outstanding: dict[int, TierJob]
    ready: ReadyParts[Part]
    _counters: TierCounters
    _io_log: RateLimitedLog

    # ---- scheduler thread ---------------------------------------------------------------------
    def _start(self, job: TierJob) -> None:
        self._outstanding[job.job_id] = job
        parts = self._parts(job)
        job.parts_left = len(parts)
        job.partial = [False] * len(job.keys)
        self.ready.push(ReadyQueue.STORE if job.kind is JobKind.STORE else ReadyQueue.LOAD
                        if job.priority is LoadPriority.DEMAND else ReadyQueue.PREFETCH, parts)
        try:
            for _ in parts:
                self._executor.submit(self._run_next)
        except RuntimeError as exc:  # executor shut down underneath us: fail the jobs, no hang
            # Tasks already submitted each pop one part (or find none and return); every part
            # still waiting now fails its job here, so no part is run twice or left behind.
            for waiting in self.ready.drain():
                self._settle(waiting.job, (False,) * len(waiting.job.keys),
                             f"executor unavailable: {exc!r}")

    def _parts(self, job: TierJob) -> list[Part]:
        """A store is one part (its calls in order); a load is split across the I/O threads,
        as an engine's own file tier reads with parallel threads: parts of at least
        ``MIN_LOAD_PART_KEYS`` keys, at most ``max_keys_per_call``."""
        count = len(job.keys)
        if job.kind is JobKind.STORE or count == 0 or job.priority is LoadPriority.PREFETCH:
            return [Part(job, 0, count)]
        size = max(MIN_LOAD_PART_KEYS, -(-count // self._settings.io_threads))
        if self._max_keys_per_call is not None:
            size = min(size, self._max_keys_per_call)
        return [Part(job, start, min(count, start + size)) for start in range(0, count, size)]

    def _settle(self, job: TierJob, results: tuple[bool, ...] | None, error: str | None, *,
                abandon: bool = False) -> bool:
        """Make ``results`` final and post the job, unless it was already settled (then False).
        ``results`` None: what the job's finished parts answered so far (:func:`so_far`).
        ``abandon``: the job's I/O is still running (a deadline, not the I/O thread, settles it).
        """
        with self._settle_lock:
            if job.settled:
                return False
            job.results = so_far(job) if results is None else results
            job.error = error
            job.abandoned = abandon and job.running > 0
            job.settled = True
        if job.abandoned:
            self._abandoned += 1
            self._counters.loads_abandoned += 1
        self._finished.put(job)
        return True

    # ---- I/O thread ---------------------------------------------------------------------------
    def _run_next(self) -> None:
        """Run the oldest waiting load, else store, else prefetch part (one per task), then the
        part of any task that was owed meanwhile (stores over ``store_threads``)."""
        part = self.ready.pop()
        while part is not None:
            store = part.job.kind is JobKind.STORE
            try:
                self._run_part(part)
            finally:
                again = self.ready.done(store)
            part = self.ready.pop() if again else None

    def _run_part(self, part: Part) -> None:
        job = part.job
        with self._settle_lock:
            if job.settled:  # expired (or failed) before this part began: never start it
                return
            job.running += 1
            began = time.perf_counter()
            if not job.first_began:
                job.first_began = began
        answers, error = self._call(job, part.start, part.end)
        busy = time.perf_counter() - began
        with self._settle_lock:
            job.running -= 1
            job.busy_s += busy  # busy time summed over the threads that ran its parts
            job.partial[part.start : part.end] = answers
            if error is not None and job.first_error is None:
                job.first_error = error
            job.parts_left -= 1
            done = job.parts_left == 0
            released = job.abandoned and job.running == 0
        if released:  # timed out meanwhile: its keys already failed; its buffers are free now
            self._released.put(job)
            return
        if not done:
            return
        final = tuple(job.partial)
        if job.suspects:
            job.results = final
            self._read_back(job)
        job.seconds = job.busy_s
        job.wall_s = time.perf_counter() - job.first_began
        self._settle(job, final, job.first_error)

    def _call(self, job: TierJob, start: int, end: int) -> tuple[list[bool], str | None]:
        """Keys ``start:end`` of ``job`` through the backend, in calls of at most
        ``max_keys_per_call``. Keys after a failed call fail; keys moved before stay moved."""
        results: list[bool] = []
        step = self._max_keys_per_call or max(1, end - start)
        try:
            for first in range(start, end, step):
                last = min(end, first + step)
                keys = job.keys[first:last]
                if job.kind is JobKind.LOAD:
                    outs = cast("Sequence[memoryview]", job.buffers[first:last])
                    raw = self._backend.get_many(keys, outs)
                else:
                    raw = self._backend.put_many(keys, job.buffers[first:last])
                answers = [item is True for item in raw]
                if len(answers) != len(keys):
                    raise ValueError(f"backend returned {len(answers)} results for "
                                     f"{len(keys)} keys")
                results.extend(answers)
        except Exception as exc:  # an I/O thread survives everything; the job fails safe
            self._io_log.warning("tier %s: %s job of %d keys failed: %r", self._name,
                                 job.kind.value, len(job.keys), exc)
            return results + [False] * (end - start - len(results)), repr(exc)
        return results, None

    def _read_back(self, job: TierJob) -> None:
        """Store job, I/O thread: read back the stored keys whose load failed recently; the
        ones that load (frame verified by the backend) are ``job.verified``."""
        positions = [p for p in job.suspects if job.results[p]]
        if not positions:
            return
        outs = [memoryview(bytearray(memoryview(job.buffers[p]).nbytes)) for p in positions]
        try:
            loaded = self._backend.get_many([job.keys[p] for p in positions], outs)
        except Exception as exc:  # the quarantine simply stays
            self._io_log.warning("tier %s: read-back of %d re-stored keys failed: %r",
                                 self._name, len(positions), exc)
            return
        job.verified = tuple(p for p, ok in zip(positions, loaded, strict=False) if ok is True)
