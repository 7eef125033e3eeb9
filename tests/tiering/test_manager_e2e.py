"""End to end through the TieringManager with real backends: files, Redis/Valkey (standalone and
Cluster) and an S3-compatible server, all started by the test session on loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np
import pytest

from kvtier.factory import open_manager
from kvtier.keys import Namespace, RequestContext, chain_keys
from kvtier.tiering.manager import KeyStatus, PromotionFailed, TieringManager

BLOCK = 16 * 1024
KINDS = ["file", "redis", "redis_cluster", "s3"]
_SERVER_FIXTURES = {"redis": "redis_server", "redis_cluster": "redis_cluster", "s3": "s3_server"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tier_url(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], str]:
    """``tier_url(kind)``: a URL of a fresh, private place in a real backend of that kind."""
    prefix = f"e2e-{uuid4().hex}"

    def url(kind: str) -> str:
        if kind == "file":
            return f"file://{tmp_path / 'tier'}"
        server = request.getfixturevalue(_SERVER_FIXTURES[kind])
        if kind == "s3":
            result: str = server.url(prefix)
            return result
        return str(server.url)

    return url


@pytest.fixture
def managers() -> Iterator[Callable[..., TieringManager]]:
    opened: list[TieringManager] = []

    def make(url: str, model: str, *, slots: int = 4, clock: Any = None,
             lookup: dict[str, Any] | None = None, **config: Any) -> TieringManager:
        tier: dict[str, Any] = {"url": url}
        if lookup:
            tier["lookup"] = lookup
        manager = open_manager(
            {"block_bytes": BLOCK, "primary_bytes": BLOCK * slots,
             "namespace": {"model": model}, "secondary_tiers": [tier], **config},
            clock=clock if clock is not None else FakeClock())
        opened.append(manager)
        return manager

    yield make
    for manager in opened:
        manager.shutdown(20)


def blocks(count: int, seed: int, namespace_model: str) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    keys = chain_keys(rng.integers(0, 32000, size=count * 16).tolist(), 16,
                      Namespace(model=namespace_model))
    payloads = [rng.integers(0, 256, size=BLOCK, dtype=np.uint8).tobytes() for _ in keys]
    return keys, payloads


def store(m: TieringManager, keys: Sequence[bytes], payloads: Sequence[bytes],
          ctx: RequestContext) -> None:
    plan = m.prepare_store(keys, ctx)
    assert plan is not None
    by_key = dict(zip(keys, payloads, strict=True))
    for key, slot in zip(plan.keys, plan.slots, strict=True):
        m.primary_view(slot)[:] = by_key[key]
    m.complete_store(plan.keys, ctx)


def step(m: TieringManager) -> None:
    m.on_schedule_end()
    assert m.wait_idle(30)


def settle(m: TieringManager, keys: Sequence[bytes], ctx: RequestContext,
           max_steps: int = 6) -> int:
    """Ask lookup_prefix every step until it answers; the bound is the no-livelock check."""
    for _ in range(max_steps):
        answer = m.lookup_prefix(keys, ctx)
        if answer is not None:
            return answer
        step(m)
    raise AssertionError(f"lookup_prefix still pending after {max_steps} steps")


def load(m: TieringManager, keys: Sequence[bytes], ctx: RequestContext) -> list[bytes]:
    plan = m.prepare_load(keys, ctx)
    try:
        return [bytes(m.primary_view(slot)) for slot in plan.slots]
    finally:
        m.complete_load(keys, ctx)


def finish(m: TieringManager, *ctxs: RequestContext) -> None:
    for ctx in ctxs:
        m.on_request_finished(ctx)
    step(m)
    stats = m.get_stats()
    assert stats["tracked_keys"] == 0
    assert stats["pins"] == 0
    assert stats["outstanding_jobs"] == 0
    assert stats["pending_promotions"] == 0
    assert stats["manager"]["invariant_violations"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_store_evict_promote_returns_exact_bytes(
        kind: str, tier_url: Callable[[str], str],
        managers: Callable[..., TieringManager]) -> None:
    model = f"test-{uuid4().hex}"
    m = managers(tier_url(kind), model, slots=4)
    keys, payloads = blocks(8, 1, model)
    writer = RequestContext("writer")
    store(m, keys[:4], payloads[:4], writer)
    step(m)
    store(m, keys[4:], payloads[4:], writer)  # evicts the first four from the primary
    step(m)
    assert all(m.lookup(key, writer) is not KeyStatus.HIT for key in keys[:4])
    reader = RequestContext("reader")
    assert settle(m, keys[:4], reader) == 4
    assert load(m, keys[:4], reader) == payloads[:4]
    tier = m.get_stats()["tiers"][m.tier_names[0]]
    assert tier["load_keys"] == 4 and tier["load_keys_failed"] == 0
    finish(m, writer, reader)


@pytest.mark.parametrize("kind", KINDS)
def test_two_managers_sharing_a_tier_see_each_others_blocks(
        kind: str, tier_url: Callable[[str], str],
        managers: Callable[..., TieringManager]) -> None:
    model = f"test-{uuid4().hex}"
    url = tier_url(kind)
    first, second = managers(url, model), managers(url, model)
    keys, payloads = blocks(4, 2, model)
    a, b = RequestContext("a"), RequestContext("b")
    store(first, keys[:2], payloads[:2], a)
    step(first)
    store(second, keys[2:], payloads[2:], b)
    step(second)
    assert settle(second, keys[:2], b) == 2
    assert load(second, keys[:2], b) == payloads[:2]
    assert settle(first, keys[2:], a) == 2
    assert load(first, keys[2:], a) == payloads[2:]
    other = managers(url, f"other-{uuid4().hex}")  # another model never sees them
    assert settle(other, keys, RequestContext("c")) == 0
    finish(first, a)
    finish(second, b)


@pytest.mark.parametrize("kind", KINDS)
def test_n_requests_coalesce_to_one_transfer(
        kind: str, tier_url: Callable[[str], str],
        managers: Callable[..., TieringManager]) -> None:
    model = f"test-{uuid4().hex}"
    url = tier_url(kind)
    writer_manager = managers(url, model)
    keys, payloads = blocks(4, 3, model)
    w = RequestContext("w")
    store(writer_manager, keys, payloads, w)
    step(writer_manager)
    m = managers(url, model, slots=8)
    requests = [RequestContext(f"r{i}") for i in range(16)]
    for _ in range(6):
        answers = [m.lookup_prefix(keys, ctx) for ctx in requests]
        if all(answer is not None for answer in answers):
            break
        step(m)
    assert answers == [4] * len(requests)
    for ctx in requests:
        assert load(m, keys, ctx) == payloads
    tier = m.get_stats()["tiers"][m.tier_names[0]]
    assert tier["backend_calls"] == 1  # one exists() batch for 16 requests x 4 keys
    assert tier["loads_submitted"] == 1  # one get_many
    assert tier["load_keys"] == 4
    finish(m, *requests)
    finish(writer_manager, w)


def corrupt(m: TieringManager, kind: str, key: bytes, request: pytest.FixtureRequest) -> None:
    backend: Any = m.tiers[0].backend
    if kind == "file":
        path = backend.path_for(key)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif kind == "s3":
        client = request.getfixturevalue("s3_server").raw_client()
        bucket = request.getfixturevalue("s3_server").bucket
        name = backend.object_name(key)
        raw = bytearray(client.get_object(Bucket=bucket, Key=name)["Body"].read())
        raw[-1] ^= 0xFF
        client.put_object(Bucket=bucket, Key=name, Body=bytes(raw))
    else:
        raw = bytearray(backend._raw_read(key))
        raw[-1] ^= 0xFF
        backend._raw_write(key, bytes(raw))


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_block_is_recomputed_without_livelock(
        kind: str, tier_url: Callable[[str], str], request: pytest.FixtureRequest,
        managers: Callable[..., TieringManager]) -> None:
    model = f"test-{uuid4().hex}"
    url = tier_url(kind)
    writer_manager = managers(url, model)
    keys, payloads = blocks(3, 4, model)
    w = RequestContext("w")
    store(writer_manager, keys, payloads, w)
    step(writer_manager)
    m = managers(url, model, slots=4)
    corrupt(m, kind, keys[1], request)
    reader = RequestContext("reader")
    assert settle(m, keys, reader) == 1  # the good prefix survives the bad block
    assert load(m, keys[:1], reader) == payloads[:1]
    assert PromotionFailed((keys[1],), m.tier_names[0]) in m.take_events()
    for _ in range(4):  # the doomed load is not retried
        assert m.lookup_prefix(keys, reader) == 1
        step(m)
    tier = m.get_stats()["tiers"][m.tier_names[0]]
    assert tier["load_keys_failed"] == 1
    assert tier["backend_corrupt_objects"] == 1
    # the engine recomputes the block and stores it again: it is whole once more
    store(m, keys[1:2], payloads[1:2], reader)
    step(m)
    fresh = managers(url, model, slots=4)
    assert settle(fresh, keys, RequestContext("later")) == 3
    assert load(fresh, keys, RequestContext("later")) == payloads
    finish(m, reader)
    finish(fresh, RequestContext("later"))
    finish(writer_manager, w)


def test_backend_killed_mid_run_degrades_to_misses_and_recovers(
        redis_server: Any, managers: Callable[..., TieringManager]) -> None:
    model = f"test-{uuid4().hex}"
    clock = FakeClock()
    lookup = {"breaker_threshold": 2, "breaker_cooldown_s": 5.0, "quarantine_s": 5.0}
    m = managers(redis_server.url, model, slots=4, clock=clock, lookup=lookup)
    keys, payloads = blocks(6, 5, model)
    w, r = RequestContext("w"), RequestContext("r")
    store(m, keys[:2], payloads[:2], w)
    step(m)
    for key in keys[:2]:
        m.pool.discard(key)
    # our own store taught the lookup manager: the promotions start (queued) at once
    assert m.lookup_prefix(keys[:2], r) is None
    assert m.get_stats()["pending_promotions"] == 2
    try:
        redis_server.stop()
        step(m)  # the loads run against a dead server
        assert settle(m, keys[:2], r) == 0
        failed = [e for e in m.take_events() if isinstance(e, PromotionFailed)]
        assert sorted(key for e in failed for key in e.keys) == sorted(keys[:2])
        outage = RequestContext("outage")
        for _ in range(3):  # new probes fail -> False; the breaker opens
            assert settle(m, keys[2:4], outage) == 0
            m.on_request_finished(outage)
        store(m, keys[2:3], payloads[2:3], outage)  # its cascade fails, safely
        step(m)
        tier = m.get_stats()["tiers"][m.tier_names[0]]
        assert tier["breaker_state"] == "open"
        assert tier["store_keys_failed"] >= 1
    finally:
        redis_server.start()
    clock.now += 10.0  # past the breaker cool-down and the quarantine
    writer = managers(redis_server.url, model)
    store(writer, keys[4:], payloads[4:], w)
    step(writer)
    after = RequestContext("after")
    assert settle(m, keys[4:], after, max_steps=8) == 2
    assert load(m, keys[4:], after) == payloads[4:]
    assert m.get_stats()["tiers"][m.tier_names[0]]["breaker_state"] == "closed"
    finish(m, w, r, outage, after)
    finish(writer, w)


def test_write_back_to_s3_flushes_at_shutdown(
        tier_url: Callable[[str], str], managers: Callable[..., TieringManager]) -> None:
    model = f"test-{uuid4().hex}"
    url = tier_url("s3")
    m = managers(url, model, slots=4, write_policy="write_back")
    keys, payloads = blocks(3, 6, model)
    store(m, keys, payloads, RequestContext("w"))
    step(m)
    assert m.tiers[0].backend.exists(keys) == [False] * 3
    m.on_request_finished(RequestContext("w"))
    m.shutdown(20)
    other = managers(url, model)
    ctx = RequestContext("r")
    assert settle(other, keys, ctx) == 3
    assert load(other, keys, ctx) == payloads
    finish(other, ctx)
