"""BoundedLRU: oldest-first eviction by count or by weight."""

import pytest

from kvtier.lru import BoundedLRU


def test_count_bound_evicts_oldest_and_touch_refreshes() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(2)
    assert lru.put("a", 1) == []
    lru.put("b", 2)
    assert lru.touch("a")
    evicted = lru.put("c", 3)
    assert [e.key for e in evicted] == ["b"]
    assert list(lru) == ["a", "c"]
    assert lru.get("a") == 1 and "b" not in lru


def test_weight_bound_and_replace_keeps_totals() -> None:
    lru: BoundedLRU[str, str] = BoundedLRU(10)
    lru.put("a", "x", weight=4)
    lru.put("b", "y", weight=4)
    lru.put("a", "z", weight=5)  # replaced: a is newest now, total 9
    assert lru.total_weight == 9 and list(lru) == ["b", "a"]
    evicted = lru.put("c", "w", weight=3)
    assert [(e.key, e.weight) for e in evicted] == [("b", 4)]
    assert lru.total_weight == 8


def test_oversized_entry_stays_alone_and_trim_keeps() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(3)
    lru.put("a", 1)
    evicted = lru.put("big", 2, weight=7)
    assert [e.key for e in evicted] == ["a"] and list(lru) == ["big"]
    assert [e.key for e in lru.trim(0)] == ["big"] and len(lru) == 0


def test_pop_unbounded_and_bad_values() -> None:
    lru: BoundedLRU[int, int] = BoundedLRU(None)
    for i in range(100):
        assert lru.put(i, i) == []
    assert lru.pop(5) == 5 and lru.pop(5) is None and len(lru) == 99
    assert lru.pop_oldest() is not None and lru.total_weight == 98
    with pytest.raises(ValueError, match="capacity"):
        BoundedLRU(-1)
    with pytest.raises(ValueError, match="weight"):
        lru.put(1, 1, weight=-1)


def test_put_many_is_put_of_each_in_order_then_one_eviction() -> None:
    lru: BoundedLRU[str, None] = BoundedLRU(10)
    lru.put("a", None, weight=4)
    lru.put("b", None, weight=4)
    evicted = lru.put_many([("a", 3), ("c", 5)], None)  # a replaced and newer, then c
    assert [(e.key, e.weight) for e in evicted] == [("b", 4)]
    assert list(lru) == ["a", "c"] and lru.total_weight == 8
    with pytest.raises(ValueError, match="weight must be >= 0"):
        lru.put_many([("d", 1), ("e", -1)], None)
    assert lru.total_weight == 9 and "d" in lru  # what went in before the bad entry counts
