"""LRU and ARC eviction policies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies import ARCPolicy, EvictionPolicy, LRUPolicy, PolicyError, make_policy


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def never(_key: bytes) -> bool:
    return False


def access(policy: EvictionPolicy, key: bytes, skip: frozenset[bytes] = frozenset()) -> None:
    """Drive a policy the way the pool does: hit -> touch; miss -> evict if full, insert."""
    if key in policy:
        policy.touch(key)
        return
    if len(policy) >= policy.capacity:
        victim = policy.victim(skip.__contains__, key)
        if victim is None:
            return
    policy.insert(key)


def test_lru_victim_is_least_recently_used_and_touch_refreshes() -> None:
    lru = LRUPolicy(3)
    for i in range(3):
        lru.insert(k(i))
    lru.touch(k(0))
    assert lru.victim(never) == k(1)
    assert k(1) not in lru
    assert len(lru) == 2


def test_lru_skips_pinned_and_answers_none_when_everything_is_pinned() -> None:
    lru = LRUPolicy(3)
    for i in range(3):
        lru.insert(k(i))
    assert lru.victim({k(0)}.__contains__) == k(1)
    assert lru.victim(lambda key: True) is None
    assert len(lru) == 2


def test_lru_contract_errors() -> None:
    lru = LRUPolicy(2)
    lru.insert(k(1))
    with pytest.raises(PolicyError, match="resident"):
        lru.insert(k(1))
    lru.remove(k(9))  # absent: no-op
    lru.remove(k(1))
    assert len(lru) == 0
    with pytest.raises(ValueError, match="capacity"):
        LRUPolicy(0)


def test_arc_new_keys_enter_t1_and_a_second_use_moves_them_to_t2() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(1))
    assert arc.where(k(1)) == "t1"
    arc.touch(k(1))
    assert arc.where(k(1)) == "t2"


def test_arc_evicted_keys_become_ghosts_and_ghost_hits_adapt_p() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.insert(k(2))
    arc.touch(k(2))  # T1 = [1], T2 = [2]
    assert arc.victim(never, k(3)) == k(1)  # |T1| = 1 > p = 0
    assert arc.where(k(1)) == "b1"
    arc.insert(k(3))
    assert arc.target_t1 == 0.0
    # k(1) comes back: a B1 ghost hit grows T1's target, so T2 gives up its LRU key.
    assert arc.victim(never, k(1)) == k(2)
    assert arc.target_t1 == 1.0
    assert arc.where(k(2)) == "b2"
    arc.insert(k(1))
    assert arc.where(k(1)) == "t2"
    assert arc.target_t1 == 1.0  # adapted once, not again at insert
    # k(2) comes back: a B2 ghost hit shrinks T1's target again.
    arc.victim(never, k(2))
    assert arc.target_t1 == 0.0
    arc.insert(k(2))
    assert arc.where(k(2)) == "t2"


def test_arc_drops_the_ghost_when_t1_alone_fills_the_cache() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.insert(k(2))
    assert arc.victim(never, k(3)) == k(1)
    arc.insert(k(3))  # |T1| + |B1| would exceed c: the B1 ghost goes (ARC case IV-A)
    assert arc.where(k(1)) is None


def test_arc_adapts_once_per_ghost_hit_even_without_eviction() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.insert(k(2))
    arc.touch(k(2))
    arc.victim(never, k(3))
    arc.insert(k(3))
    arc.remove(k(2))  # a free slot appears: the next ghost hit needs no victim
    arc.insert(k(1))
    assert arc.target_t1 == 1.0
    assert arc.where(k(1)) == "t2"


def test_arc_resists_a_scan_that_flushes_lru() -> None:
    capacity = 10
    hot = [k(i) for i in range(5)]
    scan = [k(1000 + i) for i in range(100)]
    survivors = {}
    for name, policy in (("lru", LRUPolicy(capacity)), ("arc", ARCPolicy(capacity))):
        for _ in range(3):
            for key in hot:
                access(policy, key)
        for key in scan:
            access(policy, key)
        survivors[name] = sum(key in policy for key in hot)
    assert survivors["lru"] == 0
    assert survivors["arc"] == len(hot)


def test_arc_skips_pinned_keys_and_falls_back_to_the_other_list() -> None:
    arc = ARCPolicy(3)
    arc.insert(k(1))
    arc.insert(k(2))
    arc.touch(k(2))  # T1 = [1], T2 = [2]
    arc.insert(k(3))  # T1 = [1, 3]
    pinned = {k(1), k(3)}
    assert arc.victim(pinned.__contains__) == k(2)
    assert arc.victim(lambda key: True) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["access", "remove", "pin"]),
                          st.integers(0, 40)), max_size=400),
       st.integers(1, 12))
def test_arc_invariants_hold_under_random_workloads(
    ops: list[tuple[str, int]], capacity: int
) -> None:
    arc = ARCPolicy(capacity)
    pinned: set[bytes] = set()
    for op, value in ops:
        key = k(value)
        if op == "access":
            access(arc, key, frozenset(pinned))
        elif op == "remove":
            arc.remove(key)
            pinned.discard(key)
        elif key in arc and len(pinned) < capacity - 1:
            pinned.add(key)
        sizes = arc.sizes()
        assert sizes["t1"] + sizes["t2"] <= capacity
        assert sizes["t1"] + sizes["b1"] <= capacity
        assert sum(sizes.values()) <= 2 * capacity
        assert 0.0 <= arc.target_t1 <= capacity
        assert all(key in arc for key in pinned)


class TextbookARC:
    """ARC exactly as printed in Megiddo & Modha (FAST'03, Fig. 4), the reference to match."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: dict[int, None] = {}
        self.t2: dict[int, None] = {}
        self.b1: dict[int, None] = {}
        self.b2: dict[int, None] = {}

    @staticmethod
    def _pop_lru(entries: dict[int, None]) -> int:
        key = next(iter(entries))
        del entries[key]
        return key

    def _replace(self, x: int) -> None:
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            self.b1[self._pop_lru(self.t1)] = None
        else:
            self.b2[self._pop_lru(self.t2)] = None

    def access(self, x: int) -> bool:
        c = self.c
        if x in self.t1 or x in self.t2:
            self.t1.pop(x, None)
            self.t2.pop(x, None)
            self.t2[x] = None
            return True
        if x in self.b1:
            self.p = min(c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(x)
            del self.b1[x]
            self.t2[x] = None
            return False
        if x in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(x)
            del self.b2[x]
            self.t2[x] = None
            return False
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 == c:
            if len(self.t1) < c:
                self._pop_lru(self.b1)
                self._replace(x)
            else:
                self._pop_lru(self.t1)
        elif total >= c:
            if total == 2 * c:
                self._pop_lru(self.b2)
            self._replace(x)
        self.t1[x] = None
        return False


def test_arc_matches_the_textbook_algorithm_hit_for_hit() -> None:
    """Same hits, same p and same resident set as the paper's ARC on a skewed trace whose
    target p takes fractional values (the B2-ghost tie-break compares |T1| with p exactly)."""
    import random

    rng = random.Random(0)
    capacity = 16
    ours, reference = ARCPolicy(capacity), TextbookARC(capacity)
    ours_hits = reference_hits = 0
    for _ in range(20000):
        x = (int(rng.paretovariate(1.2)) % 200 if rng.random() < 0.7 else rng.randrange(60))
        reference_hits += reference.access(x)
        ours_hits += k(x) in ours
        access(ours, k(x))
        assert ours.target_t1 == reference.p
    assert ours_hits == reference_hits
    assert {key for key in (k(x) for x in range(200)) if key in ours} == {
        k(x) for x in (*reference.t1, *reference.t2)}


def test_make_policy_names_the_bad_value() -> None:
    assert isinstance(make_policy("lru", 2), LRUPolicy)
    assert isinstance(make_policy("arc", 2), ARCPolicy)
    with pytest.raises(ValueError, match=r"'lfu'.*\['lru', 'arc'\]"):
        make_policy("lfu", 2)
