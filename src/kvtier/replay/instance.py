"""One simulated engine instance: its GPU prefix cache, waiting and running queues, the
requests' real block payloads, and the scheduling step that drives a TieringManager.

Thread ownership: all of it is owned by the thread that runs the replay (it plays every
instance's scheduler); the manager's own threads are reached only through its scheduler API.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.keys import BlockKey, RequestContext
from kvtier.replay.errors import ReplayError, ReplayIntegrityError, ReplayStuckError
from kvtier.replay.options import _KEY_PREFIX_BYTES, _PAYLOAD_SEED, ReplayOptions
from kvtier.replay.trace import TraceRequest

if TYPE_CHECKING:
    from kvtier.tiering.manager import TieringManager


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
