"""The promotion table: blocks being loaded from a secondary tier into reserved primary slots.

Thread ownership: the **scheduler thread** owns all of it: the promotions in flight by key (the
tier they load from, their slot, the requests answered HIT_PENDING for them), each request's
waits and promotion rounds, the per-tier loads queued for the end of the step (demand and
prefetch apart), and the slots of abandoned loads, retired until their I/O ends. The tiers' I/O
threads only fill the slots; their results come back through
``SecondaryTier.get_finished_jobs`` on this thread.

Every later lookup of a key in flight, from any request, joins its promotion (one transfer
per key). A prefetch promotion (:mod:`.prefetch`) has no waiter and loads at
``LoadPriority.PREFETCH``; the first request that joins it moves its load to the demand queue
(``SecondaryTier.ready.expedite``), so a request never waits behind prefetch priority. A landed
promotion is committed and held for each waiter (see :class:`~kvtier.tiering.pins.PinLedger`);
a failed one frees (or retires) its slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from kvtier.keys import BlockKey
from kvtier.primary import PrimaryPool
from kvtier.tiering.events import (
    PRIMARY,
    BlockPrefetched,
    BlockPromoted,
    BlockStored,
    Counters,
    EventLog,
    PromotionFailed,
)
from kvtier.tiering.pins import PinLedger
from kvtier.tiering.plans import LoadPriority
from kvtier.tiering.tier import SecondaryTier, TierJob

__all__ = ["MAX_PROMOTION_ROUNDS", "PREFETCH_CHUNK_KEYS", "TRANSFER_CHUNK_KEYS", "Promotion",
           "PromotionTable"]

_log = logging.getLogger("kvtier.tiering.manager")

TRANSFER_CHUNK_KEYS = 64   # keys per load/store job: one backend batch call each
MAX_PROMOTION_ROUNDS = 3   # lookup_prefix calls per request that may start promotions
# Keys per prefetch load job (one part, on one I/O thread): no bigger than a demand load's
# job, so a demand load that arrives waits behind at most that much prefetch I/O per thread.
PREFETCH_CHUNK_KEYS = TRANSFER_CHUNK_KEYS


def _of_job(job: TierJob, part: object) -> bool:
    return getattr(part, "job", None) is job


@dataclass(slots=True)
class Promotion:
    tier_index: int
    slot: int
    waiters: set[str] = field(default_factory=set)  # req_ids answered HIT_PENDING for it
    prefetch: bool = False  # started by prefetch, not by a request
    expedite: Callable[[], None] | None = None  # moves a submitted prefetch load to demand


class PromotionTable:
    """Promotions in flight, their waiters, per-request rounds, queued loads, retired slots."""

    __slots__ = ("_counters", "_events", "_pins", "_pool", "_promotions", "_queued_loads",
                 "_queued_prefetch", "_request_waits", "_retired", "_rounds",
                 "prefetch_outcomes")

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
        self._queued_prefetch: list[dict[BlockKey, None]] = [{} for _ in range(num_tiers)]
        # (key, landed) of every prefetch promotion that ended, until the prefetcher takes them
        self.prefetch_outcomes: list[tuple[BlockKey, bool]] = []
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

    def start_prefetch(self, key: BlockKey, tier_index: int, slot: int) -> None:
        """Prefetch ``key`` from tier ``tier_index`` into reserved ``slot`` (no waiter)."""
        self._promotions[key] = Promotion(tier_index, slot, prefetch=True)
        self._queued_prefetch[tier_index][key] = None

    def join(self, promotion: Promotion, key: BlockKey, req_id: str) -> None:
        if req_id in promotion.waiters:
            return
        if promotion.prefetch and not promotion.waiters:  # a request waits for it now
            self._expedite(promotion, key)
        promotion.waiters.add(req_id)
        waits = self._request_waits.get(req_id)
        if waits is None:
            self._request_waits[req_id] = {key}
        else:
            waits.add(key)

    def take_prefetch_outcomes(self) -> list[tuple[BlockKey, bool]]:
        outcomes, self.prefetch_outcomes = self.prefetch_outcomes, []
        return outcomes

    def _expedite(self, promotion: Promotion, key: BlockKey) -> None:
        queued = self._queued_prefetch[promotion.tier_index]
        if key in queued:  # not submitted yet: it goes with this step's demand loads
            del queued[key]
            self._queued_loads[promotion.tier_index].append(key)
        elif promotion.expedite is not None:
            promotion.expedite()
            promotion.expedite = None

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
        """Submit the loads queued for ``tier`` this step, in chunks: demand, then prefetch."""
        loads = self._queued_loads[tier_index]
        if loads:
            self._queued_loads[tier_index] = []
            for start in range(0, len(loads), TRANSFER_CHUNK_KEYS):
                chunk = loads[start : start + TRANSFER_CHUNK_KEYS]
                tier.submit_load(chunk, [self._pool.view(self._promotions[key].slot)
                                         for key in chunk])
        prefetch = list(self._queued_prefetch[tier_index])
        if not prefetch:
            return
        self._queued_prefetch[tier_index] = {}
        for start in range(0, len(prefetch), PREFETCH_CHUNK_KEYS):
            chunk = prefetch[start : start + PREFETCH_CHUNK_KEYS]
            promotions = [self._promotions[key] for key in chunk]
            job = tier.submit_load(chunk, [self._pool.view(p.slot) for p in promotions],
                                   LoadPriority.PREFETCH)
            expedite = partial(tier.ready.expedite, partial(_of_job, job))
            for promotion in promotions:
                promotion.expedite = expedite

    def apply_load(self, tier_index: int, tier_name: str, job: TierJob) -> None:
        """A load job of tier ``tier_index`` finished: commit (and hold) or free each slot."""
        loaded: list[BlockKey] = []
        prefetched: list[BlockKey] = []  # landed with no request waiting (counted by prefetch)
        failed: list[BlockKey] = []
        for key, ok in zip(job.keys, job.results, strict=True):
            promotion = self._finish(key, tier_index)
            if promotion is None:
                continue
            unwaited = promotion.prefetch and not promotion.waiters
            if promotion.prefetch:
                self.prefetch_outcomes.append((key, ok))
            if ok:
                self._pool.commit(key)
                (prefetched if unwaited else loaded).append(key)
                for waiter in promotion.waiters:
                    self._pins.hold(waiter, key)
            elif unwaited:
                self._retire_or_abort(key, tier_index, job)
            elif job.abandoned:  # its I/O may still write the slot: out of use till it ends
                self._retired.setdefault((tier_index, job.job_id), []).append(
                    self._pool.retire(key))
                failed.append(key)
            else:
                self._pool.abort(key)
                failed.append(key)
        self._counters.promotions_succeeded += len(loaded)
        self._counters.promotions_failed += len(failed)
        if loaded or prefetched:
            self._events.emit(BlockStored((*loaded, *prefetched), PRIMARY))
        if loaded:
            self._events.emit(BlockPromoted(tuple(loaded), tier_name))
        if prefetched:
            self._events.emit(BlockPrefetched(tuple(prefetched), tier_name))
        if failed:
            self._events.emit(PromotionFailed(tuple(failed), tier_name))

    def _retire_or_abort(self, key: BlockKey, tier_index: int, job: TierJob) -> None:
        """A failed prefetch: its slot goes back (retired while its I/O may still write it)."""
        if job.abandoned:
            self._retired.setdefault((tier_index, job.job_id), []).append(self._pool.retire(key))
        else:
            self._pool.abort(key)

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
            "queued_loads": sum(map(len, self._queued_loads))
            + sum(map(len, self._queued_prefetch)),
            "requests_waiting": len(self._request_waits),
        }

    def clear(self) -> None:
        self._promotions.clear()
        for queued in self._queued_prefetch:
            queued.clear()
        self.prefetch_outcomes.clear()
        self._request_waits.clear()
        self._rounds.clear()
