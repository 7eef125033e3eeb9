"""``KvtierTier``: a vLLM secondary tier (``vllm/v1/kv_offload/tiering``) on a kvtier backend.

vLLM's ``TieringOffloadingManager`` owns the CPU primary tier (one shared memory region of
fixed-size chunks) and drives every secondary tier from the scheduler thread: ``lookup`` each
chunk key, ``on_schedule_end`` once per step, ``submit_store`` / ``submit_load`` with the
primary chunk ids of a job, ``get_finished_jobs`` to collect results. This tier answers
lookups with kvtier's non-blocking :class:`~kvtier.lookup.AsyncLookupManager` and moves bytes
between the primary region and any kvtier backend (``memory://``, ``file://``, ``redis://``,
``redis+cluster://``, ``s3://``) on its own I/O threads. Every block loaded is verified (frame
magic, namespace, key echo, length, checksum) by the backend before a byte of it reaches the
primary region; a damaged or missing block fails only that key of the job and is marked
missing, so vLLM keeps the good prefix and recomputes the rest.

Threads and state ownership:

- Scheduler thread (vLLM's scheduler; every public method): ``_jobs`` (in-flight transfer
  jobs), ``_lookup`` (the lookup manager's scheduler-side state), ``_unloadable``, ``_events``,
  ``_reported_totals`` and ``_counters``, ``_lifecycle``.
- I/O threads (``_io_pool``): run one job at a time each, read or write the primary chunks the
  job names (vLLM pins them until the job is reported), call the backend, and hand the job's
  outcome back through ``_outcomes`` (a ``queue.SimpleQueue``). They touch nothing else.
- The lookup manager's probe thread calls ``backend.probe`` (backends are thread-safe); it
  touches no primary memory, so ``shutdown()`` waits for it only briefly
  (``_PROBE_SHUTDOWN_WAIT_S``) and then abandons a call stuck in the backend.
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from kvtier.backends import Backend, open_backend, redact_url
from kvtier.keys import BlockKey, Namespace, RequestContext
from kvtier.lookup import BreakerState, LookupStats
from kvtier.tier import BackendLookupManager, RecentLoadFailures

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

_log = logging.getLogger(__name__)

_LOOKUP_SETTINGS = (
    "probe_timeout_s",
    "verdict_ttl_s",
    "max_cached_verdicts",
    "quarantine_s",
    "max_batch_keys",
    "breaker_threshold",
    "breaker_cooldown_s",
)
_NAMESPACE_OVERRIDES = ("model", "revision", "tenant")
_REMOTE_SCHEMES = ("redis", "rediss", "redis+cluster", "s3")
_METRIC_PREFIX = "vllm:kvtier_"  # vLLM exports (and LLM.get_metrics reads) vllm:* only
# How long shutdown() waits for a probe stuck in the backend: its answer would be discarded,
# and vLLM's shutdown must not wait for a slow backend's full timeout.
_PROBE_SHUTDOWN_WAIT_S = 2.0


class KvtierTierClosedError(RuntimeError):
    """A ``KvtierTier`` was used after ``shutdown()``."""


class KvtierTierContractError(RuntimeError):
    """vLLM handed the tier a job that breaks the secondary-tier contract."""


class _Lifecycle(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class _JobKind(enum.Enum):
    LOAD = "load"  # backend -> primary (vLLM: promotion)
    STORE = "store"  # primary -> backend (vLLM: cascade)


@dataclass(slots=True)
class _Job:
    job_id: int
    kind: _JobKind
    keys: list[BlockKey]
    future: Future[None] | None = None


@dataclass(slots=True)
class _Outcome:
    """What an I/O thread reports for one job: one verdict per key, in job order."""

    job_id: int
    kind: _JobKind
    ok: list[bool]
    seconds: float
    transferred_bytes: int
    error: str | None = None


@dataclass(slots=True)
class _TierCounters:
    """Transfer counters of one tier, owned by the scheduler thread."""

    load_jobs: int = 0
    store_jobs: int = 0
    blocks_loaded: int = 0
    blocks_load_failed: int = 0
    blocks_stored: int = 0
    blocks_store_failed: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    io_errors: int = 0


@dataclass(slots=True)
class _ReportedTotals:
    """Counter values already handed to vLLM's metrics, so each report carries deltas."""

    values: dict[str, int] = field(default_factory=dict)


