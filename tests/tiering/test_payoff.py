"""The pay-off rule (``kvtier.tiering.payoff``), the measured load cost (``load_rate``) and the
tier's use of both (``SecondaryTier.blocks_worth_loading``).

Pure functions and a fit fed by hand: the numbers are chosen to be exact in binary floating
point, so the boundaries (a tie, a job that ends exactly at the deadline) are exact too.
"""

from __future__ import annotations

import pytest

from kvtier.backends.memory import MemoryBackend
from kvtier.keys import Namespace
from kvtier.settings import ConfigError
from kvtier.tiering.load_rate import LoadRate
from kvtier.tiering.payoff import FREE, LoadCost, blocks_worth_loading
from kvtier.tiering.tier import SecondaryTier
from kvtier.tiering.tier_settings import TierSettings

MIB = 1 << 20
SLOW = LoadCost(0.0, 1.0 / MIB)  # 1 s per MiB: a 1 MiB block loads in 1 s


def worth(blocks: int, cost: LoadCost, prefill: float | None, *, tokens: int = 16,
          deadline: float | None = None, block_bytes: int = MIB) -> int:
    return blocks_worth_loading(blocks, block_bytes=block_bytes, tokens_per_block=tokens,
                                cost=cost, prefill_tokens_per_s=prefill, deadline_s=deadline)


def test_a_load_faster_than_recompute_is_taken_whole() -> None:
    # 1 s per block to load, 16 tokens at 8 tokens/s = 2 s per block to recompute.
    assert worth(10, SLOW, 8.0) == 10


def test_a_load_slower_than_recompute_is_declined_whole() -> None:
    # 1 s per block to load, 0.5 s per block to recompute (32 tokens/s).
    assert worth(10, SLOW, 32.0) == 0


def test_a_tie_is_recomputed() -> None:
    # Exactly 1 s either way per block (16 tokens at 16 tokens/s): no gain, so no load.
    assert worth(4, SLOW, 16.0) == 0
    assert worth(4, SLOW, 16.0 * (1 - 2**-20)) == 4  # recompute a hair slower: load


def test_the_per_job_latency_is_amortised_over_the_prefix() -> None:
    # 0.5 s per job + 0.25 s per block to load; 0.5 s per block to recompute (32 tokens/s).
    cost = LoadCost(0.5, 0.25 / MIB)
    assert worth(1, cost, 32.0) == 0  # 0.75 s > 0.5 s
    assert worth(2, cost, 32.0) == 0  # 1.0 s == 1.0 s: a tie
    assert worth(3, cost, 32.0) == 3  # 1.25 s < 1.5 s


def test_the_deadline_keeps_the_part_that_loads_in_time() -> None:
    # 1 s per block against 2 s to recompute; a 3.5 s deadline fits 3 blocks.
    assert worth(10, SLOW, 8.0, deadline=3.5) == 3
    assert worth(10, SLOW, 8.0, deadline=3.0) == 3  # the 3rd block ends exactly at 3 s
    assert worth(2, SLOW, 8.0, deadline=3.5) == 2   # fewer asked than fit
    assert worth(10, SLOW, 8.0, deadline=0.5) == 0  # not one block in time
    assert worth(10, LoadCost(2.0, 0.0), 8.0, deadline=2.0) == 0  # the round trip alone


def test_nothing_is_declined_without_a_prefill_rate_or_tokens() -> None:
    assert worth(10, SLOW, None) == 10
    assert worth(10, SLOW, 1e9, tokens=0) == 10
    assert worth(0, SLOW, 1e9) == 0
    assert worth(10, FREE, 1e9) == 10  # free loads always pay


@pytest.mark.parametrize(("name", "kwargs", "shown"), [
    ("blocks", {"blocks": -1}, "-1"),
    ("blocks", {"blocks": 2.0}, "2.0"),
    ("blocks", {"blocks": True}, "True"),
    ("block_bytes", {"block_bytes": 0}, "0"),
    ("tokens_per_block", {"tokens_per_block": -16}, "-16"),
    ("prefill_tokens_per_s", {"prefill_tokens_per_s": 0}, "0"),
    ("prefill_tokens_per_s", {"prefill_tokens_per_s": float("inf")}, "inf"),
    ("prefill_tokens_per_s", {"prefill_tokens_per_s": "fast"}, "'fast'"),
    ("deadline_s", {"deadline_s": -1.0}, "-1.0"),
    ("deadline_s", {"deadline_s": float("nan")}, "nan"),
])
def test_bad_values_are_named_in_the_error(name: str, kwargs: dict[str, object],
                                           shown: str) -> None:
    arguments: dict[str, object] = {"blocks": 4, "block_bytes": MIB, "tokens_per_block": 16,
                                    "cost": SLOW, "prefill_tokens_per_s": 8.0,
                                    "deadline_s": None, **kwargs}
    with pytest.raises(ConfigError, match=rf"^{name}: expected .*, got {shown}$"):
        blocks_worth_loading(**arguments)  # type: ignore[arg-type]


