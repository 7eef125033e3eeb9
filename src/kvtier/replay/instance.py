"""One simulated engine instance: its GPU prefix cache, waiting and running queues, the
requests' real block payloads, and the scheduling step that drives a TieringManager.

Thread ownership: all of it is owned by the thread that runs the replay (it plays every
instance's scheduler); the manager's own threads are reached only through its scheduler API.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.keys import BlockKey, RequestContext
from kvtier.replay.errors import ReplayError, ReplayIntegrityError, ReplayStuckError
from kvtier.replay.options import _KEY_PREFIX_BYTES, _PAYLOAD_SEED, PrefixLoading, ReplayOptions
from kvtier.replay.trace import TraceRequest
from kvtier.tiering.plans import NextTurn, PrefixPiece

if TYPE_CHECKING:
    from kvtier.tiering.manager import TieringManager

_PIECES_PER_STEP = 4  # lookup_piece calls per request per step (a loaded piece makes room)


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
    last_turn: bool = False     # its session sends nothing after it (the trace says so)
    first_wait_wall: float | None = None
    first_ask_seq: int | None = None  # the instance's event count at its first lookup
    gpu_run: int | None = None  # its GPU prefix, fixed once it started loading in pieces
    loaded: int = 0             # keys after the GPU prefix loaded so far (piece by piece)
    sources: Counter[str] = field(default_factory=Counter)     # loaded blocks by cause
    row_tokens: Counter[str] = field(default_factory=Counter)  # their tokens by report row
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
    hit_sources: Counter[str] = field(default_factory=Counter)


GPU_SOURCE = "gpu"
CPU_RESIDENT = "cpu_resident"
CPU_PREFETCHED = "cpu_prefetched"
COPY_READMITTED = "copy_readmitted"
STORED_MEANWHILE = "stored_meanwhile"
PROMOTED_PREFIX = "promoted."
"""Where a hit block came from (``hit_sources``): the GPU prefix cache; the CPU pool, resident
when the request first asked; the CPU pool, where prefetch brought it back with no request
waiting (``cpu_prefetched``, counted once: a later request finds it ``cpu_resident``); a
write-back copy re-admitted; a block another request stored after the first ask; a real load
from a secondary tier that the request waited for (``promoted.<tier>``)."""


NOT_FOUND = "not_found"
NO_ROOM = "no_room"
STORE_SHED = "store_shed"


def _apply_events(events: Sequence[Any], seq: int, sources: dict[BlockKey, tuple[str, int]],
                  lost: dict[BlockKey, str]) -> None:
    """Apply the manager's events, oldest first: ``sources`` maps a resident key to (how it
    entered the primary pool, the instance's event count then); ``lost`` remembers the blocks
    a shed cascade or a failed load may have left in no tier."""
    from kvtier.tiering.manager import (
        PRIMARY,
        BlockPrefetched,
        BlockPromoted,
        BlockReadmitted,
        BlockRemoved,
        BlockStored,
        PromotionFailed,
        StoreShed,
    )

    for event in events:
        if isinstance(event, BlockPromoted):
            cause = PROMOTED_PREFIX + event.tier
        elif isinstance(event, BlockPrefetched):
            cause = CPU_PREFETCHED
        elif isinstance(event, BlockReadmitted):
            cause = COPY_READMITTED
        elif isinstance(event, BlockStored) and event.tier == PRIMARY:
            cause = STORED_MEANWHILE
        else:
            if isinstance(event, BlockRemoved) and event.tier == PRIMARY:
                for key in event.keys:
                    sources.pop(key, None)
            elif isinstance(event, (StoreShed, PromotionFailed)):
                loss = "cascade_shed" if isinstance(event, StoreShed) else "load_failed"
                lost.update(dict.fromkeys(event.keys, loss))
            continue
        for key in event.keys:
            sources[key] = (cause, seq)


def _row_of(cause: str) -> str:
    """The report row a cause is counted in: the GPU, the CPU pool, or the tier it loaded."""
    if cause == GPU_SOURCE:
        return "GPU"
    if cause.startswith(PROMOTED_PREFIX):
        return cause[len(PROMOTED_PREFIX):]
    return "CPU"


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
        # resident key -> (cause, event count when it entered the pool), from the events
        self.sources: dict[BlockKey, tuple[str, int]] = {}
        self.event_seq = 0
        self.lost_causes: dict[BlockKey, str] = {}  # why a block may be in no tier
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
                    # Its whole chain, as an engine knows it (the GPU prefix included).
                    manager.on_request_finished(request.ctx, request.keys,
                                                next_turn=NextTurn.NONE if request.last_turn
                                                else NextTurn.EXPECTED)
                    on_finished(request)
                    did_work = True
            self.running = keep
        manager.on_schedule_end()
        self._take_events()
        sources = self.sources
        if len(sources) > manager.num_slots:  # only after dropped events: forget the gone
            is_resident = manager.pool.is_resident
            for key in [key for key in sources if not is_resident(key)]:
                del sources[key]
        self.step_times.append(time.perf_counter() - started - engine_time)
        return did_work

    def _take_events(self) -> None:
        events = self.manager.take_events()
        if events:
            self.event_seq += 1
            _apply_events(events, self.event_seq, self.sources, self.lost_causes)

    def loss_cause(self, key: BlockKey) -> str:
        """Why the prefix ended at ``key``, which the ideal cache holds: a shed store or
        cascade, a failed load, no room to bring it in although a tier has it (``no_room``:
        whole-prefix loading), or ``not_found`` (in no tier: evicted from a bounded one)."""
        cause = self.lost_causes.get(key)
        if cause is not None:
            return cause
        manager = self.manager
        if manager.pool.slot_of(key) is not None or any(
                tier.backend.exists([key])[0] for tier in manager.tiers):
            return NO_ROOM
        return NOT_FOUND

    def _gpu_run(self, request: _Request) -> int:
        if request.gpu_run is not None:
            return request.gpu_run
        gpu = self.gpu
        run = 0
        for key in request.keys:
            if key not in gpu:
                break
            run += 1
        return run

    def _try_schedule(self, request: _Request) -> tuple[bool, float, dict[str, int]]:
        """Schedule ``request`` once its prefix is loaded (piece by piece: each ready piece is
        loaded into the request's GPU blocks at once); returns engine-side time spent."""
        gpu_run = self._gpu_run(request)
        if request.first_ask_seq is None:
            request.first_ask_seq = self.event_seq
        engine_time = 0.0
        more = False
        for _ in range(_PIECES_PER_STEP):
            start = gpu_run + request.loaded
            if start >= len(request.keys):
                break
            piece = self._next_piece(request.keys[start:], request.ctx)
            self._take_events()
            if piece.ready:
                engine_time += self._load(request, start, piece.ready)
            more = piece.more
            if not (more and piece.ready):
                break
        if more:
            if request.loaded:  # loading started: its GPU blocks, prefix hits included, are
                request.gpu_run = gpu_run  # allocated to it from now on (as in vLLM)
            self._note_wait(request)
            return False, engine_time, {}
        return True, engine_time + self._schedule(request, gpu_run), self._hits_of(request,
                                                                                      gpu_run)

    def _next_piece(self, keys: list[BlockKey], ctx: RequestContext) -> PrefixPiece:
        if self.options.prefix_loading is PrefixLoading.PIECES:
            return self.manager.lookup_piece(keys, ctx)
        loadable = self.manager.lookup_prefix(keys, ctx)  # the whole prefix at once
        return PrefixPiece(0, True) if loadable is None else PrefixPiece(loadable, False)

    def _note_wait(self, request: _Request) -> None:
        counters = self.counters
        now = time.monotonic()
        if request.first_wait_wall is None:
            request.first_wait_wall = now
            counters.requests_waited += 1
        elif now - request.first_wait_wall > self.options.max_wait_s:
            raise ReplayStuckError(
                f"request on trace line {request.record.line} waited "
                f"{now - request.first_wait_wall:.1f} s for lookups (max_wait_s "
                f"{self.options.max_wait_s}); the manager never answered"
            )
        counters.steps_waited += 1

    def _load(self, request: _Request, start: int, count: int) -> float:
        """Load ``count`` resident keys from position ``start`` (every byte verified), count
        each by where it came from; returns the engine-side time spent verifying."""
        manager = self.manager
        record = request.record
        loaded = request.keys[start : start + count]
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
                    f"instance {self.number}: block {start + position} "
                    f"(hash id {record.hash_ids[start + position]}) of the request on "
                    f"trace line {record.line} loaded from primary slot {slot} does not "
                    f"hold the bytes stored under key {key.hex()}"
                )
        engine_time = time.perf_counter() - verify_started
        manager.touch(loaded, request.ctx)  # a use, for the primary's LRU / ARC
        manager.complete_load(loaded, request.ctx)
        self.counters.verified_blocks += count
        self.counters.cpu_bytes_loaded += count * self.options.block_bytes
        first_seq = request.first_ask_seq or 0
        sources = self.sources
        for position, key in enumerate(loaded, start):
            source = sources.get(key)
            if source is not None and source[0] == CPU_PREFETCHED:
                cause = CPU_PREFETCHED  # whenever it landed, no request waited for it
                del sources[key]        # from now on it is simply resident
            else:
                cause = CPU_RESIDENT if source is None or source[1] <= first_seq else source[0]
            request.sources[cause] += 1
            request.row_tokens[_row_of(cause)] += record.tokens_in_blocks(
                position, position + 1, self.block_tokens)
        request.loaded += count
        return engine_time

    def _hits_of(self, request: _Request, gpu_run: int) -> dict[str, int]:
        """Hits by report row: the GPU prefix, then the loaded blocks' rows."""
        hits: Counter[str] = Counter({"GPU": gpu_run})
        for cause, count in request.sources.items():
            hits[_row_of(cause)] += count
        return dict(hits)

    def _schedule(self, request: _Request, gpu_run: int) -> float:
        """The request's prefix is loaded: count its hits, compute and store the rest, and
        give it its GPU blocks; returns the engine-side time spent storing."""
        counters = self.counters
        record = request.record
        counters.gpu_hits += gpu_run
        counters.gpu_tokens += record.tokens_in_blocks(0, gpu_run, self.block_tokens)
        if gpu_run:
            counters.hit_sources[GPU_SOURCE] += gpu_run
        counters.hit_sources.update(request.sources)
        for row, count in self._hits_of(request, 0).items():
            tokens = request.row_tokens[row]
            if row == "GPU":
                continue
            if row == "CPU":
                counters.cpu_hits += count
                counters.cpu_tokens += tokens
            else:
                counters.secondary_hits[row] = counters.secondary_hits.get(row, 0) + count
                counters.secondary_tokens[row] = counters.secondary_tokens.get(row, 0) + tokens
        engine_time = 0.0
        computed = request.keys[gpu_run + request.loaded:]
        if computed:
            request.store_backlog = computed
            engine_time += self._store(request)
            counters.store_blocks_deferred += len(request.store_backlog)  # wait for slots
        capacity = self.gpu_blocks
        if capacity:
            gpu = self.gpu
            for key in request.keys:
                if key in gpu:
                    gpu.move_to_end(key)
                else:
                    gpu[key] = None
                    if len(gpu) > capacity:
                        gpu.popitem(last=False)
        request.steps_left = 1 + -(-record.output_length // self.options.decode_tokens_per_step)
        return engine_time

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
            for key in deferred:
                self.lost_causes[key] = STORE_SHED
            request.store_backlog = []
        return engine_time
