"""ReadyParts: the order parts are taken in, and the store limit's owed tasks."""

from __future__ import annotations

import pytest

from kvtier.tiering.ready_parts import ReadyParts, ReadyQueue


def test_loads_then_stores_then_prefetch_without_a_limit() -> None:
    ready: ReadyParts[str] = ReadyParts()
    ready.push(ReadyQueue.PREFETCH, ["p1"])
    ready.push(ReadyQueue.STORE, ["s1", "s2"])
    ready.push(ReadyQueue.LOAD, ["l1"])
    assert [ready.pop() for _ in range(5)] == ["l1", "s1", "s2", "p1", None]
    assert ready.done(True) is False  # no limit: nothing is ever owed


def test_a_task_that_finds_only_stores_over_the_limit_is_owed_and_paid_in_order() -> None:
    """Three store parts, one at a time: each task that finds the limit reached returns owed,
    and the thread that ends a store takes the next one in the owed task's place, so every
    part is taken exactly once and none waits without a thread."""
    ready: ReadyParts[str] = ReadyParts(store_limit=1)
    ready.push(ReadyQueue.STORE, ["s1", "s2", "s3"])
    assert ready.pop() == "s1"
    assert ready.pop() is None and ready.pop() is None  # two tasks owed
    ready.push(ReadyQueue.LOAD, ["l1"])
    assert ready.pop() == "l1"  # a load never waits for the store limit
    # The load's thread pays one debt: its pop is over the limit again, so the debt stays.
    assert ready.done(False) is True
    assert ready.pop() is None
    assert ready.done(True) is True  # s1 ends: its thread takes s2
    assert ready.pop() == "s2"
    assert ready.done(True) is True
    assert ready.pop() == "s3"
    assert ready.done(True) is False  # nothing owed, nothing left
    assert ready.pop() is None


def test_prefetch_waits_behind_stores_held_by_the_limit() -> None:
    ready: ReadyParts[str] = ReadyParts(store_limit=1)
    ready.push(ReadyQueue.STORE, ["s1", "s2"])
    ready.push(ReadyQueue.PREFETCH, ["p1"])
    assert ready.pop() == "s1"
    assert ready.pop() is None  # s2 waits for the limit; p1 waits behind it
    assert ready.done(True) is True
    assert ready.pop() == "s2"
    assert ready.done(True) is False
    assert ready.pop() == "p1"


def test_drain_takes_every_part_whatever_the_limit() -> None:
    ready: ReadyParts[str] = ReadyParts(store_limit=1)
    ready.push(ReadyQueue.STORE, ["s1", "s2"])
    assert ready.pop() == "s1"
    assert list(ready.drain()) == ["s2"]


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "1"])
def test_a_bad_store_limit_is_refused_by_name(limit: object) -> None:
    with pytest.raises(ValueError, match=r"store_limit must be None or an int >= 1, got"):
        ReadyParts(store_limit=limit)  # type: ignore[arg-type]
