"""S3 backend tests against a real SeaweedFS server (the session's ``s3_server``).

Faults come from real parts: objects rewritten with a raw S3 client, the server stopped and
restarted, and a real TCP relay (``_GateRelay``) between the backend and the server that can hold
requests (to observe concurrency and to close the backend mid-batch) or swallow them (a server
that accepts connections and never answers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier import codec
from kvtier.backends import BackendClosedError, BackendUnavailableError, OpenMode, open_backend
from kvtier.backends.s3 import PutMode, S3Backend
from kvtier.keys import Namespace
from servers.seaweed import SeaweedServer


def _namespace() -> Namespace:
    return Namespace(model=f"test-{uuid.uuid4().hex}")


def _keys(count: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(count)]


def _payloads(count: int, size: int = 3000) -> list[bytes]:
    return [os.urandom(size + index) for index in range(count)]


def _outs(payloads: list[bytes]) -> list[memoryview]:
    return [memoryview(bytearray(len(payload))) for payload in payloads]


def _open(url: str, namespace: Namespace, **options: Any) -> S3Backend:
    opened = open_backend(url, namespace, **options)
    if not isinstance(opened, S3Backend):
        raise TypeError(f"open_backend gave {type(opened).__name__}, expected S3Backend")
    return opened


@pytest.fixture
def backend(s3_server: SeaweedServer) -> Iterator[S3Backend]:
    opened = _open(s3_server.url("kvtier-tests"), _namespace(), timeout_s=3)
    try:
        yield opened
    finally:
        opened.close()


# --------------------------------------------------------------------------- URL and options


def test_url_parts_and_options_are_parsed(s3_server: SeaweedServer) -> None:
    ns = _namespace()
    with _open(
        f"s3://{s3_server.bucket}/a/b%20c/?endpoint_url={s3_server.endpoint_url}"
        "&region=eu-west-1&max_concurrency=7&timeout_s=1.5&put_mode=head-then-put",
        ns,
    ) as opened:
        settings = opened.settings
        assert settings.bucket == s3_server.bucket
        assert settings.prefix == "a/b c"
        assert settings.endpoint_url == s3_server.endpoint_url
        assert settings.region == "eu-west-1"
        assert settings.max_concurrency == 7
        assert settings.timeout_s == 1.5
        assert settings.put_mode is PutMode.HEAD_THEN_PUT
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in opened.url
        key = bytes(range(16))
        assert opened.object_name(key) == f"a/b c/{ns.digest_hex}/{key.hex()}"
        # The canonical URL opens an equivalent backend.
        with _open(opened.url, ns) as again:
            assert again.settings.endpoint_url == settings.endpoint_url
            assert again.settings.prefix == settings.prefix


def test_options_as_keywords(s3_server: SeaweedServer) -> None:
    with _open(
        f"s3://{s3_server.bucket}",
        _namespace(),
        endpoint_url=s3_server.endpoint_url,
        max_concurrency=3,
        timeout_s=2,
        put_mode="if-none-match",
    ) as opened:
        assert opened.settings.prefix == ""
        assert opened.settings.max_concurrency == 3
        assert opened.settings.put_mode is PutMode.IF_NONE_MATCH
        assert opened.object_name(b"\x01").startswith(opened.namespace.digest_hex + "/")


@pytest.mark.parametrize(
    ("url", "options", "expected"),
    [
        ("s3://", {}, "no bucket"),
        ("s3:///prefix", {}, "no bucket"),
        ("s3://Bad_Bucket!", {}, "'Bad_Bucket!'"),
        ("s3://bucket:9000/p", {}, "has a port"),
        ("s3://AKIA:hunter2@bucket/p", {}, "must not carry credentials"),
        ("s3://bucket/p?colour=blue", {}, "'s3.colour'"),
        ("s3://bucket/p", {"colour": "blue"}, "'s3.colour'"),
        ("s3://bucket/p?aws_secret_access_key=hunter2", {}, "'s3.aws_secret_access_key'"),
        ("s3://bucket/p?region=x&region=y", {}, "twice"),
        ("s3://bucket/p?region=x", {"region": "y"}, "both"),
        ("s3://bucket/p?endpoint_url=ftp://host:21", {}, "'ftp'"),
        ("s3://bucket/p?endpoint_url=http://u:hunter2@host:1", {}, "must not carry credentials"),
        ("s3://bucket/p?endpoint_url=http://host:99999", {}, "endpoint_url"),
        ("s3://bucket/p?endpoint_url=http://host/path", {}, "must not have a path"),
        ("s3://bucket/p?max_concurrency=0", {},
         "max_concurrency: expected an integer >= 1 and <= 1024, got '0'"),
        ("s3://bucket/p?max_concurrency=many", {},
         "expected an integer >= 1 and <= 1024, got 'many'"),
        ("s3://bucket/p?timeout_s=-1", {},
         "timeout_s: expected a finite number > 0 and <= 3600.0 (s), got '-1'"),
        ("s3://bucket/p?timeout_s=0", {},
         "timeout_s: expected a finite number > 0 and <= 3600.0 (s), got '0'"),
        ("s3://bucket/p?put_mode=sometimes", {},
         "put_mode: expected one of 'if_none_match', 'head_then_put', got 'sometimes'"),
        ("s3://bucket/p?region=eu%20west", {}, "region='eu west'"),
        ("s3://bucket/a/../b", {}, "'..'"),
        ("s3://bucket/a//b", {}, "empty"),
        ("s3://bucket/p#frag", {}, "fragment"),
        ("s4://bucket/p", {}, "s4"),
    ],
)
def test_bad_url_or_option_names_the_bad_part(
    url: str, options: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        open_backend(url, _namespace(), **options)
    message = str(caught.value)
    assert expected in message
    assert "hunter2" not in message


# --------------------------------------------------------------------------- basic behaviour


def test_round_trip_exists_delete(backend: S3Backend, s3_server: SeaweedServer) -> None:
    keys, payloads = _keys(12), _payloads(12)
    assert backend.exists(keys) == [False] * 12
    assert backend.put_many(keys, payloads) == [True] * 12
    assert backend.exists([*keys, os.urandom(16)]) == [True] * 12 + [False]
    outs = _outs(payloads)
    assert backend.get_many(keys, outs) == [True] * 12
    assert [bytes(out) for out in outs] == payloads
    # One object per block, holding exactly the codec frame.
    raw = s3_server.raw_client()
    body = raw.get_object(Bucket=s3_server.bucket, Key=backend.object_name(keys[0]))["Body"]
    assert body.read() == bytes(codec.encode(backend.namespace.digest, keys[0], payloads[0]))
    backend.delete([*keys[:4], os.urandom(16)])  # an absent key is a no-op
    assert backend.exists(keys) == [False] * 4 + [True] * 8
    stats = backend.stats()
    assert stats["errors"] == 0
    assert stats["bytes_written"] == sum(len(p) for p in payloads)  # payload bytes
    # 12 HEAD + 12 PUT + 13 HEAD + 12 GET + 1 bulk DELETE + 12 HEAD
    assert stats["round_trips"] == 62


def test_empty_batches_make_no_requests(backend: S3Backend) -> None:
    assert backend.exists([]) == []
    assert backend.put_many([], []) == []
    assert backend.get_many([], []) == []
    backend.delete([])
    assert backend.stats()["round_trips"] == 0


def test_caller_may_reuse_its_buffers_after_put(backend: S3Backend) -> None:
    key = os.urandom(16)
    buffer = bytearray(os.urandom(5000))
    original = bytes(buffer)
    assert backend.put_many([key], [memoryview(buffer)]) == [True]
    buffer[:] = bytes(len(buffer))
    out = memoryview(bytearray(len(buffer)))
    assert backend.get_many([key], [out]) == [True]
    assert bytes(out) == original


def test_wrong_size_out_is_false_and_object_is_replaceable(backend: S3Backend) -> None:
    """A valid frame of another length is removed, so the next store replaces it (it was kept,
    and locked its key for good)."""
    key, payload = os.urandom(16), os.urandom(4096)
    assert backend.put_many([key], [payload]) == [True]
    short = bytearray(b"\xaa" * 4095)
    assert backend.get_many([key], [memoryview(short)]) == [False]
    assert short == bytearray(b"\xaa" * 4095)
    assert backend.exists([key]) == [False]
    assert backend.stats()["size_mismatches"] == 1
    assert backend.stats()["corrupt_objects"] == 0


def test_namespaces_are_isolated(s3_server: SeaweedServer) -> None:
    url = s3_server.url("kvtier-tests")
    with (
        _open(url, _namespace()) as first,
        _open(url, _namespace()) as second,
    ):
        key, payload = os.urandom(16), os.urandom(2048)
        assert first.put_many([key], [payload]) == [True]
        assert second.exists([key]) == [False]
        out = memoryview(bytearray(2048))
        assert second.get_many([key], [out]) == [False]
        assert bytes(out) == bytes(2048)
        assert first.object_name(key) != second.object_name(key)
        # The second namespace stores its own block under the same key, side by side.
        other = os.urandom(2048)
        assert second.put_many([key], [other]) == [True]
        assert first.get_many([key], [out]) == [True]
        assert bytes(out) == payload
        assert second.get_many([key], [out]) == [True]
        assert bytes(out) == other


# --------------------------------------------------------------------------- corrupt objects


def _flip_payload_byte(frame: bytes, _other: bytes) -> bytes:
    damaged = bytearray(frame)
    damaged[codec.HEADER_BYTES + 100] ^= 0x10
    return bytes(damaged)


def _flip_header_byte(frame: bytes, _other: bytes) -> bytes:
    damaged = bytearray(frame)
    damaged[9] ^= 0x01  # inside the payload length field
    return bytes(damaged)


def _truncate(frame: bytes, _other: bytes) -> bytes:
    return frame[: len(frame) - 7]


def _other_namespace(_frame: bytes, other: bytes) -> bytes:
    return other


def _garbage(frame: bytes, _other: bytes) -> bytes:
    return os.urandom(len(frame))


def _empty(_frame: bytes, _other: bytes) -> bytes:
    return b""


@pytest.mark.parametrize(
    "damage",
    [_flip_payload_byte, _flip_header_byte, _truncate, _other_namespace, _garbage, _empty],
)
def test_corrupt_object_is_false_counted_and_deleted(
    backend: S3Backend, s3_server: SeaweedServer, damage: Any
) -> None:
    keys, payloads = _keys(3), _payloads(3, size=1024)
    assert backend.put_many(keys, payloads) == [True] * 3
    raw = s3_server.raw_client()
    name = backend.object_name(keys[1])
    frame = raw.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read()
    foreign = bytes(codec.encode(_namespace().digest, keys[1], payloads[1]))
    raw.put_object(Bucket=s3_server.bucket, Key=name, Body=damage(frame, foreign))

    sentinel = b"\x5a" * len(payloads[1])
    outs = _outs(payloads)
    outs[1][:] = sentinel
    assert backend.get_many(keys, outs) == [True, False, True]
    assert bytes(outs[1]) == sentinel  # nothing of the bad object reached the caller
    assert [bytes(outs[0]), bytes(outs[2])] == [payloads[0], payloads[2]]
    assert backend.stats()["corrupt_objects"] == 1
    with pytest.raises(Exception, match=r"404|Not Found"):
        raw.head_object(Bucket=s3_server.bucket, Key=name)
    # The slot is free again: a fresh put stores a good block.
    assert backend.put_many([keys[1]], [payloads[1]]) == [True]
    assert backend.get_many([keys[1]], [outs[1]]) == [True]
    assert bytes(outs[1]) == payloads[1]


def test_good_block_stored_after_the_corrupt_read_is_not_deleted(
    backend: S3Backend, s3_server: SeaweedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader GETs a corrupt object; before it deletes it, another reader removes it and a
    writer stores the good block (the conditional PUT succeeds on the free name). The first
    reader's delete must spare that good block. The wrapper around ``codec.FrameCodec.decode`` only
    pins that interleaving (a real server cannot be paused between our GET and DELETE); server,
    objects and deletes are real."""
    keys, payloads = _keys(1), _payloads(1, size=1024)
    name = backend.object_name(keys[0])
    raw = s3_server.raw_client()
    good = bytes(codec.encode(backend.namespace.digest, keys[0], payloads[0]))
    raw.put_object(Bucket=s3_server.bucket, Key=name, Body=_flip_payload_byte(good, b""))
    writer = _open(s3_server.url("kvtier-tests"), backend.namespace, timeout_s=3)
    real_decode = codec.FrameCodec.decode

    def decode_then_race(self: Any, frame: Any, key: bytes, out: memoryview, **kw: Any) -> None:
        try:
            real_decode(self, frame, key, out, **kw)
        except codec.FrameError:
            raw.delete_object(Bucket=s3_server.bucket, Key=name)  # someone dropped it ...
            assert writer.put_many(keys, payloads) == [True]  # ... and the block came back
            raise

    monkeypatch.setattr(codec.FrameCodec, "decode", decode_then_race)
    try:
        outs = _outs(payloads)
        assert backend.get_many(keys, outs) == [False]
        monkeypatch.undo()
        assert backend.stats()["corrupt_objects"] == 1
        assert raw.get_object(Bucket=s3_server.bucket, Key=name)["Body"].read() == good
        assert backend.get_many(keys, outs) == [True] and bytes(outs[0]) == payloads[0]
    finally:
        writer.close()


