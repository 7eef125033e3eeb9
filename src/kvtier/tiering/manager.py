"""The engine-facing tiering manager: prefix lookup across tiers, promotion, cascade, failures.

Thread ownership:

- **Scheduler thread** (the engine thread that calls the public methods) owns everything here:
  the primary pool's metadata, the promotion table (``_promotions``), the per-tier queues of
  transfers to submit at the end of the step (``_queued_loads``, ``_queued_stores``), the
  engine-store table (``_store_filling``), the unwritten blocks (``_unwritten``), the evicted
  blocks' copies awaiting their writes (``_copies``) and the cascade pin count, the per-request
  pins (``_request_pins``), holds (``_holds``) and promotion rounds (``_promotion_rounds``), the
  event buffer (``_events``), the counters (``_counters``) and the
  lifecycle (``_state``). No public method is thread-safe; call them from one thread.
- **Background threads** belong to the secondary tiers (a probe worker per tier, I/O threads per
  tier) and talk to this thread only through the tiers' queues, drained in
  :meth:`TieringManager.on_schedule_end`.

Lookup and promotion: ``lookup(key)`` answers HIT when the key is resident in the primary pool.
Otherwise it asks the secondary tiers' lookup managers in config order, stopping at the first
that does not say False: None -> RETRY (ask again next step); True -> a promotion starts (a
primary slot is reserved, evicting an unpinned victim; no slot -> MISS) and the answer is
HIT_PENDING until the load lands. Every later lookup of a key whose promotion is in flight, from
any request, joins it (one transfer per key). Loads are batched per tier and submitted at
``on_schedule_end``. When a load fails (I/O error, missing, corrupt frame) the slot is freed, the
tier quarantines the key (``mark_miss``) and the next lookup moves on to the next tier in order,
so each tier gets at most one failed attempt per quarantine period: no livelock. All False ->
MISS (recompute).

Liveness: ``lookup_prefix`` gives a request at most ``_MAX_PROMOTION_ROUNDS`` calls that start
promotions (a round per tier to fall through a failed load, and a retry). After that a key of
its prefix that is neither resident nor being promoted ends the prefix (``promotions_lost``)
instead of starting yet another promotion, so a request bigger than what the pool can hold for
it, or one whose promoted blocks other requests keep evicting, is answered with what is loadable
within a bounded number of steps (probe answers, the rounds' loads, the answer), never waiting
on slots it can never get.

Stores: ``prepare_store`` reserves slots for the keys the pool does not hold: all or nothing
(``StoreMode.ALL``), or the longest leading run that fits now (``StoreMode.PREFIX``: the rest is
``StorePlan.deferred``, for the engine to store in later steps, chunk by chunk, as cascades
release slots); the engine writes ``primary_view(slot)``; ``complete_store`` makes them resident
and cascades.
write_through queues every stored block for every secondary tier, its slot pinned until the
tier's write finishes, while those cascades pin at most ``_MAX_CASCADE_PIN_FRACTION`` of the pool;
the blocks past that budget stay unwritten (``_unwritten``: resident, evictable) and are queued
oldest first as the budget frees, so a tier slower than the engine never pins the pool full and
never makes a store fail. write_back leaves every block unwritten until the pool evicts it. An
unwritten block that is evicted is copied out (``_copies``) and written from the copy; a lookup
meanwhile re-admits it from the copy, so a block is always in some tier. Everything unwritten is
flushed at ``shutdown()``. Promoted blocks are never cascaded (so never written back to the tier
they came from). Cascades a backlogged tier cannot take yet wait for the next step; only when a
tier's waiting cascades exceed half the pool is the oldest excess shed (``StoreShed`` event,
``kvtier_store_shed_blocks_total``), so a slow or dead tier never stalls the engine; the
backend's put-if-absent skips blocks a tier already holds.

Public API::

    LookupResult: HIT, HIT_PENDING, RETRY, MISS
    LoadPlan(keys, slots); StorePlan(keys, slots, evicted, deferred); StoreMode: ALL, PREFIX
    events: BlockStored, BlockRemoved, BlockPromoted, PromotionFailed, StoreShed (keys, tier)
    TieringManager(pool, tiers, *, namespace, write_policy, metrics, clock, max_events)
    open_manager(config=None, **overrides) -> TieringManager
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import prometheus_client

from kvtier.config import (
    ConfigError,
    KvtierConfig,
    MetricsRegistry,
    WritePolicy,
    load_config,
)
from kvtier.errors import ClosedError, KvtierError
from kvtier.keys import BlockKey, Namespace, RequestContext, validate_keys
from kvtier.ops.metrics import KvtierMetrics, manager_samples
from kvtier.primary import PrimaryPool
from kvtier.tiering.tier import IO_YIELD_S, JobKind, LookupFactory, SecondaryTier, TransferJob

__all__ = [
    "BlockPromoted",
    "BlockRemoved",
    "BlockStored",
    "KeyNotResidentError",
    "LoadPlan",
    "LookupResult",
    "ManagerClosedError",
    "ManagerEvent",
    "PromotionFailed",
    "StoreMode",
    "StorePlan",
    "StoreShed",
    "TieringManager",
    "open_manager",
]

_log = logging.getLogger("kvtier.tiering.manager")

PRIMARY = "primary"
_TRANSFER_CHUNK_KEYS = 64      # keys per load/store job: one backend batch call each
_METRICS_INTERVAL_S = 1.0      # scheduler-side counters are published at most this often
_HOLD_STEPS = 8                # a request's hold on its prefix blocks lasts this many steps
_MAX_HELD_FRACTION = 0.75      # holds never pin more than this share of the pool
_MAX_PROMOTION_ROUNDS = 3      # lookup_prefix calls per request that may start promotions
_MAX_WAITING_CASCADE_FRACTION = 0.5  # cascades waiting for a backlogged tier, share of the pool
_MAX_CASCADE_PIN_FRACTION = 0.5  # pool share write-through cascades may pin (queued + in flight)


class LookupResult(enum.Enum):
    HIT = "hit"                  # resident in the primary pool: loadable now
    HIT_PENDING = "hit_pending"  # a promotion from a secondary tier is in flight
    RETRY = "retry"              # a secondary tier has not answered yet: ask next step
    MISS = "miss"                # nowhere (or no slot to promote into): recompute


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Where to read each key: ``slots[i]`` holds ``keys[i]`` (pinned until complete_load)."""

    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]


