"""Redis Cluster faults with a real 3-primary cluster: with replicas, killing a primary costs at
most the failover time and the tier recovers by itself; without replicas (and
``cluster-require-full-coverage no``), a dead node costs only the keys it held."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any
from uuid import uuid4

from kvtier.backends import Backend, open_backend
from kvtier.keys import Namespace

BLOCK = 1024
KEYS = 90
FAST = {"socket_timeout_s": 0.5, "connect_timeout_s": 0.5}


def _keys() -> list[bytes]:
    return [uuid4().bytes for _ in range(KEYS)]


def _payload(key: bytes) -> bytes:
    return (key * (BLOCK // len(key) + 1))[:BLOCK]


def _loaded(backend: Backend, keys: Sequence[bytes]) -> list[bool]:
    outs = [memoryview(bytearray(BLOCK)) for _ in keys]
    results = backend.get_many(keys, outs)
    return [ok is True and bytes(out) == _payload(key)
            for key, ok, out in zip(keys, results, outs, strict=True)]


def _held_by(node: Any, keys: Sequence[bytes]) -> set[bytes]:
    client = node.client()
    try:
        names = {name.decode() for name in client.keys("*")}
    finally:
        client.close()
    return {key for key in keys if any(name.endswith(key.hex()) for name in names)}


def test_killing_a_primary_costs_at_most_the_failover_time(
        redis_cluster_factory: Callable[..., Any]) -> None:
    cluster = redis_cluster_factory(masters=3, replicas=1, node_timeout_ms=1000)
    backend = open_backend(cluster.url, Namespace(model=f"failover-{uuid4().hex}"), **FAST)
    try:
        keys = _keys()
        assert backend.put_many(keys, [_payload(key) for key in keys]) == [True] * KEYS
        for master in cluster.masters:  # every write reached the replica before the crash
            client = master.client()
            try:
                assert client.execute_command("WAIT", 1, 5000) == 1
            finally:
                client.close()
        victim = cluster.masters[0]
        lost = _held_by(victim, keys)
        assert 0 < len(lost) < KEYS
        victim.kill()
        killed = time.monotonic()
        recovered_s = None
        while time.monotonic() - killed < 60:  # each round is bounded by the socket timeouts
            loaded = _loaded(backend, keys)  # a batch touching the dead primary fails whole
            if all(loaded):
                recovered_s = time.monotonic() - killed
                break
        assert recovered_s is not None, "the tier never recovered after the failover"
        print(f"recovered {recovered_s:.2f} s after the primary was killed")
        # Failover = node timeout + election (a few hundred ms); slack for a loaded machine.
        assert recovered_s < cluster.node_timeout_s + 15
        new_keys = _keys()  # and writes land again, without reopening the backend
        assert backend.put_many(new_keys, [_payload(key) for key in new_keys]) == [True] * KEYS
        assert all(_loaded(backend, new_keys))
    finally:
        backend.close()


def test_a_dead_node_without_replica_costs_only_its_keys(
        redis_cluster_factory: Callable[..., Any]) -> None:
    cluster = redis_cluster_factory(masters=3, node_timeout_ms=1000, full_coverage=False)
    backend = open_backend(cluster.url, Namespace(model=f"partial-{uuid4().hex}"), **FAST)
    try:
        keys = _keys()
        assert backend.put_many(keys, [_payload(key) for key in keys]) == [True] * KEYS
        victim = cluster.masters[1]
        lost = _held_by(victim, keys)
        assert 0 < len(lost) < KEYS
        victim.kill()
        started = time.monotonic()
        # One key per call: a pipeline batch that touches the dead node fails as a whole
        # (redis-py raises for the batch), so per-key loads show which keys the node cost.
        loaded = [_loaded(backend, [key])[0] for key in keys]
        assert time.monotonic() - started < 60  # a dead node never hangs a call
        assert {key for key, ok in zip(keys, loaded, strict=True) if not ok} == lost
        # once the cluster marks the node failed, the survivors still take writes
        deadline = time.monotonic() + 30
        fresh = _keys()
        stored = [backend.put_many([key], [_payload(key)])[0] for key in fresh]
        assert sum(ok is True for ok in stored) >= KEYS // 2
        assert time.monotonic() < deadline
    finally:
        backend.close()
