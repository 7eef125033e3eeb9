"""``KvtierTier``: a vLLM secondary tier (``vllm/v1/kv_offload/tiering``) on a kvtier backend.

vLLM's ``TieringOffloadingManager`` owns the CPU primary region and drives each secondary tier
from the scheduler thread (``lookup`` per chunk key, ``on_schedule_end`` per step,
``submit_store`` / ``submit_load`` with primary chunk ids, ``get_finished_jobs``). This tier maps
those calls onto a :class:`~kvtier.tiering.tier.SecondaryTier` (a backend, its non-blocking
lookup manager, I/O threads). One vLLM job is one tier job; a store is never shed silently (it
would be reported failed). Every loaded block is verified before a byte reaches the primary
region; a bad or missing block fails only that key (marked missing), so vLLM keeps the good
prefix and recomputes the rest.

Threads and state:

- Scheduler thread (every public method): ``_jobs`` / ``_vllm_job_ids`` (submitted, not yet
  reported), ``_collected`` (finished, reported by the next ``get_finished_jobs``),
  ``_abandoned`` (loads past their deadline, reported once their I/O ended), ``_held``,
  ``_skipped``, ``_store_keys_skipped``, ``_events``, ``_deltas`` (metric values already
  reported), ``_gate`` (each request's run of keys asked, for declining hits that would not
  pay), and the SecondaryTier's scheduler-side state.
- The tier's I/O threads read or write the primary chunks a job names (vLLM pins them until the
  job is reported); the probe thread records call durations in ``_probe_durations``
  (thread-safe) and touches no primary memory.
- GIL hand-off: where the model runs on the scheduler thread (vLLM's ``uni`` executor, or the
  engine core inside the caller), vLLM's loop steps the scheduler back to back while requests
  wait, and an I/O thread returning from a system call waits up to Python's 5 ms switch
  interval for the GIL. So while a load or probe is in flight, ``on_schedule_end`` waits at most
  ``io_yield_ms`` for it, which releases the GIL (no wait when nothing is in flight). Where the
  model runs in worker processes (vLLM's ``mp`` executor), the scheduler thread waits for each
  step's result spinning on ``sched_yield``, which lets the GIL go at every turn: there the wait
  shortens a small load (it ends within the wait and is reported a step earlier) and lengthened
  a large one (0.5 ms a step it spanned). So a load is waited for only once it is due within the
  wait by the tier's measured load rate, or overdue (a starved one: every step);
  ``docs/benchmarks.md`` has the numbers.
- ``_CLAIMED_POSITIONS`` (tier positions already labelled) is written only while vLLM builds its
  tiers, on the thread that calls the spec's ``get_manager``.
"""

from __future__ import annotations

import itertools
import logging
import sys
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from kvtier.backends import kind_for, open_backend, redact_url
from kvtier.errors import ClosedError, KvtierError
from kvtier.integrations.vllm._payoff import LoadGate
from kvtier.integrations.vllm._settings import VLLM_TIER_SETTINGS
from kvtier.integrations.vllm._staging import (
    PrefetchStaging,
    StagedReads,
    chain_of,
    open_staging,
)
from kvtier.keys import Namespace, RequestContext
from kvtier.lookup.manager import LOOKUP_SETTINGS
from kvtier.ops.metrics import (
    VLLM_PREFIX,
    DeltaTracker,
    ProbeDurations,
    prefetch_samples,
    tier_label,
    tier_samples,
    vllm_metric_definitions,
)
from kvtier.settings import ConfigError, env_layer
from kvtier.tiering.tier import JobKind, SecondaryTier, TierJob
from kvtier.tiering.tier_settings import LookupConfig, TierSettings

_DRAIN_WAIT_S = 86400.0  # drain_jobs waits for abandoned loads' calls too (never aborts a copy)


if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

    from kvtier.backends.base import Backend

_log = logging.getLogger(__name__)

_NAMESPACE_OVERRIDES = ("model", "revision", "tenant")
# Tier positions already claimed per spec, so two identical tier entries get distinct labels.
_CLAIMED_POSITIONS: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


KvtierTierClosedError = ClosedError  # the one closed error; this name is kept for callers


