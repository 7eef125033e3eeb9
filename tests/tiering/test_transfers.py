"""Transfers: routing finished jobs to the promotion and write-back tables (no threads)."""

from __future__ import annotations

from kvtier.tiering.pins import PinLedger
from kvtier.tiering.promotions import PromotionTable
from kvtier.tiering.tier import JobKind
from kvtier.tiering.transfers import Transfers
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