def test_a_bad_cost_is_named_in_the_error() -> None:
    with pytest.raises(ConfigError, match=r"LoadCost.seconds_per_byte: .* got -1.0"):
        LoadCost(0.0, -1.0)
    with pytest.raises(ConfigError, match=r"LoadCost.seconds_per_job: .* got nan"):
        LoadCost(float("nan"), 0.0)
    with pytest.raises(ConfigError, match=r"cost: expected a LoadCost, got float"):
        blocks_worth_loading(1, block_bytes=1, tokens_per_block=1, cost=1.0,  # type: ignore[arg-type]
                             prefill_tokens_per_s=1.0)


# ---- the measured cost ---------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_prior_is_free_until_a_job_is_measured() -> None:
    rate = LoadRate(clock=FakeClock())
    assert rate.cost() == FREE and rate.samples == 0
    rate.observe(0, 1.0)  # no bytes: says nothing
    rate.observe(MIB, float("nan"))
    assert rate.cost() == FREE


def test_jobs_of_one_size_charge_their_time_to_the_bytes() -> None:
    rate = LoadRate(clock=FakeClock())
    for _ in range(3):
        rate.observe(MIB, 0.5)
    cost = rate.cost()
    assert cost.seconds_per_job == 0.0
    assert cost.seconds_per_byte == pytest.approx(0.5 / MIB)


def test_jobs_of_several_sizes_separate_round_trip_and_bytes() -> None:
    rate = LoadRate(clock=FakeClock())
    for blocks in (1, 4, 2, 8, 1, 4):  # seconds = 0.01 + 0.1 per MiB
        rate.observe(blocks * MIB, 0.01 + 0.1 * blocks)
    cost = rate.cost()
    assert cost.seconds_per_job == pytest.approx(0.01)
    assert cost.seconds_per_byte == pytest.approx(0.1 / MIB)


def test_the_estimate_follows_a_tier_that_slows_down() -> None:
    rate = LoadRate(clock=FakeClock())
    for _ in range(4):
        rate.observe(MIB, 0.01)
    for _ in range(12):
        rate.observe(MIB, 1.0)
    assert rate.cost().seconds_per_byte * MIB > 0.95  # the old fast jobs have faded


def test_a_stale_estimate_asks_for_one_measurement_that_replaces_it() -> None:
    clock = FakeClock()
    rate = LoadRate(clock=clock, remeasure_after_s=60.0)
    assert not rate.stale  # never measured: the prior, not a stale estimate
    rate.observe(MIB, 2.0)
    clock.now += 60.0
    assert not rate.stale  # exactly 60 s: not yet
    clock.now += 0.5
    assert rate.stale
    assert rate.cost().seconds_per_byte * MIB == pytest.approx(2.0)  # still the estimate
    rate.remeasure()
    assert not rate.stale  # one measuring load per period
    rate.observe(MIB, 0.25)  # the old history is dropped, not averaged in
    assert rate.cost().seconds_per_byte * MIB == pytest.approx(0.25)
    assert rate.samples == 1


def test_a_tier_declined_on_a_stale_estimate_lets_one_block_through() -> None:
    """The tier's rule on its own estimate (fed by hand; the real loads are in
    test_decline.py)."""
    clock = FakeClock()
    backend = MemoryBackend(Namespace(model="m", block_size=16))
    tier = SecondaryTier("slow", backend, TierSettings(prefill_tokens_per_s=32.0), clock=clock)
    try:
        assert tier.blocks_worth_loading(10, MIB) == 10  # nothing measured: optimistic
        tier.load_rate.observe(MIB, 1.0)  # 1 s per block against 0.5 s to recompute
        assert tier.blocks_worth_loading(10, MIB) == 0
        clock.now += 61.0
        assert tier.blocks_worth_loading(10, MIB) == 1  # stale: one measuring block
        assert tier.blocks_worth_loading(10, MIB) == 0  # only one per period
        tier.load_rate.observe(MIB, 0.125)  # the tier got fast again
        assert tier.blocks_worth_loading(10, MIB) == 10
        tier.count_declined(3)
        assert tier.stats().counters.loads_declined == 3
    finally:
        tier.shutdown()


def test_bad_estimator_parameters_are_named() -> None:
    with pytest.raises(ValueError, match=r"weight: expected a number in \(0, 1\], got 0"):
        LoadRate(weight=0)
    with pytest.raises(ValueError, match=r"remeasure_after_s: .* got -1"):
        LoadRate(remeasure_after_s=-1)
