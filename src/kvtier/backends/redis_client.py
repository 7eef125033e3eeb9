"""The redis-py clients of one Redis backend: the standalone client and its connection pool, or
the Redis Cluster client (built lazily: a cluster that is down at open is not an error).

State (used from any thread at once): the redis-py client and pools (redis-py's own locking;
every batch takes its own connections); ``cluster``, built lazily under ``_lock``.
"""

from __future__ import annotations

import threading
from typing import Any, Final

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.backends.redis_config import RedisConfig, RedisTopology
from kvtier.backends.redis_wire import FrameConnection

__all__ = ["IO_ERRORS", "RedisClients"]

# The I/O errors a batch call turns into False answers. RedisClusterException is not a
# RedisError subclass (e.g. "no node reachable for slot"), hence listed on its own.
IO_ERRORS: Final = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)


class RedisClients:
    """The standalone client, or the lazily built Cluster client, of one configuration."""

    def __init__(self, config: RedisConfig, zero_copy: bool) -> None:
        self._config = config
        self._zero_copy = zero_copy
        self._lock = threading.Lock()
        self.standalone: redis.Redis | None = None
        self.cluster: redis.cluster.RedisCluster | None = None
        if config.topology is RedisTopology.STANDALONE:
            self.standalone = redis.Redis(connection_pool=self._standalone_pool())

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

    def connect_cluster(self) -> redis.cluster.RedisCluster:
        built = self.cluster
        if built is not None:  # the hot path takes no lock
            return built
        with self._lock:
            if self.cluster is None:
                config = self._config
                kwargs = self._common_kwargs()
                if self._zero_copy:
                    kwargs["connection_class"] = FrameConnection
                host = f"[{config.host}]" if ":" in config.host else config.host
                # The seed goes in as a URL: only redis-py's URL path builds node pools from
                # our kwargs, which is how the node connections get the zero-copy packer.
                self.cluster = redis.cluster.RedisCluster(
                    url=f"{'rediss' if config.tls else 'redis'}://{host}:{config.port}",
                    retry=Retry(NoBackoff(), 1),
                    **kwargs,
                )
            return self.cluster

    def pipeline(self) -> Any:
        if self.standalone is not None:
            return self.standalone.pipeline(transaction=False)
        return self.connect_cluster().pipeline()  # type: ignore[no-untyped-call]

    def raw(self) -> Any:
        """The redis-py client (standalone or Cluster)."""
        if self.standalone is not None:
            return self.standalone
        return self.connect_cluster()

    def close(self) -> None:
        with self._lock:
            if self.standalone is not None:
                self.standalone.close()
                self.standalone.connection_pool.disconnect()
            if self.cluster is not None:
                self.cluster.close()
