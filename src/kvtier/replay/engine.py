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

import enum
import hashlib
import heapq
import math
import os
import shutil
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.keys import BlockKey, Namespace, RequestContext
from kvtier.replay.errors import ReplayError, ReplayIntegrityError, ReplayStuckError
from kvtier.replay.reference import ideal_hit_runs
from kvtier.replay.results import ReplayResult, TierKind, TierResult, TimelinePoint
from kvtier.replay.strategies import Strategy, lookup_factory_for, manager_config_for
from kvtier.replay.trace import Trace, TraceRequest

DEFAULT_GPU_BLOCKS = 2_000
STORE_PATIENCE_STEPS = 500
ARRIVAL_RULE = "arrival order (the trace names no sessions)"
CAUSAL_RULE = ("session causality: a session's next request waits until its previous one "
               "finished, plus the recorded gap / speed")

if TYPE_CHECKING:
    from kvtier.tiering.manager import TieringManager

_PAYLOAD_SEED = 0x6B76_7469_6572  # "kvtier"
_KEY_PREFIX_BYTES = 16
_IDLE_SLEEP_S = 0.0005
_MAX_SPEED_SLEEP_S = 0.005


class Route(enum.Enum):
    """How requests are spread over instances."""

    ROUND_ROBIN = "round-robin"
    FIRST_BLOCK_HASH = "hash"


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """Settings of one replay; see ``kvtier replay --help`` for the meaning of each."""

    tier_urls: tuple[str, ...] = ()
    instances: int = 1
    route: Route = Route.ROUND_ROBIN
    speed: float | None = None
    max_running: int = 32
    gpu_blocks: int | None = None
    cpu_blocks: int = 16_000
    block_bytes: int = 16 * 1024
    decode_tokens_per_step: int = 64
    step_ms: float = 10.0
    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    namespace_tag: str = ""
    scratch_dir: str | None = None
    max_wait_s: float = 120.0
    timeline_windows: int = 100
    store_patience_steps: int = STORE_PATIENCE_STEPS

    def __post_init__(self) -> None:
        _require_int("instances", self.instances, 1)
        _require_int("max_running", self.max_running, 1)
        if self.gpu_blocks is not None:
            _require_int("gpu_blocks", self.gpu_blocks, 0)
        _require_int("store_patience_steps", self.store_patience_steps, 1)
        _require_int("cpu_blocks", self.cpu_blocks, 1)
        _require_int("block_bytes", self.block_bytes, 16)
        if self.block_bytes % 16:
            raise ValueError(
                f"block_bytes must be a multiple of 16, got {self.block_bytes}"
            )
        _require_int("decode_tokens_per_step", self.decode_tokens_per_step, 1)
        _require_int("timeline_windows", self.timeline_windows, 1)
        if self.speed is not None and not self.speed > 0:
            raise ValueError(
                f"speed must be > 0 (or None for as fast as possible), got {self.speed}"
            )
        if not (self.step_ms >= 0 and math.isfinite(self.step_ms)):
            raise ValueError(f"step_ms must be a finite number >= 0, got {self.step_ms}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")


def _require_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


ProgressCallback = Callable[[int, int], None]
"""Called with (requests scheduled, total requests) as the replay advances."""


class _Payloads:
    """Deterministic block bytes: the key, then a window of a fixed random pad chosen by the key.

    A block served for the wrong key differs in its first bytes; a torn or shifted block differs
    from the random window. Only byte copies and compares (no numpy ufuncs): those keep the GIL,
    so the scheduler thread is not convoyed behind the tiers' I/O threads.
    """

    def __init__(self, block_bytes: int) -> None:
        pad = np.random.default_rng(_PAYLOAD_SEED).bytes(block_bytes)
        self._pad2 = pad + pad
        self._pad2_view = memoryview(self._pad2)
        self._block_bytes = block_bytes
        self._window = block_bytes - _KEY_PREFIX_BYTES

    def expected(self, key: BlockKey) -> bytes:
        head = key[:_KEY_PREFIX_BYTES].ljust(_KEY_PREFIX_BYTES, b"\0")
        offset = int.from_bytes(key[-8:], "little") % self._block_bytes
        return head + self._pad2[offset : offset + self._window]

    def write(self, key: BlockKey, out: memoryview) -> None:
        """Like ``out[:] = expected(key)``, with one copy of the pad window instead of three."""
        head = key[:_KEY_PREFIX_BYTES].ljust(_KEY_PREFIX_BYTES, b"\0")
        offset = int.from_bytes(key[-8:], "little") % self._block_bytes
        out[:_KEY_PREFIX_BYTES] = head
        out[_KEY_PREFIX_BYTES:] = self._pad2_view[offset : offset + self._window]

    def matches(self, key: BlockKey, data: memoryview) -> bool:
        return bytes(data) == self.expected(key)


@dataclass(slots=True)
class _Request:
    index: int
    record: TraceRequest
    ctx: RequestContext
    keys: list[BlockKey]
    arrival_s: float
    first_wait_wall: float | None = None
    resident_at_first_ask: int | None = None
    steps_left: int = 0
    store_backlog: list[BlockKey] = field(default_factory=list)
    store_stalled_steps: int = 0


