"""Write-back and cascades: which blocks still have to reach the secondary tiers, and how.

Thread ownership: the **scheduler thread** owns all of it: the unwritten blocks (resident
blocks no tier has been sent yet; insertion order is age, the oldest go first), the evicted
blocks' copies awaiting their tier writes, and the per-tier stores queued for the end of the
step. The tiers' I/O threads only read the submitted payloads.

write_through queues every stored block for every tier, its slot pinned (a cascade pin, see
:class:`~kvtier.tiering.pins.PinLedger`) until the tier's write finishes, within the cascade
pin budget; the rest stay unwritten (resident, evictable) and go oldest first as the budget
frees. write_back leaves every block unwritten until the pool evicts it. An unwritten block that
is evicted is copied out and written from the copy; a lookup meanwhile re-admits it from the
copy, so a block is always in some tier.

Back-pressure: cascades a backlogged tier cannot take wait for the next step, up to
``MAX_WAITING_CASCADE_FRACTION`` of the pool per tier. Beyond that the scheduler thread waits,
inside the step, for the tier's store jobs to finish (counted by the tier: ``store_waits``,
``store_wait_seconds``, ``store_stalls``): a slow tier costs time, not hits. The wait depends
only on the tier's I/O threads, which never wait for the scheduler, so it cannot deadlock with
pins or staged loads.
Only a tier that finishes no job for its ``store_stall_s`` is *stalled*: the excess is shed
(counted) and later steps shed without waiting until one of its jobs finishes again, so a dead
tier costs one stall, not one per step.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.keys import BlockKey
from kvtier.lru import BoundedLRU
from kvtier.primary import PrimaryPool
from kvtier.tiering.events import (
    PRIMARY,
    BlockReadmitted,
    BlockRemoved,
    BlockStored,
    Counters,
    EventLog,
    StoreShed,
)
from kvtier.tiering.pins import PinLedger
from kvtier.tiering.promotions import TRANSFER_CHUNK_KEYS
from kvtier.tiering.tier import SecondaryTier, TierJob

__all__ = ["MAX_WAITING_CASCADE_FRACTION", "Backlog", "QueuedStore", "WriteBack"]

MAX_WAITING_CASCADE_FRACTION = 0.5  # cascades waiting for a backlogged tier, share of the pool
_WAIT_SLICE_S = 0.01  # back-pressure checks for room at least this often


class Backlog(enum.Enum):
    """What submitting does with the stores a backlogged tier cannot take now."""

    WAIT_NEXT_STEP = "wait_next_step"  # they wait for the next step; the oldest excess is shed
    WAIT_FOR_ROOM = "wait_for_room"    # shutdown: wait for room until the deadline, then shed


@dataclass(slots=True)
class QueuedStore:
    key: BlockKey
    payload: memoryview | bytes
    pinned: bool  # True: payload is the pinned primary slot (write-through); False: a copy


@dataclass(slots=True)
class _Copy:
    payload: bytes  # an evicted, not yet written block's bytes
    writers: int    # tiers that have not finished (or given up on) writing it


class WriteBack:
    """Unwritten blocks, evicted blocks' copies and the per-tier store queues."""

    __slots__ = ("_clock", "_copies", "_counters", "_events", "_max_waiting", "_pins", "_pool",
                 "_queued", "_stalled", "_tiers", "_unwritten")

    def __init__(self, pool: PrimaryPool, num_tiers: int, pins: PinLedger, counters: Counters,
                 events: EventLog, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._tiers = num_tiers
        self._pins = pins
        self._counters = counters
        self._events = events
        self._unwritten: BoundedLRU[BlockKey, None] = BoundedLRU(None)  # oldest first
        self._copies: dict[BlockKey, _Copy] = {}
        self._queued: list[list[QueuedStore]] = [[] for _ in range(num_tiers)]
        self._max_waiting = max(1, int(pool.num_slots * MAX_WAITING_CASCADE_FRACTION))
        self._clock = clock  # times back-pressure waits (real time: they block on the tier)
        self._stalled = [False] * num_tiers  # finished no store job within a wait's stall time

    # ---- what is unwritten -------------------------------------------------------------------
    def note_stored(self, keys: Iterable[BlockKey]) -> None:
        """The engine stored ``keys``: unwritten, unless an earlier copy is being written."""
        if not self._tiers:
            return
        copies = self._copies
        unwritten = self._unwritten
        for key in keys:
            if key not in copies and key not in unwritten:  # else it keeps its age
                unwritten.put(key, None)

    def cascade_unwritten(self) -> None:
        """Write-through: queue the oldest unwritten blocks for every tier, pinned, while the
        cascade pin budget lasts. The rest stay unwritten (resident, evictable): a backlogged
        tier never pins the pool full and so never makes the engine's stores fail."""
        unwritten = self._unwritten
        tiers = self._tiers
        if not tiers or not unwritten:
            return
        room = self._pins.cascade_room(tiers)
        if room <= 0:
            return
        pool = self._pool
        batch: list[BlockKey] = []
        for _ in range(min(room, len(unwritten))):
            oldest = unwritten.pop_oldest()
            if oldest is not None and pool.is_resident(oldest.key):  # else discarded: gone
                batch.append(oldest.key)
        for key in batch:
            self._queue_pinned(key)
        self._counters.cascades_queued += len(batch) * tiers

    def flush_unwritten(self) -> None:
        """Shutdown: queue every unwritten resident block for every tier, pinned, no budget."""
        pool = self._pool
        for key in self._unwritten:
            if pool.is_resident(key):
                self._queue_pinned(key)
                self._counters.write_backs += 1
        self._unwritten.clear()

    def _queue_pinned(self, key: BlockKey) -> None:
        """Queue resident ``key`` for every tier from its slot, pinned once per tier write."""
        view = self._pool.view(self._pins.pin_cascade(key, self._tiers))
        for queue_ in self._queued:
            queue_.append(QueuedStore(key, view, True))

    def on_evicted(self, key: BlockKey, slot: int) -> None:
        """``key`` just lost ``slot`` to a new reservation, its bytes still there: counted and
        announced; if unwritten, it is copied out and written from the copy."""
        self._counters.evictions += 1
        self._events.emit(BlockRemoved((key,), PRIMARY))
        if key not in self._unwritten:
            return
        self._unwritten.pop(key)
        payload = bytes(self._pool.view(slot))  # the slot is about to be rewritten
        self._copies[key] = _Copy(payload, self._tiers)
        for queue_ in self._queued:
            queue_.append(QueuedStore(key, payload, False))
        self._counters.write_backs += 1
        self._counters.cascades_queued += self._tiers

    def is_unwritten(self, key: BlockKey) -> bool:
        """Whether resident ``key`` is in no tier yet (evicting it would copy it out)."""
        return key in self._unwritten

    def copy_of(self, key: BlockKey) -> bytes | None:
        """The bytes of evicted ``key`` whose write is still pending, if any."""
        if not self._copies:
            return None
        copy = self._copies.get(key)
        return None if copy is None else copy.payload

    def readmit(self, key: BlockKey, slot: int, payload: bytes) -> None:
        """Evicted ``key`` (its write still pending) comes back into reserved ``slot`` from its
        copy ``payload``, so there is never a window in which a block is in no tier at all."""
        self._pool.view(slot)[:] = payload
        self._pool.commit(key)
        self._counters.copies_readmitted += 1
        self._counters.hits += 1
        self._events.emit(BlockStored((key,), PRIMARY))
        self._events.emit(BlockReadmitted((key,), PRIMARY))

    def _release(self, key: BlockKey, pinned: bool) -> None:
        """One tier is done with (or gave up on) a queued cascade of ``key``."""
        if pinned:
            self._pins.unpin_cascade(key)
            return
        copy = self._copies.get(key)
        if copy is not None:
            copy.writers -= 1
            if copy.writers <= 0:
                del self._copies[key]

    # ---- transfers ---------------------------------------------------------------------------
    def submit(self, tier_index: int, tier: SecondaryTier, *,
               backlog: Backlog = Backlog.WAIT_NEXT_STEP, deadline: float | None = None,
               apply: Callable[[int, TierJob], None] | None = None) -> None:
        """Submit the stores queued for ``tier`` in chunks, applying finished jobs with
        ``apply`` while it waits. What a backlogged tier cannot take waits for the next step
        up to the bound; beyond it this call waits for the tier's jobs (the excess is shed only
        when the tier is stalled, or without ``apply``). With ``Backlog.WAIT_FOR_ROOM``
        (shutdown) it waits for room until ``deadline``, then sheds."""
        stores = self._queued[tier_index]
        if not stores:
            return
        self._queued[tier_index] = []
        for start in range(0, len(stores), TRANSFER_CHUNK_KEYS):
            chunk = stores[start : start + TRANSFER_CHUNK_KEYS]
            keys = [item.key for item in chunk]
            payloads = [item.payload for item in chunk]
            nbytes = sum(memoryview(p).nbytes for p in payloads)
            if backlog is Backlog.WAIT_NEXT_STEP and not tier.can_accept_store(nbytes):
                left = len(stores) - start
                if (left <= self._max_waiting or apply is None
                        or not self._wait_for_tier(tier_index, tier, nbytes, apply)):
                    self._wait_or_shed(tier_index, tier, stores[start:])
                    break
            if backlog is Backlog.WAIT_FOR_ROOM:
                self._wait_for_room(tier_index, tier, nbytes, deadline, apply)
            job = tier.submit_store(keys, payloads)
            if job is None:
                for item in chunk:
                    self._release(item.key, item.pinned)
                self._counters.cascades_shed += len(chunk)
                self._events.emit(StoreShed(tuple(keys), tier.name))
            elif any(item.pinned for item in chunk):
                self._pins.note_store_job(tier_index, job.job_id,
                                          tuple(item.pinned for item in chunk))

    def _wait_for_tier(self, tier_index: int, tier: SecondaryTier, nbytes: int,
                       apply: Callable[[int, TierJob], None]) -> bool:
        """Back-pressure: wait until ``tier`` can take ``nbytes`` more, applying the jobs it
        finishes; False (do not wait) when it is stalled. Every finished job restarts the stall
        clock, so a slow tier is waited for as long as it makes progress."""
        if self._stalled[tier_index]:
            return False
        clock = self._clock
        started = last_progress = clock()
        while not tier.can_accept_store(nbytes):
            remaining = last_progress + tier.store_stall_s - clock()
            if remaining <= 0:
                self._stalled[tier_index] = True
                break
            # In slices: the wait ends as soon as a finished job makes room, not when all have.
            finished = tier.get_finished_jobs(wait=True, timeout=min(remaining, _WAIT_SLICE_S))
            if finished:
                last_progress = clock()
            for job in finished:
                apply(tier_index, job)
        tier.count_store_wait(clock() - started, stalled=self._stalled[tier_index])
        return not self._stalled[tier_index]

    def _wait_for_room(self, tier_index: int, tier: SecondaryTier, nbytes: int,
                       deadline: float | None,
                       apply: Callable[[int, TierJob], None] | None) -> None:
        while not tier.can_accept_store(nbytes):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return  # a stuck tier: the rest is shed, counted, not waited for
            for finished in tier.get_finished_jobs(wait=True, timeout=remaining):
                if apply is not None:
                    apply(tier_index, finished)

    def _wait_or_shed(self, tier_index: int, tier: SecondaryTier,
                      waiting: list[QueuedStore]) -> None:
        """Cascades a backlogged tier cannot take yet wait in the pool for the next step; the
        oldest beyond the bound are shed (counted), so a dead tier never pins the whole pool."""
        excess = len(waiting) - self._max_waiting
        if excess > 0:
            shed, waiting = waiting[:excess], waiting[excess:]
            for item in shed:
                self._release(item.key, item.pinned)
            self._counters.cascades_shed += len(shed)
            tier.count_shed(len(shed))
            self._events.emit(StoreShed(tuple(item.key for item in shed), tier.name))
        self._queued[tier_index] = waiting
        self._counters.cascades_waited += len(waiting)

    def apply_store(self, tier_index: int, tier_name: str, job: TierJob) -> None:
        """A store job of tier ``tier_index`` finished: release its pins or copies."""
        stored: list[BlockKey] = []
        pinned = self._pins.pop_store_job(tier_index, job.job_id)
        self._stalled[tier_index] = False  # it makes progress again: worth waiting for
        for position, (key, ok) in enumerate(zip(job.keys, job.results, strict=True)):
            self._release(key, pinned is not None and pinned[position])
            if ok:
                stored.append(key)
        self._counters.cascades_stored += len(stored)
        self._counters.cascades_failed += len(job.keys) - len(stored)
        if stored:
            self._events.emit(BlockStored(tuple(stored), tier_name))

    # ---- sizes, lifecycle --------------------------------------------------------------------
    @property
    def has_unwritten(self) -> bool:
        return bool(self._unwritten)

    @property
    def has_queued(self) -> bool:
        return any(self._queued)

    def sizes(self) -> dict[str, int]:
        return {
            "unwritten_blocks": len(self._unwritten),
            "pending_copies": len(self._copies),
            "queued_stores": sum(map(len, self._queued)),
        }

    def clear_copies(self) -> None:
        self._copies.clear()
