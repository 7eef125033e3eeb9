"""Redis / Valkey backend: standalone (``redis://``), TLS (``rediss://``) and Redis Cluster
(``redis+cluster://``, ``rediss+cluster://``), on redis-py with hiredis. URL and options:
:mod:`kvtier.backends.redis_config`; inventory: :mod:`kvtier.backends.redis_kind`; the bytes on
the socket (packer, reply reader, one-pipeline exchanges): :mod:`kvtier.backends.redis_wire`.

State (used from any thread at once): the redis-py client and pools (redis-py's own locking;
every batch takes its own connections); ``_cluster_client`` and ``_lanes`` (the thread pool
that runs a call's extra lanes), built lazily under ``_client_lock``; counters, error log and
lifecycle, each under its own lock. A lane thread owns only the connection it was handed and the
reply buffers of its own pipelines.

Layout: one string per block, ``kvtier:<namespace digest hex>:<key hex>``, holding the frame.
No hash tag on purpose: blocks spread over every Cluster slot instead of one node.

Batches: ``exists``, ``put_many`` (``SET NX [PX]``) and ``get_many`` (``GET`` / ``GETEX PX``)
split a call's keys into pipelines of at most ``batch_bytes`` value bytes (and
``_MAX_PIPELINE_COMMANDS`` commands), per node on a Cluster. Up to ``connections`` pipelines of
one call run at once, each lane on its own connection (taken on the calling thread, so a call
never waits for a connection another lane of it holds); the calling thread runs the first lane.
``delete`` (``UNLINK``) and the rare paths send one redis-py pipeline.

Copies: payloads go to the socket without a copy on plain TCP (header and payload are separate
chunks of one RESP bulk string, :class:`~kvtier.backends.redis_wire.FramePacker`); a ``GET``
reply of the expected size is read by :class:`~kvtier.backends.redis_wire.ReplyReader` with
``recv_into`` straight into the caller's buffer (the header into a small buffer of its own) and
verified there; hiredis never sees it.

Failures: a lost connection, dead server or per-key error answers False for the keys of that
pipeline, counts ``errors`` and logs (rate-limited), never raises; one immediate retry
reconnects after a server restart; a timeout is not retried and drops the connection (no stale
reply is ever read). On a Cluster a failed pipeline, or keys answered MOVED / ASK / TRYAGAIN /
CLUSTERDOWN, go once more through redis-py's cluster pipeline (which follows the new slot map),
and if that fails, one pipeline per node, so a dead node costs only its keys. A wrong password or
ACL user raises ``ValueError`` at open (when reachable). ``ttl_s`` expires every block; a read
(``GETEX``) pushes the expiry forward: the TTL bounds idle time, not age.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    Verdict,
)
from kvtier.backends.manifest import MAX_MANIFEST_BYTES
from kvtier.backends.redis_config import (
    SETTINGS,
    RedisConfig,
    RedisTopology,
    parse_redis_url,
)
from kvtier.backends.redis_wire import (
    ZERO_COPY_SUPPORTED,
    FrameConnection,
    FramedValue,
    InPlaceRead,
    exchange,
    exchange_gets,
    is_redirect,
)
from kvtier.codec import HEADER_BYTES
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


_MAX_PIPELINE_COMMANDS: Final = 1024
_SERVED: Final = frozenset({Verdict.VALID, Verdict.OLDER_KEY, Verdict.OLDER_FORMAT})


@dataclass(slots=True)
class _Unit:
    """One pipeline of a call: the indexes of its items, all on the node behind ``pool``."""

    pool: Any
    indexes: list[int]
    replies: list[Any] | None = None  # None: the pipeline failed (already counted)


@dataclass(slots=True)
class _Lane:
    """Pipelines run one after another on one connection (taken on the calling thread)."""

    pool: Any
    units: list[_Unit]
    connection: Any = None


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
        self._zero_copy = ZERO_COPY_SUPPORTED and not config.tls
        self._client_lock = threading.Lock()
        self._lanes: concurrent.futures.ThreadPoolExecutor | None = None
        # A bounded pool could make two calls wait on each other's extra connections.
        self._lanes_per_node = 1 if config.max_connections is not None else config.connections
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
            connection_class=redis.SSLConnection if config.tls else FrameConnection,
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
                    kwargs["connection_class"] = FrameConnection
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

    # -- batches over parallel connections ----------------------------------------------------

    def _batched(self, operation: str, keys: list[BlockKey],
                 command: Callable[[int], tuple[Any, ...]], sizes: list[int] | None = None,
                 outs: list[memoryview] | None = None) -> list[Any]:
        """One reply per key (``_FAILED`` where its pipeline failed, already counted): the keys
        split into pipelines by node, ``batch_bytes`` of ``sizes`` and command count, run on up
        to ``connections`` connections per node at once. ``outs``: ``GET`` replies are read
        into them (:class:`ReplyReader`)."""
        replies: list[Any] = [_FAILED] * len(keys)
        units, unplaced = self._plan(keys, sizes)

        def run_unit(conn: Any, unit: _Unit) -> list[Any]:
            commands = [command(index) for index in unit.indexes]
            if outs is None:
                return exchange(conn, commands)
            return exchange_gets(conn, commands, [outs[index] for index in unit.indexes])

        self._run_lanes(operation, units, run_unit)
        again = list(unplaced)
        for unit in units:
            if unit.replies is None:
                again += unit.indexes
                continue
            for index, reply in zip(unit.indexes, unit.replies, strict=True):
                if self._cluster_client is not None and is_redirect(reply):
                    again.append(index)
                else:
                    replies[index] = reply
        if again and self._cluster_client is not None:
            # redis-py's cluster pipeline follows MOVED / refreshes the slot map after a
            # failover; if that fails too, one pipeline per node (a dead node costs its keys).
            again.sort()
            rerun = self._run(operation, again,
                              lambda pipe, index: pipe.execute_command(*command(index)),
                              lambda index: keys[index])
            for index, reply in zip(again, rerun, strict=True):
                replies[index] = reply
        return replies

    def _plan(self, keys: list[BlockKey],
              sizes: list[int] | None) -> tuple[list[_Unit], list[int]]:
        """The pipelines of one call, and the indexes no node serves now (cluster only)."""
        groups, unplaced = self._by_node(keys)
        units: list[_Unit] = []
        for pool, indexes in groups:
            units += self._split(pool, indexes, sizes)
        return units, unplaced

    def _by_node(self, keys: list[BlockKey]) -> tuple[list[tuple[Any, list[int]]], list[int]]:
        """(connection pool, indexes) per node; and the indexes of keys no node serves now."""
        if self._standalone_client is not None:
            return [(self._standalone_client.connection_pool, list(range(len(keys))))], []
        try:
            client = self._connect_cluster()
        except _IO_ERRORS as exc:
            self._count_error("connect", len(keys), exc)
            return [], []
        groups: dict[int, tuple[Any, list[int]]] = {}
        unplaced: list[int] = []
        for index, key in enumerate(keys):
            try:
                node = client.nodes_manager.get_node_from_slot(
                    client.keyslot(self._name(key)))  # type: ignore[no-untyped-call]
                pool = client.get_redis_connection(node).connection_pool
            except _IO_ERRORS:  # no node serves the slot now: the cluster path decides
                unplaced.append(index)
                continue
            groups.setdefault(id(pool), (pool, []))[1].append(index)
        return list(groups.values()), unplaced

    def _split(self, pool: Any, indexes: list[int], sizes: list[int] | None) -> list[_Unit]:
        """Consecutive runs of ``indexes`` of at most ``batch_bytes`` (a larger item alone)
        and ``_MAX_PIPELINE_COMMANDS`` commands."""
        limit = self._config.batch_bytes
        units = [_Unit(pool, [])]
        held = 0
        for index in indexes:
            size = 0 if sizes is None else sizes[index]
            current = units[-1].indexes
            if current and (held + size > limit or len(current) >= _MAX_PIPELINE_COMMANDS):
                units.append(_Unit(pool, []))
                held = 0
            units[-1].indexes.append(index)
            held += size
        return units if units[0].indexes else []

    def _run_lanes(self, operation: str, units: list[_Unit],
                   run_unit: Callable[[Any, _Unit], list[Any]]) -> None:
        """Run ``units`` (setting their ``replies``): per node up to ``connections`` lanes,
        the first on this thread, the others on the lane pool."""
        lanes = self._lanes_for(operation, units)
        if not lanes:
            return
        futures: list[tuple[concurrent.futures.Future[None], _Lane]] = []
        here = [lanes[0]]
        for lane in lanes[1:]:
            try:
                futures.append((self._lane_pool().submit(self._run_lane, operation, lane,
                                                         run_unit), lane))
            except RuntimeError:  # the backend closed meanwhile: the lane runs here
                here.append(lane)
        for lane in here:
            self._run_lane(operation, lane, run_unit)
        for future, lane in futures:
            try:
                future.result()
            except concurrent.futures.CancelledError:  # closed meanwhile: its units failed
                lane.pool.release(lane.connection)

    def _lanes_for(self, operation: str, units: list[_Unit]) -> list[_Lane]:
        """Lanes with their connections, taken here so that lanes never wait for each other.
        A node whose first connection fails gets no lane (its units stay failed)."""
        by_pool: dict[int, list[_Unit]] = {}
        for unit in units:
            by_pool.setdefault(id(unit.pool), []).append(unit)
        lanes: list[_Lane] = []
        for pool_units in by_pool.values():
            pool = pool_units[0].pool
            connections: list[Any] = []
            for _number in range(min(self._lanes_per_node, len(pool_units))):
                try:
                    connections.append(pool.get_connection())
                except _IO_ERRORS as exc:
                    if not connections:  # the node is down: one error for all its keys
                        self._count_error(operation, sum(len(u.indexes) for u in pool_units),
                                          exc)
                    break  # else fewer lanes: the units go round the ones we have
            for number, connection in enumerate(connections):
                lanes.append(_Lane(pool, pool_units[number::len(connections)], connection))
        return lanes

    def _run_lane(self, operation: str, lane: _Lane,
                  run_unit: Callable[[Any, _Unit], list[Any]]) -> None:
        try:
            for unit in lane.units:
                unit.replies = self._exchange_unit(operation, lane.connection, unit, run_unit)
        finally:
            lane.pool.release(lane.connection)

    def _exchange_unit(self, operation: str, conn: Any, unit: _Unit,
                       run_unit: Callable[[Any, _Unit], list[Any]]) -> list[Any] | None:
        """One pipeline, retried once on a broken (not a timed-out) connection."""
        for attempt in (1, 2):
            self._stats.add("round_trips")
            try:
                return run_unit(conn, unit)
            except redis.ConnectionError as exc:  # reconnects on the next send
                if attempt == 2:
                    self._count_error(operation, len(unit.indexes), exc)
            except _IO_ERRORS as exc:
                conn.disconnect()
                self._count_error(operation, len(unit.indexes), exc)
                return None
        return None

    def _lane_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        lanes = self._lanes
        if lanes is not None:
            return lanes
        with self._client_lock:
            if self._lanes is None:
                self._lanes = concurrent.futures.ThreadPoolExecutor(
                    max_workers=4 * self._config.connections,
                    thread_name_prefix="kvtier-redis-lane")
            return self._lanes

    # -- identity -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._config.url

    @property
    def config(self) -> RedisConfig:
        return self._config

    # -- medium hooks -------------------------------------------------------------------------

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        replies = self._batched("exists", keys, lambda index: ("EXISTS", self._name(keys[index])))
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
        expiry = () if self._config.ttl_ms is None else ("PX", self._config.ttl_ms)

        def command(index: int) -> tuple[Any, ...]:
            frame = frames[index]
            value = (FramedValue(frame.header, frame.payload) if self._zero_copy
                     else frame.joined())
            return ("SET", self._name(frame.key), value, "NX", *expiry)

        replies = self._batched("put", [frame.key for frame in frames], command,
                                [frame.nbytes for frame in frames])
        # SET NX answers nil when the block is already stored: never overwritten
        return self._outcomes("put", replies,
                              lambda reply: Outcome.OK if reply else Outcome.PRESENT)

    def _m_fetch(self, keys: list[BlockKey], outs: list[memoryview]) -> list[Fetched]:
        ttl_ms = self._config.ttl_ms

        def command(index: int) -> tuple[Any, ...]:
            if ttl_ms is None:
                return ("GET", self._name(keys[index]))
            return ("GETEX", self._name(keys[index]), "PX", ttl_ms)

        replies = self._batched("get", keys, command,
                                [HEADER_BYTES + out.nbytes for out in outs], outs)
        return [self._fetched(reply) for reply in replies]

    def _fetched(self, reply: Any) -> Fetched:
        if isinstance(reply, Fetched):  # read into the caller's buffer by ReplyReader
            return reply
        if reply is _FAILED:
            return FAILED_FETCH
        if reply is None:
            return MISSING_FETCH
        if isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE"):
            # Something that is not a string sits under our block's name: not our block.
            return CORRUPT_FETCH
        if isinstance(reply, Exception):
            self._fail("get", "1 key", reply)
            return FAILED_FETCH
        return Fetched(Outcome.OK, frame=memoryview(reply))

    def _judge(self, key: BlockKey, out: memoryview, item: Fetched) -> Verdict | None:
        verdict = super()._judge(key, out, item)
        token = item.token
        if isinstance(token, InPlaceRead) and verdict is not None and verdict not in _SERVED:
            # Now, before the next key's read can reuse ``out``: the object as read.
            digest = hashlib.sha1(token.header, usedforsecurity=False)
            digest.update(out)
            token.digest = digest.hexdigest()
        return verdict

    def _m_delete(self, keys: list[BlockKey]) -> None:
        self._unlink(keys, "delete")

    def _m_remove_bad(self, bad: list[tuple[BlockKey, Fetched]]) -> None:
        """Delete each bad object only if it is unchanged (one pipelined round trip).

        Between our GET and this delete, another reader may have removed the bad object and a
        writer stored the good block under the same name (``SET NX`` succeeds once the name is
        free); a plain UNLINK would drop that good block. The script compares first: a string
        whose SHA-1 is the one we read, or ("" digest) a value of a non-string type.
        """
        targets = [(key, self._object_digest(item)) for key, item in bad]
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

    @staticmethod
    def _object_digest(item: Fetched) -> str:
        """The SHA-1 of the object as read ("" where none was read: a non-string value)."""
        if isinstance(item.token, InPlaceRead):
            return item.token.digest
        if item.frame is None:
            return ""
        return hashlib.sha1(item.frame, usedforsecurity=False).hexdigest()

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
            if self._lanes is not None:
                # Lanes in flight end within a socket timeout; their callers answer False.
                self._lanes.shutdown(wait=False, cancel_futures=True)
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
