"""WriteBack: unwritten blocks, cascades within the pin budget, copies, shedding (no threads)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from kvtier.tiering.tier import JobKind, TierJob
from kvtier.tiering.writeback import Backlog, WriteBack
from tiering.fakes import BLOCK, FakeTier, finished, k, make_pool, resident, tables


def table(num_slots: int = 4, num_tiers: int = 1) -> tuple[WriteBack, PrimaryPool, PinLedger,
                                                           Counters, EventLog]:
    pool = make_pool(num_slots)
    counters, events = tables()
    pins = PinLedger(pool, counters, num_tiers)
    return WriteBack(pool, num_tiers, pins, counters, events), pool, pins, counters, events


def test_cascade_pins_only_within_the_budget_oldest_first() -> None:
    writeback, pool, pins, counters, _events = table(num_slots=4)  # budget: 2 blocks
    for i in range(3):
        resident(pool, k(i))
    writeback.note_stored([k(0), k(1), k(2)])
    writeback.cascade_unwritten()
    assert pins.cascade_pins == 2 and counters.cascades_queued == 2
    assert [pool.pin_count(k(i)) for i in range(3)] == [1, 1, 0]
    assert writeback.sizes() == {"unwritten_blocks": 1, "pending_copies": 0, "queued_stores": 2}
    tier = FakeTier()
    writeback.submit(0, tier)  # type: ignore[arg-type]
    assert tier.stores[0][0] == [k(0), k(1)] and not writeback.has_queued
    writeback.apply_store(0, "t", finished(1, JobKind.STORE, [k(0), k(1)], [True, False]))
    assert pins.cascade_pins == 0 and pool.occupancy().pins == 0
    assert counters.cascades_stored == 1 and counters.cascades_failed == 1
    writeback.cascade_unwritten()  # the budget freed: the last one goes
    assert pool.pin_count(k(2)) == 1 and not writeback.has_unwritten


def test_no_tiers_means_nothing_unwritten() -> None:
    writeback, pool, _pins, _counters, _events = table(num_tiers=0)
    resident(pool, k(1))
    writeback.note_stored([k(1)])
    assert not writeback.has_unwritten


def test_evicted_unwritten_block_is_copied_written_and_readmittable() -> None:
    writeback, pool, _pins, counters, events = table(num_slots=1)
    slot = resident(pool, k(1), fill=7)
    writeback.note_stored([k(1)])
    writeback.on_evicted(k(1), slot)
    assert counters.evictions == 1 and counters.write_backs == 1
    assert events.take() == [BlockRemoved((k(1),), PRIMARY)]
    assert writeback.copy_of(k(1)) == bytes([7]) * BLOCK
    assert writeback.sizes()["pending_copies"] == 1 and writeback.sizes()["queued_stores"] == 1
    tier = FakeTier()
    writeback.submit(0, tier)  # type: ignore[arg-type]
    assert tier.stores[0][1] == [bytes([7]) * BLOCK]
    writeback.apply_store(0, "t", finished(1, JobKind.STORE, [k(1)], [True]))
    assert writeback.copy_of(k(1)) is None  # its one writer finished
    assert events.take() == [BlockStored((k(1),), "t")]


def test_readmit_restores_the_copy_into_a_slot() -> None:
    writeback, pool, _pins, counters, events = table(num_slots=2)
    reservation = pool.reserve(k(1))
    assert reservation is not None
    writeback.readmit(k(1), reservation.slot, bytes([3]) * BLOCK)
    assert pool.is_resident(k(1)) and bytes(pool.view(reservation.slot)) == bytes([3]) * BLOCK
    assert counters.copies_readmitted == 1 and counters.hits == 1
    assert events.take() == [BlockStored((k(1),), PRIMARY), BlockReadmitted((k(1),), PRIMARY)]


def test_evicting_a_written_block_only_counts_it() -> None:
    writeback, pool, _pins, counters, _events = table()
    slot = resident(pool, k(1))
    writeback.on_evicted(k(1), slot)
    assert counters.evictions == 1 and counters.write_backs == 0
    assert writeback.copy_of(k(1)) is None and not writeback.has_queued


def test_without_a_way_to_apply_jobs_a_backlog_sheds_the_excess() -> None:
    writeback, pool, pins, counters, events = table(num_slots=8)  # waiting bound: 4
    for i in range(4):
        resident(pool, k(i))
    writeback.note_stored([k(i) for i in range(4)])
    writeback.cascade_unwritten()  # budget: 4 blocks
    for i in range(4, 7):  # evicted unwritten copies join the queue
        slot = resident(pool, k(i))
        writeback.note_stored([k(i)])
        writeback.on_evicted(k(i), slot)
    events.take()
    tier = FakeTier(accept=False)
    writeback.submit(0, tier)  # type: ignore[arg-type]
    assert counters.cascades_shed == 3 and tier.shed_counts == [3]
    assert events.take() == [StoreShed((k(0), k(1), k(2)), "fake")]
    assert writeback.sizes()["queued_stores"] == 4 and counters.cascades_waited == 4
    assert pins.cascade_pins == 1 and writeback.sizes()["pending_copies"] == 3


def test_tier_refusing_a_job_sheds_it() -> None:
    writeback, pool, pins, counters, events = table()
    resident(pool, k(1))
    writeback.note_stored([k(1)])
    writeback.cascade_unwritten()
    writeback.submit(0, FakeTier(shed=True))  # type: ignore[arg-type]
    assert counters.cascades_shed == 1 and pins.cascade_pins == 0
    assert events.take() == [StoreShed((k(1),), "fake")]


def test_flush_unwritten_pins_every_resident_block_for_every_tier() -> None:
    writeback, pool, pins, counters, _events = table(num_slots=4, num_tiers=2)
    for i in range(3):
        resident(pool, k(i))
    writeback.note_stored([k(0), k(1), k(2), k(3)])  # k(3) is not resident: skipped
    writeback.flush_unwritten()
    assert pins.cascade_pins == 6 and counters.write_backs == 3
    assert writeback.sizes()["queued_stores"] == 6 and not writeback.has_unwritten


def test_waiting_for_room_gives_up_at_the_deadline_and_submits() -> None:
    writeback, pool, _pins, counters, _events = table()
    resident(pool, k(1))
    writeback.note_stored([k(1)])
    writeback.cascade_unwritten()
    tier = FakeTier(accept=False)
    applied: list[object] = []
    writeback.submit(0, tier, backlog=Backlog.WAIT_FOR_ROOM,  # type: ignore[arg-type]
                     deadline=time.monotonic(), apply=lambda index, job: applied.append(job))
    assert tier.stores[0][0] == [k(1)] and counters.cascades_shed == 0 and applied == []


@dataclass
class OneJobTier(FakeTier):
    """A tier that takes one store job at a time; waiting on it finishes that job (as an I/O
    thread would), unless ``stuck``, when waiting only moves ``clock`` past the stall time."""

    stuck: bool = False
    store_stall_s: float = 5.0
    now: float = 0.0
    outstanding: list[TierJob] = field(default_factory=list)
    waits: int = 0
    store_waits: int = 0
    store_stalls: int = 0

    def count_store_wait(self, seconds: float, *, stalled: bool) -> None:
        self.store_waits += 1
        self.store_stalls += stalled

    def can_accept_store(self, nbytes: int) -> bool:
        return not self.outstanding

    def submit_store(self, keys: Sequence[bytes], payloads: Sequence[Any]) -> TierJob | None:
        job = super().submit_store(keys, payloads)
        if job is not None:
            self.outstanding.append(job)
        return job

    def get_finished_jobs(self, wait: bool = False,
                          timeout: float | None = None) -> list[TierJob]:
        if not wait:
            return []
        self.waits += 1
        if self.stuck:
            self.now += timeout or 0.0
            return []
        return [finished(job.job_id, job.kind, job.keys, [True] * len(job.keys))
                for job in self.outstanding[:1]]


def backlog_of(cascades: int) -> tuple[WriteBack, PrimaryPool, Counters, OneJobTier,
                                       list[TierJob]]:
    """A pool of 512 slots (waiting bound 256) with ``cascades`` resident blocks queued."""
    tier = OneJobTier()
    pool = make_pool(512)
    counters, events = tables()
    pins = PinLedger(pool, counters, 1)
    writeback = WriteBack(pool, 1, pins, counters, events, clock=lambda: tier.now)
    keys = [k(i) for i in range(cascades)]
    for key in keys:
        resident(pool, key)
    writeback.note_stored(keys)
    writeback.flush_unwritten()
    applied: list[TierJob] = []
    return writeback, pool, counters, tier, applied


def apply_to(writeback: WriteBack, tier: OneJobTier,
             applied: list[TierJob]) -> Callable[[int, TierJob], None]:
    def apply(index: int, job: TierJob) -> None:
        tier.outstanding = [j for j in tier.outstanding if j.job_id != job.job_id]
        writeback.apply_store(index, tier.name, job)
        applied.append(job)
    return apply


def test_a_backlog_beyond_the_bound_waits_for_the_tier_and_sheds_nothing() -> None:
    writeback, _pool, counters, tier, applied = backlog_of(384)  # 6 chunks of 64
    writeback.submit(0, tier, apply=apply_to(writeback, tier, applied))  # type: ignore[arg-type]
    # chunk 1 goes; 320 left > 256: the step waits for chunk 1, then chunk 2 goes; the
    # remaining 256 fit under the bound and wait for the next step.
    assert len(tier.stores) == 2 and len(applied) == 1 and tier.waits == 1
    assert counters.cascades_shed == 0 and tier.shed_counts == []
    assert tier.store_waits == 1 and tier.store_stalls == 0
    assert writeback.sizes()["queued_stores"] == 256 and counters.cascades_stored == 64


def test_a_stalled_tier_sheds_the_excess_once_and_is_not_waited_for_again() -> None:
    writeback, pool, counters, tier, applied = backlog_of(384)
    tier.stuck = True
    apply = apply_to(writeback, tier, applied)
    writeback.submit(0, tier, apply=apply)  # type: ignore[arg-type]
    assert tier.store_stalls == 1 and tier.now >= tier.store_stall_s
    assert counters.cascades_shed == 64 and writeback.sizes()["queued_stores"] == 256
    waits_before = tier.waits
    for i in range(384, 448):  # another step's cascades: shed at once, no second wait
        resident(pool, k(i))
    writeback.note_stored([k(i) for i in range(384, 448)])
    writeback.flush_unwritten()
    writeback.submit(0, tier, apply=apply)  # type: ignore[arg-type]
    assert tier.waits == waits_before and tier.store_waits == 1
    assert counters.cascades_shed == 128
    tier.stuck = False  # the tier finishes its job: progress, so it is waited for again
    apply(0, finished(tier.outstanding[0].job_id, JobKind.STORE, tier.outstanding[0].keys,
                      [True] * 64))
    for i in range(448, 576):
        resident(pool, k(i))
    writeback.note_stored([k(i) for i in range(448, 576)])
    writeback.flush_unwritten()
    writeback.submit(0, tier, apply=apply)  # type: ignore[arg-type]
    assert tier.store_waits == 2 and tier.store_stalls == 1
    assert counters.cascades_shed == 128
