"""Reference simulations, and their validation against the published Mooncake numbers."""

from __future__ import annotations

import pytest

from kvtier.replay import reference
from kvtier.replay.reader import read_trace

from ._traces import TraceWriter, full, record


def test_lru_on_synthetic_trace_matches_published_numbers() -> None:
    """LRU 10,000 and 100,000 blocks on the bundled synthetic trace (the published file)."""
    trace = read_trace("builtin:synthetic")
    published = {10_000: 0.4235, 100_000: 0.6396}
    for capacity, expected in published.items():
        result = reference.lru(trace, capacity)
        assert result.block_hit_ratio == pytest.approx(expected, abs=0.01), capacity
        assert result.token_hit_ratio - result.block_hit_ratio <= 0.0125
    validation = reference.validate(trace)
    assert validation is not None and validation.passed
    assert validation.summary().startswith("PASSED: Mooncake FAST'25 synthetic_trace.jsonl")


def test_conversation_trace_matches_published_numbers() -> None:
    trace = read_trace("builtin:conversation")
    lru_10k = reference.lru(trace, 10_000)
    assert lru_10k.block_hit_ratio == pytest.approx(0.2112, abs=0.01)
    assert (lru_10k.inserts, lru_10k.evictions) == (227_579, 217_579)
    assert reference.lru(trace, 100_000).block_hit_ratio == pytest.approx(0.3637, abs=0.01)
    ideal = reference.ideal(trace)
    assert ideal.block_hit_ratio == pytest.approx(0.3664, abs=0.0001)
    assert ideal.token_hit_ratio == pytest.approx(0.3736, abs=0.0001)
    assert (ideal.inserts, ideal.evictions) == (182_790, 0)


def test_hand_computed_lru_and_ideal(write_trace: TraceWriter) -> None:
    # blocks: A=[1,2] B=[1,2,3] C=[4] D=[1,2,3] with a partial last block in D
    trace = read_trace(write_trace([
        full([1, 2]), full([1, 2, 3]), full([4]), record(0, 1100, [1, 2, 3]),
    ]))
    ideal = reference.ideal(trace)
    assert (ideal.block_hits, ideal.block_refs) == (2 + 0 + 3, 9)
    assert ideal.token_hits == 1024 + 1100
    assert ideal.total_tokens == 1024 + 1536 + 512 + 1100
    small = reference.lru(trace, 3)
    # after B: {1,2,3}; C evicts 1 -> {2,3,4}; D misses at its first block, and touching
    # 1, 2, 3 in order evicts 2, 3, 4 in turn.
    assert (small.block_hits, small.inserts, small.evictions) == (2, 7, 4)
    assert small.block_hit_ratio == pytest.approx(2 / 9)


def test_unknown_or_cut_traces_are_not_validated(write_trace: TraceWriter) -> None:
    assert reference.validate(read_trace(write_trace([full([1])]))) is None
    cut = read_trace("builtin:synthetic", max_requests=10)
    assert reference.published_for(cut) is not None
    assert reference.validate(cut) is None


def test_failed_validation_says_so() -> None:
    check = reference.ValidationCheck("LRU 10,000", computed=0.40, published=0.4235)
    validation = reference.Validation("t", (check,))
    assert not validation.passed
    assert validation.summary().startswith("FAILED: t: LRU 10,000 0.4000 vs 0.4235")


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_bad_capacity(write_trace: TraceWriter, capacity: object) -> None:
    trace = read_trace(write_trace([full([1])]))
    with pytest.raises(ValueError, match="capacity_blocks must be an integer >= 1"):
        reference.lru(trace, capacity)  # type: ignore[arg-type]
