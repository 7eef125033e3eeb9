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


def test_a_share_at_the_line_switches_once_not_every_turn() -> None:
    """Every fourth next turn lost: the share crosses a quarter now and then; without the
    margin the order would switch at each crossing (12 times here)."""
    check = HeldOrderCheck()
    for turn in range(4 * HELD_CHECK_SAMPLES):
        check.record(turn % 4 != 0, 0)
    assert check.switches <= 1


def test_back_on_only_at_an_eighth_lost() -> None:
    check = HeldOrderCheck()
    for _ in range(HELD_CHECK_SAMPLES):
        check.record(False, 0)
    assert not check.trusted
    lost_share = [False] * 5 + [True] * (HELD_CHECK_SAMPLES - 5)  # 5/32 > 1/8: stays off
    for held in lost_share:
        check.record(held, 0)
    assert not check.trusted
    for _ in range(2):  # the window now holds 3 lost of 32, under an eighth
        check.record(True, 0)
    assert check.trusted and check.switches == 2