def _parse_lookup_settings(raw: object) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"KvtierTier option 'lookup' must be a mapping of {list(_LOOKUP_SETTINGS)}, got "
            f"{type(raw).__name__} {raw!r}"
        )
    unknown = sorted(set(raw) - set(_LOOKUP_SETTINGS))
    if unknown:
        raise ValueError(
            f"unknown KvtierTier lookup setting(s) {unknown}; expected some of "
            f"{list(_LOOKUP_SETTINGS)}"
        )
    return dict(raw)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"KvtierTier option {name!r} must be an int >= 1, got {value!r}")
    return value


def namespace_for(
    offloading_spec: OffloadingSpec, chunk_bytes: int, overrides: Mapping[str, str]
) -> Namespace:
    """The kvtier namespace of one vLLM deployment's offloaded chunks.

    Everything that changes the bytes of a chunk for the same tokens is in it: the model, the KV
    dtype, the KV cache layout, the chunk size in tokens and bytes, the offloaded cache groups
    and the parallel layout (a primary chunk holds every worker's share). vLLM's block hashes
    themselves only cover tokens, so without this two models could read each other's blocks.
    """
    config = offloading_spec.config
    group_ids = ",".join(str(group.group_id) for group in config.groups)
    tokens_per_block = ",".join(str(group.tokens_per_block) for group in config.groups)
    parallel = config.parallel
    kv_layout = (
        f"vllm;layout={config.kv_cache_layout or 'default'};groups={group_ids}"
        f";tokens_per_block={tokens_per_block};blocks_per_chunk={config.cache.blocks_per_chunk}"
        f";chunk_bytes={chunk_bytes};tp={parallel.tp_size};pp={parallel.pp_size}"
        f";pcp={parallel.pcp_size};dcp={parallel.dcp_size}"
        f";canonical={bool(config.canonical_layout)};replicated={bool(config.replicated_layout)}"
    )
    tokens_per_chunk = config.groups[0].tokens_per_block * config.cache.blocks_per_chunk
    return Namespace(
        model=overrides.get("model") or config.model.name,
        revision=overrides.get("revision", ""),
        dtype=config.model.dtype,
        kv_layout=kv_layout,
        block_size=int(tokens_per_chunk),
        world_size=max(1, int(parallel.world_size)),
        rank=0,
        tenant=overrides.get("tenant", ""),
    )


class KvtierTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier storing offloaded KV chunks in a kvtier backend.

    Configured as one entry of ``secondary_tiers``::

        {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
         "url": "redis://127.0.0.1:6379/0",       # any kvtier backend URL
         "io_threads": 4, "max_blocks_per_call": 32,
         "lookup": {"quarantine_s": 30, "probe_timeout_s": 5},
         "tenant": "", "revision": "", "model": "",  # namespace overrides
         "locality": "REMOTE", "enable_kv_events": false,
         ...backend options (e.g. "ttl_s", "max_bytes", "fsync")}

    Scheduler-side methods are called by vLLM on its scheduler thread only and are not
    thread-safe.
    """

    medium: ClassVar[Medium | None] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        url: str | None = None,
        io_threads: int = 4,
        max_blocks_per_call: int = 32,
        lookup: Mapping[str, Any] | None = None,
        locality: str | None = None,
        enable_kv_events: bool = False,
        model: str = "",
        revision: str = "",
        tenant: str = "",
        **backend_options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(url, str) or not url:
            raise ValueError(
                f"KvtierTier needs a 'url' naming a kvtier backend (memory://, file:///abs/path,"
                f" redis://host:port/db, redis+cluster://host:port, s3://bucket/prefix), got "
                f"{url!r}"
            )
        io_threads = _positive_int("io_threads", io_threads)
        self._max_blocks_per_call = _positive_int("max_blocks_per_call", max_blocks_per_call)
        lookup_settings = _parse_lookup_settings(lookup)
        overrides = {"model": model, "revision": revision, "tenant": tenant}
        for name, value in overrides.items():
            if not isinstance(value, str):
                raise ValueError(f"KvtierTier option {name!r} must be a str, got {value!r}")
        if locality is None:
            scheme = url.partition("://")[0].lower()
            self.locality = Locality.REMOTE if scheme in _REMOTE_SCHEMES else Locality.LOCAL
        else:
            try:
                self.locality = Locality(str(locality).upper())
            except ValueError:
                raise ValueError(
                    f"KvtierTier option 'locality' must be 'LOCAL' or 'REMOTE', got {locality!r}"
                ) from None

        self._chunk_bytes = self.block_size_bytes
        self._num_chunks = primary_kv_view.nbytes // self._chunk_bytes
        self._namespace = namespace_for(offloading_spec, self._chunk_bytes, overrides)
        self._backend: Backend = open_backend(url, self._namespace, **backend_options)
        self._url = redact_url(url)
        try:
            self._lookup = BackendLookupManager(self._url, self._backend, options=lookup_settings)
        except Exception:
            self._backend.close()
            raise
        # Taken last: this view pins vLLM's primary mmap until shutdown() releases it, so a
        # failed constructor must not leave one behind.
        self._primary_bytes = primary_kv_view.cast("B")
        self._io_pool = ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix=f"kvtier-io-{tier_type}"
        )
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._jobs: dict[int, _Job] = {}
        # A store of a key whose load just failed must not lift its quarantine (see
        # RecentLoadFailures): the backend may be keeping the very object that failed.
        self._unloadable = RecentLoadFailures(self._lookup.quarantine_s)
        self._counters = _TierCounters()
        self._reported = _ReportedTotals()
        emit_events = bool(enable_kv_events) and bool(
            offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self._events: list[OffloadingEvent] | None = [] if emit_events else None
        self._lifecycle = _Lifecycle.OPEN
        _log.info(
            "kvtier tier %s: %s, %d chunks of %d bytes, namespace %s",
            tier_type, self._url, self._num_chunks, self._chunk_bytes,
            self._namespace.digest_hex,
        )

    # -- introspection ----------------------------------------------------------------------

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def url(self) -> str:
        """The backend URL with credentials redacted."""
        return self._url

    def stats_snapshot(self) -> dict[str, int]:
        """Every counter: transfers, lookups (``lookup_*``) and the backend's (``backend_*``)."""
        snapshot: dict[str, int] = {
            item.name: int(getattr(self._counters, item.name)) for item in fields(_TierCounters)
        }
        lookup_stats = self._lookup.stats
        for item in fields(LookupStats):
            value = getattr(lookup_stats, item.name)
            if isinstance(value, BreakerState):
                snapshot["lookup_breaker_open"] = int(value is not BreakerState.CLOSED)
            else:
                snapshot[f"lookup_{item.name}"] = int(value)
        for name, value in self._backend.stats().items():
            snapshot[f"backend_{name}"] = int(value)
        snapshot["jobs_in_flight"] = len(self._jobs)
        return snapshot

    # -- lookups ----------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._require_open("on_new_request")
        req_context.set_state(RequestContext(req_context.req_id))
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        context = req_context.get_state(RequestContext)
        if context is None:
            context = RequestContext(req_context.req_id)
            req_context.set_state(context)
        verdict = self._lookup.lookup(bytes(key), context)
        if verdict is None:
            return LookupResult.RETRY
        return LookupResult.HIT if verdict else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lifecycle is _Lifecycle.OPEN:
            self._lookup.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lifecycle is _Lifecycle.OPEN:
            self._lookup.cleanup(req_context.req_id)

    # -- transfers --------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, _JobKind.STORE)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, _JobKind.LOAD)

    def _submit(self, job_metadata: TransferJob, kind: _JobKind) -> None:
        self._require_open(f"submit_{kind.value}")
        job_id = int(job_metadata.job_id)
        keys = [bytes(key) for key in job_metadata.keys]
        slots = [int(chunk) for chunk in job_metadata.chunk_ids]
        if job_id in self._jobs:
            raise KvtierTierContractError(f"KvtierTier: job {job_id} was submitted twice")
        if len(keys) != len(slots):
            raise KvtierTierContractError(
                f"KvtierTier: job {job_id} has {len(keys)} keys but {len(slots)} chunk ids"
            )
        bad = [slot for slot in slots if not 0 <= slot < self._num_chunks]
        if bad:
            raise KvtierTierContractError(
                f"KvtierTier: job {job_id} names chunk ids {bad[:4]} outside the primary region "
                f"of {self._num_chunks} chunks"
            )
        job = _Job(job_id, kind, keys)
        self._jobs[job_id] = job
        job.future = self._io_pool.submit(self._run_job, job_id, kind, keys, slots)

    def _slot_view(self, slot: int) -> memoryview:
        start = slot * self._chunk_bytes
        return self._primary_bytes[start : start + self._chunk_bytes]

    def _run_job(
        self, job_id: int, kind: _JobKind, keys: list[BlockKey], slots: list[int]
    ) -> None:
        """I/O thread: move one job's chunks, then post its outcome (always exactly once)."""
        started = time.perf_counter()
        ok = [False] * len(keys)
        error: str | None = None
        try:
            step = self._max_blocks_per_call
            for start in range(0, len(keys), step):
                batch_keys = keys[start : start + step]
                views = [self._slot_view(slot) for slot in slots[start : start + step]]
                if kind is _JobKind.STORE:
                    answers = self._backend.put_many(batch_keys, views)
                else:
                    answers = self._backend.get_many(batch_keys, views)
                if len(answers) != len(batch_keys):
                    error = (
                        f"backend answered {len(answers)} verdicts for {len(batch_keys)} keys"
                    )
                    break
                ok[start : start + len(batch_keys)] = [answer is True for answer in answers]
        except Exception as exc:  # the job fails; vLLM recomputes, the engine keeps running
            error = f"{type(exc).__name__}: {exc}"
        transferred = sum(ok) * self._chunk_bytes
        self._outcomes.put(
            _Outcome(job_id, kind, ok, time.perf_counter() - started, transferred, error)
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                outcome = self._outcomes.get_nowait()
            except queue.Empty:
                break
            job = self._jobs.pop(outcome.job_id, None)
            if job is None:
                self._counters.io_errors += 1
                _log.error("kvtier tier %s: outcome for unknown job %d dropped",
                           self._url, outcome.job_id)
                continue
            results.append(self._finish(job, outcome))
        return results

    def _finish(self, job: _Job, outcome: _Outcome) -> JobResult:
        good = [key for key, ok in zip(job.keys, outcome.ok, strict=True) if ok]
        failed = [key for key, ok in zip(job.keys, outcome.ok, strict=True) if not ok]
        if outcome.error is not None:
            self._counters.io_errors += 1
            _log.warning("kvtier tier %s: %s job %d failed: %s",
                         self._url, job.kind.value, job.job_id, outcome.error)
        if job.kind is _JobKind.LOAD:
            self._counters.load_jobs += 1
            self._counters.blocks_loaded += len(good)
            self._counters.blocks_load_failed += len(failed)
            self._counters.bytes_loaded += outcome.transferred_bytes
            if failed:
                # Missing or damaged in the backend: never promise these again for a while,
                # so the scheduler recomputes instead of retrying a doomed promotion.
                self._lookup.mark_miss(failed)
                self._unloadable.add(failed)
        else:
            self._counters.store_jobs += 1
            self._counters.blocks_stored += len(good)
            self._counters.blocks_store_failed += len(failed)
            self._counters.bytes_stored += outcome.transferred_bytes
            if good:
                self._lookup.note_stored(self._unloadable.without(good))
                if self._events is not None:
                    self._events.append(
                        OffloadingEvent(
                            keys=good, medium=Medium.STORAGE, removed=False,
                            locality=self.locality,
                        )
                    )
        success = not failed
        successful_keys = None if success or not good else tuple(good)
        return JobResult(
            job_id=job.job_id,
            success=success,
            successful_keys=successful_keys,
            transfer_time=outcome.seconds,
            transfer_bytes=outcome.transferred_bytes,
        )

    def has_pending_work(self) -> bool:
        # Keeps the engine stepping until every transfer has been reported, so stores reach
        # the backend and are acknowledged even after the last request finished.
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        futures = [job.future for job in self._jobs.values() if job.future is not None]
        if futures:
            wait_futures(futures)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    # -- metrics ----------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        counters = [item.name for item in fields(_TierCounters)] + [
            f"lookup_{name}" for name in (
                "lookups", "backend_calls", "probes_submitted", "inflight_reuses",
                "verdict_cache_hits", "quarantine_hits", "probe_errors", "probe_timeouts",
                "breaker_opens",
            )
        ] + ["backend_corrupt_objects", "backend_errors"]
        definitions: dict[str, Any] = {
            _METRIC_PREFIX + name: OffloadingCounterMetadata(
                documentation=f"kvtier tier counter {name}.", labelnames=("tier",)
            )
            for name in counters
        }
        definitions[_METRIC_PREFIX + "jobs_in_flight"] = OffloadingGaugeMetadata(
            documentation="kvtier transfer jobs submitted and not yet reported.",
            labelnames=("tier",),
        )
        definitions[_METRIC_PREFIX + "lookup_breaker_open"] = OffloadingGaugeMetadata(
            documentation="1 while the tier's lookup circuit breaker is open or half-open.",
            labelnames=("tier",),
        )
        return definitions

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self._lifecycle is not _Lifecycle.OPEN:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        definitions = self.build_metric_definitions({})
        snapshot = self.stats_snapshot()
        stats = OffloadingConnectorStats()
        labels = (self._url,)
        changed = False
        for metric_name, metadata in definitions.items():
            name = metric_name.removeprefix(_METRIC_PREFIX)
            value = snapshot.get(name, 0)
            if isinstance(metadata, OffloadingGaugeMetadata):
                stats.set_gauge(metric_name, value, labels)
                continue
            delta = value - self._reported.values.get(name, 0)
            if delta:
                stats.increase_counter(metric_name, delta, labels)
                self._reported.values[name] = value
                changed = True
        return stats if changed else None

    # -- lifecycle --------------------------------------------------------------------------

    def _require_open(self, operation: str) -> None:
        if self._lifecycle is not _Lifecycle.OPEN:
            raise KvtierTierClosedError(
                f"KvtierTier {self._url}: {operation}() called after shutdown()"
            )

    def shutdown(self) -> None:
        """Finish in-flight transfers (never abort a copy), stop every thread, close the backend.

        A probe stuck in the backend is abandoned after ``_PROBE_SHUTDOWN_WAIT_S`` (its daemon
        thread reads no primary memory). Idempotent.
        """
        if self._lifecycle is _Lifecycle.CLOSED:
            return
        self._lifecycle = _Lifecycle.CLOSED
        self._io_pool.shutdown(wait=True)
        self._account_outcomes_after_close()
        self._lookup.shutdown(_PROBE_SHUTDOWN_WAIT_S)
        self._backend.close()
        # vLLM unmaps the primary region right after this; an exported view would block it.
        self._primary_bytes.release()

    def _account_outcomes_after_close(self) -> None:
        """Account for outcomes that arrived during shutdown (nobody will ask for them)."""
        while True:
            try:
                outcome = self._outcomes.get_nowait()
            except queue.Empty:
                return
            job = self._jobs.pop(outcome.job_id, None)
            if job is not None:
                self._finish(job, outcome)
