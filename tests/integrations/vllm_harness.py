"""Helpers that drive vLLM's real ``TieringOffloadingManager`` the way its connector does.

No model is loaded: the tests play the engine's part (they write chunk bytes into the primary
region where the GPU->CPU copy would, and call the scheduler hooks in the connector's order), so
everything under test — vLLM's tiering manager, its primary tier and shared region, and
``KvtierTier`` with its real backend — is the production code.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from uuid import uuid4

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import ScheduleEndContext

from kvtier.integrations.vllm import KvtierOffloadingSpec, KvtierTier

PAGE_BYTES = 4096
TOKENS_PER_BLOCK = 16
END_OF_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def offloading_config(
    extra: dict[str, Any], *, model: str = "tiny-model", dtype: str = "float32",
    blocks_per_chunk: int = 1,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, ("layer.0",), 0),),
        worker_kv_bytes_per_block=PAGE_BYTES,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=f"kvtier-test-{uuid4().hex}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK,
                                    blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def tier_entry(url: str, **options: Any) -> dict[str, Any]:
    return {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "url": url,
            **options}


class Engine:
    """One scheduler-side tiering stack: vLLM's manager with one ``KvtierTier``."""

    def __init__(self, url: str, *, primary_chunks: int = 16, model: str = "tiny-model",
                 dtype: str = "float32", **tier_options: Any) -> None:
        extra = {
            "cpu_bytes_to_use": primary_chunks * PAGE_BYTES,
            "secondary_tiers": [tier_entry(url, **tier_options)],
        }
        self.spec = KvtierOffloadingSpec(offloading_config(extra, model=model, dtype=dtype))
        self.manager = self.spec.get_manager()
        tiers = self.manager.secondary_tiers
        assert len(tiers) == 1 and isinstance(tiers[0], KvtierTier)
        self.tier: KvtierTier = tiers[0]
        view = self.manager.primary_tier.get_kv_memoryview()
        self.primary = np.frombuffer(view, dtype=np.uint8).reshape(len(view), -1)

    def new_request(self) -> ReqContext:
        context = ReqContext(req_id=f"req-{uuid4().hex[:8]}")
        self.manager.on_new_request(context)
        return context

    def store(self, keys: Sequence[bytes], payloads: Sequence[bytes]) -> None:
        """What the connector does for freshly computed blocks: primary, then cascade."""
        context = self.new_request()
        prepared = self.manager.prepare_store(keys, context)
        assert prepared is not None
        by_key = dict(zip(keys, payloads, strict=True))
        for key, chunk in zip(prepared.keys_to_store, prepared.store_spec.chunk_ids,
                              strict=True):
            self.primary[chunk, :] = np.frombuffer(by_key[key], dtype=np.uint8)
        self.manager.complete_store(prepared.keys_to_store, context)
        self.manager.on_request_finished(context)
        self.settle()

    def settle(self) -> None:
        """Wait for every transfer this tier started and let the manager account for them."""
        self.tier.drain_jobs()
        # vLLM polls finished jobs at most once per step, and an earlier call in this step may
        # have used that poll already: end two steps, as a running engine would.
        self.manager.on_schedule_end(END_OF_STEP)
        self.manager.on_schedule_end(END_OF_STEP)

    def lookup_until_final(self, keys: Sequence[bytes], context: ReqContext,
                           max_steps: int = 6) -> list[LookupResult]:
        """Step like the scheduler until every key is HIT or MISS (bounded: never loops)."""
        results: list[LookupResult] = []
        for _ in range(max_steps):
            results = [self.manager.lookup(key, context) for key in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in results):
                return results
            self.manager.on_schedule_end(END_OF_STEP)
            # Private test hook of kvtier's lookup manager: wait for the probe just flushed.
            self.tier._tier.lookup_manager._wait_for_results(10.0)
            self.tier.drain_jobs()
        return results

    def chunk_of(self, key: bytes, context: ReqContext) -> int:
        spec = self.manager.prepare_load([key], context)
        chunk = int(spec.chunk_ids[0])
        self.manager.complete_load([key], context)
        return chunk

    def close(self) -> None:
        # Our numpy view exports the primary mmap; vLLM cannot unmap it while that exists.
        del self.primary
        self.manager.shutdown()


@contextmanager
def engine(url: str, **options: Any) -> Iterator[Engine]:
    stack = Engine(url, **options)
    try:
        yield stack
    finally:
        stack.close()


def random_keys(count: int) -> list[bytes]:
    return [make_offload_key(os.urandom(32), 0) for _ in range(count)]


def random_payloads(count: int) -> list[bytes]:
    return [os.urandom(PAGE_BYTES) for _ in range(count)]
