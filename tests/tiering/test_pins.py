"""PinLedger: request pins, holds with expiry, cascade and store-job pins (no threads)."""

from __future__ import annotations

from kvtier.tiering.pins import HOLD_STEPS, PinLedger
from tiering.fakes import k, make_pool, resident, tables


def ledger(num_slots: int = 4, num_tiers: int = 1) -> tuple[PinLedger, object, object]:
    pool = make_pool(num_slots)
    counters, _events = tables()
    return PinLedger(pool, counters, num_tiers), pool, counters


def test_request_pins_are_released_once_each() -> None:
    pins, pool, counters = ledger()
    resident(pool, k(1))
    slots = pins.pin_for_request("r", [k(1), k(1)])
    assert slots == [pool.slot_of(k(1))] * 2 and pool.pin_count(k(1)) == 2
    assert pins.requests_with_pins == 1
    pins.unpin_for_request("r", [k(1)])
    assert pool.pin_count(k(1)) == 1
    pins.unpin_for_request("other", [k(1)])  # not its pin: counted, not unpinned
    assert counters.unexpected_completions == 1 and pool.pin_count(k(1)) == 1
    pins.release_request("r")
    assert pool.pin_count(k(1)) == 0 and pins.requests_with_pins == 0
    assert counters.pins_released_at_finish == 1


def test_completing_every_pin_forgets_the_request() -> None:
    pins, pool, counters = ledger()
    resident(pool, k(1))
    pins.pin_for_request("r", [k(1)])
    pins.unpin_for_request("r", [k(1)])
    pins.unpin_for_request("r", [k(1)])
    assert pins.requests_with_pins == 0 and counters.unexpected_completions == 1


def test_hold_expires_after_its_steps_and_refresh_extends_it() -> None:
    pins, pool, counters = ledger()
    resident(pool, k(1))
    resident(pool, k(2))
    pins.hold("r", k(1))
    assert pins.held == 1 and pool.pin_count(k(1)) == 1 and counters.holds_placed == 1
    pins.hold("r", k(1))  # already held: nothing more
    assert pool.pin_count(k(1)) == 1
    for _ in range(HOLD_STEPS - 1):
        pins.advance_step()
    pins.hold("r", k(2))  # refreshes the request's one expiry
    pins.advance_step()
    assert pins.held == 2
    for _ in range(HOLD_STEPS - 1):
        pins.advance_step()
    assert pins.held == 0 and pool.pin_count(k(1)) == 0 and pool.pin_count(k(2)) == 0
    assert counters.holds_expired == 2


def test_hold_refused_for_absent_keys_and_beyond_the_cap() -> None:
    pins, pool, counters = ledger(num_slots=4)  # cap: 3 held blocks
    for i in range(4):
        resident(pool, k(i))
    pins.hold("r", k(9))
    assert counters.holds_refused == 1 and pins.held == 0
    pins.hold_many("r", {k(0), k(1), k(2), k(3)}, None)
    assert pins.held == 3 and counters.holds_placed == 3 and counters.holds_refused == 2
    pins.release_hold("r")
    assert pins.held == 0 and pool.occupancy().pins == 0


def test_taken_hold_is_settled_keeping_what_was_found_again() -> None:
    pins, pool, _counters = ledger()
    for i in range(3):
        resident(pool, k(i))
    pins.hold_many("r", {k(0), k(1)}, None)
    previous = pins.take_hold("r")
    assert previous is not None and previous.keys == {k(0), k(1)}
    assert pool.pin_count(k(0)) == 1  # still pinned while the lookup runs
    pins.hold_many("r", {k(1), k(2)}, previous)
    assert pins.held == 2
    assert [pool.pin_count(k(i)) for i in range(3)] == [0, 1, 1]
    taken = pins.take_hold("r")
    assert taken is not None
    pins.unpin_held(taken.keys)
    assert pins.held == 0 and pool.occupancy().pins == 0
    assert pins.take_hold("r") is None


def test_cascade_pins_are_budgeted_per_tier_write() -> None:
    pins, pool, _counters = ledger(num_slots=4, num_tiers=2)  # budget: 2 blocks * 2 tiers
    resident(pool, k(1))
    assert pins.cascade_room(2) == 2
    slot = pins.pin_cascade(k(1), 2)
    assert slot == pool.slot_of(k(1)) and pool.pin_count(k(1)) == 2
    assert pins.cascade_pins == 2 and pins.cascade_room(2) == 1
    pins.unpin_cascade(k(1))
    pins.unpin_cascade(k(1))
    assert pins.cascade_pins == 0 and pool.pin_count(k(1)) == 0


def test_store_job_pins_are_popped_once() -> None:
    pins, _pool, _counters = ledger()
    pins.note_store_job(0, 7, (True, False))
    assert pins.pop_store_job(0, 7) == (True, False)
    assert pins.pop_store_job(0, 7) is None


def test_clear_forgets_every_hold_and_request() -> None:
    pins, pool, _counters = ledger()
    resident(pool, k(1))
    pins.hold("r", k(1))
    pins.pin_for_request("s", [k(1)])
    pins.clear()
    assert pins.held == 0 and pins.requests_with_pins == 0 and pins.take_hold("r") is None
