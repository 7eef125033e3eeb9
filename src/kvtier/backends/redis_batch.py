"""Batches of the Redis backend: a call's keys planned into pipelines (per node, at most
``batch_bytes`` value bytes and ``_MAX_PIPELINE_COMMANDS`` commands) and run over parallel
connections, or sent as one redis-py pipeline (with the Cluster fallbacks).

Up to ``connections`` pipelines of one call run at once, each lane on its own connection (taken
on the calling thread, so a call never waits for a connection another lane of it holds); the
calling thread runs the first lane.

State (used from any thread at once): ``_lanes`` (the thread pool that runs a call's extra
lanes), built lazily under ``_lock``; the clients (:class:`RedisClients`, redis-py's own
locking) and counters are the backend's. A lane thread owns only the connection it was handed
and the reply buffers of its own pipelines.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import redis

from kvtier.backends.redis_client import IO_ERRORS, RedisClients
from kvtier.backends.redis_config import RedisConfig
from kvtier.backends.redis_wire import exchange, exchange_gets, is_redirect
from kvtier.backends.stats import BackendStats
from kvtier.keys import BlockKey

__all__ = ["FAILED", "RedisBatches"]

_T = TypeVar("_T")


class _BatchFailed:
    """The reply of a command whose pipeline failed (the failure is already counted)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<pipeline failed>"


FAILED: Final = _BatchFailed()


def _identity(key: BlockKey) -> BlockKey:
    return key


_MAX_PIPELINE_COMMANDS: Final = 1024


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


class RedisBatches:
    """Runs a backend's batches on its clients (see module docstring)."""

    def __init__(self, config: RedisConfig, clients: RedisClients, stats: BackendStats,
                 name: Callable[[BlockKey], bytes],
                 count_error: Callable[[str, int, BaseException], None]) -> None:
        self._config = config
        self._clients = clients
        self._stats = stats
        self._name = name
        self._count_error = count_error
        self._lock = threading.Lock()
        self._lanes: concurrent.futures.ThreadPoolExecutor | None = None
        # A bounded pool could make two calls wait on each other's extra connections.
        self._lanes_per_node = 1 if config.max_connections is not None else config.connections

    def _execute(self, pipe: Any, operation: str, keys: int) -> list[Any] | None:
        """Run a pipeline; its replies (errors as exception objects), or None if it failed."""
        try:
            self._stats.add("round_trips")
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except IO_ERRORS as exc:
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

    def run(self, operation: str, items: Sequence[_T], add: Callable[[Any, _T], object],
            key_of: Callable[[Any], BlockKey] = _identity) -> list[Any]:
        """One pipeline with one command per item: one reply per item, :data:`FAILED` for
        the items whose pipeline failed (already counted and logged).

        On a Cluster, redis-py fails the whole pipeline when one node is dead, so a failed
        batch is run again one pipeline per node (keys grouped by the client's slot map): the
        keys on live nodes are answered, only the dead node's keys answer ``FAILED``. The
        retry costs a second connect attempt to the dead node (one ``connect_timeout_s`` at
        most; a refused connection returns at once).
        """
        replies = self._run_one(operation, items, add)
        if replies is not None:
            return replies
        if self._clients.cluster is None or len(items) < 2:
            return [FAILED] * len(items)
        return self._run_per_node(operation, items, add, key_of)

    def _run_one(self, operation: str, items: Sequence[_T],
                 add: Callable[[Any, _T], object]) -> list[Any] | None:
        try:
            pipe = self._clients.pipeline()
        except IO_ERRORS as exc:
            self._count_error(operation, len(items), exc)
            return None
        for item in items:
            add(pipe, item)
        return self._execute(pipe, operation, len(items))

    def _run_per_node(self, operation: str, items: Sequence[_T],
                      add: Callable[[Any, _T], object],
                      key_of: Callable[[_T], BlockKey]) -> list[Any]:
        groups: dict[str, list[int]] = {}
        replies: list[Any] = [FAILED] * len(items)
        client = self._clients.connect_cluster()
        for index, item in enumerate(items):
            try:
                node = client.nodes_manager.get_node_from_slot(
                    client.keyslot(self._name(key_of(item))))  # type: ignore[no-untyped-call]
            except IO_ERRORS:  # a slot no node serves: that key stays FAILED
                continue
            groups.setdefault(node.name, []).append(index)
        self._stats.add("node_fallbacks")
        for indexes in groups.values():
            group = self._run_one(operation, [items[index] for index in indexes], add)
            for index, reply in zip(indexes, group or (), strict=False):
                replies[index] = reply
        return replies

    def batched(self, operation: str, keys: list[BlockKey],
                command: Callable[[int], tuple[Any, ...]], sizes: list[int] | None = None,
                outs: list[memoryview] | None = None) -> list[Any]:
        """One reply per key (``FAILED`` where its pipeline failed, already counted): the keys
        split into pipelines by node, ``batch_bytes`` of ``sizes`` and command count, run on up
        to ``connections`` connections per node at once. ``outs``: ``GET`` replies are read
        into them (:class:`ReplyReader`)."""
        replies: list[Any] = [FAILED] * len(keys)
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
                if self._clients.cluster is not None and is_redirect(reply):
                    again.append(index)
                else:
                    replies[index] = reply
        if again and self._clients.cluster is not None:
            # redis-py's cluster pipeline follows MOVED / refreshes the slot map after a
            # failover; if that fails too, one pipeline per node (a dead node costs its keys).
            again.sort()
            rerun = self.run(operation, again,
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
        if self._clients.standalone is not None:
            return [(self._clients.standalone.connection_pool, list(range(len(keys))))], []
        try:
            client = self._clients.connect_cluster()
        except IO_ERRORS as exc:
            self._count_error("connect", len(keys), exc)
            return [], []
        groups: dict[int, tuple[Any, list[int]]] = {}
        unplaced: list[int] = []
        for index, key in enumerate(keys):
            try:
                node = client.nodes_manager.get_node_from_slot(
                    client.keyslot(self._name(key)))  # type: ignore[no-untyped-call]
                pool = client.get_redis_connection(node).connection_pool
            except IO_ERRORS:  # no node serves the slot now: the cluster path decides
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
                except IO_ERRORS as exc:
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
            except IO_ERRORS as exc:
                conn.disconnect()
                self._count_error(operation, len(unit.indexes), exc)
                return None
        return None

    def _lane_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        lanes = self._lanes
        if lanes is not None:
            return lanes
        with self._lock:
            if self._lanes is None:
                self._lanes = concurrent.futures.ThreadPoolExecutor(
                    max_workers=4 * self._config.connections,
                    thread_name_prefix="kvtier-redis-lane")
            return self._lanes

    def close(self) -> None:
        with self._lock:
            if self._lanes is not None:
                # Lanes in flight end within a socket timeout; their callers answer False.
                self._lanes.shutdown(wait=False, cancel_futures=True)