class StoreMode(enum.Enum):
    """What ``prepare_store`` does when the pool cannot take every new key now."""

    ALL = "all"        # reserve every new key or none (returns None)
    PREFIX = "prefix"  # reserve the leading new keys that fit; the rest is ``deferred``


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Write ``keys[i]`` into ``slots[i]``; ``evicted`` lists every key this call evicted;
    ``deferred`` the new keys that did not fit now (``StoreMode.PREFIX``), in order."""

    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[BlockKey, ...]
    deferred: tuple[BlockKey, ...] = ()


@dataclass(frozen=True, slots=True)
class _TierEvent:
    keys: tuple[BlockKey, ...]
    tier: str


class BlockStored(_TierEvent):
    """``keys`` are now held by ``tier`` ("primary" or a secondary tier's name)."""

    __slots__ = ()


class BlockRemoved(_TierEvent):
    """``keys`` left ``tier`` (primary evictions)."""

    __slots__ = ()


class BlockPromoted(_TierEvent):
    """``keys`` were promoted into the primary pool from secondary tier ``tier`` (each promotion
    also emits ``BlockStored(keys, "primary")``, just before this event)."""

    __slots__ = ()


class PromotionFailed(_TierEvent):
    """Loading ``keys`` from ``tier`` failed (missing, I/O error or corrupt); they recompute."""

    __slots__ = ()


class StoreShed(_TierEvent):
    """Cascading ``keys`` to ``tier`` was dropped because the tier was backlogged."""

    __slots__ = ()


ManagerEvent = BlockStored | BlockRemoved | BlockPromoted | PromotionFailed | StoreShed


class KeyNotResidentError(KvtierError, ValueError):
    """``prepare_load`` was asked for a key that is not resident in the primary pool."""


ManagerClosedError = ClosedError  # the one closed error; this name is kept for callers


class _ManagerState(enum.Enum):
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(slots=True)
class _Promotion:
    tier_index: int
    slot: int
    waiters: set[str] = field(default_factory=set)  # req_ids answered HIT_PENDING for it


@dataclass(slots=True)
class _Hold:
    keys: set[BlockKey]
    expiry: int


@dataclass(slots=True)
class _QueuedStore:
    key: BlockKey
    payload: memoryview | bytes
    pinned: bool  # True: payload is the pinned primary slot (write-through); False: a copy


@dataclass(slots=True)
class _Copy:
    payload: bytes  # an evicted, not yet written block's bytes
    writers: int    # tiers that have not finished (or given up on) writing it


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    hits: int = 0
    hit_pending: int = 0
    retries: int = 0
    misses: int = 0
    promotions_started: int = 0
    promotions_joined: int = 0
    promotions_succeeded: int = 0
    promotions_failed: int = 0
    promotions_no_slot: int = 0
    promotions_lost: int = 0
    stores_prepared: int = 0
    stores_rejected: int = 0
    stores_deferred: int = 0
    cascades_waited: int = 0
    stores_completed: int = 0
    stores_aborted: int = 0
    cascades_queued: int = 0
    cascades_stored: int = 0
    cascades_failed: int = 0
    cascades_shed: int = 0
    write_backs: int = 0
    copies_readmitted: int = 0
    evictions: int = 0
    unexpected_completions: int = 0
    pins_released_at_finish: int = 0
    holds_placed: int = 0
    holds_expired: int = 0
    holds_refused: int = 0
    events_dropped: int = 0
    invariant_violations: int = 0


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
        self._promotions: dict[BlockKey, _Promotion] = {}
        self._queued_loads: list[list[BlockKey]] = [[] for _ in self._tiers]
        self._queued_stores: list[list[_QueuedStore]] = [[] for _ in self._tiers]
        # (tier index, store job id) -> per key: is the payload a pinned primary slot?
        self._store_pins: dict[tuple[int, int], tuple[bool, ...]] = {}
        self._store_filling: set[BlockKey] = set()
        # Resident blocks no tier has been sent yet: every block under write-back; under
        # write-through the blocks past the cascade pin budget (sent when it frees, or copied
        # out on eviction). Insertion order is age: the oldest go first.
        self._unwritten: dict[BlockKey, None] = {}
        self._cascade_pins = 0  # pool pins held by queued or in-flight write-through cascades
        # Evicted blocks whose tier writes are still queued or in flight, by key: a lookup
        # re-admits them from here instead of missing until the write lands.
        self._copies: dict[BlockKey, _Copy] = {}
        # (tier index, job id) -> slots of an abandoned load, retired until its I/O ends.
        self._retired: dict[tuple[int, int], list[int]] = {}
        # The budget is a share of the pool's blocks; each block takes one pin per tier.
        self._max_cascade_pins = max(1, int(pool.num_slots * _MAX_CASCADE_PIN_FRACTION)) * max(
            1, len(self._tiers))
        self._request_pins: dict[str, Counter[BlockKey]] = {}
        # Holds: a pending request's resident prefix blocks (and promotions that landed for
        # it) stay pinned until it looks up again, loads, finishes, or the hold expires, so
        # other requests' promotions cannot evict them in between (no promotion ping-pong).
        # One hold per request: its pinned keys and one expiry step (refreshed by every hold),
        # so holding and releasing a 10k-block prefix is one pin / unpin per key, nothing more.
        self._holds: dict[str, _Hold] = {}
        self._hold_expiries: deque[tuple[int, str]] = deque()
        self._held = 0
        self._max_held = int(pool.num_slots * _MAX_HELD_FRACTION)
        self._request_waits: dict[str, set[BlockKey]] = {}  # req_id -> promotions it waits on
        self._promotion_rounds: dict[str, int] = {}  # req_id -> calls that started promotions
        self._max_waiting_cascades = max(1, int(pool.num_slots * _MAX_WAITING_CASCADE_FRACTION))
        self._step = 0
        self._events: deque[ManagerEvent] = deque(maxlen=max(0, max_events))
        self._counters = _Counters()
        if metrics is not None:
            metrics.bind_tiers(names)
        self._next_publish = 0.0
        self._state = _ManagerState.RUNNING

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
    def lookup(self, key: BlockKey, ctx: RequestContext) -> LookupResult:
        """Where ``key`` stands now (see :class:`LookupResult`). Never blocks."""
        self._require_running("lookup")
        if not isinstance(key, bytes):
            raise TypeError(f"key must be a BlockKey (bytes), got {type(key).__name__}")
        return self._lookup(key, ctx, ())

    def lookup_prefix(self, keys: Sequence[BlockKey], ctx: RequestContext) -> int | None:
        """How many leading ``keys`` are loadable now; None while a needed answer is pending.

        Counts leading HITs and stops at the first MISS; a RETRY or HIT_PENDING before that
        makes the answer None (ask again next step). Keys after a pending one are still looked
        up, so a whole prefix is probed and promoted in the same step.
        """
        self._require_running("lookup_prefix")
        # The request's hold (from its last answer None) stays pinned through this call and is
        # settled at the end: kept for what it found again, released for the rest.
        previous = self._holds.pop(ctx.req_id, None) if self._holds else None
        try:
            resident = self._pool.resident_prefix_length(keys)
        except TypeError:  # an unhashable key: say which one
            validate_keys(keys)
            raise
        counters = self._counters
        counters.lookups += resident
        counters.hits += resident
        if resident == len(keys):  # the steady-state fast path: everything is in the pool
            if previous is not None:
                self._unpin_hold(previous.keys)
            return resident
        hits: set[BlockKey] = set(keys[:resident])
        count = resident
        pending = False
        req_id = ctx.req_id
        # Past its last promotion round, what is not resident or in flight ends the prefix.
        rounds = self._promotion_rounds.get(req_id, 0) if self._promotion_rounds else 0
        round_over = rounds >= _MAX_PROMOTION_ROUNDS
        started = counters.promotions_started
        promotions = self._promotions
        for index in range(resident, len(keys)):
            key = keys[index]
            if not isinstance(key, bytes):
                raise TypeError(
                    f"keys[{index}] must be a BlockKey (bytes), got {type(key).__name__}")
            if (round_over and key not in promotions and not self._pool.is_resident(key)
                    and key not in self._copies):
                counters.lookups += 1
                counters.misses += 1
                counters.promotions_lost += 1
                break
            result = self._lookup(key, ctx, hits)
            if result is LookupResult.HIT:
                hits.add(key)  # promotions later in this prefix must not evict it
                if not pending:
                    count += 1
            elif result is LookupResult.MISS:
                break
            else:
                pending = True
        if counters.promotions_started != started:
            self._promotion_rounds[req_id] = rounds + 1
        if not pending:
            if previous is not None:
                self._unpin_hold(previous.keys)
            return count
        self._hold_many(req_id, hits, previous)  # it comes back next step: keep what it found
        return None

    def _lookup(self, key: BlockKey, ctx: RequestContext,
                protect: set[BlockKey] | tuple[()]) -> LookupResult:
        counters = self._counters
        counters.lookups += 1
        pool = self._pool
        if pool.is_resident(key):
            counters.hits += 1
            return LookupResult.HIT
        promotion = self._promotions.get(key)
        if promotion is not None:
            counters.promotions_joined += 1
            counters.hit_pending += 1
            self._add_waiter(promotion, key, ctx.req_id)
            return LookupResult.HIT_PENDING
        if pool.slot_of(key) is not None:  # the engine is storing it right now
            counters.misses += 1
            return LookupResult.MISS
        if self._copies:
            copy = self._copies.get(key)
            if copy is not None:
                return self._readmit(key, copy, protect)
        for index, tier in enumerate(self._tiers):
            verdict = tier.lookup(key, ctx)
            if verdict is None:
                counters.retries += 1
                return LookupResult.RETRY
            if verdict:
                return self._start_promotion(key, index, protect, ctx.req_id)
        counters.misses += 1
        return LookupResult.MISS

    def _reserve_for(self, key: BlockKey, protect: set[BlockKey] | tuple[()]) -> int | None:
        """A slot for bringing ``key`` into the pool (evicting a victim), or None (counted as
        a miss for want of a slot)."""
        reservation = self._pool.reserve(key, protect)
        if reservation is None:
            self._counters.promotions_no_slot += 1
            self._counters.misses += 1
            return None
        if reservation.evicted is not None:
            self._on_evicted(reservation.evicted, reservation.slot)
        return reservation.slot

    def _start_promotion(self, key: BlockKey, tier_index: int,
                         protect: set[BlockKey] | tuple[()], req_id: str) -> LookupResult:
        slot = self._reserve_for(key, protect)
        if slot is None:
            return LookupResult.MISS
        promotion = self._promotions[key] = _Promotion(tier_index, slot)
        self._add_waiter(promotion, key, req_id)
        self._queued_loads[tier_index].append(key)
        self._counters.promotions_started += 1
        self._counters.hit_pending += 1
        return LookupResult.HIT_PENDING

    def _add_waiter(self, promotion: _Promotion, key: BlockKey, req_id: str) -> None:
        if req_id in promotion.waiters:
            return
        promotion.waiters.add(req_id)
        waits = self._request_waits.get(req_id)
        if waits is None:
            self._request_waits[req_id] = {key}
        else:
            waits.add(key)

    # ---- holds ------------------------------------------------------------------------------
    def _hold(self, req_id: str, key: BlockKey) -> None:
        """Pin ``key`` for ``req_id`` until it looks up again, loads, finishes or the hold
        expires (``_HOLD_STEPS`` after its latest refresh); refused beyond the cap."""
        hold = self._renew_hold(req_id)
        if key in hold.keys:
            return
        if self._held >= self._max_held or not self._pool.is_resident(key):
            self._counters.holds_refused += 1
            return
        self._pool.pin(key)
        hold.keys.add(key)
        self._held += 1
        self._counters.holds_placed += 1

    def _renew_hold(self, req_id: str) -> _Hold:
        expiry = self._step + _HOLD_STEPS
        hold = self._holds.get(req_id)
        if hold is None:
            hold = self._holds[req_id] = _Hold(set(), expiry)
        elif hold.expiry == expiry:
            return hold
        hold.expiry = expiry
        self._hold_expiries.append((expiry, req_id))
        return hold

    def _hold_many(self, req_id: str, keys: set[BlockKey], previous: _Hold | None) -> None:
        """Hold ``keys`` (all resident) for ``req_id``; of ``previous`` (its old hold, still
        pinned) the keys not in ``keys`` are released."""
        if previous is not None:
            self._holds[req_id] = previous
            stale = previous.keys - keys
            if stale:
                self._unpin_hold(stale)
                previous.keys -= stale
        hold = self._renew_hold(req_id)
        held = hold.keys
        room = self._max_held - self._held
        pin = self._pool.pin
        placed = 0
        for key in keys:
            if key in held:
                continue
            if placed >= room:
                self._counters.holds_refused += 1
                continue
            pin(key)
            held.add(key)
            placed += 1
        self._held += placed
        self._counters.holds_placed += placed

    def _unpin_hold(self, keys: set[BlockKey]) -> None:
        unpin = self._pool.unpin
        for key in keys:
            unpin(key)
        self._held -= len(keys)

    def _release_holds(self, req_id: str) -> None:
        hold = self._holds.pop(req_id, None)
        if hold is not None and hold.keys:
            self._unpin_hold(hold.keys)

    def _expire_holds(self) -> None:
        expiries = self._hold_expiries
        step = self._step
        while expiries and expiries[0][0] <= step:
            expiry, req_id = expiries.popleft()
            hold = self._holds.get(req_id)
            if hold is None or hold.expiry != expiry:
                continue  # released or refreshed since
            del self._holds[req_id]
            if hold.keys:
                self._unpin_hold(hold.keys)
                self._counters.holds_expired += len(hold.keys)

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
        pins = self._request_pins.get(ctx.req_id)
        if pins is None:
            pins = self._request_pins[ctx.req_id] = Counter()
        slots = []
        for key in checked:
            slots.append(pool.pin(key))
            pins[key] += 1
        if self._holds:
            self._release_holds(ctx.req_id)
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
        pins = self._request_pins.get(ctx.req_id)
        for key in validate_keys(keys):
            if pins is None or pins[key] <= 0:
                self._counters.unexpected_completions += 1
                continue
            pins[key] -= 1
            if pins[key] == 0:
                del pins[key]
            self._pool.unpin(key)
        if pins is not None and not pins:
            del self._request_pins[ctx.req_id]

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
                self._on_evicted(reservation.evicted, reservation.slot)
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
        self._emit(BlockStored(tuple(stored), PRIMARY))
        if not self._tiers:
            return
        unwritten = self._unwritten
        copies = self._copies
        for key in stored:
            if key not in copies:  # else its earlier copy is being written already
                unwritten[key] = None
        if self._write_policy is WritePolicy.WRITE_THROUGH:
            self._cascade_unwritten()

    def _cascade_unwritten(self) -> None:
        """Write-through: queue the oldest unwritten blocks for every tier, pinned, while the
        cascade pin budget lasts. The rest stay unwritten (resident, evictable): a backlogged
        tier never pins the pool full and so never makes the engine's stores fail; they are
        sent in a later step, or copied out when the pool evicts them."""
        unwritten = self._unwritten
        tiers = len(self._tiers)
        if not tiers or not unwritten:
            return
        room = (self._max_cascade_pins - self._cascade_pins) // tiers
        if room <= 0:
            return
        pool = self._pool
        batch = [key for key, _ in zip(unwritten, range(room), strict=False)]
        for key in batch:
            del unwritten[key]
        batch = [key for key in batch if pool.is_resident(key)]  # discarded meanwhile: gone
        for key in batch:
            view = pool.view(pool.pin(key))
            for queue_ in self._queued_stores:
                queue_.append(_QueuedStore(key, view, True))
            for _ in range(tiers - 1):
                pool.pin(key)  # one pin per tier write
        self._cascade_pins += len(batch) * tiers
        self._counters.cascades_queued += len(batch) * tiers

    def _unpin_cascade(self, key: BlockKey) -> None:
        self._pool.unpin(key)
        self._cascade_pins -= 1

    def _on_evicted(self, key: BlockKey, slot: int) -> None:
        """``key`` just lost ``slot`` to a new reservation; its bytes are still in the slot."""
        self._counters.evictions += 1
        self._emit(BlockRemoved((key,), PRIMARY))
        if key in self._unwritten:
            del self._unwritten[key]
            payload = bytes(self._pool.view(slot))  # the slot is about to be rewritten
            self._copies[key] = _Copy(payload, len(self._tiers))
            for queue_ in self._queued_stores:
                queue_.append(_QueuedStore(key, payload, False))
            self._counters.write_backs += 1
            self._counters.cascades_queued += len(self._tiers)

    def _release_queued(self, key: BlockKey, pinned: bool) -> None:
        """One tier is done with (or gave up on) a queued cascade of ``key``."""
        if pinned:
            self._unpin_cascade(key)
            return
        copy = self._copies.get(key)
        if copy is not None:
            copy.writers -= 1
            if copy.writers <= 0:
                del self._copies[key]

    def _readmit(self, key: BlockKey, copy: _Copy,
                 protect: set[BlockKey] | tuple[()]) -> LookupResult:
        """An evicted block whose write is still pending comes back from its copy, so there is
        never a window in which a block is in no tier at all."""
        slot = self._reserve_for(key, protect)
        if slot is None:
            return LookupResult.MISS
        self._pool.view(slot)[:] = copy.payload
        self._pool.commit(key)
        self._counters.copies_readmitted += 1
        self._counters.hits += 1
        self._emit(BlockStored((key,), PRIMARY))
        return LookupResult.HIT

    # ---- the step -----------------------------------------------------------------------------
    def on_schedule_end(self) -> None:
        """Once per engine step: apply finished transfers, submit this step's, flush probes."""
        self._require_running("on_schedule_end")
        self._step += 1
        if self._hold_expiries:
            self._expire_holds()
        self._poll_jobs()
        if self._unwritten and self._write_policy is WritePolicy.WRITE_THROUGH:
            self._cascade_unwritten()
        self._submit_queued()
        for tier in self._tiers:
            tier.flush()
        self._yield_to_io()
        if self._metrics is not None:
            now = self._clock()
            if now >= self._next_publish:
                self._next_publish = now + _METRICS_INTERVAL_S
                self.publish_metrics()

    def _yield_to_io(self) -> None:
        """With transfers or probes in flight, wait at most ``IO_YIELD_S`` for them (applying
        what finishes), which hands the GIL to the tiers' threads: a scheduler that steps back
        to back would otherwise starve them (see :data:`kvtier.tiering.tier.IO_YIELD_S`)."""
        deadline = time.monotonic() + IO_YIELD_S
        for index, tier in enumerate(self._tiers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for job in tier.yield_to_io(remaining):
                self._apply_job(index, job)

    def on_request_finished(self, ctx: RequestContext) -> None:
        """Release the request's lookup state and any pins it still holds.

        Call it only after the engine stopped reading the request's loaded slots.
        """
        self._require_running("on_request_finished")
        for tier in self._tiers:
            tier.cleanup(ctx.req_id)
        self._release_holds(ctx.req_id)
        self._promotion_rounds.pop(ctx.req_id, None)
        waits = self._request_waits.pop(ctx.req_id, None)
        if waits:
            for key in waits:
                promotion = self._promotions.get(key)
                if promotion is not None:
                    promotion.waiters.discard(ctx.req_id)
        pins = self._request_pins.pop(ctx.req_id, None)
        if pins:
            for key, count in pins.items():
                for _ in range(count):
                    self._pool.unpin(key)
                self._counters.pins_released_at_finish += count

    def _poll_jobs(self, *, wait: bool = False, timeout: float | None = None) -> None:
        for index, tier in enumerate(self._tiers):
            for job in tier.get_finished_jobs(wait=wait, timeout=timeout):
                self._apply_job(index, job)
            if self._retired:
                self._reclaim(index, tier)

    def _reclaim(self, tier_index: int, tier: SecondaryTier, wait_s: float = 0.0) -> None:
        """Slots of abandoned loads whose I/O has ended go back into circulation."""
        for job in tier.take_released_loads(wait_s):
            for slot in self._retired.pop((tier_index, job.job_id), ()):
                self._pool.reclaim(slot)

    def _apply_job(self, tier_index: int, job: TransferJob) -> None:
        tier_name = self._tiers[tier_index].name
        pool = self._pool
        if job.kind is JobKind.LOAD:
            loaded: list[BlockKey] = []
            failed: list[BlockKey] = []
            for key, ok in zip(job.keys, job.results, strict=True):
                promotion = self._promotions.get(key)
                if promotion is None or promotion.tier_index != tier_index:
                    self._violation(f"load result for key {key.hex()} without its promotion")
                    continue
                del self._promotions[key]
                for waiter in promotion.waiters:
                    waits = self._request_waits.get(waiter)
                    if waits is not None:
                        waits.discard(key)
                        if not waits:
                            del self._request_waits[waiter]
                if ok:
                    pool.commit(key)
                    loaded.append(key)
                    for waiter in promotion.waiters:
                        self._hold(waiter, key)
                elif job.abandoned:  # its I/O may still write the slot: out of use till it ends
                    self._retired.setdefault((tier_index, job.job_id), []).append(
                        pool.retire(key))
                    failed.append(key)
                else:
                    pool.abort(key)
                    failed.append(key)
            self._counters.promotions_succeeded += len(loaded)
            self._counters.promotions_failed += len(failed)
            if loaded:
                self._emit(BlockStored(tuple(loaded), PRIMARY))
                self._emit(BlockPromoted(tuple(loaded), tier_name))
            if failed:
                self._emit(PromotionFailed(tuple(failed), tier_name))
            return
        stored: list[BlockKey] = []
        pinned = self._store_pins.pop((tier_index, job.job_id), None)
        for position, (key, ok) in enumerate(zip(job.keys, job.results, strict=True)):
            self._release_queued(key, pinned is not None and pinned[position])
            if ok:
                stored.append(key)
        self._counters.cascades_stored += len(stored)
        self._counters.cascades_failed += len(job.keys) - len(stored)
        if stored:
            self._emit(BlockStored(tuple(stored), tier_name))

    def _submit_queued(self, *, force: bool = False, timeout: float | None = None) -> None:
        """Submit the step's queued loads and stores. ``force`` (shutdown) waits, up to
        ``timeout`` s per tier, for room instead of shedding."""
        pool = self._pool
        deadline = None if timeout is None else time.monotonic() + timeout
        for index, tier in enumerate(self._tiers):
            loads = self._queued_loads[index]
            if loads:
                self._queued_loads[index] = []
                for start in range(0, len(loads), _TRANSFER_CHUNK_KEYS):
                    chunk = loads[start : start + _TRANSFER_CHUNK_KEYS]
                    outs = [pool.view(self._promotions[key].slot) for key in chunk]
                    tier.submit_load(chunk, outs)
            stores = self._queued_stores[index]
            if not stores:
                continue
            self._queued_stores[index] = []
            for start in range(0, len(stores), _TRANSFER_CHUNK_KEYS):
                chunk_stores = stores[start : start + _TRANSFER_CHUNK_KEYS]
                keys = [item.key for item in chunk_stores]
                payloads = [item.payload for item in chunk_stores]
                if not force and not tier.can_accept_store(
                        sum(memoryview(p).nbytes for p in payloads)):
                    self._wait_or_shed(index, stores[start:])
                    break
                if force:
                    nbytes = sum(memoryview(p).nbytes for p in payloads)
                    while not tier.can_accept_store(nbytes):
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            break  # a stuck tier: the rest is shed, counted, not waited for
                        for finished in tier.get_finished_jobs(wait=True, timeout=remaining):
                            self._apply_job(index, finished)
                job = tier.submit_store(keys, payloads)
                if job is None:
                    for item in chunk_stores:
                        self._release_queued(item.key, item.pinned)
                    self._counters.cascades_shed += len(chunk_stores)
                    self._emit(StoreShed(tuple(keys), tier.name))
                elif any(item.pinned for item in chunk_stores):
                    self._store_pins[(index, job.job_id)] = tuple(
                        item.pinned for item in chunk_stores)

    def _wait_or_shed(self, tier_index: int, waiting: list[_QueuedStore]) -> None:
        """Cascades a backlogged tier cannot take yet wait in the pool for the next step; the
        oldest beyond the bound are shed (counted), so a dead tier never pins the whole pool."""
        excess = len(waiting) - self._max_waiting_cascades
        if excess > 0:
            shed, waiting = waiting[:excess], waiting[excess:]
            self._shed(tier_index, shed)
        self._queued_stores[tier_index] = waiting
        self._counters.cascades_waited += len(waiting)

    def _shed(self, tier_index: int, shed: list[_QueuedStore]) -> None:
        tier = self._tiers[tier_index]
        for item in shed:
            self._release_queued(item.key, item.pinned)
        self._counters.cascades_shed += len(shed)
        tier.count_shed(len(shed))
        self._emit(StoreShed(tuple(item.key for item in shed), tier.name))

    # ---- events, stats, metrics -------------------------------------------------------------
    def _emit(self, event: ManagerEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self._counters.events_dropped += 1
            if not self._events.maxlen:
                return
        self._events.append(event)

    def take_events(self) -> list[ManagerEvent]:
        """Every event since the last call, oldest first (at most ``max_events`` are kept)."""
        events = list(self._events)
        self._events.clear()
        return events

    def _violation(self, message: str) -> None:
        self._counters.invariant_violations += 1
        _log.warning("invariant violated: %s", message)

    def get_stats(self) -> dict[str, Any]:
        """Counters and state sizes: ``primary``, ``manager``, ``tiers`` (by name), and totals.

        Top-level ``tracked_keys``, ``pins``, ``outstanding_jobs``, ``pending_promotions`` are 0
        when every request finished and every transfer landed.
        """
        pool = self._pool
        tiers = {tier.name: tier.stats() for tier in self._tiers}
        manager = asdict(self._counters)
        manager.update(
            pending_promotions=len(self._promotions),
            pending_stores=len(self._store_filling),
            unwritten_blocks=len(self._unwritten),
            pending_copies=len(self._copies),
            retired_slots=sum(map(len, self._retired.values())),
            queued_transfers=sum(map(len, self._queued_loads))
            + sum(map(len, self._queued_stores)),
            requests_with_pins=len(self._request_pins),
            held_blocks=self._held,
            requests_waiting=len(self._request_waits),
            state=self._state.value,
        )
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
        deadline = time.monotonic() + timeout
        idle = True
        for tier in self._tiers:
            remaining = max(0.0, deadline - time.monotonic())
            idle = tier.lookup_manager._wait_for_results(remaining) and idle
        through = self._write_policy is WritePolicy.WRITE_THROUGH
        while True:  # cascades waiting for a backlogged tier (or the pin budget) go as jobs land
            if through and self._unwritten:
                self._cascade_unwritten()
            self._submit_queued()
            for index, tier in enumerate(self._tiers):
                remaining = max(0.0, deadline - time.monotonic())
                for job in tier.get_finished_jobs(wait=True, timeout=remaining):
                    self._apply_job(index, job)
            unsent = any(self._queued_stores) or (through and bool(self._unwritten))
            if not unsent or time.monotonic() >= deadline:
                break
        for index, tier in enumerate(self._tiers):
            if self._retired:  # abandoned loads count as transfers until their call ends
                self._reclaim(index, tier, max(0.0, deadline - time.monotonic()))
            idle = idle and tier.outstanding_jobs == 0
            tier.lookup_manager.drain_results()
        return idle and not unsent and not self._retired

    # ---- lifecycle --------------------------------------------------------------------------
    def _require_running(self, operation: str) -> None:
        if self._state is not _ManagerState.RUNNING:
            raise ManagerClosedError(
                f"the tiering manager is shut down; {operation}() is not allowed any more"
            )

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Flush write-back blocks, wait for transfers, stop every thread, close backends and
        the pool. Idempotent. Returns within ``timeout + tiers * SHUTDOWN_EXTRA_PER_TIER_S``
        seconds (see :mod:`kvtier.tiering.io_pool`); transfers still stuck then are abandoned on
        daemon threads, which never hold up interpreter exit. ``None``: wait without bound."""
        if self._state is _ManagerState.CLOSED:
            return
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            self._poll_jobs()
            if self._unwritten:
                pool = self._pool
                for key in self._unwritten:
                    if pool.is_resident(key):
                        for queue_ in self._queued_stores:  # one pin per tier write
                            slot = pool.pin(key)
                            queue_.append(_QueuedStore(key, pool.view(slot), True))
                            self._cascade_pins += 1
                        self._counters.write_backs += 1
                self._unwritten.clear()
            self._submit_queued(force=True, timeout=left())
            self._poll_jobs(wait=True, timeout=left())
        finally:
            self._state = _ManagerState.CLOSED
            for index, tier in enumerate(self._tiers):
                try:
                    for job in tier.shutdown(left()):
                        self._apply_job(index, job)
                except Exception as exc:
                    _log.warning("tier %s: shutdown failed: %r", tier.name, exc)
            self._promotions.clear()
            self._store_filling.clear()
            self._request_pins.clear()
            self._holds.clear()
            self._hold_expiries.clear()
            self._request_waits.clear()
            self._promotion_rounds.clear()
            self._copies.clear()
            self._held = 0
            self.publish_metrics()
            if self._metrics is not None and self._owns_global_metrics:
                self._metrics.unregister()
            self._pool.close()

    def __enter__(self) -> TieringManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def open_manager(
    config: KvtierConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    lookup_factory: LookupFactory | None = None,
    **overrides: Any,
) -> TieringManager:
    """Build the whole stack (pool, backends, tiers, metrics) from a config.

    ``config`` is a :class:`KvtierConfig`, a dict, a YAML file path, or None for the ``KVTIER_*``
    environment; ``overrides`` replace top-level keys. ``clock`` drives every tier's lookup
    manager (tests inject one); ``lookup_factory`` replaces each tier's lookup manager (see
    :class:`~kvtier.tiering.tier.SecondaryTier`). Raises :class:`ConfigError` naming the
    bad key path, including for a backend URL or option the backend rejects.
    """
    cfg = load_config(config, **overrides)
    metrics: KvtierMetrics | None
    if cfg.metrics_registry is MetricsRegistry.DISABLED:
        metrics = None
    elif cfg.metrics_registry is MetricsRegistry.GLOBAL:
        try:
            metrics = KvtierMetrics(prometheus_client.REGISTRY)
        except ValueError as exc:
            raise ConfigError(
                f"metrics_registry: 'global' failed ({exc}); another manager in this process "
                f"already registered kvtier metrics — use 'private'"
            ) from None
    else:
        metrics = KvtierMetrics()
    from kvtier.backends import open_backend  # lazy: backends import redis/boto3 on demand

    tiers: list[SecondaryTier] = []
    pool: PrimaryPool | None = None
    try:
        for index, tier_cfg in enumerate(cfg.secondary_tiers):
            try:
                backend = open_backend(tier_cfg.url, cfg.namespace, **dict(tier_cfg.options))
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"secondary_tiers[{index}]: {exc}") from None
            try:
                tiers.append(SecondaryTier(
                    tier_cfg.name, backend, lookup=tier_cfg.lookup,
                    io_threads=tier_cfg.io_threads,
                    max_pending_store_bytes=tier_cfg.max_pending_store_bytes,
                    max_pending_store_jobs=tier_cfg.max_pending_store_jobs,
                    metrics=metrics, clock=clock, lookup_factory=lookup_factory,
                    load_timeout_s=tier_cfg.load_timeout_s,
                ))
            except (ValueError, TypeError) as exc:
                backend.close()
                raise ConfigError(f"secondary_tiers[{index}]: {exc}") from None
        pool = PrimaryPool(cfg.block_bytes, cfg.num_slots, cfg.eviction_policy,
                           backing=cfg.primary_backing, path=cfg.primary_path)
        return TieringManager(
            pool, tiers, namespace=cfg.namespace, write_policy=cfg.write_policy,
            metrics=metrics, clock=clock, max_events=cfg.max_events,
            owns_global_metrics=cfg.metrics_registry is MetricsRegistry.GLOBAL,
        )
    except BaseException:
        for tier in tiers:
            tier.shutdown(5.0)
        if pool is not None:
            pool.close()
        if metrics is not None and cfg.metrics_registry is MetricsRegistry.GLOBAL:
            metrics.unregister()
        raise
