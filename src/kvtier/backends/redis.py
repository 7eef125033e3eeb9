"""Redis / Valkey backend: standalone (``redis://``), TLS (``rediss://``) and Redis Cluster
(``redis+cluster://``, ``rediss+cluster://``), on redis-py with hiredis. URL and options:
:mod:`kvtier.backends.redis_config`; inventory: :mod:`kvtier.backends.redis_kind`.

State (used from any thread at once): the redis-py client and pools (redis-py's own locking;
every batch builds its own pipeline); ``_cluster_client``, built lazily under ``_client_lock``
(the seed may be down at open); counters, error log and lifecycle, each under its own lock.

Layout: one string per block, ``kvtier:<namespace digest hex>:<key hex>``, holding the frame.
No hash tag on purpose: blocks spread over every Cluster slot instead of one node.

Round trips: ``exists``, ``put_many`` (``SET NX [PX]``), ``get_many`` (``GET`` / ``GETEX PX``)
and ``delete`` (``UNLINK``) each send one pipeline (per node on a Cluster, written to all nodes
before any reply is read). Payloads go to the socket without a copy on plain TCP: header and
payload are separate chunks of one RESP bulk string (:class:`_FramePacker`).

Failures: a lost connection, dead server or per-key error answers False for the keys, counts
``errors`` and logs (rate-limited), never raises; one immediate retry reconnects after a server
restart. On a Cluster a failed batch is rerun one pipeline per node, so a dead node costs only
its keys. A wrong password or ACL user raises ``ValueError`` at open (when reachable).
``ttl_s`` expires every block; a read (``GETEX``) pushes the expiry forward: the TTL bounds idle
time, not age.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.backends.base import (
    CORRUPT_FETCH,
    FAILED_FETCH,
    MISSING_FETCH,
    Backend,
    Fetched,
    Outcome,
    StoredFrame,
)
from kvtier.backends.manifest import MAX_MANIFEST_BYTES
from kvtier.backends.redis_config import (
    SETTINGS,
    RedisConfig,
    RedisTopology,
    parse_redis_url,
)
from kvtier.keys import BlockKey, Namespace

__all__ = [
    "SETTINGS",
    "RedisBackend",
    "RedisConfig",
    "RedisTopology",
    "from_url",
    "parse_redis_url",
    "read_manifest_value",
]

MANIFEST_SUFFIX: Final = b"namespace"
"""``kvtier:<digest>:namespace`` holds the namespace manifest; a block's suffix is hex."""

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_KEY_PREFIX: Final = b"kvtier:"
_SEPARATE_CHUNK_BYTES: Final = 16 * 1024
# Deletes a corrupt block only if it is still the object we read: a string whose SHA-1 is
# ARGV[1], or (ARGV[1] empty) a value of a non-string type. A good block that a concurrent
# writer stored after someone else removed the bad one is therefore never deleted.
_DELETE_IF_UNCHANGED: Final = b"""
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind ~= 'string' then
  if ARGV[1] == '' then return redis.call('UNLINK', KEYS[1]) end
  return 0
end
if ARGV[1] ~= '' and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[1] then
  return redis.call('UNLINK', KEYS[1])
end
return 0
"""

# The I/O errors a batch call turns into False answers. RedisClusterException is not a
# RedisError subclass (e.g. "no node reachable for slot"), hence listed on its own.
_IO_ERRORS: Final = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


class _BatchFailed:
    """The reply of a command whose pipeline failed (the failure is already counted)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<pipeline failed>"


_FAILED: Final = _BatchFailed()


def _identity(key: BlockKey) -> BlockKey:
    return key


class _FramedValue:
    """One RESP bulk string sent as two chunks: the frame header and the caller's payload."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + self.payload.nbytes


