"""The engine-facing tiering manager: the step loop and the public API over its tables.

Thread ownership: the **scheduler thread** (the engine thread that calls the public methods)
owns everything here and in the tables the manager builds: the primary pool's metadata, the
engine-store table (``_store_filling``), the pin ledger (:mod:`.pins`: request pins, holds,
cascade and store-job pins), the promotion table (:mod:`.promotions`: promotions, waiters,
rounds, queued loads, retired slots), the write-back table (:mod:`.writeback`: unwritten blocks,
copies, queued stores, shedding), the prefetcher (:mod:`.prefetch`: paused chains, prefetches in
flight, prefetched blocks), the events and counters (:mod:`.events`) and the lifecycle
(``_state``). No public method is thread-safe; call them from one thread. **Background
threads** belong to the secondary tiers (a probe worker and I/O threads per tier) and talk to
this thread only through the tiers' queues, drained by :mod:`.transfers` in ``on_schedule_end``.

``lookup(key)``: HIT when resident; else the tiers in config order, stopping at the first that
does not say False: None -> RETRY; True -> a promotion starts into a reserved slot (no slot ->
MISS), HIT_PENDING until it lands; all False -> MISS. A failed load frees the slot and the tier
quarantines the key, so the next lookup moves on to the next tier: no livelock. Liveness:
``lookup_prefix`` gives a request ``MAX_PROMOTION_ROUNDS`` calls that start promotions; after
that a key neither resident nor in flight ends its prefix (``promotions_lost``).

Stores: ``prepare_store`` reserves slots for the keys the pool does not hold (``StoreMode.ALL``:
all or nothing; ``PREFIX``: the leading run that fits, the rest ``deferred``); the engine writes
``primary_view(slot)``; ``complete_store`` makes them resident and hands them to write-back.
Everything unwritten is flushed at ``shutdown()``. Promoted blocks are never cascaded.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from kvtier.errors import ClosedError
from kvtier.keys import BlockKey, Namespace, RequestContext, check_key, validate_keys
from kvtier.lookup.manager import OwnerThreadError
from kvtier.ops.metrics import KvtierMetrics, manager_samples
from kvtier.primary import PrimaryPool
from kvtier.tiering.events import (
    PRIMARY,
    BlockPrefetched,
    BlockPromoted,
    BlockReadmitted,
    BlockRemoved,
    BlockStored,
    Counters,
    EventLog,
    ManagerEvent,
    PromotionFailed,
    StoreShed,
)
from kvtier.tiering.finder import KeyFinder, PrefixScan, ScanMode
from kvtier.tiering.pins import PinLedger
from kvtier.tiering.plans import (
    KeyNotResidentError,
    KeyStatus,
    LoadPlan,
    NextTurn,
    PrefixPiece,
    StoreMode,
    StorePlan,
    WritePolicy,
)
from kvtier.tiering.prefetch import Prefetcher
from kvtier.tiering.promotions import PromotionTable
from kvtier.tiering.tier import SecondaryTier
from kvtier.tiering.tier_settings import PrefetchSettings
from kvtier.tiering.transfers import Transfers
from kvtier.tiering.writeback import Backlog, WriteBack

__all__ = [
    "PRIMARY",
    "BlockPrefetched",
    "BlockPromoted",
    "BlockReadmitted",
    "BlockRemoved",
    "BlockStored",
    "KeyNotResidentError",
    "KeyStatus",
    "LoadPlan",
    "ManagerClosedError",
    "ManagerEvent",
    "NextTurn",
    "PrefixPiece",
    "PromotionFailed",
    "StoreMode",
    "StorePlan",
    "StoreShed",
    "TieringManager",
]

_METRICS_INTERVAL_S = 1.0      # scheduler-side counters are published at most this often

ManagerClosedError = ClosedError  # the one closed error; this name is kept for callers

_get_ident = threading.get_ident  # bound once: every scheduler-side call asks it


class _ManagerState(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"


class TieringManager:
    """Scheduler-side tiered KV cache (see the module docstring). Not thread-safe."""

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[SecondaryTier] = (),
        *,
        namespace: Namespace,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        metrics: KvtierMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_events: int = 65536,
        owns_global_metrics: bool = False,
        prefetch: PrefetchSettings | None = None,
    ) -> None:
        if not isinstance(pool, PrimaryPool):
            raise TypeError(f"pool must be a PrimaryPool, got {type(pool).__name__}")
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names) or PRIMARY in names:
            raise ValueError(f"tier names must be unique and not 'primary', got {names}")
        try:
            self._write_policy = WritePolicy(write_policy)
        except ValueError:
            raise ValueError(f"write_policy must be one of "
                             f"{[p.value for p in WritePolicy]}, got {write_policy!r}") from None
        self._pool = pool
        self._tiers = tuple(tiers)
        self._namespace = namespace
        self._metrics = metrics
        self._owns_global_metrics = owns_global_metrics
        self._clock = clock
        self._counters = Counters()
        self._events = EventLog(max_events, self._counters)
        self._pins = PinLedger(pool, self._counters, len(self._tiers))
        self._promotions = PromotionTable(pool, len(self._tiers), self._pins, self._counters,
                                          self._events)
        self._writeback = WriteBack(pool, len(self._tiers), self._pins, self._counters,
                                    self._events)
        self._transfers = Transfers(self._tiers, self._promotions, self._writeback)
        self._finder = KeyFinder(pool, self._tiers, self._pins, self._promotions,
                                 self._writeback, self._counters)
        self._prefetch = Prefetcher(prefetch or PrefetchSettings(), pool, self._tiers,
                                    self._promotions, self._writeback, self._counters,
                                    self._events, clock)
        self._store_filling: set[BlockKey] = set()
        if metrics is not None:
            metrics.bind_tiers(names)
        self._next_publish = 0.0
        self._step_cpu_mark = time.thread_time()  # this thread's CPU time at the last step end
        self._state = _ManagerState.RUNNING
        self._owner: int | None = None  # the scheduler thread, bound by its first call

    # ---- geometry ----------------------------------------------------------------------------
    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def block_bytes(self) -> int:
        return self._pool.block_bytes

    @property
    def num_slots(self) -> int:
        return self._pool.num_slots

    @property
    def arena(self) -> memoryview:
        """The whole primary buffer (``num_slots * block_bytes`` bytes)."""
        return self._pool.arena

    @property
    def pool(self) -> PrimaryPool:
        return self._pool

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        return self._tiers

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(tier.name for tier in self._tiers)

    @property
    def write_policy(self) -> WritePolicy:
        return self._write_policy

    @property
    def metrics(self) -> KvtierMetrics | None:
        return self._metrics

    def primary_view(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes (writable, ``block_bytes`` long)."""
        return self._pool.view(slot)

    # ---- lookups ----------------------------------------------------------------------------
    def lookup(self, key: BlockKey, ctx: RequestContext) -> KeyStatus:
        """Where ``key`` stands now (see :class:`KeyStatus`). Never blocks."""
        self._require_running("lookup")
        status = self._finder.find(check_key(key), ctx, ())
        if status is KeyStatus.HIT_PENDING or status is KeyStatus.RETRY:
            self._prefetch.note_demand_wait()  # demand waits: no prefetch starts this step
        return KeyStatus.MISS if status is None else status

    def lookup_prefix(self, keys: Sequence[BlockKey], ctx: RequestContext) -> int | None:
        """How many leading ``keys`` are loadable now; None while a needed answer is pending.

        Counts leading HITs and stops at the first MISS; a RETRY or HIT_PENDING before that
        makes the answer None (ask again next step). Keys after a pending one are still looked
        up, so a whole prefix is probed and promoted in the same step. The whole prefix must
        fit in the pool at once: where room ends, the prefix ends (see :meth:`lookup_piece`).
        """
        self._require_running("lookup_prefix")
        scan, more = self._scan_and_hold(keys, ctx, ScanMode.WHOLE)
        return None if more else scan.count

    def lookup_piece(self, keys: Sequence[BlockKey], ctx: RequestContext) -> PrefixPiece:
        """The next piece of a prefix of any length: ``ready`` leading keys are resident now
        (load them with :meth:`prepare_load` this step); ``more`` says keys after them may be
        loadable (promotions in flight, or waiting for room or for this request's turn): load
        the piece, then call again with the keys after it. Never blocks.

        A request may stage one piece (:data:`~kvtier.tiering.finder.PIECE_FRACTION` of the
        pool) beyond its resident run at a time, and long requests take turns, so a prefix
        longer than the pool costs steps, not hits.
        """
        self._require_running("lookup_piece")
        scan, more = self._scan_and_hold(keys, ctx, ScanMode.PIECES)
        self._counters.pieces_served += more and scan.count > 0
        return PrefixPiece(scan.count, more)

    def _scan_and_hold(self, keys: Sequence[BlockKey], ctx: RequestContext,
                       mode: ScanMode) -> tuple[PrefixScan, bool]:
        """Scan the prefix; (the scan, whether the request must ask again). The request's hold
        (from its last answer) stays pinned through the scan and is settled after it: kept for
        what it found again while it comes back next step, released otherwise."""
        previous = self._pins.take_hold(ctx.req_id)
        self._prefetch.note_lookup(ctx, keys)
        scan = self._finder.scan(keys, ctx, mode)
        more = scan.pending or scan.waiting
        if more:
            self._prefetch.note_demand_wait()  # demand waits: no prefetch starts this step
            self._pins.hold_many(ctx.req_id, scan.found, previous)
        elif previous is not None:
            self._pins.unpin_held(previous.keys)
        return scan, more

    # ---- loads ------------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[BlockKey], ctx: RequestContext) -> LoadPlan:
        """Pin every key's slot for the engine to read; every key must be a HIT."""
        self._require_running("prepare_load")
        checked = validate_keys(keys)
        pool = self._pool
        for index, key in enumerate(checked):
            if not pool.is_resident(key):
                raise KeyNotResidentError(
                    f"keys[{index}] = {key.hex()} is not resident in the primary pool (state "
                    f"{pool.state_of(key).value}); only keys that lookup() answered HIT can be "
                    f"loaded"
                )
        slots = self._pins.pin_for_request(ctx.req_id, checked)
        self._prefetch.note_loaded(checked)
        # The loaded keys leave the request's hold; the rest (a piece's next blocks) stays
        # held until its next lookup settles it, it finishes, or the hold expires.
        self._pins.release_held(ctx.req_id, checked)
        return LoadPlan(tuple(checked), tuple(slots))

    def touch(self, keys: Sequence[BlockKey], ctx: RequestContext) -> None:
        """Count a use of each resident key for the eviction policy (LRU recency, ARC T2)."""
        self._require_running("touch")
        pool = self._pool
        for key in validate_keys(keys):
            pool.touch(key)

    def complete_load(self, keys: Sequence[BlockKey], ctx: RequestContext) -> None:
        """The engine finished reading: unpin one pin of this request per key."""
        self._require_running("complete_load")
        self._pins.unpin_for_request(ctx.req_id, validate_keys(keys))

    # ---- stores -----------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[BlockKey], ctx: RequestContext,
                      mode: StoreMode = StoreMode.ALL) -> StorePlan | None:
        """Reserve slots for the keys the pool does not hold yet.

        ``StoreMode.ALL``: None if they do not all fit. ``StoreMode.PREFIX``: the leading new
        keys that fit now, the rest in ``.deferred`` (never None). Keys already held (resident,
        being promoted or being stored) are left out of ``.keys`` and are never evicted by this
        call.
        """
        self._require_running("prepare_store")
        checked = validate_keys(keys)
        pool = self._pool
        new_keys: list[BlockKey] = []
        seen: set[BlockKey] = set()
        for key in checked:
            if key in seen or pool.slot_of(key) is not None:
                continue
            seen.add(key)
            new_keys.append(key)
        if not new_keys:
            return StorePlan((), (), ())
        protect = set(checked)
        deferred: list[BlockKey] = []
        if mode is StoreMode.PREFIX:
            fits = min(len(new_keys), pool.evictable_count(protect))
            new_keys, deferred = new_keys[:fits], new_keys[fits:]
            self._counters.stores_deferred += len(deferred)
            if not new_keys:
                return StorePlan((), (), (), tuple(deferred))
        reservations = pool.reserve_many(new_keys, protect=protect)
        if reservations is None:
            self._counters.stores_rejected += 1
            if mode is StoreMode.PREFIX:  # cannot happen after the count; stay consistent
                return StorePlan((), (), (), tuple(new_keys + deferred))
            return None
        evicted: list[BlockKey] = []
        for reservation in reservations:
            if reservation.evicted is not None:
                evicted.append(reservation.evicted)
                self._writeback.on_evicted(reservation.evicted, reservation.slot)
            self._store_filling.add(reservation.key)
        self._counters.stores_prepared += len(new_keys)
        return StorePlan(tuple(new_keys), tuple(r.slot for r in reservations), tuple(evicted),
                         tuple(deferred))

    def complete_store(self, keys: Sequence[BlockKey], ctx: RequestContext,
                       success: bool = True) -> None:
        """The engine wrote (``success``) or gave up on the slots of ``keys``."""
        self._require_running("complete_store")
        pool = self._pool
        stored: list[BlockKey] = []
        for key in validate_keys(keys):
            if key not in self._store_filling:
                self._counters.unexpected_completions += 1
                continue
            self._store_filling.discard(key)
            if success:
                pool.commit(key)
                stored.append(key)
            else:
                pool.abort(key)
                self._counters.stores_aborted += 1
        if not stored:
            return
        self._counters.stores_completed += len(stored)
        self._prefetch.note_stored(ctx, stored)
        self._events.emit(BlockStored(tuple(stored), PRIMARY))
        self._writeback.note_stored(stored)
        if self._tiers and self._write_policy is WritePolicy.WRITE_THROUGH:
            self._writeback.cascade_unwritten()

    # ---- the step -----------------------------------------------------------------------------
    def on_schedule_end(self) -> None:
        """Once per engine step: apply finished transfers, submit this step's, flush probes."""
        self._require_running("on_schedule_end")
        self._pins.advance_step()
        self._transfers.poll()
        if self._write_policy is WritePolicy.WRITE_THROUGH:
            self._writeback.cascade_unwritten()
        self._prefetch.step()  # after this step's demand; its loads go after demand's
        self._transfers.submit()
        for tier in self._tiers:
            tier.flush()
        # The scheduler thread's CPU time, not wall time: an engine that waits for its model
        # between steps already leaves the GIL to the tiers' threads.
        busy_s = time.thread_time() - self._step_cpu_mark
        self._transfers.yield_to_io(busy_s)
        self._step_cpu_mark = time.thread_time()
        if self._metrics is not None:
            now = self._clock()
            if now >= self._next_publish:
                self._next_publish = now + _METRICS_INTERVAL_S
                self.publish_metrics()

    def on_request_finished(self, ctx: RequestContext,
                            chain: Sequence[BlockKey] | None = None, *,
                            next_turn: NextTurn = NextTurn.EXPECTED) -> None:
        """Release the request's lookup state and any pins it still holds.

        Call it only after the engine stopped reading the request's loaded slots. ``chain``:
        the request's block keys as the engine knows them, for prefetch (None: the keys it
        looked up and stored here); ``next_turn``: ``NONE`` when the engine knows the session
        ended (its chain is then not kept for a next turn).
        """
        self._require_running("on_request_finished")
        if not isinstance(next_turn, NextTurn):
            raise ValueError(f"next_turn must be one of {[t.value for t in NextTurn]}, got "
                             f"{next_turn!r}")
        self._prefetch.on_finished(ctx, None if chain is None else validate_keys(chain),
                                   next_turn)
        for tier in self._tiers:
            tier.cleanup(ctx.req_id)
        self._promotions.forget_request(ctx.req_id)
        self._finder.leave(ctx.req_id)
        self._pins.release_request(ctx.req_id)

    # ---- events, stats, metrics -------------------------------------------------------------
    def take_events(self) -> list[ManagerEvent]:
        """Every event since the last call, oldest first (at most ``max_events`` are kept)."""
        return self._events.take()

    def get_stats(self) -> dict[str, Any]:
        """Counters and state sizes: ``primary``, ``manager``, ``tiers`` (by name), and totals.

        Top-level ``tracked_keys``, ``pins``, ``outstanding_jobs``, ``pending_promotions`` are 0
        when every request finished and every transfer landed.
        """
        pool = self._pool
        tiers = {tier.name: tier.stats() for tier in self._tiers}
        manager = asdict(self._counters)
        promotion_sizes = self._promotions.sizes()
        writeback_sizes = self._writeback.sizes()
        manager.update(
            pending_promotions=len(self._promotions),
            pending_stores=len(self._store_filling),
            unwritten_blocks=writeback_sizes["unwritten_blocks"],
            pending_copies=writeback_sizes["pending_copies"],
            retired_slots=promotion_sizes["retired_slots"],
            queued_transfers=promotion_sizes["queued_loads"] + writeback_sizes["queued_stores"],
            requests_with_pins=self._pins.requests_with_pins,
            held_blocks=self._pins.held,
            requests_waiting=promotion_sizes["requests_waiting"],
            state=self._state.value,
        )
        prefetch = self._prefetch.stats()
        closed = self._state is _ManagerState.CLOSED
        used = None if closed else pool.occupancy()
        primary = {
            "num_slots": pool.num_slots,
            "block_bytes": pool.block_bytes,
            "free_slots": pool.num_slots if used is None else used.free,
            "resident_blocks": 0 if used is None else used.resident,
            "filling_slots": 0 if used is None else used.filling,
            "pinned_slots": 0 if used is None else used.pinned,
            "pins": 0 if used is None else used.pins,
            "evictions": pool.evictions,
            "eviction_policy": type(pool.policy).__name__,
        }
        return {
            "primary": primary,
            "manager": manager,
            "prefetch": prefetch,
            "tiers": tiers,
            "tracked_keys": sum(t["tracked_keys"] for t in tiers.values()),
            "pins": primary["pins"],
            "outstanding_jobs": sum(t["outstanding_jobs"] for t in tiers.values()),
            "pending_promotions": len(self._promotions),
        }

    def publish_metrics(self) -> None:
        """Push scheduler-side counters into the Prometheus metrics (on_schedule_end does this
        at most once a second, and shutdown once more)."""
        if self._metrics is not None:
            self._metrics.publish(manager_samples(self.get_stats(), self._namespace.block_size))

    # ---- waiting (tests, replay, benchmarks; never the engine's hot path) -------------------
    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until every submitted probe answered and every transfer landed (submitting the
        loads queued this step first), then apply them as ``on_schedule_end`` would; probes are
        not flushed. True if everything landed within ``timeout``."""
        self._require_running("wait_idle")
        return self._transfers.wait_idle(
            timeout, write_through=self._write_policy is WritePolicy.WRITE_THROUGH)

    # ---- lifecycle --------------------------------------------------------------------------
    def _require_running(self, operation: str) -> None:
        """Every scheduler-side call starts here: refuse a closed manager, bind the owner thread
        on the first call and refuse any other thread, before any state changes."""
        if self._state is not _ManagerState.RUNNING:
            raise ManagerClosedError(
                f"the tiering manager is shut down; {operation}() is not allowed any more"
            )
        caller = _get_ident()
        if caller != self._owner:
            if self._owner is not None:
                raise OwnerThreadError(
                    f"tiering manager: {operation}() was called from thread "
                    f"{threading.current_thread().name!r}, but every TieringManager method "
                    "belongs to the scheduler thread that first called one (they are not "
                    "thread-safe); nothing was changed")
            self._owner = caller

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Flush write-back blocks, wait for transfers, stop every thread, close backends and
        the pool. Idempotent. Returns within ``timeout + tiers * SHUTDOWN_EXTRA_PER_TIER_S``
        seconds (see :mod:`kvtier.tiering.io_pool`); transfers still stuck then are abandoned on
        daemon threads, which never hold up interpreter exit. ``None``: wait without bound."""
        if self._state is _ManagerState.CLOSED:
            return
        if self._owner is not None and _get_ident() != self._owner:
            raise OwnerThreadError(
                f"tiering manager: shutdown() was called from thread "
                f"{threading.current_thread().name!r}, not the scheduler thread that drives the "
                "manager; nothing was changed (call it from the scheduler thread)")
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            self._transfers.poll()
            self._writeback.flush_unwritten()
            self._transfers.submit(Backlog.WAIT_FOR_ROOM, left())
            self._transfers.poll(wait=True, timeout=left())
        finally:
            self._state = _ManagerState.CLOSED
            self._transfers.shutdown_tiers(left)
            self._prefetch.close()  # before the promotions: it settles their prefetches
            self._promotions.clear()
            self._store_filling.clear()
            self._pins.clear()
            self._writeback.clear_copies()
            self.publish_metrics()
            if self._metrics is not None and self._owns_global_metrics:
                self._metrics.unregister()
            self._pool.close()

    def __enter__(self) -> TieringManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
