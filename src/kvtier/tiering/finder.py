"""Prefix lookups: walking a request's keys through the pool, the write-back copies and the
secondary tiers, and the turns long prefixes take to stage through the pool in pieces.

Thread ownership: the **scheduler thread** owns all of it: the staging turns (requests whose
loadable prefix is longer than one piece, in the order they first ran out of room; only the
first of them stages beyond its resident run, so concurrent long requests take turns instead of
evicting each other's staged blocks). The tables it reads and changes (pool, pins, promotions,
write-back, counters) are the manager's, on the same thread.

A *piece* is what one request may bring into the pool at once (promotions, re-admitted copies
and blocks held behind a pending one): :data:`PIECE_FRACTION` of the pool. ``lookup_prefix``
answers all or nothing, so a prefix longer than the pool can stage ends where the room ends;
``lookup_piece`` answers the resident leading run now and more later, so any prefix that is
in some tier is loaded whole, piece by piece.

A hit is taken only when it pays: the first time a scan finds a key in a tier, the tier says how
many of the prefix's remaining keys are worth loading from it
(:meth:`~kvtier.tiering.tier.SecondaryTier.blocks_worth_loading`); the scan's allowance per tier
(``_allowance``, reset by each scan) is spent by the promotions it starts there, and a hit past
it is answered absent, so the prefix ends there and the engine recomputes the rest. The tier
counts it as declined once, when that is the scan's final answer (``_declined``: the tier whose
hit ended this scan); while earlier keys are pending the request asks again, and a hit declined
only for the load deadline is then asked again as the start of the next job.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.keys import BlockKey, RequestContext, check_key, validate_keys
from kvtier.primary import PrimaryPool
from kvtier.tiering.events import Counters
from kvtier.tiering.pins import PinLedger
from kvtier.tiering.plans import KeyStatus
from kvtier.tiering.promotions import MAX_PROMOTION_ROUNDS, PromotionTable
from kvtier.tiering.tier import SecondaryTier
from kvtier.tiering.writeback import WriteBack

__all__ = ["PIECE_FRACTION", "KeyFinder", "PrefixScan", "ScanMode"]

PIECE_FRACTION = 0.25  # pool share one request may stage (promote, re-admit, hold) per piece


class ScanMode(enum.Enum):
    WHOLE = "whole"    # lookup_prefix: all of the loadable prefix at once, or where room ends
    PIECES = "pieces"  # lookup_piece: the resident leading run now, the rest piece by piece


@dataclass(slots=True)
class PrefixScan:
    count: int                 # leading keys resident now, before the first pending one
    pending: bool = False      # a needed answer or promotion is in flight
    waiting: bool = False      # stopped for room or for its turn; more may be loadable
    found: set[BlockKey] = field(default_factory=set)  # resident keys seen (to hold)


class KeyFinder:
    """One key's status (``find``) and one request's prefix (``scan``) over the manager's
    tables; the staging turns of requests loading in pieces."""

    __slots__ = ("_allowance", "_counters", "_declined", "_piece_blocks", "_pins", "_pool",
                 "_promotions", "_tiers", "_turns", "_writeback")

    def __init__(self, pool: PrimaryPool, tiers: tuple[SecondaryTier, ...], pins: PinLedger,
                 promotions: PromotionTable, writeback: WriteBack, counters: Counters) -> None:
        self._pool = pool
        self._tiers = tiers
        self._pins = pins
        self._promotions = promotions
        self._writeback = writeback
        self._counters = counters
        self._piece_blocks = max(1, int(pool.num_slots * PIECE_FRACTION))
        self._turns: dict[str, int] = {}  # req_id -> step it last asked; order: the turns
        self._allowance: dict[int, int] = {}  # this scan: tier index -> blocks it may still load
        self._declined: SecondaryTier | None = None  # this scan: the tier whose hit ended it

    def leave(self, req_id: str) -> None:
        """``req_id`` finished, or its prefix is complete: the next request's turn."""
        self._turns.pop(req_id, None)

    # ---- one key -------------------------------------------------------------------------
    def find(self, key: BlockKey, ctx: RequestContext, protect: set[BlockKey] | tuple[()],
             *, room_is_miss: bool = True, remaining: int | None = None) -> KeyStatus | None:
        """Where ``key`` stands, starting its promotion or re-admission if it needs one.
        None (only with ``room_is_miss`` False): it is loadable but no slot is free now.
        ``remaining``: keys of the scanned prefix from this one on (a tier hit is then taken
        only when loading pays, see the module docstring); None: a single key, never declined."""
        counters = self._counters
        counters.lookups += 1
        pool = self._pool
        if pool.is_resident(key):
            counters.hits += 1
            return KeyStatus.HIT
        promotion = self._promotions.get(key)
        if promotion is not None:
            counters.promotions_joined += 1
            counters.hit_pending += 1
            self._promotions.join(promotion, key, ctx.req_id)
            return KeyStatus.HIT_PENDING
        if pool.slot_of(key) is not None:  # the engine is storing it right now
            counters.misses += 1
            return KeyStatus.MISS
        payload = self._writeback.copy_of(key)
        if payload is not None:  # evicted, its write pending: re-admitted from its copy
            slot = self._reserve_for(key, protect, room_is_miss)
            if slot is None:
                return KeyStatus.MISS if room_is_miss else None
            self._writeback.readmit(key, slot, payload)
            return KeyStatus.HIT
        for index, tier in enumerate(self._tiers):
            verdict = tier.lookup(key, ctx)
            if verdict is None:
                counters.retries += 1
                return KeyStatus.RETRY
            if verdict:
                if remaining is not None and not self._pays(index, tier, remaining):
                    counters.misses += 1
                    return KeyStatus.MISS
                slot = self._reserve_for(key, protect, room_is_miss)
                if slot is None:
                    return KeyStatus.MISS if room_is_miss else None
                self._promotions.start(key, index, slot, ctx.req_id)
                counters.hit_pending += 1
                return KeyStatus.HIT_PENDING
        counters.misses += 1
        return KeyStatus.MISS

    def _pays(self, index: int, tier: SecondaryTier, remaining: int) -> bool:
        """Whether this scan's hit in tier ``index`` is worth loading (spends its allowance)."""
        allowance = self._allowance.get(index)
        if allowance is None:
            allowance = tier.blocks_worth_loading(remaining, self._pool.block_bytes)
        if allowance <= 0:
            self._allowance[index] = 0
            self._declined = tier
            return False
        self._allowance[index] = allowance - 1
        return True

    def _take_declined(self) -> SecondaryTier | None:
        declined, self._declined = self._declined, None
        return declined

    def _reserve_for(self, key: BlockKey, protect: set[BlockKey] | tuple[()],
                     room_is_miss: bool) -> int | None:
        """A slot for bringing ``key`` into the pool (evicting a victim), or None: counted as
        a miss for want of a slot, or (``room_is_miss`` False) as a piece that waits."""
        reservation = self._pool.reserve(key, protect)
        if reservation is None:
            if room_is_miss:
                self._counters.promotions_no_slot += 1
                self._counters.misses += 1
            return None
        if reservation.evicted is not None:
            self._writeback.on_evicted(reservation.evicted, reservation.slot)
        return reservation.slot

    # ---- one request's prefix --------------------------------------------------------------
    def scan(self, keys: Sequence[BlockKey], ctx: RequestContext, mode: ScanMode) -> PrefixScan:
        """Walk ``keys`` in order: count the leading resident run, start the promotions the
        rest needs (within one piece in ``PIECES`` mode) and stop at the first miss."""
        try:
            resident = self._pool.resident_prefix_length(keys)
        except TypeError:  # an unhashable key: say which one
            validate_keys(keys)
            raise
        counters = self._counters
        counters.lookups += resident
        counters.hits += resident
        scan = PrefixScan(resident)
        if resident == len(keys):  # the steady-state fast path: everything is in the pool
            return scan
        scan.found.update(keys[:resident])
        self._allowance.clear()
        self._declined = None
        req_id = ctx.req_id
        pieces = mode is ScanMode.PIECES
        room = self._room(req_id) if pieces else len(keys)
        rounds = self._promotions.rounds(req_id)
        round_over = rounds >= MAX_PROMOTION_ROUNDS
        started = counters.promotions_started
        staged = 0
        for index in range(resident, len(keys)):
            key = keys[index]
            check_key(key, f"keys[{index}]")
            if pieces and staged >= room:
                scan.waiting = True
                break
            if round_over and self._would_be_lost(key):
                counters.lookups += 1
                counters.misses += 1
                counters.promotions_lost += 1
                break
            result = self.find(key, ctx, scan.found, room_is_miss=not pieces,
                               remaining=len(keys) - index)
            if result is None:  # loadable, no room now: this piece ends, the rest waits
                scan.waiting = True
                break
            if result is KeyStatus.HIT:
                scan.found.add(key)  # promotions later in this prefix must not evict it
                if scan.pending:
                    staged += 1
                else:
                    scan.count += 1
            elif result is KeyStatus.MISS:
                break
            else:
                scan.pending = True
                staged += result is KeyStatus.HIT_PENDING
        self._settle_rounds(req_id, rounds, started, scan, pieces)
        declined = self._take_declined()
        if declined is not None and not (scan.pending or scan.waiting):
            declined.count_declined(1)  # the final answer ends at a declined hit
        if pieces:
            self._settle_turn(req_id, scan)
        return scan

    def _would_be_lost(self, key: BlockKey) -> bool:
        """Past its last promotion round, a key neither resident nor in flight ends a prefix."""
        return (key not in self._promotions and not self._pool.is_resident(key)
                and self._writeback.copy_of(key) is None)

    def _room(self, req_id: str) -> int:
        """Blocks ``req_id`` may stage beyond its resident run now: a piece on its turn (or
        while nobody waits for one), nothing while another request's turn lasts. A first in
        line that did not ask in the previous step (the engine's batch was full, or it was
        dropped) goes to the back of the line, so no turn is held by a request not asking."""
        turns = self._turns
        if not turns or req_id not in turns:
            return self._piece_blocks
        step = self._pins.step
        turns[req_id] = step
        head = next(iter(turns))
        while head != req_id and turns[head] < step - 1:
            turns[head] = turns.pop(head)  # to the back of the line
            head = next(iter(turns))
        return self._piece_blocks if head == req_id else 0

    def _settle_rounds(self, req_id: str, rounds: int, started: int, scan: PrefixScan,
                       pieces: bool) -> None:
        if pieces and scan.count:  # a piece is ready: the next piece gets its own rounds
            if rounds:
                self._promotions.set_rounds(req_id, 0)
            return
        if self._counters.promotions_started != started:
            self._promotions.set_rounds(req_id, rounds + 1)

    def _settle_turn(self, req_id: str, scan: PrefixScan) -> None:
        if scan.waiting:
            self._turns.setdefault(req_id, self._pins.step)
            self._counters.piece_waits += 1
        elif not scan.pending:
            self._turns.pop(req_id, None)