# --------------------------------------------------------------------------- put-if-absent


@pytest.mark.parametrize("put_mode", ["if-none-match", "head-then-put"])
def test_put_never_overwrites(s3_server: SeaweedServer, put_mode: str) -> None:
    with _open(s3_server.url("kvtier-tests"), _namespace(), put_mode=put_mode) as opened:
        key = os.urandom(16)
        first, second = os.urandom(3000), os.urandom(3000)
        assert opened.put_many([key], [first]) == [True]
        etag = s3_server.raw_client().head_object(
            Bucket=s3_server.bucket, Key=opened.object_name(key)
        )["ETag"]
        assert opened.put_many([key], [second]) == [True]
        assert opened.stats()["puts_existing"] == 1
        assert (
            s3_server.raw_client().head_object(
                Bucket=s3_server.bucket, Key=opened.object_name(key)
            )["ETag"]
            == etag
        )
        out = memoryview(bytearray(3000))
        assert opened.get_many([key], [out]) == [True]
        assert bytes(out) == first


def test_racing_conditional_puts_store_exactly_one_block(s3_server: SeaweedServer) -> None:
    """Writers released together by a barrier; the server's If-None-Match picks one winner."""
    ns = _namespace()
    writers = 6
    backends = [_open(s3_server.url("kvtier-tests"), ns) for _ in range(writers)]
    try:
        key = os.urandom(16)
        payloads = _payloads(writers, size=200_000)
        barrier = threading.Barrier(writers)
        results: list[list[bool]] = [[] for _ in range(writers)]

        def write(index: int) -> None:
            barrier.wait(timeout=30)
            results[index] = backends[index].put_many([key], [payloads[index]])

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results == [[True]] * writers
        already = sum(b.stats()["puts_existing"] for b in backends)
        assert already == writers - 1
        # Each payload has its own length: the stored object's names the winner (a get of
        # another length would remove the object).
        size = s3_server.raw_client().head_object(
            Bucket=s3_server.bucket, Key=backends[0].object_name(key))["ContentLength"]
        [stored] = [b for b in payloads if len(b) == size - codec.HEADER_BYTES]
        out = memoryview(bytearray(len(stored)))
        assert backends[0].get_many([key], [out]) == [True]
        assert bytes(out) == stored
    finally:
        for opened in backends:
            opened.close()


