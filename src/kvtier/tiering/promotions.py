"""The promotion table: blocks being loaded from a secondary tier into reserved primary slots.

Thread ownership: the **scheduler thread** owns all of it: the promotions in flight by key (the
tier they load from, their slot, the requests answered HIT_PENDING for them), each request's
waits and promotion rounds, the per-tier loads queued for the end of the step, and the slots
of abandoned loads, retired until their I/O ends. The tiers' I/O threads only fill the slots;
their results come back through ``SecondaryTier.get_finished_jobs`` on this thread.

Every later lookup of a key in flight, from any request, joins its promotion (one transfer
per key). A landed promotion is committed and held for each waiter (see
:class:`~kvtier.tiering.pins.PinLedger`); a failed one frees (or retires) its slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvtier.keys import BlockKey
from kvtier.primary import PrimaryPool
from kvtier.tiering.events import (
    PRIMARY,
    BlockPromoted,
    BlockStored,
    Counters,
    EventLog,
    PromotionFailed,
)
from kvtier.tiering.pins import PinLedger
from kvtier.tiering.tier import SecondaryTier, TierJob

__all__ = ["MAX_PROMOTION_ROUNDS", "TRANSFER_CHUNK_KEYS", "Promotion", "PromotionTable"]

_log = logging.getLogger("kvtier.tiering.manager")

TRANSFER_CHUNK_KEYS = 64   # keys per load/store job: one backend batch call each
MAX_PROMOTION_ROUNDS = 3   # lookup_prefix calls per request that may start promotions


@dataclass(slots=True)
class Promotion:
    tier_index: int
    slot: int
    waiters: set[str] = field(default_factory=set)  # req_ids answered HIT_PENDING for it


class PromotionTable:
    """Promotions in flight, their waiters, per-request rounds, queued loads, retired slots."""

    __slots__ = ("_counters", "_events", "_pins", "_pool", "_promotions", "_queued_loads",
                 "_request_waits", "_retired", "_rounds")

    def __init__(self, pool: PrimaryPool, num_tiers: int, pins: PinLedger, counters: Counters,
                 events: EventLog) -> None:
        self._pool = pool
        self._pins = pins
        self._counters = counters
        self._events = events
        self._promotions: dict[BlockKey, Promotion] = {}
        self._request_waits: dict[str, set[BlockKey]] = {}  # req_id -> promotions it waits on
        self._rounds: dict[str, int] = {}  # req_id -> lookup_prefix calls that started some
        self._queued_loads: list[list[BlockKey]] = [[] for _ in range(num_tiers)]
        # (tier index, job id) -> slots of an abandoned load, retired until its I/O ends.
        self._retired: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self._promotions)

    def __contains__(self, key: object) -> bool:
        return key in self._promotions

    def get(self, key: BlockKey) -> Promotion | None:
        return self._promotions.get(key)

    # ---- starting and joining ----------------------------------------------------------------
    def start(self, key: BlockKey, tier_index: int, slot: int, req_id: str) -> None:
        """Load ``key`` from tier ``tier_index`` into reserved ``slot`` at the end of the step."""
        promotion = self._promotions[key] = Promotion(tier_index, slot)
        self.join(promotion, key, req_id)
        self._queued_loads[tier_index].append(key)
        self._counters.promotions_started += 1

    def join(self, promotion: Promotion, key: BlockKey, req_id: str) -> None:
        if req_id in promotion.waiters:
            return
        promotion.waiters.add(req_id)
        waits = self._request_waits.get(req_id)
        if waits is None:
            self._request_waits[req_id] = {key}
        else:
            waits.add(key)

    def rounds(self, req_id: str) -> int:
        return self._rounds.get(req_id, 0) if self._rounds else 0

    def set_rounds(self, req_id: str, rounds: int) -> None:
        self._rounds[req_id] = rounds

    def forget_request(self, req_id: str) -> None:
        """``req_id`` finished: its rounds go and it waits on nothing any more."""
        self._rounds.pop(req_id, None)
        waits = self._request_waits.pop(req_id, None)
        if waits:
            for key in waits:
                promotion = self._promotions.get(key)
                if promotion is not None:
                    promotion.waiters.discard(req_id)

    # ---- transfers ---------------------------------------------------------------------------
    def submit(self, tier_index: int, tier: SecondaryTier) -> None:
        """Submit the loads queued for ``tier`` this step, in chunks."""
        loads = self._queued_loads[tier_index]
        if not loads:
            return
        self._queued_loads[tier_index] = []
        for start in range(0, len(loads), TRANSFER_CHUNK_KEYS):
            chunk = loads[start : start + TRANSFER_CHUNK_KEYS]
            tier.submit_load(chunk, [self._pool.view(self._promotions[key].slot)
                                     for key in chunk])

    def apply_load(self, tier_index: int, tier_name: str, job: TierJob) -> None:
        """A load job of tier ``tier_index`` finished: commit (and hold) or free each slot."""
        loaded: list[BlockKey] = []
        failed: list[BlockKey] = []
        for key, ok in zip(job.keys, job.results, strict=True):
            promotion = self._finish(key, tier_index)
            if promotion is None:
                continue
            if ok:
                self._pool.commit(key)
                loaded.append(key)
                for waiter in promotion.waiters:
                    self._pins.hold(waiter, key)
            elif job.abandoned:  # its I/O may still write the slot: out of use till it ends
                self._retired.setdefault((tier_index, job.job_id), []).append(
                    self._pool.retire(key))
                failed.append(key)
            else:
                self._pool.abort(key)
                failed.append(key)
        self._counters.promotions_succeeded += len(loaded)
        self._counters.promotions_failed += len(failed)
        if loaded:
            self._events.emit(BlockStored(tuple(loaded), PRIMARY))
            self._events.emit(BlockPromoted(tuple(loaded), tier_name))
        if failed:
            self._events.emit(PromotionFailed(tuple(failed), tier_name))

    def _finish(self, key: BlockKey, tier_index: int) -> Promotion | None:
        promotion = self._promotions.get(key)
        if promotion is None or promotion.tier_index != tier_index:
            self._counters.invariant_violations += 1
            _log.warning("invariant violated: load result for key %s without its promotion",
                         key.hex())
            return None
        del self._promotions[key]
        for waiter in promotion.waiters:
            waits = self._request_waits.get(waiter)
            if waits is not None:
                waits.discard(key)
                if not waits:
                    del self._request_waits[waiter]
        return promotion

    def reclaim(self, tier_index: int, tier: SecondaryTier, wait_s: float = 0.0) -> None:
        """Slots of abandoned loads whose I/O has ended go back into circulation."""
        for job in tier.take_released_loads(wait_s):
            for slot in self._retired.pop((tier_index, job.job_id), ()):
                self._pool.reclaim(slot)

    # ---- sizes, lifecycle --------------------------------------------------------------------
    @property
    def has_retired(self) -> bool:
        return bool(self._retired)

    def sizes(self) -> dict[str, int]:
        return {
            "retired_slots": sum(map(len, self._retired.values())),
            "queued_loads": sum(map(len, self._queued_loads)),
            "requests_waiting": len(self._request_waits),
        }

    def clear(self) -> None:
        self._promotions.clear()
        self._request_waits.clear()
        self._rounds.clear()
