"""PromotionTable: starting, joining, submitting and applying promotions (no threads)."""

from __future__ import annotations

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
from kvtier.tiering.promotions import TRANSFER_CHUNK_KEYS, PromotionTable
from kvtier.tiering.tier import JobKind
from tiering.fakes import FakeTier, finished, k, make_pool, tables


def table(num_slots: int = 4) -> tuple[PromotionTable, PrimaryPool, PinLedger, Counters,
                                       EventLog]:
    pool = make_pool(num_slots)
    counters, events = tables()
    pins = PinLedger(pool, counters, 1)
    return PromotionTable(pool, 1, pins, counters, events), pool, pins, counters, events


def start(promotions: PromotionTable, pool: PrimaryPool, key: bytes, req_id: str) -> int:
    reservation = pool.reserve(key)
    assert reservation is not None
    promotions.start(key, 0, reservation.slot, req_id)
    return reservation.slot


def test_start_and_join_track_waiters_once() -> None:
    promotions, pool, _pins, counters, _events = table()
    slot = start(promotions, pool, k(1), "a")
    assert k(1) in promotions and len(promotions) == 1 and counters.promotions_started == 1
    promotion = promotions.get(k(1))
    assert promotion is not None and promotion.slot == slot and promotion.tier_index == 0
    promotions.join(promotion, k(1), "b")
    promotions.join(promotion, k(1), "b")
    assert promotion.waiters == {"a", "b"}
    assert promotions.sizes()["requests_waiting"] == 2
    promotions.forget_request("b")
    assert promotion.waiters == {"a"} and promotions.sizes()["requests_waiting"] == 1


def test_submit_sends_queued_loads_in_chunks_into_their_slots() -> None:
    promotions, pool, _pins, _counters, _events = table(num_slots=TRANSFER_CHUNK_KEYS + 2)
    for i in range(TRANSFER_CHUNK_KEYS + 1):
        start(promotions, pool, k(i), "r")
    assert promotions.sizes()["queued_loads"] == TRANSFER_CHUNK_KEYS + 1
    tier = FakeTier()
    promotions.submit(0, tier)  # type: ignore[arg-type]
    assert [len(keys) for keys, _outs in tier.loads] == [TRANSFER_CHUNK_KEYS, 1]
    assert promotions.sizes()["queued_loads"] == 0
    promotions.submit(0, tier)  # type: ignore[arg-type]
    assert len(tier.loads) == 2


def test_landed_load_commits_holds_for_waiters_and_announces() -> None:
    promotions, pool, pins, counters, events = table()
    start(promotions, pool, k(1), "a")
    promotions.join(promotions.get(k(1)), k(1), "b")  # type: ignore[arg-type]
    promotions.apply_load(0, "t", finished(1, JobKind.LOAD, [k(1)], [True]))
    assert pool.is_resident(k(1)) and k(1) not in promotions
    assert pins.held == 2 and pool.pin_count(k(1)) == 2
    assert counters.promotions_succeeded == 1
    assert promotions.sizes()["requests_waiting"] == 0
    assert events.take() == [BlockStored((k(1),), PRIMARY), BlockPromoted((k(1),), "t")]


def test_failed_load_frees_the_slot() -> None:
    promotions, pool, _pins, counters, events = table()
    start(promotions, pool, k(1), "a")
    promotions.apply_load(0, "t", finished(1, JobKind.LOAD, [k(1)], [False]))
    assert pool.slot_of(k(1)) is None and pool.free_slots == 4
    assert counters.promotions_failed == 1
    assert events.take() == [PromotionFailed((k(1),), "t")]


def test_abandoned_load_retires_its_slot_until_reclaimed() -> None:
    promotions, pool, _pins, _counters, _events = table()
    start(promotions, pool, k(1), "a")
    job = finished(5, JobKind.LOAD, [k(1)], [False], abandoned=True)
    promotions.apply_load(0, "t", job)
    assert promotions.has_retired and promotions.sizes()["retired_slots"] == 1
    assert pool.free_slots == 3
    tier = FakeTier(released=[job])
    promotions.reclaim(0, tier)  # type: ignore[arg-type]
    assert not promotions.has_retired and pool.free_slots == 4


def test_result_without_a_promotion_is_an_invariant_violation() -> None:
    promotions, _pool, _pins, counters, events = table()
    promotions.apply_load(0, "t", finished(1, JobKind.LOAD, [k(9)], [True]))
    assert counters.invariant_violations == 1 and events.take() == []


def test_rounds_are_per_request_and_forgotten_at_finish() -> None:
    promotions, _pool, _pins, _counters, _events = table()
    assert promotions.rounds("r") == 0
    promotions.set_rounds("r", 2)
    assert promotions.rounds("r") == 2 and promotions.rounds("s") == 0
    promotions.forget_request("r")
    assert promotions.rounds("r") == 0
