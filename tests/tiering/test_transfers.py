"""Transfers: routing finished jobs to the promotion and write-back tables (no threads)."""

from __future__ import annotations

from kvtier.tiering.pins import PinLedger
from kvtier.tiering.promotions import PromotionTable
from kvtier.tiering.tier import IO_YIELD_S, JobKind
from kvtier.tiering.transfers import IO_YIELD_MAX_S, Transfers
from kvtier.tiering.writeback import WriteBack
from tiering.fakes import FakeTier, finished, k, make_pool, resident, tables


def test_submit_then_poll_routes_loads_and_stores() -> None:
    pool = make_pool(4)
    counters, events = tables()
    pins = PinLedger(pool, counters, 1)
    promotions = PromotionTable(pool, 1, pins, counters, events)
    writeback = WriteBack(pool, 1, pins, counters, events)
    tier = FakeTier(name="t")
    transfers = Transfers((tier,), promotions, writeback)  # type: ignore[arg-type]
    reservation = pool.reserve(k(1))
    assert reservation is not None
    promotions.start(k(1), 0, reservation.slot, "r")
    resident(pool, k(2))
    writeback.note_stored([k(2)])
    writeback.cascade_unwritten()
    transfers.submit()
    assert [keys for keys, _ in tier.loads] == [[k(1)]]
    assert [keys for keys, _ in tier.stores] == [[k(2)]]
    tier.done = [finished(1, JobKind.LOAD, [k(1)], [True]),
                 finished(2, JobKind.STORE, [k(2)], [True])]
    transfers.poll()
    assert pool.is_resident(k(1)) and len(promotions) == 0
    assert counters.promotions_succeeded == 1 and counters.cascades_stored == 1
    assert pins.cascade_pins == 0


class YieldRecorder(FakeTier):
    """Records the longest wait each ``yield_to_io`` call may take."""

    def __init__(self) -> None:
        super().__init__(name="y")
        self.timeouts: list[float] = []

    def yield_to_io(self, timeout: float, *, stores: bool = True) -> list[object]:
        self.timeouts.append(timeout)
        return []


def recorder_transfers() -> tuple[Transfers, YieldRecorder]:
    pool = make_pool(4)
    counters, events = tables()
    pins = PinLedger(pool, counters, 1)
    tier = YieldRecorder()
    promotions = PromotionTable(pool, 1, pins, counters, events)
    writeback = WriteBack(pool, 1, pins, counters, events)
    transfers = Transfers((tier,), promotions, writeback)  # type: ignore[arg-type]
    return transfers, tier


def test_the_end_of_step_wait_matches_the_schedulers_own_time_within_bounds() -> None:
    """The tiers' threads get as much time as the scheduler thread took (they would otherwise
    wait a 5 ms switch interval per system call), never less than IO_YIELD_S and never more
    than IO_YIELD_MAX_S."""
    transfers, tier = recorder_transfers()
    for busy in (0.0, 0.004, 10.0):
        transfers.yield_to_io(busy)
    low, mid, high = tier.timeouts
    assert IO_YIELD_S * 0.5 < low <= IO_YIELD_S
    assert 0.003 < mid <= 0.004
    assert IO_YIELD_MAX_S * 0.9 < high <= IO_YIELD_MAX_S
