"""Never slower than recompute: a tier on a slow link is declined, a fast one is not.

Real parts only: one private Valkey server (``redis_server``), reached directly (the fast tier)
and through :class:`~servers.throttle.ThrottledProxy`, a real TCP proxy that delivers the
server's replies at 1 MiB/s (the slow tier: a remote store a long way off). The managers'
clock is a fake one so that the load estimate never goes stale during a test; the load times
themselves are real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any
from uuid import uuid4

import numpy as np
import pytest

from kvtier.factory import open_manager
from kvtier.keys import Namespace, RequestContext, chain_keys
from kvtier.tiering.manager import TieringManager
from servers.throttle import ThrottledProxy
from servers.valkey import ValkeyServer

BLOCK = 256 * 1024
TOKENS = 16
LINK_BYTES_PER_S = 1024 * 1024  # 0.25 s per block over the slow link
# Recomputing a block takes 16 / 320 = 50 ms: 5x faster than the slow link, and a local Valkey
# moves 256 KiB in well under that even on a busy machine.
PREFILL_TOKENS_PER_S = 320.0
RECOMPUTE_BLOCK_S = TOKENS / PREFILL_TOKENS_PER_S
DB = 7

pytestmark = pytest.mark.timeout(120)


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def slow_link(redis_server: ValkeyServer) -> Iterator[ThrottledProxy]:
    with ThrottledProxy(redis_server.port, LINK_BYTES_PER_S) as proxy:
        yield proxy


@pytest.fixture
def managers() -> Iterator[Callable[..., TieringManager]]:
    opened: list[TieringManager] = []

    def make(url: str, model: str, **tier: Any) -> TieringManager:
        manager = open_manager(
            {"block_bytes": BLOCK, "primary_bytes": BLOCK * 16,
             "namespace": {"model": model, "block_size": TOKENS},
             "secondary_tiers": [{"url": url, **tier}]},
            clock=FakeClock())
        opened.append(manager)
        return manager

    yield make
    for manager in opened:
        manager.shutdown(20)


def prefix(count: int, seed: int, model: str) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = chain_keys(rng.integers(0, 32000, size=count * TOKENS).tolist(), TOKENS,
                      Namespace(model=model, block_size=TOKENS))
    return keys, [rng.integers(0, 256, size=BLOCK, dtype=np.uint8).tobytes() for _ in keys]


def store(m: TieringManager, keys: Sequence[bytes], payloads: Sequence[bytes]) -> None:
    ctx = RequestContext(f"writer-{uuid4().hex}")
    plan = m.prepare_store(keys, ctx)
    assert plan is not None
    by_key = dict(zip(keys, payloads, strict=True))
    for key, slot in zip(plan.keys, plan.slots, strict=True):
        m.primary_view(slot)[:] = by_key[key]
    m.complete_store(plan.keys, ctx)
    m.on_request_finished(ctx)
    m.on_schedule_end()
    assert m.wait_idle(30)


def settle(m: TieringManager, keys: Sequence[bytes], ctx: RequestContext) -> int:
    for _ in range(8):
        answer = m.lookup_prefix(keys, ctx)
        if answer is not None:
            return answer
        m.on_schedule_end()
        assert m.wait_idle(30)
    raise AssertionError("lookup_prefix still pending after 8 steps")


def read(m: TieringManager, keys: Sequence[bytes], ctx: RequestContext) -> list[bytes]:
    plan = m.prepare_load(keys, ctx)
    try:
        return [bytes(m.primary_view(slot)) for slot in plan.slots]
    finally:
        m.complete_load(keys, ctx)
        m.on_request_finished(ctx)


def tier_counters(m: TieringManager) -> Any:
    return m.get_stats()["tiers"][m.tier_names[0]].counters


def test_the_slow_tier_is_declined_after_one_measured_load_and_the_fast_one_never(
        redis_server: ValkeyServer, slow_link: ThrottledProxy,
        managers: Callable[..., TieringManager]) -> None:
    model = f"decline-{uuid4().hex}"
    writer = managers(f"redis://127.0.0.1:{redis_server.port}/{DB}", model)
    first, first_bytes = prefix(4, 1, model)
    second, second_bytes = prefix(4, 2, model)
    store(writer, first, first_bytes)
    store(writer, second, second_bytes)

    fast = managers(f"redis://127.0.0.1:{redis_server.port}/{DB}", model,
                    prefill_tokens_per_s=PREFILL_TOKENS_PER_S)
    slow = managers(slow_link.url(DB), model, prefill_tokens_per_s=PREFILL_TOKENS_PER_S)
    for m in (fast, slow):
        # Nothing measured yet: the prior is optimistic, so the first prefix loads (measured).
        ctx = RequestContext(f"first-{uuid4().hex}")
        assert settle(m, first, ctx) == 4
        assert read(m, first, ctx) == first_bytes

    slow_block_s = slow.tiers[0].load_rate.cost().seconds(BLOCK)
    fast_block_s = fast.tiers[0].load_rate.cost().seconds(BLOCK)
    assert slow_block_s > RECOMPUTE_BLOCK_S > fast_block_s, (slow_block_s, fast_block_s)

    # The slow link's second prefix would load in ~1 s against 0.2 s to recompute: declined.
    ctx = RequestContext("second-slow")
    assert settle(slow, second, ctx) == 0
    slow.on_request_finished(ctx)
    counters = tier_counters(slow)
    assert counters.loads_declined == 1
    assert counters.load_keys == 4  # only the first, measured, prefix was ever loaded
    # The fast tier's is taken.
    ctx = RequestContext("second-fast")
    assert settle(fast, second, ctx) == 4
    assert read(fast, second, ctx) == second_bytes
    counters = tier_counters(fast)
    assert counters.loads_declined == 0 and counters.load_keys == 8


def test_the_declined_count_is_published_as_a_metric(
        redis_server: ValkeyServer, slow_link: ThrottledProxy,
        managers: Callable[..., TieringManager]) -> None:
    from kvtier.ops.metrics import tier_samples

    model = f"decline-{uuid4().hex}"
    writer = managers(f"redis://127.0.0.1:{redis_server.port}/{DB}", model)
    first, first_bytes = prefix(2, 3, model)
    second, second_bytes = prefix(2, 4, model)
    store(writer, first, first_bytes)
    store(writer, second, second_bytes)
    slow = managers(slow_link.url(DB), model, prefill_tokens_per_s=PREFILL_TOKENS_PER_S)
    ctx = RequestContext("measure")
    assert settle(slow, first, ctx) == 2
    read(slow, first, ctx)
    assert settle(slow, second, RequestContext("declined")) == 0
    stats = slow.get_stats()["tiers"][slow.tier_names[0]]
    assert tier_samples(stats, "1:redis", TOKENS)["loads_declined"] == {("1:redis",): 1}


def test_without_a_prefill_rate_the_slow_tier_is_still_used(
        redis_server: ValkeyServer, slow_link: ThrottledProxy,
        managers: Callable[..., TieringManager]) -> None:
    model = f"decline-{uuid4().hex}"
    writer = managers(f"redis://127.0.0.1:{redis_server.port}/{DB}", model)
    first, first_bytes = prefix(1, 5, model)
    second, second_bytes = prefix(1, 6, model)
    store(writer, first, first_bytes)
    store(writer, second, second_bytes)
    slow = managers(slow_link.url(DB), model)  # prefill_tokens_per_s unset: never declines
    for keys, payloads in ((first, first_bytes), (second, second_bytes)):
        ctx = RequestContext(uuid4().hex)
        assert settle(slow, keys, ctx) == 1
        assert read(slow, keys, ctx) == payloads
    assert tier_counters(slow).loads_declined == 0


@pytest.mark.parametrize("bad", [0, -5, "fast", float("nan"), 1e12])
def test_a_bad_prefill_rate_is_named_with_its_bounds(bad: object) -> None:
    from kvtier.settings import ConfigError

    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.prefill_tokens_per_s: "
                                          r"expected a finite number > 0\.0 and <= "
                                          r"1000000000\.0 \(tokens/s\), got"):
        open_manager({"block_bytes": BLOCK, "primary_bytes": BLOCK * 4,
                      "namespace": {"model": "m", "block_size": TOKENS},
                      "secondary_tiers": [{"url": "memory://", "prefill_tokens_per_s": bad}]})


def test_the_lookup_answers_the_fast_tiers_part_and_declines_the_slow_rest(
        redis_server: ValkeyServer, slow_link: ThrottledProxy) -> None:
    """Two tiers in lookup order, both with the prefill rate: the prefix's first two blocks are
    in the fast tier, the last two only behind the slow link. The answer is the fast part."""
    model = f"decline-{uuid4().hex}"
    direct = f"redis://127.0.0.1:{redis_server.port}"
    fast_db, slow_db = DB + 1, DB + 2
    opened: list[TieringManager] = []

    def make(*tiers: dict[str, Any]) -> TieringManager:
        manager = open_manager(
            {"block_bytes": BLOCK, "primary_bytes": BLOCK * 16,
             "namespace": {"model": model, "block_size": TOKENS},
             "secondary_tiers": list(tiers)}, clock=FakeClock())
        opened.append(manager)
        return manager

    try:
        measure, measure_bytes = prefix(2, 9, model)
        keys, payloads = prefix(4, 10, model)
        store(make({"url": f"{direct}/{slow_db}"}), [*measure, *keys], [*measure_bytes, *payloads])
        store(make({"url": f"{direct}/{fast_db}"}), keys[:2], payloads[:2])
        reader = make({"url": f"{direct}/{fast_db}", "name": "fast",
                       "prefill_tokens_per_s": PREFILL_TOKENS_PER_S},
                      {"url": slow_link.url(slow_db), "name": "slow",
                       "prefill_tokens_per_s": PREFILL_TOKENS_PER_S})
        ctx = RequestContext("measure")  # only the slow tier has it: its first, measured load
        assert settle(reader, measure, ctx) == 2
        read(reader, measure, ctx)
        ctx = RequestContext("partial")
        assert settle(reader, keys, ctx) == 2
        assert read(reader, keys[:2], ctx) == payloads[:2]
        tiers = reader.get_stats()["tiers"]
        assert tiers["fast"].counters.load_keys == 2
        assert tiers["fast"].counters.loads_declined == 0
        assert tiers["slow"].counters.load_keys == 2  # the measured prefix only
        assert tiers["slow"].counters.loads_declined == 1  # once, for the final answer
    finally:
        for manager in opened:
            manager.shutdown(20)