class _FramePacker:
    """RESP command packer that never copies a large :class:`_FramedValue` payload.

    redis-py's ``pack_commands`` keeps every ``memoryview`` chunk as its own ``sendall`` (no
    join), so a large payload goes from the caller's buffer to the kernel. hiredis' packer would
    copy each value twice (``bytes()`` and its output buffer); replies are still parsed by
    hiredis. Payloads up to ``_SEPARATE_CHUNK_BYTES`` are joined into the command buffer instead:
    copying a few KiB is cheaper than one more system call per block.
    """

    __slots__ = ("_encode",)

    def __init__(self, encode: Any) -> None:
        self._encode = encode

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        output: list[bytes | memoryview] = []
        pending: list[bytes] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, _FramedValue) and arg.payload.nbytes > _SEPARATE_CHUNK_BYTES:
                pending += (b"$%d\r\n" % len(arg), arg.header)
                output.append(b"".join(pending))
                output.append(arg.payload)
                pending = [b"\r\n"]
            elif isinstance(arg, _FramedValue):
                pending += (b"$%d\r\n" % len(arg), arg.header, arg.payload.tobytes(), b"\r\n")
            else:
                raw = self._encode(arg)
                pending += (b"$%d\r\n" % len(raw), bytes(raw), b"\r\n")
        output.append(b"".join(pending))
        return output


class _FrameConnection(redis.Connection):
    """A plain TCP connection that packs commands with :class:`_FramePacker`."""

    def _construct_command_packer(self, packer: Any) -> Any:
        if packer is not None:
            return packer
        return _FramePacker(self.encoder.encode)


def _frame_packer_works() -> bool:
    """Whether this redis-py still builds its packer through the hook we override.

    The hook is redis-py internals; should a future release drop it, frames fall back to one
    contiguous buffer instead of failing every put.
    """
    probe = _FrameConnection()  # type: ignore[no-untyped-call]  # no socket opened yet
    return isinstance(getattr(probe, "_command_packer", None), _FramePacker)


_ZERO_COPY_SUPPORTED: Final = _frame_packer_works()


# --------------------------------------------------------------------------- the backend


