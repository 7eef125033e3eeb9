"""Unit tests of the lookup layer's small tables, without threads: the expiry map (verdict
cache and quarantine), the noted verdicts and the per-key table built on them."""

from __future__ import annotations

import pytest

from kvtier.lookup.expiry import ExpiryMap
from kvtier.lookup.noted import NotedVerdicts
from kvtier.lookup.states import KeyState, KeyTable, LookupPhase, VerdictSource


def key(index: int) -> bytes:
    return index.to_bytes(16, "big")


# --------------------------------------------------------------------------- ExpiryMap


def test_put_get_expiry_pop() -> None:
    table: ExpiryMap[str, int] = ExpiryMap(4)
    assert table.put("a", 1, 10.0) == []
    assert ("a" in table, len(table), table.get("a"), table.expiry("a")) == (True, 1, 1, 10.0)
    assert (table.get("b"), table.expiry("b"), table.pop("b")) == (None, None, None)
    assert table.pop("a") == 1 and len(table) == 0 and "a" not in table


def test_the_bound_evicts_the_least_recently_put_and_counts_it() -> None:
    table: ExpiryMap[str, int] = ExpiryMap(2)
    table.put("a", 1, 10.0)
    table.put("b", 2, 10.0)
    table.put("a", 3, 20.0)  # put again: newest, new value and expiry
    assert table.put("c", 4, 10.0) == [2]
    assert table.evictions == 1
    assert (table.get("a"), table.expiry("a"), "b" in table) == (3, 20.0, False)
    table.clear()
    assert len(table) == 0 and table.evictions == 1  # the count outlives clear()


def test_sweep_drops_lapsed_entries_from_the_oldest_end_only() -> None:
    table: ExpiryMap[str, int] = ExpiryMap(8)
    table.put("a", 1, 5.0)
    table.put("b", 2, 6.0)
    table.put("c", 3, 20.0)
    table.put("d", 4, 1.0)  # lapsed, but behind a live entry: left for its reader
    assert table.sweep(4.0) == []
    assert table.sweep(6.0) == [1, 2]  # an entry lapses at its expiry (live while now < expiry)
    assert list(filter(table.__contains__, "abcd")) == ["c", "d"]
    assert table.sweep(100.0) == [3, 4] and len(table) == 0
    assert table.evictions == 0  # lapsing is not an eviction


@pytest.mark.parametrize("capacity", [0, -1, True, 1.5])
def test_bad_capacity_is_refused(capacity: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        ExpiryMap(capacity)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- KeyTable


def _resolved(table: KeyTable, index: int, expiry: float | None, refs: int = 0) -> KeyState:
    state = KeyState(key(index), next(table.generations), LookupPhase.RESOLVED, refs)
    state.resolve(True, VerdictSource.BACKEND, expiry)
    table.states[state.key] = state
    return state


def test_release_caches_a_cacheable_verdict_and_forgets_the_rest() -> None:
    table = KeyTable(max_cached_verdicts=2)
    cached = _resolved(table, 1, 10.0)
    fault = _resolved(table, 2, None)
    table.release(cached)
    table.release(fault)
    assert table.is_cached(key(1)) and key(2) not in table.states
    assert (len(table.states), table.tracked) == (1, 0)


def test_cache_bound_drops_the_evicted_states() -> None:
    table = KeyTable(max_cached_verdicts=2)
    for index in range(3):
        table.release(_resolved(table, index, 10.0))
    assert sorted(table.states) == [key(1), key(2)]
    assert table.evictions == 1


def test_reuse_cached_takes_a_live_verdict_and_forgets_a_lapsed_one() -> None:
    table = KeyTable(max_cached_verdicts=4)
    live = _resolved(table, 1, 10.0)
    lapsed = _resolved(table, 2, 5.0)
    table.release(live)
    table.release(lapsed)
    assert table.reuse_cached(live, 9.0) is True
    assert key(1) in table.states and not table.is_cached(key(1)) and table.tracked == 1
    assert table.reuse_cached(lapsed, 5.0) is False
    assert key(2) not in table.states and not table.is_cached(key(2))


def test_override_supersedes_a_running_probe_and_releases_an_unheld_state() -> None:
    table = KeyTable(max_cached_verdicts=4)
    state = KeyState(key(1), next(table.generations), LookupPhase.IN_FLIGHT, 0)
    table.states[state.key] = state
    old_generation = state.generation
    table.override(state, True, VerdictSource.NOTED, 30.0)
    assert state.generation > old_generation and state.phase is LookupPhase.RESOLVED
    assert table.is_cached(key(1)) and table.states[key(1)] is state  # cached at once
    table.override(state, False, VerdictSource.MISS_MARKED, None)
    assert key(1) not in table.states and table.cached == 0


def test_forget_leaves_a_newer_state_of_the_same_key_alone() -> None:
    table = KeyTable(max_cached_verdicts=4)
    old = _resolved(table, 1, 10.0)
    new = _resolved(table, 1, 10.0)  # replaces the old state in ``states``
    table.forget(old)
    assert table.states[key(1)] is new


def test_sweep_and_restart() -> None:
    table = KeyTable(max_cached_verdicts=4)
    table.release(_resolved(table, 1, 5.0))
    table.sweep(5.0)
    assert not table.states and table.cached == 0 and table.queued == 0
    state = _resolved(table, 2, 5.0, refs=1)
    state.restart(next(table.generations))
    assert (state.phase, state.verdict, state.source, state.cache_expiry) == (
        LookupPhase.PENDING, None, None, None)
    table.clear()
    assert not table.states


# --------------------------------------------------------------------------- NotedVerdicts


def test_noted_verdicts_sweep_by_note_and_skip_keys_noted_again() -> None:
    noted = NotedVerdicts()
    noted.add([key(1), key(2)], True, 5.0)
    noted.add([key(2)], False, 9.0)  # key 2 noted again: its entry is the newer note's
    assert (len(noted), noted.oldest_expiry()) == (2, 5.0)
    noted.sweep(5.0)  # the first note lapsed: key 1 goes, key 2 (noted again) stays
    assert noted.entries == {key(2): (False, 9.0)}
    noted.sweep(9.0)
    assert (len(noted), noted.oldest_expiry()) == (0, None)


def test_noted_verdicts_drop_oldest_first_and_stay_compact() -> None:
    noted = NotedVerdicts()
    noted.add([key(1), key(2)], True, 5.0)
    noted.add([key(3)], True, 6.0)
    assert noted.drop_oldest() and noted.drop_oldest()
    assert list(noted.entries) == [key(3)]
    for _ in range(5000):  # the same key noted again and again: dead places are compacted
        noted.add([key(3)], True, 7.0)
    assert len(noted) == 1 and noted._batched <= 2 * 1 + 1024
    assert noted.drop_oldest() and not noted.drop_oldest()


def test_key_table_bound_counts_noted_verdicts_and_drops_the_first_to_lapse() -> None:
    table = KeyTable(max_cached_verdicts=2)
    table.noted.add([key(1)], True, 20.0)
    table.release(_resolved(table, 2, 10.0))  # lapses first
    table.release(_resolved(table, 3, 30.0))  # over the bound: key 2 goes, not the note
    assert (table.cached_count, table.evictions) == (2, 1)
    assert key(1) in table.noted.entries and key(2) not in table.states
    assert table.lapsed_first(20.0) and not table.lapsed_first(9.0)
    table.sweep(20.0)
    assert (table.cached_count, list(table.states)) == (1, [key(3)])