@dataclass(slots=True)
class _Counters:
    gpu_hits: int = 0
    gpu_tokens: int = 0
    cpu_hits: int = 0
    cpu_tokens: int = 0
    cpu_bytes_loaded: int = 0
    cpu_bytes_stored: int = 0
    secondary_hits: dict[str, int] = field(default_factory=dict)
    secondary_tokens: dict[str, int] = field(default_factory=dict)
    steps_waited: int = 0
    requests_waited: int = 0
    verified_blocks: int = 0
    store_plans_refused: int = 0
    store_blocks_deferred: int = 0
    store_blocks_shed: int = 0


def _note_promotions(
    events: Sequence[Any], tier_index: Mapping[str, int], promoted_from: dict[BlockKey, int]
) -> None:
    """Apply the manager's events, oldest first, to ``promoted_from``: ``key -> index of the
    tier its latest promotion came from``, kept while the block stays in the primary pool."""
    from kvtier.tiering.manager import PRIMARY, BlockPromoted, BlockRemoved

    for event in events:
        if isinstance(event, BlockPromoted):
            index = tier_index.get(event.tier)
            if index is not None:
                for key in event.keys:
                    promoted_from[key] = index
        elif isinstance(event, BlockRemoved) and event.tier == PRIMARY:
            for key in event.keys:
                promoted_from.pop(key, None)