class KvtierTierContractError(KvtierError, RuntimeError):
    """vLLM handed the tier a job that breaks the secondary-tier contract."""


class HeldKeys:
    """Keys this tier's backend is known to hold: stored or loaded by us, not since missed.

    vLLM cascades every chunk newly written to its CPU primary tier to every secondary tier.
    A chunk evicted from the primary tier but still in the engine's prefix cache is written to
    the primary tier again when a later request offloads it, and would be written to the
    backend again although the backend still holds it (write amplification: 6.5x more blocks
    stored with vLLM's prefix cache on than off, in issue 13's client run). Stores of held
    keys are skipped and reported as done. A key leaves the record when a lookup finds it
    absent, a load of it fails or the backend evicts it itself (so a key the backend lost is
    stored again on its next offload), and the oldest leave first past ``capacity``. Owned by
    the scheduler thread.
    """

    __slots__ = ("_capacity", "_keys")

    def __init__(self, capacity: int = 65536) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def discard(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys.pop(key, None)


def _parse_lookup_settings(raw: object) -> LookupConfig:
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(
            f"KvtierTier.lookup: expected a mapping of {list(LOOKUP_SETTINGS.names)}, got "
            f"{type(raw).__name__} {raw!r}"
        )
    return LookupConfig.from_dict(env_layer(LOOKUP_SETTINGS, raw or {}, "KvtierTier.lookup."),
                                  "KvtierTier.lookup")


def _metrics_label(offloading_spec: Any, tier_type: str, url: str) -> str:
    """vLLM's label of this tier (``"1:KvtierTier"``): its position in ``secondary_tiers``."""
    entries = getattr(offloading_spec, "secondary_tier_configs", None) or []
    try:
        claimed = _CLAIMED_POSITIONS.setdefault(offloading_spec, set())
    except TypeError:  # a spec that cannot be weakly referenced: no de-duplication
        claimed = set()
    matches = [index for index, entry in enumerate(entries) if isinstance(entry, Mapping)
               and entry.get("type") == tier_type and entry.get("url") == url]
    unclaimed = [index for index in matches if index not in claimed]
    position = (unclaimed or matches or [0])[0]
    claimed.add(position)
    return tier_label(position + 1, tier_type)


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
         "prefill_tokens_per_s": 4000,             # decline hits slower than recompute
         "lookup": {"quarantine_s": 30, "probe_timeout_s": 5},
         "tenant": "", "revision": "", "model": "",  # namespace overrides
         "locality": "REMOTE", "enable_kv_events": false,
         "prefetch_bytes": "256MiB", "prefetch_ttl_s": 300,  # session-aware prefetch
         "io_yield_ms": 0.5,                       # end-of-step wait for in-flight I/O
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
        io_threads: int | None = None,
        max_blocks_per_call: int | None = None,
        load_timeout_s: float | None = None,
        prefill_tokens_per_s: float | None = None,
        lookup: Mapping[str, Any] | None = None,
        locality: str | None = None,
        enable_kv_events: bool | None = None,
        model: str | None = None,
        revision: str | None = None,
        tenant: str | None = None,
        prefetch_bytes: int | str | None = None,
        prefetch_ttl_s: float | None = None,
        io_yield_ms: float | None = None,
        **backend_options: Any,
    ) -> None:
        """Every option left out (None) takes its ``KVTIER_*`` variable, else the default of
        :data:`~kvtier.integrations.vllm._settings.VLLM_TIER_SETTINGS`; bad values raise
        ``ConfigError``."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        given = {"url": url, "io_threads": io_threads, "max_blocks_per_call": max_blocks_per_call,
                 "load_timeout_s": load_timeout_s, "prefill_tokens_per_s": prefill_tokens_per_s,
                 "locality": locality, "enable_kv_events": enable_kv_events, "model": model,
                 "revision": revision, "tenant": tenant, "prefetch_bytes": prefetch_bytes,
                 "prefetch_ttl_s": prefetch_ttl_s, "io_yield_ms": io_yield_ms}
        options = VLLM_TIER_SETTINGS.parse(
            env_layer(VLLM_TIER_SETTINGS,
                      {name: value for name, value in given.items() if value is not None},
                      "KvtierTier."),
            "KvtierTier")
        url = options["url"]
        lookup_settings = _parse_lookup_settings(lookup)
        overrides = {name: options[name] for name in _NAMESPACE_OVERRIDES}
        if options["locality"] is None:
            scheme = url.partition("://")[0].lower()
            self.locality = Locality.REMOTE if kind_for(scheme).remote else Locality.LOCAL
        else:
            self.locality = Locality(options["locality"].upper())

        self._chunk_bytes = self.block_size_bytes
        self._num_chunks = primary_kv_view.nbytes // self._chunk_bytes
        self._namespace = namespace_for(offloading_spec, self._chunk_bytes, overrides)
        backend = open_backend(url, self._namespace, **backend_options)
        self._staging: PrefetchStaging | None = None
        self._url = redact_url(url)
        try:
            # vLLM bounds its own in-flight stores (back-pressure): this tier must never shed
            # one, so its store limits are unreachable. The SecondaryTier applies each job's
            # effects on lookups: mark_miss on failed loads, note_stored on stores (unless the
            # key's load just failed: see RecentLoadFailures).
            self._probe_durations = ProbeDurations()
            self._held = HeldKeys()
            # Prefetch: the SecondaryTier reads through the staging memory (see _staging).
            self._staging = open_staging(
                backend, prefetch_bytes=options["prefetch_bytes"],
                ttl_s=options["prefetch_ttl_s"], block_bytes=self._chunk_bytes,
                batch_blocks=options["max_blocks_per_call"], where="KvtierTier")
            tier_backend = backend if self._staging is None else cast(
                "Backend", StagedReads(backend, self._staging))
            settings = TierSettings(
                io_threads=options["io_threads"], load_timeout_s=options["load_timeout_s"],
                prefill_tokens_per_s=options["prefill_tokens_per_s"],
                max_pending_store_bytes=sys.maxsize, max_pending_store_jobs=sys.maxsize)
            self._tier = SecondaryTier(
                self._url, tier_backend, settings, lookup=lookup_settings,
                max_keys_per_call=options["max_blocks_per_call"], metrics=self._probe_durations,
                on_evicted=self._held.discard,
            )
        except Exception:
            if self._staging is not None:
                self._staging.shutdown()
            backend.close()
            raise
        # Taken last: this view pins vLLM's primary mmap until shutdown() releases it, so a
        # failed constructor must not leave one behind.
        try:
            self._primary_bytes = primary_kv_view.cast("B")
        except Exception:
            self._tier.shutdown()
            raise
        self._jobs: dict[int, int] = {}  # vLLM job id -> SecondaryTier job id, until reported
        self._vllm_job_ids: dict[int, int] = {}  # SecondaryTier job id -> vLLM job id
        self._collected: list[TierJob] = []  # finished, reported by the next get_finished_jobs
        self._abandoned: dict[int, TierJob] = {}  # timed-out loads whose I/O still runs
        self._released: list[TierJob] = []  # abandoned loads drain_jobs saw end
        # Ids of jobs finished without the SecondaryTier (shed or skipped; never the tier's).
        self._local_ids = itertools.count(-1, -1)
        # Hits that would load slower than vLLM recomputes them are declined (see _payoff).
        self._gate = (None if options["prefill_tokens_per_s"] is None
                      else LoadGate(self._tier, self._chunk_bytes))
        self._skipped: dict[int, tuple[bytes, ...]] = {}  # vLLM job id -> keys not rewritten
        self._store_keys_skipped = 0
        self._metrics_label = _metrics_label(offloading_spec, tier_type, url)
        self._deltas = DeltaTracker()
        emit_events = options["enable_kv_events"] and bool(
            offloading_spec.kv_events_config.enable_kv_cache_events
        )
        self._events: list[OffloadingEvent] | None = [] if emit_events else None
        self._io_yield_s: float = options["io_yield_ms"] / 1e3
        _log.info(
            "kvtier tier %s: %s, %d chunks of %d bytes, namespace %s, end-of-step I/O wait "
            "%g ms", tier_type, self._url, self._num_chunks, self._chunk_bytes,
            self._namespace.digest_hex, self._io_yield_s * 1e3,
        )

    # -- introspection ----------------------------------------------------------------------

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def url(self) -> str:
        """The backend URL with credentials redacted."""
        return self._url

    def stats_snapshot(self) -> dict[str, Any]:
        """The tier's counters (:meth:`SecondaryTier.stats`: lookups, transfers, ``backend_*``),
        the one source :meth:`get_stats` publishes from; plus ``store_keys_skipped`` (stores of
        blocks the backend already held, see :class:`HeldKeys`)."""
        snapshot = self._tier.stats().flat()
        snapshot["store_keys_skipped"] = self._store_keys_skipped
        if self._staging is not None:
            snapshot.update({f"prefetch_{name}": value
                             for name, value in self._staging.counts().as_dict().items()})
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
        raw_key = bytes(key)
        verdict = self._tier.lookup(raw_key, context)
        gate = self._gate
        if gate is not None:
            gate.asked(context.req_id, raw_key)
            if verdict and not gate.admits(context.req_id, raw_key):
                return LookupResult.MISS
        if verdict is None:
            return LookupResult.RETRY
        if not verdict and raw_key in self._held:
            self._held.discard((raw_key,))
        return LookupResult.HIT if verdict else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._tier.closed:
            return
        self._tier.flush()
        if self._staging is not None:  # prefetch reads only while no transfer is in flight
            self._staging.step(idle=self._tier.outstanding_jobs == 0)
        if self._io_yield_s <= 0:
            return
        self._collected.extend(self._tier.yield_to_io(self._io_yield_s, stores=False))

    def on_request_finished(self, req_context: ReqContext) -> None:
        if not self._tier.closed:
            self._tier.cleanup(req_context.req_id)
            if self._staging is not None:
                self._staging.admit_chain(chain_of(req_context))
        if self._gate is not None:
            self._gate.forget(req_context.req_id)

    # -- transfers --------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, JobKind.STORE)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, JobKind.LOAD)

    def _submit(self, job_metadata: TransferJob, kind: JobKind) -> None:
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
        job: TierJob | None
        if kind is JobKind.LOAD:
            job = self._tier.submit_load(keys, [self._slot_view(slot) for slot in slots])
        else:
            keys, slots = self._without_held(job_id, keys, slots)
            if not keys:
                job = TierJob(next(self._local_ids), JobKind.STORE, (), (), 0, results=())
                self._collected.append(job)
                self._jobs[job_id] = job.job_id
                self._vllm_job_ids[job.job_id] = job_id
                return
            job = self._tier.submit_store(keys, [self._slot_view(slot) for slot in slots])
            if job is None:  # unreachable with our limits; if ever, a failed job, never lost
                job = TierJob(next(self._local_ids), JobKind.STORE, tuple(keys), (), 0,
                              results=(False,) * len(keys), error="shed: tier backlogged")
                self._collected.append(job)
        self._jobs[job_id] = job.job_id
        self._vllm_job_ids[job.job_id] = job_id

    def _without_held(self, job_id: int, keys: list[bytes],
                      slots: list[int]) -> tuple[list[bytes], list[int]]:
        """The keys of a store job the backend does not hold yet (see :class:`HeldKeys`)."""
        held = self._held
        if not any(key in held for key in keys):
            return keys, slots
        fresh = [(key, slot) for key, slot in zip(keys, slots, strict=True) if key not in held]
        self._skipped[job_id] = tuple(key for key in keys if key in held)
        self._store_keys_skipped += len(keys) - len(fresh)
        return [key for key, _ in fresh], [slot for _, slot in fresh]

    def _slot_view(self, slot: int) -> memoryview:
        start = slot * self._chunk_bytes
        return self._primary_bytes[start : start + self._chunk_bytes]

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._collected = self._collected, []
        finished.extend(self._tier.get_finished_jobs())
        results: list[JobResult] = []
        for job in self._reportable(finished):
            result = self._finish(job)
            if result is not None:
                results.append(result)
        return results

    def _finish(self, job: TierJob) -> JobResult | None:
        """Account for one finished job (the SecondaryTier already updated the lookups)."""
        job_id = self._vllm_job_ids.pop(job.job_id, None)
        if job_id is None:
            _log.error("kvtier tier %s: outcome for unknown job %d dropped",
                       self._url, job.job_id)
            return None
        del self._jobs[job_id]
        good = job.succeeded
        failed = len(job.keys) - len(good)
        if failed:
            self._held.discard(job.failed)
        if good:
            self._held.add(good)
        transferred = len(good) * self._chunk_bytes
        if job.kind is JobKind.STORE and good and self._events is not None:
            self._events.append(
                OffloadingEvent(
                    keys=good, medium=Medium.STORAGE, removed=False, locality=self.locality,
                )
            )
        skipped = self._skipped.pop(job_id, ())
        success = not failed
        successful_keys = None if success or not (good or skipped) else (*good, *skipped)
        return JobResult(
            job_id=job_id,
            success=success,
            successful_keys=successful_keys,
            transfer_time=job.seconds,
            transfer_bytes=transferred,
        )

    def _reportable(self, finished: list[TierJob]) -> list[TierJob]:
        """``finished`` less the loads abandoned at their deadline whose I/O still runs: vLLM
        would reuse their chunks at once, so they are reported (failed) only once the backend
        call has ended and can no longer write them."""
        ready: list[TierJob] = []
        for job in finished:
            if job.abandoned:
                self._abandoned[job.job_id] = job
            else:
                ready.append(job)
        if self._abandoned:
            released, self._released = [*self._released, *self._tier.take_released_loads()], []
            for job in released:
                if self._abandoned.pop(job.job_id, None) is not None:
                    ready.append(job)
        return ready

    def has_pending_work(self) -> bool:
        # Keeps the engine stepping until every transfer has been reported, so stores reach
        # the backend and are acknowledged even after the last request finished.
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        # Waits for every running job (never aborts a copy); the next get_finished_jobs()
        # reports them.
        self._collected.extend(self._tier.get_finished_jobs(wait=True))
        self._released.extend(self._tier.take_released_loads(_DRAIN_WAIT_S))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    # -- metrics ----------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return vllm_metric_definitions(OffloadingCounterMetadata, OffloadingGaugeMetadata,
                                       OffloadingHistogramMetadata)

    def get_stats(self) -> OffloadingConnectorStats | None:
        """This tier's metrics since the last call (kvtier's vocabulary, prefix
        ``vllm:kvtier_``, labelled with vLLM's own tier label); None when nothing changed."""
        if self._tier.closed:
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        samples = tier_samples(self._tier.stats(), self._metrics_label,
                               self._namespace.block_size)
        if self._staging is not None:
            samples.update(prefetch_samples(self._staging.counts().as_dict(),
                                            self._staging.staged_bytes(), self._metrics_label))
        increments, gauges = self._deltas.changes(samples)
        durations = self._probe_durations.drain()
        if not increments and not durations:
            return None
        stats = OffloadingConnectorStats()
        for name, labels, delta in increments:
            stats.increase_counter(VLLM_PREFIX + name, delta, labels)
        for name, labels, value in gauges:
            stats.set_gauge(VLLM_PREFIX + name, value, labels)
        for seconds in durations:
            stats.observe_histogram(VLLM_PREFIX + "probe_duration_seconds", seconds,
                                    (self._metrics_label,))
        return stats

    # -- lifecycle --------------------------------------------------------------------------

    def _require_open(self, operation: str) -> None:
        if self._tier.closed:
            raise KvtierTierClosedError(
                f"KvtierTier {self._url}: {operation}() called after shutdown()"
            )

    def shutdown(self) -> None:
        """Finish in-flight transfers (never abort a copy), stop every thread, close the backend.

        A probe stuck in the backend is abandoned after the SecondaryTier's bounded probe wait
        (its daemon thread reads no primary memory). Outcomes that arrive meanwhile are
        accounted for (nobody will ask for them). Idempotent.
        """
        if self._tier.closed:
            return
        finished, self._collected = [*self._collected, *self._tier.shutdown()], []
        for job in finished:
            self._finish(job)
        # vLLM unmaps the primary region right after this; an exported view would block it.
        self._primary_bytes.release()
