"""Redis / Valkey backend: standalone (``redis://``), TLS (``rediss://``) and Redis Cluster
(``redis+cluster://``, ``rediss+cluster://``), on redis-py with hiredis. URL and options:
:mod:`kvtier.backends.redis_config`; inventory: :mod:`kvtier.backends.redis_kind`; the redis-py
clients: :mod:`kvtier.backends.redis_client`; pipelines and lanes:
:mod:`kvtier.backends.redis_batch`; the bytes on the socket (packer, reply reader, one-pipeline
exchanges): :mod:`kvtier.backends.redis_wire`.

State (used from any thread at once): the clients (:class:`RedisClients`) and the batches'
lane pool (:class:`RedisBatches`), each under its own lock; counters, error log and lifecycle,
each under its own lock.

Layout: one string per block, ``kvtier:<namespace digest hex>:<key hex>``, holding the frame.
No hash tag on purpose: blocks spread over every Cluster slot instead of one node.

Batches: ``exists``, ``put_many`` (``SET NX [PX]``) and ``get_many`` (``GET`` / ``GETEX PX``)
split a call's keys into pipelines of at most ``batch_bytes`` value bytes, per node on a
Cluster, run on up to ``connections`` connections at once (:mod:`kvtier.backends.redis_batch`).
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

import hashlib
import logging
from collections.abc import Callable
from typing import Any, Final

import redis
import redis.cluster

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
from kvtier.backends.redis_batch import FAILED, RedisBatches
from kvtier.backends.redis_client import IO_ERRORS, RedisClients
from kvtier.backends.redis_config import (
    SETTINGS,
    RedisConfig,
    RedisTopology,
    parse_redis_url,
)
from kvtier.backends.redis_wire import ZERO_COPY_SUPPORTED, FramedValue, InPlaceRead
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

_SERVED: Final = frozenset({Verdict.VALID, Verdict.OLDER_KEY, Verdict.OLDER_FORMAT})

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
        self.block_lifetime_s = None if config.ttl_ms is None else config.ttl_ms / 1000
        self._zero_copy = ZERO_COPY_SUPPORTED and not config.tls
        self._clients = RedisClients(config, self._zero_copy)
        self._batches = RedisBatches(config, self._clients, self._stats, self._name,
                                     self._count_error)
        if config.topology is RedisTopology.STANDALONE:
            self._check_credentials()
        else:
            try:
                self._clients.connect_cluster()
            except IO_ERRORS as exc:
                self._check_auth_error(exc)
                self._count_error("open", 0, exc)

    # -- construction ---------------------------------------------------------------------

    def _check_credentials(self) -> None:
        """Fail fast on a wrong password; a server that is down now is not an error."""
        client = self._clients.standalone
        if client is None:
            return
        try:
            client.ping()
        except IO_ERRORS as exc:
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

    # -- helpers ----------------------------------------------------------------------------

    def _name(self, key: BlockKey) -> bytes:
        return self._prefix + key.hex().encode()

    def _count_error(self, operation: str, keys: int, exc: BaseException) -> None:
        self._fail(operation, f"{keys} key(s)", exc)

    # -- identity -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._config.url

    @property
    def config(self) -> RedisConfig:
        return self._config

    # -- medium hooks -------------------------------------------------------------------------

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        replies = self._batches.batched("exists", keys,
                                        lambda index: ("EXISTS", self._name(keys[index])))
        return self._outcomes("exists", replies,
                              lambda reply: Outcome.OK if reply == 1 else Outcome.MISSING)

    def _outcomes(self, op: str, replies: list[Any],
                  answered: Callable[[Any], Outcome]) -> list[Outcome]:
        """One outcome per pipeline reply: a failed batch, a failed command, or ``answered``."""
        return [Outcome.FAILED if reply is FAILED
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

        replies = self._batches.batched("put", [frame.key for frame in frames], command,
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

        replies = self._batches.batched("get", keys, command,
                                        [HEADER_BYTES + out.nbytes for out in outs], outs)
        return [self._fetched(reply) for reply in replies]

    def _fetched(self, reply: Any) -> Fetched:
        if isinstance(reply, Fetched):  # read into the caller's buffer by ReplyReader
            return reply
        if reply is FAILED:
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
        replies = self._batches.run(
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
        replies = self._batches.run(operation, key_list,
                                    lambda pipe, key: pipe.unlink(self._name(key)))
        for reply in replies:
            if isinstance(reply, Exception):
                self._count_error(operation, 1, reply)

    def _m_close(self) -> None:
        self._client_close()

    def _client_close(self) -> None:
        self._batches.close()
        self._clients.close()

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
        return self._clients.raw()

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