class _Instance:
    """One simulated engine: a GPU prefix cache, a batch, and its own TieringManager."""

    def __init__(
        self,
        number: int,
        manager: TieringManager,
        options: ReplayOptions,
        block_tokens: int,
        payloads: _Payloads,
        tier_names: Sequence[str],
        gpu_blocks: int,
    ) -> None:
        self.number = number
        self.manager = manager
        self.options = options
        self.gpu_blocks = gpu_blocks
        from kvtier.tiering.manager import StoreMode

        self._store_mode = StoreMode.PREFIX
        self.block_tokens = block_tokens
        self.payloads = payloads
        self.tier_names = list(tier_names) or ["(none)"]
        self.tier_index = {name: index for index, name in enumerate(manager.tier_names)}
        self.promoted_from: dict[BlockKey, int] = {}  # from the manager's BlockPromoted events
        self.gpu: OrderedDict[BlockKey, None] = OrderedDict()
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.counters = _Counters(
            secondary_hits={name: 0 for name in self.tier_names},
            secondary_tokens={name: 0 for name in self.tier_names},
        )
        self.step_times: list[float] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self, on_scheduled: Callable[[_Request, dict[str, int]], None],
             on_finished: Callable[[_Request], None]) -> bool:
        """Run one engine step; True if it scheduled or finished anything."""
        manager = self.manager
        did_work = False
        engine_time = 0.0
        started = time.perf_counter()
        room = self.options.max_running - len(self.running)
        if room > 0 and self.waiting:
            still_waiting: list[_Request] = []
            for request in self.waiting:
                if room <= 0:
                    still_waiting.append(request)
                    continue
                scheduled, spent, hits = self._try_schedule(request)
                engine_time += spent
                if scheduled:
                    room -= 1
                    did_work = True
                    self.running.append(request)
                    on_scheduled(request, hits)
                else:
                    still_waiting.append(request)
            self.waiting = still_waiting
        if self.running:
            keep: list[_Request] = []
            for request in self.running:
                if request.store_backlog:
                    engine_time += self._store(request)
                request.steps_left -= 1
                if request.steps_left > 0 or request.store_backlog:
                    keep.append(request)
                else:
                    manager.on_request_finished(request.ctx)
                    on_finished(request)
                    did_work = True
            self.running = keep
        manager.on_schedule_end()
        promoted_from = self.promoted_from
        _note_promotions(manager.take_events(), self.tier_index, promoted_from)
        if len(promoted_from) > manager.num_slots:  # only after dropped events: forget the gone
            is_resident = manager.pool.is_resident
            for key in [key for key in promoted_from if not is_resident(key)]:
                del promoted_from[key]
        self.step_times.append(time.perf_counter() - started - engine_time)
        return did_work

    def _try_schedule(self, request: _Request) -> tuple[bool, float, dict[str, int]]:
        """Schedule ``request`` if its lookups are answered; returns engine-side time spent."""
        manager = self.manager
        counters = self.counters
        keys = request.keys
        gpu = self.gpu
        gpu_run = 0
        for key in keys:
            if key not in gpu:
                break
            gpu_run += 1
        rest = keys[gpu_run:]
        loadable = manager.lookup_prefix(rest, request.ctx) if rest else 0
        if loadable is None:
            now = time.monotonic()
            if request.first_wait_wall is None:
                request.first_wait_wall = now
                request.resident_at_first_ask = manager.pool.resident_prefix_length(rest)
                counters.requests_waited += 1
            elif now - request.first_wait_wall > self.options.max_wait_s:
                raise ReplayStuckError(
                    f"request on trace line {request.record.line} waited "
                    f"{now - request.first_wait_wall:.1f} s for lookups (max_wait_s "
                    f"{self.options.max_wait_s}); the manager never answered"
                )
            counters.steps_waited += 1
            return False, 0.0, {}
        engine_time = 0.0
        record = request.record
        block_tokens = self.block_tokens
        hits: dict[str, int] = {"GPU": gpu_run}
        counters.gpu_hits += gpu_run
        counters.gpu_tokens += record.tokens_in_blocks(0, gpu_run, block_tokens)
        if loadable:
            resident = request.resident_at_first_ask
            from_cpu = loadable if resident is None else min(resident, loadable)
            loaded = rest[:loadable]
            plan = manager.prepare_load(loaded, request.ctx)
            if len(plan.slots) != len(loaded):
                raise ReplayError(
                    f"prepare_load returned {len(plan.slots)} slots for {len(loaded)} keys "
                    f"(trace line {record.line})"
                )
            verify_started = time.perf_counter()
            for position, (key, slot) in enumerate(zip(loaded, plan.slots, strict=True)):
                if not self.payloads.matches(key, manager.primary_view(slot)):
                    raise ReplayIntegrityError(
                        f"instance {self.number}: block {gpu_run + position} "
                        f"(hash id {record.hash_ids[gpu_run + position]}) of the request on "
                        f"trace line {record.line} loaded from primary slot {slot} does not "
                        f"hold the bytes stored under key {key.hex()}"
                    )
            engine_time += time.perf_counter() - verify_started
            counters.verified_blocks += loadable
            manager.touch(loaded, request.ctx)  # a use, for the primary's LRU / ARC
            manager.complete_load(loaded, request.ctx)
            counters.cpu_hits += from_cpu
            hits["CPU"] = from_cpu
            counters.cpu_tokens += record.tokens_in_blocks(
                gpu_run, gpu_run + from_cpu, block_tokens
            )
            counters.cpu_bytes_loaded += loadable * self.options.block_bytes
            for position in range(from_cpu, loadable):
                tier = self.tier_names[self.promoted_from.get(rest[position], 0)]
                counters.secondary_hits[tier] += 1
                hits[tier] = hits.get(tier, 0) + 1
                absolute = gpu_run + position
                counters.secondary_tokens[tier] += record.tokens_in_blocks(
                    absolute, absolute + 1, block_tokens
                )
        computed = rest[loadable:]
        if computed:
            request.store_backlog = computed
            engine_time += self._store(request)
            counters.store_blocks_deferred += len(request.store_backlog)  # wait for slots
        capacity = self.gpu_blocks
        if capacity:
            for key in keys:
                if key in gpu:
                    gpu.move_to_end(key)
                else:
                    gpu[key] = None
                    if len(gpu) > capacity:
                        gpu.popitem(last=False)
        request.steps_left = 1 + -(-record.output_length // self.options.decode_tokens_per_step)
        return True, engine_time, hits

    def _store(self, request: _Request) -> float:
        """Store what the pool can take of the request's computed blocks now (the rest stays in
        its backlog for later steps); returns the engine-side time spent writing bytes."""
        manager = self.manager
        counters = self.counters
        plan = manager.prepare_store(request.store_backlog, request.ctx, self._store_mode)
        engine_time = 0.0
        if plan is not None and plan.keys:
            write_started = time.perf_counter()
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                self.payloads.write(key, manager.primary_view(slot))
            engine_time = time.perf_counter() - write_started
            manager.complete_store(list(plan.keys), request.ctx)
            counters.cpu_bytes_stored += len(plan.keys) * self.options.block_bytes
            request.store_stalled_steps = 0
        elif plan is not None and plan.deferred:
            counters.store_plans_refused += 1
            request.store_stalled_steps += 1
        deferred = list(plan.deferred) if plan is not None else []
        request.store_backlog = deferred
        if deferred and request.store_stalled_steps >= self.options.store_patience_steps:
            counters.store_blocks_shed += len(deferred)  # really shed: counted and shown
            request.store_backlog = []
        return engine_time


def _key_maker(namespace: Namespace) -> Callable[[int], BlockKey]:
    salt = b"kvtier.replay.v1" + namespace.digest

    def make(block_id: int) -> BlockKey:
        return hashlib.blake2b(salt + block_id.to_bytes(8, "little"), digest_size=16).digest()

    return make


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


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
    from kvtier.tiering.manager import open_manager

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
        self._finished = 0
        self.window = max(1, -(-max(1, self.served) // options.timeline_windows))
        self.timeline: list[TimelinePoint] = []
        self._window_hits: dict[str, int] = {}
        self._window_refs = 0
        self._window_ideal = 0
        self._started = time.monotonic()
        self._key_cache: dict[int, BlockKey] = {}

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
                ctx=RequestContext(f"{self.strategy.value}-{index}"),
                keys=self._keys_for(record),
                arrival_s=record.timestamp_ms / 1000.0,
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
            step_time_p50_s=_percentile(step_times, 0.50),
            step_time_p99_s=_percentile(step_times, 0.99),
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
            scheduler_s=sum(step_times),
        )
