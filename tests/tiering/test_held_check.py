"""HeldOrderCheck: the value order's trust follows its recent next turns, both ways."""

from __future__ import annotations

from kvtier.tiering.held_check import HELD_CHECK_MIN, HELD_CHECK_SAMPLES, HeldOrderCheck


def test_trusted_until_enough_next_turns_then_off_and_back_on() -> None:
    check = HeldOrderCheck()
    for _ in range(HELD_CHECK_MIN - 1):
        check.record(False, 10)  # all lost, but too few to judge
    assert check.trusted and check.switches == 0
    check.record(False, 10)
    assert not check.trusted and check.switches == 1
    assert (check.right_blocks, check.wrong_blocks) == (0, 10 * HELD_CHECK_MIN)
    for _ in range(HELD_CHECK_SAMPLES):  # the lost ones age out of the window
        check.record(True, 1)
    assert check.trusted and check.switches == 2
    assert check.right_blocks == HELD_CHECK_SAMPLES


def test_a_quarter_lost_is_still_trusted() -> None:
    check = HeldOrderCheck()
    for turn in range(HELD_CHECK_SAMPLES):
        check.record(turn % 4 != 0, 0)  # every fourth lost: exactly a quarter
    assert check.trusted and check.switches == 0