class RedisBackend(Backend):
    """Blocks of one namespace in Redis / Valkey (see module docstring)."""

    EXTRA_COUNTERS = ("node_fallbacks",)

    def __init__(self, namespace: Namespace, config: RedisConfig) -> None:
        if not isinstance(config, RedisConfig):
            raise TypeError(f"config must be a RedisConfig, got {type(config).__name__}")
        self._config = config
        super().__init__(namespace, name=f"redis backend {config.url}", logger=_log,
                         auth_key=config.auth_key)
        self._prefix = _KEY_PREFIX + namespace.digest_hex.encode() + b":"
        self._zero_copy = _ZERO_COPY_SUPPORTED and not config.tls
        self._client_lock = threading.Lock()
        self._standalone_client: redis.Redis | None = None
        self._cluster_client: redis.cluster.RedisCluster | None = None
        if config.topology is RedisTopology.STANDALONE:
            self._standalone_client = redis.Redis(connection_pool=self._standalone_pool())
            self._check_credentials()
        else:
            try:
                self._connect_cluster()
            except _IO_ERRORS as exc:
                self._check_auth_error(exc)
                self._count_error("open", 0, exc)

    # -- construction ---------------------------------------------------------------------

    def _common_kwargs(self) -> dict[str, Any]:
        config = self._config
        kwargs: dict[str, Any] = {
            "username": config.username,
            "password": None if config.password is None else config.password.reveal(),
            "socket_timeout": config.socket_timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "max_connections": config.max_connections,
        }
        if config.tls:
            kwargs.update(
                ssl_ca_certs=config.ssl_ca_certs,
                ssl_certfile=config.ssl_certfile,
                ssl_keyfile=config.ssl_keyfile,
                ssl_cert_reqs="required",
                ssl_check_hostname=config.ssl_check_hostname,
            )
        return kwargs

    def _standalone_pool(self) -> redis.ConnectionPool:
        config = self._config
        kwargs = self._common_kwargs()
        pool_class: type[redis.ConnectionPool] = redis.ConnectionPool
        if kwargs["max_connections"] is None:
            del kwargs["max_connections"]
        else:
            # With a bound, callers wait for a free connection instead of failing.
            pool_class = redis.BlockingConnectionPool
            kwargs["timeout"] = config.socket_timeout_s
        return pool_class(
            connection_class=redis.SSLConnection if config.tls else _FrameConnection,
            host=config.host,
            port=config.port,
            db=config.db,
            # One immediate retry on a broken connection: the first call after a server restart
            # finds a stale pooled socket, reconnects and succeeds. Timeouts are not retried, so
            # a hung server costs at most one socket_timeout per call.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            **kwargs,
        )

    def _connect_cluster(self) -> redis.cluster.RedisCluster:
        built = self._cluster_client
        if built is not None:  # the hot path takes no lock
            return built
        with self._client_lock:
            if self._cluster_client is None:
                config = self._config
                kwargs = self._common_kwargs()
                if self._zero_copy:
                    kwargs["connection_class"] = _FrameConnection
                host = f"[{config.host}]" if ":" in config.host else config.host
                # The seed goes in as a URL: only redis-py's URL path builds node pools from
                # our kwargs, which is how the node connections get the zero-copy packer.
                self._cluster_client = redis.cluster.RedisCluster(
                    url=f"{'rediss' if config.tls else 'redis'}://{host}:{config.port}",
                    retry=Retry(NoBackoff(), 1),
                    **kwargs,
                )
            return self._cluster_client

    def _check_credentials(self) -> None:
        """Fail fast on a wrong password; a server that is down now is not an error."""
        client = self._standalone_client
        if client is None:
            return
        try:
            client.ping()
        except _IO_ERRORS as exc:
            self._check_auth_error(exc)
            self._check_db_error(exc)
            self._count_error("open", 0, exc)

    def _check_db_error(self, exc: BaseException) -> None:
        """A db the server does not have (its ``databases`` setting) fails every call: refuse
        it at open, by name, as a wrong password is."""
        text = str(exc)
        if "DB index is out of range" in text or "invalid DB index" in text:
            self._client_close()
            raise ValueError(
                f"redis backend {self._config.url}: db {self._config.db} does not exist on the "
                f"server ({text}); expected a db below the server's `databases` setting (16 by "
                "default)"
            ) from None

    def _check_auth_error(self, exc: BaseException) -> None:
        text = str(exc)
        if isinstance(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)) or any(
            marker in text for marker in ("WRONGPASS", "NOAUTH", "invalid username-password")
        ):
            user = self._config.username or "default"
            self._client_close()
            raise ValueError(
                f"redis backend {self._config.url}: authentication failed for user {user!r} "
                f"({text}); check the username/password options"
            ) from None

    def _pipeline(self) -> Any:
        if self._standalone_client is not None:
            return self._standalone_client.pipeline(transaction=False)
        return self._connect_cluster().pipeline()  # type: ignore[no-untyped-call]

    # -- helpers ----------------------------------------------------------------------------

    def _name(self, key: BlockKey) -> bytes:
        return self._prefix + key.hex().encode()

    def _count_error(self, operation: str, keys: int, exc: BaseException) -> None:
        self._fail(operation, f"{keys} key(s)", exc)

    def _execute(self, pipe: Any, operation: str, keys: int) -> list[Any] | None:
        """Run a pipeline; its replies (errors as exception objects), or None if it failed."""
        try:
            self._stats.add("round_trips")
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except _IO_ERRORS as exc:
            self._count_error(operation, keys, exc)
            return None
        finally:
            pipe.reset()
        if len(replies) != keys:
            self._count_error(
                operation, keys, RuntimeError(f"{len(replies)} replies for {keys} commands")
            )
            return None
        return replies

    def _run(self, operation: str, items: Sequence[_T], add: Callable[[Any, _T], object],
             key_of: Callable[[Any], BlockKey] = _identity) -> list[Any]:
        """One pipeline with one command per item: one reply per item, :data:`_FAILED` for
        the items whose pipeline failed (already counted and logged).

        On a Cluster, redis-py fails the whole pipeline when one node is dead, so a failed
        batch is run again one pipeline per node (keys grouped by the client's slot map): the
        keys on live nodes are answered, only the dead node's keys answer ``_FAILED``. The
        retry costs a second connect attempt to the dead node (one ``connect_timeout_s`` at
        most; a refused connection returns at once).
        """
        replies = self._run_one(operation, items, add)
        if replies is not None:
            return replies
        if self._cluster_client is None or len(items) < 2:
            return [_FAILED] * len(items)
        return self._run_per_node(operation, items, add, key_of)

    def _run_one(self, operation: str, items: Sequence[_T],
                 add: Callable[[Any, _T], object]) -> list[Any] | None:
        try:
            pipe = self._pipeline()
        except _IO_ERRORS as exc:
            self._count_error(operation, len(items), exc)
            return None
        for item in items:
            add(pipe, item)
        return self._execute(pipe, operation, len(items))

    def _run_per_node(self, operation: str, items: Sequence[_T],
                      add: Callable[[Any, _T], object],
                      key_of: Callable[[_T], BlockKey]) -> list[Any]:
        groups: dict[str, list[int]] = {}
        replies: list[Any] = [_FAILED] * len(items)
        client = self._connect_cluster()
        for index, item in enumerate(items):
            try:
                node = client.nodes_manager.get_node_from_slot(
                    client.keyslot(self._name(key_of(item))))  # type: ignore[no-untyped-call]
            except _IO_ERRORS:  # a slot no node serves: that key stays _FAILED
                continue
            groups.setdefault(node.name, []).append(index)
        self._stats.add("node_fallbacks")
        for indexes in groups.values():
            group = self._run_one(operation, [items[index] for index in indexes], add)
            for index, reply in zip(indexes, group or (), strict=False):
                replies[index] = reply
        return replies

    # -- identity -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._config.url

    @property
    def config(self) -> RedisConfig:
        return self._config

    # -- medium hooks -------------------------------------------------------------------------

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        replies = self._run("exists", keys, lambda pipe, key: pipe.exists(self._name(key)))
        return self._outcomes("exists", replies,
                              lambda reply: Outcome.OK if reply == 1 else Outcome.MISSING)

    def _outcomes(self, op: str, replies: list[Any],
                  answered: Callable[[Any], Outcome]) -> list[Outcome]:
        """One outcome per pipeline reply: a failed batch, a failed command, or ``answered``."""
        return [Outcome.FAILED if reply is _FAILED
                else self._fail(op, "1 key", reply) if isinstance(reply, Exception)
                else answered(reply)
                for reply in replies]

    def _m_store(self, frames: list[StoredFrame]) -> list[Outcome]:
        ttl_ms = self._config.ttl_ms

        def add(pipe: Any, frame: StoredFrame) -> None:
            value = (_FramedValue(frame.header, frame.payload) if self._zero_copy
                     else frame.joined())
            pipe.set(self._name(frame.key), value, nx=True, px=ttl_ms)

        replies = self._run("put", frames, add, lambda frame: frame.key)
        # SET NX answers nil when the block is already stored: never overwritten
        return self._outcomes("put", replies,
                              lambda reply: Outcome.OK if reply else Outcome.PRESENT)

    def _m_fetch(self, keys: list[BlockKey], outs: list[memoryview]) -> list[Fetched]:
        ttl_ms = self._config.ttl_ms

        def add(pipe: Any, key: BlockKey) -> None:
            if ttl_ms is None:
                pipe.get(self._name(key))
            else:
                pipe.getex(self._name(key), px=ttl_ms)

        replies = self._run("get", keys, add)
        fetched: list[Fetched] = []
        for reply in replies:
            if reply is _FAILED:
                fetched.append(FAILED_FETCH)
            elif reply is None:
                fetched.append(MISSING_FETCH)
            elif isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE"):
                # Something that is not a string sits under our block's name: not our block.
                fetched.append(CORRUPT_FETCH)
            elif isinstance(reply, Exception):
                self._fail("get", "1 key", reply)
                fetched.append(FAILED_FETCH)
            else:
                fetched.append(Fetched(Outcome.OK, frame=memoryview(reply)))
        return fetched

    def _m_delete(self, keys: list[BlockKey]) -> None:
        self._unlink(keys, "delete")

    def _m_remove_bad(self, bad: list[tuple[BlockKey, Fetched]]) -> None:
        """Delete each bad object only if it is unchanged (one pipelined round trip).

        Between our GET and this delete, another reader may have removed the bad object and a
        writer stored the good block under the same name (``SET NX`` succeeds once the name is
        free); a plain UNLINK would drop that good block. The script compares first: a string
        whose SHA-1 is the one we read, or ("" digest) a value of a non-string type.
        """
        targets = [
            (key, "" if item.frame is None
             else hashlib.sha1(item.frame, usedforsecurity=False).hexdigest())
            for key, item in bad
        ]
        keys = [key for key, _digest in targets]
        replies = self._run(
            "delete corrupt", targets,
            # execute_command: redis-py's ClusterPipeline refuses .eval(), not EVAL itself.
            lambda pipe, target: pipe.execute_command(
                "EVAL", _DELETE_IF_UNCHANGED, 1, self._name(target[0]), target[1]),
            lambda target: target[0],
        )
        refused: list[BlockKey] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, redis.ResponseError):
                # Scripting disabled or denied by an ACL (NOPERM): a plain UNLINK still gets rid
                # of the bad object, with the small race described above.
                refused.append(key)
                self._error_log.warning(
                    "redis backend %s: compare-and-delete refused (%s); using UNLINK",
                    self._config.url, reply,
                )
            elif isinstance(reply, Exception):
                self._count_error("delete corrupt", 1, reply)
        if refused:
            self._unlink(refused, "delete corrupt")

    def _unlink(self, key_list: list[BlockKey], operation: str) -> None:
        # One UNLINK per key: a multi-key command would be CROSSSLOT on a Cluster.
        replies = self._run(operation, key_list, lambda pipe, key: pipe.unlink(self._name(key)))
        for reply in replies:
            if isinstance(reply, Exception):
                self._count_error(operation, 1, reply)

    def _m_close(self) -> None:
        self._client_close()

    def _client_close(self) -> None:
        with self._client_lock:
            if self._standalone_client is not None:
                self._standalone_client.close()
                self._standalone_client.connection_pool.disconnect()
            if self._cluster_client is not None:
                self._cluster_client.close()

    # Test hooks: raw access to the stored objects, used by the contract suite to inject faults.
    def _m_update_manifest(self, decide: Callable[[bytes | None], bytes]) -> None:
        """``SET kvtier:<digest>:namespace`` to ``decide`` of what it holds, always (with the
        tier's TTL, so it goes with the blocks)."""
        name = _KEY_PREFIX + self.namespace.digest_hex.encode() + b":" + MANIFEST_SUFFIX
        client = self.raw_client()
        client.set(name, decide(read_manifest_value(client, name)), px=self.config.ttl_ms)

    def primary_clients(self) -> list[Any]:
        """One client per primary: the standalone server, or every Cluster primary."""
        client = self.raw_client()
        if isinstance(client, redis.cluster.RedisCluster):
            return [client.get_redis_connection(node)
                    for node in client.get_primaries()]  # type: ignore[no-untyped-call]
        return [client]

    def raw_client(self) -> Any:
        """The redis-py client (standalone or Cluster) this backend talks through."""
        if self._standalone_client is not None:
            return self._standalone_client
        return self._connect_cluster()

    def _raw_read(self, key: BlockKey) -> bytes | None:
        value = self.raw_client().get(self._name(key))
        return None if value is None else bytes(value)

    def _raw_write(self, key: BlockKey, frame: bytes) -> None:
        self.raw_client().set(self._name(key), bytes(frame))


def read_manifest_value(client: Any, name: bytes) -> bytes | None:
    """A manifest's bytes; None for another type (WRONGTYPE) or a value too large to be one."""
    try:
        if int(client.strlen(name)) > MAX_MANIFEST_BYTES:
            return None
        value = client.get(name)
    except redis.ResponseError:
        return None
    return value if isinstance(value, bytes) else None


def from_url(url: str, namespace: Namespace, options: dict[str, Any]) -> RedisBackend:
    """Build a :class:`RedisBackend` from a ``redis://``, ``rediss://``, ``redis+cluster://``
    or ``rediss+cluster://`` URL.

    Options (keywords, or the URL query string; not both for one name): see :data:`SETTINGS`.
    Raises ``ValueError`` naming the bad URL part or option, or a failed login.
    """
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    return RedisBackend(namespace, parse_redis_url(url, options))