# --------------------------------------------------------------------------- faults


def test_server_stopped_then_restarted(
    s3_server: SeaweedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.backends.s3")
    with _open(s3_server.url("kvtier-tests"), _namespace(), timeout_s=2) as opened:
        keys, payloads = _keys(6), _payloads(6)
        assert opened.put_many(keys[:3], payloads[:3]) == [True] * 3
        s3_server.stop()
        try:
            started = time.monotonic()
            assert opened.exists(keys) == [False] * 6
            assert opened.put_many(keys[3:], payloads[3:]) == [False] * 3
            outs = _outs(payloads)
            for out in outs:
                out[:] = b"\x77" * len(out)
            assert opened.get_many(keys, outs) == [False] * 6
            assert all(bytes(out) == b"\x77" * len(out) for out in outs)
            opened.delete(keys[:1])  # no raise either
            # probe() tells "unknown" from "absent": the lookup manager must not cache this.
            with pytest.raises(BackendUnavailableError, match="existence check"):
                opened.probe(keys)
            elapsed = time.monotonic() - started
            assert opened.stats()["errors"] >= 4
            # Many failed requests, one log line: the rest are counted, not printed.
            warnings = [r for r in caplog.records if r.name == "kvtier.backends.s3"]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            assert "failed" in warnings[0].getMessage()
            assert elapsed < 20, f"calls against a dead server took {elapsed:.1f}s"
        finally:
            s3_server.start()
        # Same backend object, no reopen: works as soon as the server is back.
        assert opened.exists(keys) == [True] * 3 + [False] * 3
        assert opened.probe(keys) == [True] * 3 + [False] * 3
        assert opened.put_many(keys[3:], payloads[3:]) == [True] * 3
        outs = _outs(payloads)
        assert opened.get_many(keys, outs) == [True] * 6
        assert [bytes(out) for out in outs] == payloads


class _GateRelay:
    """A real TCP relay in front of the S3 server.

    While ``gate`` is closed every new connection's first request is held (not forwarded) and
    counted in ``holding``; ``reached`` is set once ``expect`` requests are held and
    ``exceeded`` if more arrive. With ``forward=False`` nothing is ever answered (a hung
    server). Threads: one acceptor plus two pumps per connection, all daemon, all stopped by
    ``close()``.
    """

    def __init__(self, upstream_port: int, *, expect: int, forward: bool = True) -> None:
        self.gate = threading.Event()
        self.reached = threading.Event()
        self.exceeded = threading.Event()
        self.holding = 0
        self.peak = 0
        self._expect = expect
        self._forward = forward
        self._upstream_port = upstream_port
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            first = client.recv(1 << 16)
            if not first:
                return
            with self._lock:
                self.holding += 1
                self.peak = max(self.peak, self.holding)
                if self.holding >= self._expect:
                    self.reached.set()
                if self.holding > self._expect:
                    self.exceeded.set()
            self.gate.wait()
            with self._lock:
                self.holding -= 1
            if not self._forward:
                while client.recv(1 << 16):
                    pass
                return
            upstream = socket.create_connection(("127.0.0.1", self._upstream_port))
            with self._lock:
                self._sockets.append(upstream)
            upstream.sendall(first)
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
            self._pump(client, upstream)
        except OSError:
            return

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.gate.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _relayed_backend(
    s3_server: SeaweedServer, relay: _GateRelay, namespace: Namespace, **options: Any
) -> S3Backend:
    return _open(
        f"s3://{s3_server.bucket}/kvtier-tests",
        namespace,
        endpoint_url=relay.endpoint_url,
        region=s3_server.region,
        mode=OpenMode.INSPECT,  # no namespace-manifest PUT: the relay counts every request
        **options,
    )


def test_concurrency_is_bounded(s3_server: SeaweedServer) -> None:
    """The relay holds requests; with max_concurrency=4 only 4 of 24 HEADs may be sent.

    The "no fifth request" check waits a bounded 0.5 s: it can only pass wrongly (a fifth
    request arriving late), never fail wrongly.
    """
    ns = _namespace()
    keys = _keys(24)
    with _open(s3_server.url("kvtier-tests"), ns) as direct:
        assert direct.put_many(keys[:10], _payloads(10, size=100)) == [True] * 10
    relay = _GateRelay(s3_server.port, expect=4)
    limited = _relayed_backend(s3_server, relay, ns, max_concurrency=4, timeout_s=30)
    try:
        results: list[bool] = []
        worker = threading.Thread(target=lambda: results.extend(limited.exists(keys)))
        worker.start()
        assert relay.reached.wait(timeout=20), f"only {relay.holding} requests arrived"
        assert not relay.exceeded.wait(timeout=0.5), f"{relay.holding} requests in flight"
        relay.gate.set()
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert results == [True] * 10 + [False] * 14
        assert relay.peak == 4
        assert limited.stats()["peak_in_flight"] == 4
    finally:
        limited.close()
        relay.close()


def test_hung_server_times_out_without_hanging(s3_server: SeaweedServer) -> None:
    """A relay that accepts connections and never answers: every call returns False in time."""
    relay = _GateRelay(s3_server.port, expect=1, forward=False)
    hung = _relayed_backend(s3_server, relay, _namespace(), max_concurrency=4, timeout_s=0.5)
    try:
        keys, payloads = _keys(10), _payloads(10)
        started = time.monotonic()
        assert hung.exists(keys) == [False] * 10
        assert hung.put_many(keys, payloads) == [False] * 10
        outs = _outs(payloads)
        assert hung.get_many(keys, outs) == [False] * 10
        elapsed = time.monotonic() - started
        stats = hung.stats()
        assert stats["errors"] >= 3
        # A failed request stops the rest of its batch: one timeout per batch, not per key.
        assert stats["skipped"] >= 3 * (10 - 4)
        assert elapsed < 10, f"three batches against a hung server took {elapsed:.1f}s"
        assert all(bytes(out) == bytes(len(out)) for out in outs)
    finally:
        hung.close()
        relay.close()


def test_close_during_a_batch_returns_promptly(s3_server: SeaweedServer) -> None:
    relay = _GateRelay(s3_server.port, expect=2)
    held = _relayed_backend(s3_server, relay, _namespace(), max_concurrency=2, timeout_s=30)
    try:
        keys, payloads = _keys(6), _payloads(6)
        outs = _outs(payloads)
        results: list[bool] = []
        worker = threading.Thread(target=lambda: results.extend(held.get_many(keys, outs)))
        worker.start()
        assert relay.reached.wait(timeout=20)
        held.close()
        worker.join(timeout=10)
        assert not worker.is_alive(), "get_many still blocked after close()"
        assert results == [False] * 6
        assert all(bytes(out) == bytes(len(out)) for out in outs)
        with pytest.raises(BackendClosedError):
            held.exists(keys)
        held.close()  # idempotent
    finally:
        held.close()
        relay.close()
