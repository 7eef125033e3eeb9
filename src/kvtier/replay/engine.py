"""The engine-step simulator: replays a trace through real TieringManagers.

Thread ownership: everything in this module (the instances, their GPU prefix caches, waiting and
running queues, counters and the source tier of each promoted block) is owned by the thread that
calls :func:`replay`, which plays the engine scheduler of every simulated instance. The managers'
own background threads (lookup probes, transfers) are theirs; they are reached only through the
manager's scheduler-thread API.

Per step and instance, like a real scheduler: admit arrived requests; for each waiting request
(in arrival order, while the running batch has room) take the GPU prefix hit, ask
``lookup_prefix`` for the rest (``None``: the request waits for a later step), load the hit blocks
from their primary slots (``prepare_load`` / ``complete_load``, every byte verified), "compute"
the rest and store it (``prepare_store`` / ``primary_view`` / ``complete_store``), then
``on_schedule_end``. A request stays in the batch for one prefill step plus one step per
``decode_tokens_per_step`` output tokens, then ``on_request_finished``.

Rules a real engine imposes, modelled here:

- **Requests bigger than the GPU.** vLLM refuses a prompt longer than ``max_model_len``, and
  refuses to start when ``max_model_len`` does not fit its KV cache; so a request needing more
  blocks than the modelled GPU is *rejected* at admission, counted (``requests_rejected``,
  ``rejected_blocks``), and left out of both the achieved and the ideal hit ratio. By default
  (``gpu_blocks=None``) the GPU is sized from the trace: ``max(2000, largest request)`` blocks,
  so nothing is rejected.
- **Stores stream.** The engine stores a request's computed blocks with
  ``prepare_store(..., StoreMode.PREFIX)``: what fits in the pool now is written and cascaded,
  the rest waits for later steps (the request stays in the batch, as a chunked prefill does)
  until cascades release slots. A backlog that makes no progress for ``store_patience_steps``
  steps is shed, counted and shown (``store_blocks_shed``).
- **Session causality.** When the trace names sessions, a request that follows an earlier one
  of its session thread (``TraceRequest.after``) is admitted only after that one finished, plus
  its recorded gap divided by ``speed`` (no gap when replaying as fast as possible); other
  requests arrive as before (``admission_rule`` in the result says which rule applied).

Block payloads are real bytes derived from the key (the key, then a key-chosen window of a fixed
random pad), so a load of the wrong block, a torn block or a shifted block fails the run.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.keys import BlockKey, Namespace, RequestContext
from kvtier.replay.instance import _Instance, _Payloads, _Request
from kvtier.replay.options import (
    _IDLE_SLEEP_S,
    _MAX_SPEED_SLEEP_S,
    ARRIVAL_RULE,
    CAUSAL_RULE,
    DEFAULT_GPU_BLOCKS,
    STORE_PATIENCE_STEPS,
    Prefetch,
    PrefixLoading,
    ProgressCallback,
    ReplayOptions,
    Route,
)
from kvtier.replay.reference import ideal_hit_runs
from kvtier.replay.results import (
    PREFETCH_FIELDS,
    ReplayResult,
    TierKind,
    TierResult,
    TimelinePoint,
)
from kvtier.replay.stats import percentile
from kvtier.replay.strategies import Strategy, lookup_factory_for, manager_config_for
from kvtier.replay.trace import Trace, TraceRequest

if TYPE_CHECKING:
    from kvtier.tiering.manager import TieringManager

__all__ = [
    "ARRIVAL_RULE",
    "CAUSAL_RULE",
    "DEFAULT_GPU_BLOCKS",
    "STORE_PATIENCE_STEPS",
    "Prefetch",
    "PrefixLoading",
    "ReplayOptions",
    "Route",
    "default_scratch_dir",
    "gpu_blocks_for",
    "rejected_requests",
    "replay",
]


def _key_maker(namespace: Namespace) -> Callable[[int], BlockKey]:
    salt = b"kvtier.replay.v1" + namespace.digest

    def make(block_id: int) -> BlockKey:
        return hashlib.blake2b(salt + block_id.to_bytes(8, "little"), digest_size=16).digest()

    return make


def replay(
    trace: Trace,
    options: ReplayOptions,
    strategy: Strategy = Strategy.KVTIER,
    *,
    progress: ProgressCallback | None = None,
) -> ReplayResult:
    """Replay ``trace`` through ``options.instances`` simulated engines and measure the caches.

    With no ``tier_urls`` the secondary tier is a file tier in a temporary directory (under
    ``options.scratch_dir``, else see :func:`default_scratch_dir`) that is removed afterwards.
    Raises :class:`ReplayIntegrityError` on any byte mismatch.
    """
    if options.tier_urls:
        return _replay(trace, options, strategy, options.tier_urls, progress)
    parent = options.scratch_dir or default_scratch_dir(trace, options.block_bytes)
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-", dir=parent) as scratch:
        tier_urls = (Path(scratch, "file-tier").as_uri(),)
        return _replay(trace, options, strategy, tier_urls, progress)


def default_scratch_dir(trace: Trace, block_bytes: int) -> str | None:
    """Where the default file tier lives: ``/dev/shm`` (a RAM-backed filesystem, so the replay
    measures kvtier rather than the disk) when it exists, is writable and has room for every
    unique block of ``trace`` twice over; otherwise the system temporary directory (None)."""
    shm = Path("/dev/shm")
    try:
        if not (shm.is_dir() and os.access(shm, os.W_OK | os.X_OK)):
            return None
        unique_blocks = len({block for request in trace.requests for block in request.hash_ids})
        needed = 2 * unique_blocks * (block_bytes + 4096)
        return str(shm) if shutil.disk_usage(shm).free >= needed else None
    except OSError:
        return None


def _replay(
    trace: Trace,
    options: ReplayOptions,
    strategy: Strategy,
    tier_urls: tuple[str, ...],
    progress: ProgressCallback | None,
) -> ReplayResult:
    from kvtier.factory import open_manager

    tag = options.namespace_tag or uuid.uuid4().hex[:12]
    namespace_fields: dict[str, Any] = {
        "model": "kvtier-replay",
        "revision": f"{tag}-{strategy.value}",
        "block_size": trace.block_tokens,
    }
    namespace = Namespace.from_mapping(namespace_fields)
    make_key = _key_maker(namespace)
    payloads = _Payloads(options.block_bytes)
    managers: list[TieringManager] = []
    wall_started = time.perf_counter()
    try:
        for _ in range(options.instances):
            config = manager_config_for(
                strategy,
                block_bytes=options.block_bytes,
                primary_bytes=options.cpu_blocks * options.block_bytes,
                eviction_policy=options.eviction_policy,
                write_policy=options.write_policy,
                tier_urls=tier_urls,
                namespace=namespace_fields,
                prefetch=options.prefetch.value,
            )
            managers.append(open_manager(config, lookup_factory=lookup_factory_for(strategy)))
        tier_names = list(managers[0].tier_names)
        gpu_blocks = gpu_blocks_for(trace, options)
        instances = [
            _Instance(number, manager, options, trace.block_tokens, payloads, tier_names,
                      gpu_blocks)
            for number, manager in enumerate(managers)
        ]
        loop = _Loop(trace, options, instances, make_key, strategy, progress)
        loop.run()
        wall_s = time.perf_counter() - wall_started
        for manager in managers:
            manager.shutdown()
        stats = [manager.get_stats() for manager in managers]  # with each tier's I/O seconds
        return loop.result(tier_names, tier_urls, stats, wall_s)
    finally:
        for manager in managers:
            manager.shutdown()


def prefetch_totals(manager_stats: list[dict[str, Any]]) -> dict[str, int]:
    """The prefetch counters of every instance, summed (see :mod:`kvtier.tiering.prefetch`)."""
    totals: Counter[str] = Counter()
    for stats in manager_stats:
        prefetch = stats.get("prefetch", {})
        for name in PREFETCH_FIELDS:
            totals[name] += int(prefetch.get(name, 0))
    return {name: totals[name] for name in PREFETCH_FIELDS}


def gpu_blocks_for(trace: Trace, options: ReplayOptions) -> int:
    """The modelled GPU's size in blocks: ``options.gpu_blocks``, or (None) sized from the
    trace so that its largest request fits: ``max(DEFAULT_GPU_BLOCKS, largest request)``."""
    if options.gpu_blocks is not None:
        return options.gpu_blocks
    largest = max((len(request.hash_ids) for request in trace.requests), default=0)
    return max(DEFAULT_GPU_BLOCKS, largest)


def rejected_requests(trace: Trace, gpu_blocks: int) -> list[int]:
    """Indexes of the requests the modelled GPU can never hold (0: no GPU model, no limit)."""
    if not gpu_blocks:
        return []
    return [index for index, request in enumerate(trace.requests)
            if len(request.hash_ids) > gpu_blocks]


class _Loop:
    """Admits requests to instances and steps them until the trace is done."""

    def __init__(
        self,
        trace: Trace,
        options: ReplayOptions,
        instances: list[_Instance],
        make_key: Callable[[int], BlockKey],
        strategy: Strategy,
        progress: ProgressCallback | None,
    ) -> None:
        self.trace = trace
        self.options = options
        self.instances = instances
        self.make_key = make_key
        self.strategy = strategy
        self.progress = progress
        self.next_index = 0
        self.scheduled = 0
        self.steps = 0
        self.gpu_blocks = instances[0].gpu_blocks
        self.rejected = set(rejected_requests(trace, self.gpu_blocks))
        self.rejected_blocks = sum(len(trace.requests[i].hash_ids) for i in self.rejected)
        served = [r for i, r in enumerate(trace.requests) if i not in self.rejected]
        served_trace = replace(trace, requests=tuple(served))
        runs = iter(ideal_hit_runs(served_trace)) if served else iter(())
        self.ideal: list[tuple[int, int]] = []  # per trace request; (0, 0) when rejected
        for index, record in enumerate(trace.requests):
            if index in self.rejected:
                self.ideal.append((0, 0))
                continue
            run = next(runs)
            self.ideal.append((run, record.tokens_in_blocks(0, run, trace.block_tokens)))
        self.total = len(trace.requests)
        self.served = len(served)
        self.block_refs = sum(len(r.hash_ids) for r in served)
        self.total_tokens = sum(r.input_length for r in served)
        self.causal = trace.causal
        # Session causality: request index -> the requests waiting for it to finish; due
        # requests (their predecessor finished) in a heap of (due time, index).
        self._dependents: dict[int, list[int]] = {}
        if self.causal:
            for index, record in enumerate(trace.requests):
                if record.after is not None:
                    self._dependents.setdefault(record.after, []).append(index)
        self._due: list[tuple[float, int]] = []
        # session -> its last request (only when the trace names sessions and their order)
        self._last_of_session: dict[int | None, int] = {}
        if self.causal:
            for index, record in enumerate(trace.requests):
                if record.session is not None:
                    self._last_of_session[record.session] = index
        self._finished = 0
        self.window = max(1, -(-max(1, self.served) // options.timeline_windows))
        self.timeline: list[TimelinePoint] = []
        self._window_hits: dict[str, int] = {}
        self._window_refs = 0
        self._window_ideal = 0
        self._started = time.monotonic()
        self._key_cache: dict[int, BlockKey] = {}
        self.lost_hits: dict[str, int] = {}

    def _keys_for(self, record: TraceRequest) -> list[BlockKey]:
        cache = self._key_cache
        keys: list[BlockKey] = []
        for block_id in record.hash_ids:
            key = cache.get(block_id)
            if key is None:
                key = self.make_key(block_id)
                cache[block_id] = key
            keys.append(key)
        return keys

    def _route(self, index: int, record: TraceRequest) -> _Instance:
        count = len(self.instances)
        if self.options.route is Route.FIRST_BLOCK_HASH:
            first = record.hash_ids[0] if record.hash_ids else (record.session or 0)
            return self.instances[first % count]
        return self.instances[index % count]

    def _enqueue(self, index: int) -> None:
        record = self.trace.requests[index]
        if index in self.rejected:  # never fits the modelled GPU: refused, like vLLM
            self._on_done(index)
            return
        self._route(index, record).waiting.append(
            _Request(
                index=index,
                record=record,
                ctx=RequestContext(f"{self.strategy.value}-{index}", session_id=(
                    None if record.session is None else f"session-{record.session}")),
                keys=self._keys_for(record),
                arrival_s=record.timestamp_ms / 1000.0,
                # A session's last turn (an agent's loop ends): the manager keeps nothing of it.
                last_turn=self._last_of_session.get(record.session) == index,
            )
        )

    def _on_done(self, index: int) -> None:
        """A request finished (or was rejected): its session's next request becomes due."""
        self._finished += 1
        dependents = self._dependents.pop(index, None)
        if not dependents:
            return
        now = time.monotonic()
        speed = self.options.speed
        for dependent in dependents:
            gap_s = 0.0 if speed is None else self.trace.requests[dependent].gap_ms / 1000 / speed
            heapq.heappush(self._due, (now + gap_s, dependent))

    def _on_finished(self, request: _Request) -> None:
        self._on_done(request.index)

    def _admit(self) -> None:
        requests = self.trace.requests
        speed = self.options.speed
        due = self._due
        if due:
            now = time.monotonic()
            while due and due[0][0] <= now:
                self._enqueue(heapq.heappop(due)[1])
        elapsed_ms = (time.monotonic() - self._started) * 1000.0 * (speed or 0.0)
        while self.next_index < len(requests):
            record = requests[self.next_index]
            if record.after is not None:  # waits for its predecessor (see _on_done)
                self.next_index += 1
                continue
            instance = self._route(self.next_index, record)
            if speed is None:
                if len(instance.waiting) >= self.options.max_running:
                    return
            elif record.timestamp_ms > elapsed_ms:
                return
            self._enqueue(self.next_index)
            self.next_index += 1

    def _on_scheduled(self, request: _Request, hits: dict[str, int]) -> None:
        self.scheduled += 1
        got = sum(hits.values())
        ideal = self.ideal[request.index][0]
        if got < ideal:  # the prefix ended before the ideal's: say why
            cause = self._route(request.index, request.record).loss_cause(request.keys[got])
            self.lost_hits[cause] = self.lost_hits.get(cause, 0) + ideal - got
        window_hits = self._window_hits
        for tier, count in hits.items():
            window_hits[tier] = window_hits.get(tier, 0) + count
        self._window_refs += len(request.keys)
        self._window_ideal += self.ideal[request.index][0]
        if self.scheduled % self.window == 0 or self.scheduled == self.served:
            self.timeline.append(
                TimelinePoint(
                    requests_done=self.scheduled,
                    sim_time_s=request.arrival_s,
                    block_refs=self._window_refs,
                    tier_hits=dict(window_hits),
                    ideal_hits=self._window_ideal,
                )
            )
            self._window_hits = {}
            self._window_refs = 0
            self._window_ideal = 0
            if self.progress is not None:
                self.progress(self.scheduled, self.served)

    def _unfinished(self) -> bool:
        return self._finished < self.total

    def run(self) -> None:
        step_s = self.options.step_ms / 1000.0
        while self._unfinished():
            step_started = time.perf_counter()
            self._admit()
            did_work = False
            busy = False
            for instance in self.instances:
                if instance.busy:
                    busy = True
                    did_work |= instance.step(self._on_scheduled, self._on_finished)
            if busy:
                self.steps += 1
            # The model's forward pass: the scheduler thread is idle for the rest of the step
            # (instances run side by side, like engines on separate GPUs), and the tiers' I/O
            # threads get the CPU.
            remaining = step_s - (time.perf_counter() - step_started)
            if remaining > 0:
                time.sleep(remaining)
            elif not did_work:
                time.sleep(self._idle_sleep())
        for instance in self.instances:
            # Drain what the last steps left in flight (cascaded stores, events).
            instance.manager.on_schedule_end()

    def _idle_sleep(self) -> float:
        """An idle engine still steps (to collect I/O results) but must not starve I/O threads."""
        if any(i.busy for i in self.instances):
            return _IDLE_SLEEP_S
        now = time.monotonic()
        wake = [self._due[0][0]] if self._due else []
        if self.options.speed is not None and self.next_index < len(self.trace.requests):
            next_ms = self.trace.requests[self.next_index].timestamp_ms
            wake.append(self._started + next_ms / 1000.0 / self.options.speed)
        if not wake:
            return _IDLE_SLEEP_S
        return min(_MAX_SPEED_SLEEP_S, max(0.0, min(wake) - now))

    def result(
        self,
        tier_names: list[str],
        tier_urls: tuple[str, ...],
        manager_stats: list[dict[str, Any]],
        wall_s: float,
    ) -> ReplayResult:
        from kvtier.replay.stats import secondary_tier_results

        block_bytes = self.options.block_bytes
        counters = [instance.counters for instance in self.instances]
        gpu = TierResult(
            name="GPU",
            kind=TierKind.GPU,
            block_hits=sum(c.gpu_hits for c in counters),
            token_hits=sum(c.gpu_tokens for c in counters),
        )
        cpu = TierResult(
            name="CPU",
            kind=TierKind.PRIMARY,
            block_hits=sum(c.cpu_hits for c in counters),
            token_hits=sum(c.cpu_tokens for c in counters),
            bytes_read=sum(c.cpu_bytes_loaded for c in counters),
            bytes_written=sum(c.cpu_bytes_stored for c in counters),
        )
        secondaries = secondary_tier_results(tier_names, manager_stats)
        for tier in secondaries:
            tier.block_hits = sum(c.secondary_hits.get(tier.name, 0) for c in counters)
            tier.token_hits = sum(c.secondary_tokens.get(tier.name, 0) for c in counters)
        step_times = [t for instance in self.instances for t in instance.step_times]
        return ReplayResult(
            strategy=self.strategy.value,
            trace_name=self.trace.name,
            requests=self.scheduled,
            skipped_lines=self.trace.skipped_lines,
            instances=len(self.instances),
            block_bytes=block_bytes,
            block_refs=self.block_refs,
            total_tokens=self.total_tokens,
            ideal_block_hits=sum(hits for hits, _ in self.ideal),
            ideal_token_hits=sum(tokens for _, tokens in self.ideal),
            tiers=[gpu, cpu, *secondaries],
            steps=self.steps,
            steps_waited=sum(c.steps_waited for c in counters),
            requests_waited=sum(c.requests_waited for c in counters),
            verified_blocks=sum(c.verified_blocks for c in counters),
            store_plans_refused=sum(c.store_plans_refused for c in counters),
            step_time_p50_s=percentile(step_times, 50),
            step_time_p99_s=percentile(step_times, 99),
            wall_s=wall_s,
            tier_urls=list(tier_urls),
            timeline=self.timeline,
            manager_stats=manager_stats,
            requests_rejected=len(self.rejected),
            rejected_blocks=self.rejected_blocks,
            gpu_blocks=self.gpu_blocks,
            admission_rule=CAUSAL_RULE if self.causal else ARRIVAL_RULE,
            hash_convention=self.trace.hash_convention,
            sessions=self.trace.sessions,
            store_blocks_deferred=sum(c.store_blocks_deferred for c in counters),
            store_blocks_shed=sum(c.store_blocks_shed for c in counters),
            promotions_lost=sum(int(stats["manager"].get("promotions_lost", 0))
                                for stats in manager_stats),
            cascades_shed=sum(int(stats["manager"].get("cascades_shed", 0))
                              for stats in manager_stats),
            store_waits=sum(int(tier["store_waits"]) for stats in manager_stats
                            for tier in stats["tiers"].values()),
            store_wait_s=sum(float(tier["store_wait_seconds"]) for stats in manager_stats
                             for tier in stats["tiers"].values()),
            scheduler_s=sum(step_times),
            hit_sources=dict(sorted(sum((c.hit_sources for c in counters), Counter()).items())),
            prefetch=prefetch_totals(manager_stats),
            lost_hits=dict(sorted(self.lost_hits.items())),
        )

