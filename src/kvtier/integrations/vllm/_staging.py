"""Prefetch staging memory of the vLLM :class:`~kvtier.integrations.vllm.KvtierTier`.

Under vLLM, kvtier sees lookups, loads and stores but not vLLM's own CPU tier, so it cannot
promote a finished request's blocks back into that tier. Instead, when a request finishes, the
blocks of its chain are read ahead from the backend into a bounded staging memory (``budget``
bytes); a later load of a staged block is a memory copy into vLLM's primary chunk, not a disk or
network read. vLLM pauses between an agent's turns are what this fills.

Rules:

- **Budget and value.** At most ``budget // block_bytes`` blocks are staged or being read. A
  block is worth less the deeper it sits in its chain (a prefix hit needs every block before
  it), and among equal depths the most recently admitted is worth least: that one is evicted
  (staged: ``wasted``; still queued or being read: ``cancelled``) to make room for a block of
  more value; a chain is admitted in prefix order and stops at its first block that does not
  fit. A staged block that a load used leaves the staging memory at once (vLLM's CPU tier now
  holds it).
- **Bandwidth.** One reader thread, at most one batch of ``batch_blocks`` in flight, and a
  batch starts only when the tier has no transfer in flight (``step(idle=True)``), so a demand
  load never waits behind a prefetch read and a prefetch never reads a block whose store is
  still being written. A demand load of a block still queued or being read does not wait for
  it: that prefetch is cancelled and the load reads the backend.
- **Verified, never stale.** Staged bytes are a frame the backend verified (namespace, key,
  length, checksum; the MAC with ``auth_key``), and their xxh3 digest is checked again before
  they are served (a mismatch is counted ``corrupt`` and the load reads the backend). A staged
  block is dropped (``wasted``) as soon as this tier sees its backend copy change or go: a probe
  that finds it absent, a failed load, a store or a delete through this tier (a store keeps a
  block still queued: its read comes after the store, as reads wait for an idle tier, so a
  chain admitted while its own stores are in flight is read, not cancelled); and it expires
  after ``ttl_s``. Keys are content hashes inside the namespace, so another writer can replace
  a block only with another verified copy of the same KV; ``ttl_s`` bounds how long a change
  that this tier cannot see (another instance deleting it) goes unnoticed.

Threads and state:

- ``_lock`` guards ``_entries`` (key -> :class:`_Entry`), ``_reserved`` (blocks staged or being
  read), ``_expiry`` (staged entries in staging order), ``_queue`` (entries to read, in
  admission order), ``_reading`` (whether a batch is with the reader) and ``_counts``. They are
  written by the scheduler thread (:meth:`PrefetchStaging.admit_chain`, :meth:`step`), the
  tier's I/O threads (:meth:`serve`, :meth:`discard` through :class:`StagedReads`), the probe
  thread (:meth:`discard`) and the reader thread (publishing a batch). The lock is held for
  table updates only, never for a copy or a backend call; a staged buffer being copied out is
  pinned (``_Entry.pins``) so eviction skips it.
- The reader thread owns the buffers of the batch it reads until it publishes them under
  ``_lock``; ``_batches`` (a ``queue.SimpleQueue``) hands it batches.
- ``_next_sequence`` is the scheduler thread's.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import xxhash

from kvtier.backends.base import Backend, Buffer
from kvtier.backends.stats import RateLimitedLog
from kvtier.keys import BlockKey
from kvtier.settings import ConfigError

__all__ = ["PrefetchCounts", "PrefetchStaging", "StagedReads", "chain_of", "open_staging"]

_log = logging.getLogger(__name__)
_READER_STOP_WAIT_S = 5.0


class EntryState(enum.Enum):
    QUEUED = "queued"    # admitted, waiting for the reader
    READING = "reading"  # handed to the reader thread
    STAGED = "staged"    # verified bytes in memory, servable


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    depth: int     # position in its chain (0: the first block)
    sequence: int  # admission order (higher: admitted later, worth less at equal depth)
    state: EntryState = EntryState.QUEUED
    buffer: bytearray | None = None
    digest: int = 0
    staged_at: float = 0.0
    pins: int = 0

    def value_rank(self) -> tuple[int, int]:
        """Larger is worth less (evicted first)."""
        return (self.depth, self.sequence)


@dataclass(slots=True)
class PrefetchCounts:
    """Blocks, cumulative. ``prefetched``: read ahead and staged; ``used``: served to a load;
    ``wasted``: staged and dropped unused (evicted, expired, invalidated); ``cancelled``:
    dropped before staging (a demand load took the key, or the room was needed); ``missing``:
    the backend did not have them (or the read failed); ``corrupt``: staged bytes whose digest
    no longer matched (not served)."""

    prefetched_blocks: int = 0
    used_blocks: int = 0
    wasted_blocks: int = 0
    cancelled_blocks: int = 0
    missing_blocks: int = 0
    corrupt_blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


class PrefetchStaging:
    """A bounded staging memory filled ahead of demand (see the module docstring)."""

    def __init__(self, backend: Backend, *, budget_bytes: int, block_bytes: int, ttl_s: float,
                 batch_blocks: int, name: str = "staging",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``budget_bytes`` must hold at least one block of ``block_bytes`` (the caller
        validates its settings and names them in its error)."""
        if block_bytes <= 0 or budget_bytes < block_bytes:
            raise ValueError(f"staging {name}: budget {budget_bytes} bytes holds no block of "
                             f"{block_bytes} bytes")
        self._backend = backend
        self._capacity = budget_bytes // block_bytes
        self._block_bytes = block_bytes
        self._ttl_s = ttl_s
        self._batch_blocks = max(1, batch_blocks)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[BlockKey, _Entry] = {}
        self._reserved = 0
        self._expiry: deque[_Entry] = deque()
        self._queue: deque[_Entry] = deque()
        self._reading = False
        self._reader_idle = threading.Event()  # set while no batch is with the reader
        self._reader_idle.set()
        self._counts = PrefetchCounts()
        self._next_sequence = itertools.count()
        self._closed = False
        self._io_log = RateLimitedLog(_log)
        self._batches: queue.SimpleQueue[list[_Entry] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_batches, name=f"kvtier-prefetch-{name}",
                                        daemon=True)
        self._reader.start()

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    # -- scheduler thread -------------------------------------------------------------------

    def admit_chain(self, chain: Sequence[BlockKey]) -> int:
        """Queue ``chain``'s blocks (prefix order) for reading, within the budget; returns how
        many were newly admitted. Blocks already staged or queued keep their entry (at the
        better depth of the two)."""
        admitted = 0
        sequence = next(self._next_sequence)
        with self._lock:
            if self._closed:
                return 0
            for depth, key in enumerate(chain):
                entry = self._entries.get(key)
                if entry is not None:
                    entry.depth = min(entry.depth, depth)
                    continue
                candidate = _Entry(key, depth, sequence)
                if self._reserved >= self._capacity and not self._evict_below(candidate):
                    break  # deeper blocks are worth even less: the chain stops here
                self._entries[key] = candidate
                self._reserved += 1
                self._queue.append(candidate)
                admitted += 1
        return admitted

    def step(self, *, idle: bool) -> None:
        """Once per engine step: expire old staged blocks; with the tier ``idle`` (no transfer
        in flight) and no batch with the reader, hand it the next batch."""
        with self._lock:
            self._expire()
            if not idle or self._reading or self._closed:
                return
            batch: list[_Entry] = []
            while self._queue and len(batch) < self._batch_blocks:
                entry = self._queue.popleft()
                if self._entries.get(entry.key) is entry and entry.state is EntryState.QUEUED:
                    entry.state = EntryState.READING
                    batch.append(entry)
            if not batch:
                return
            self._reading = True
            self._reader_idle.clear()
        self._batches.put(batch)

    def counts(self) -> PrefetchCounts:
        with self._lock:
            return PrefetchCounts(**self._counts.as_dict())

    def staged_bytes(self) -> int:
        with self._lock:
            return sum(1 for entry in self._entries.values()
                       if entry.state is EntryState.STAGED) * self._block_bytes

    def state_of(self, key: BlockKey) -> EntryState | None:
        """Where ``key`` is in the staging memory (None: not there); for tests and tools."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.state

    def wait_reader(self, timeout: float) -> bool:
        """Wait until no batch is with the reader (tests, shutdown); False on timeout."""
        return self._reader_idle.wait(timeout)

    def shutdown(self) -> None:
        """Stop the reader (waits for its batch, bounded) and free every buffer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._batches.put(None)
        self._reader.join(_READER_STOP_WAIT_S)
        with self._lock:
            self._entries.clear()
            self._queue.clear()
            self._expiry.clear()
            self._reserved = 0

    # -- any thread -------------------------------------------------------------------------

    def serve(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        """Copy the staged blocks of ``keys`` into ``outs`` (True where served). A key still
        queued or being read is cancelled (the caller reads it from the backend)."""
        served = [False] * len(keys)
        taken: list[tuple[int, _Entry]] = []
        with self._lock:
            for index, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is None:
                    continue
                if entry.state is not EntryState.STAGED:
                    self._drop(entry)
                    continue
                if self._ttl_s and self._clock() - entry.staged_at > self._ttl_s:
                    self._drop(entry)
                    continue
                entry.pins += 1
                taken.append((index, entry))
        corrupt: list[_Entry] = []
        for index, entry in taken:
            buffer = entry.buffer
            out = outs[index]
            if buffer is None or out.nbytes != len(buffer):
                corrupt.append(entry)
                continue
            out[:] = buffer  # one memory copy
            if xxhash.xxh3_64_intdigest(out) != entry.digest:
                corrupt.append(entry)
                continue
            served[index] = True
        with self._lock:
            for index, entry in taken:
                entry.pins -= 1
                if self._entries.get(entry.key) is not entry:
                    continue
                if served[index]:
                    self._counts.used_blocks += 1
                    self._remove(entry)
                else:
                    self._counts.corrupt_blocks += 1
                    self._drop(entry)
        if corrupt:
            self._io_log.warning("prefetch staging: %d staged blocks failed their digest check; "
                                 "read from the backend instead", len(corrupt))
        return served

    def discard(self, keys: Sequence[BlockKey], *, keep_queued: bool = False) -> None:
        """The backend's copy of ``keys`` changed or went: their staged copies are dropped.
        ``keep_queued`` (a store through this tier): a block still queued stays, as its read
        starts only with the tier idle, after the store, and so reads the new copy; a finished
        request's chain, admitted while its own stores are in flight, is not cancelled by
        them."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and not (keep_queued and entry.state is EntryState.QUEUED):
                    self._drop(entry)

    # -- under _lock ------------------------------------------------------------------------

    def _evict_below(self, candidate: _Entry) -> bool:
        """Free one block for ``candidate`` by dropping the entry worth least, if it is worth
        less than ``candidate``; False when none is."""
        victims = [entry for entry in self._entries.values() if entry.pins == 0]
        if not victims:
            return False
        victim = max(victims, key=_Entry.value_rank)
        if victim.value_rank() <= candidate.value_rank():
            return False
        self._drop(victim)
        return True

    def _drop(self, entry: _Entry) -> None:
        """Remove ``entry`` unused: wasted if staged, cancelled if queued or being read."""
        if entry.state is EntryState.STAGED:
            self._counts.wasted_blocks += 1
        else:
            self._counts.cancelled_blocks += 1
        self._remove(entry)

    def _remove(self, entry: _Entry) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self._reserved -= 1
        entry.buffer = None

    def _expire(self) -> None:
        if not self._ttl_s:
            return
        horizon = self._clock() - self._ttl_s
        pending = self._expiry
        while pending and pending[0].staged_at < horizon:
            entry = pending.popleft()
            if self._entries.get(entry.key) is entry and entry.pins == 0:
                self._drop(entry)

    # -- reader thread ----------------------------------------------------------------------

    def _read_batches(self) -> None:
        while True:
            batch = self._batches.get()
            if batch is None:
                return
            try:
                self._read(batch)
            except Exception as exc:  # never leave a batch marked in flight: prefetch stops
                self._io_log.warning("prefetch staging: batch of %d blocks dropped: %r",
                                     len(batch), exc)
                with self._lock:
                    for entry in batch:
                        if self._entries.get(entry.key) is entry:
                            self._counts.cancelled_blocks += 1
                            self._remove(entry)
                    self._reading = False
                    self._reader_idle.set()

    def _read(self, batch: list[_Entry]) -> None:
        buffers = [bytearray(self._block_bytes) for _ in batch]
        try:
            results = self._backend.get_many([entry.key for entry in batch],
                                             [memoryview(buffer) for buffer in buffers])
        except Exception as exc:  # the reader survives everything; nothing is staged
            self._io_log.warning("prefetch staging: read of %d blocks failed: %r", len(batch),
                                 exc)
            results = [False] * len(batch)
        digests = [xxhash.xxh3_64_intdigest(buffer) if ok is True else 0
                   for buffer, ok in zip(buffers, results, strict=False)]
        with self._lock:
            now = self._clock()
            for position, entry in enumerate(batch):
                ok = position < len(results) and results[position] is True
                if self._entries.get(entry.key) is not entry:
                    continue  # cancelled while it was read: counted then
                if not ok:
                    self._counts.missing_blocks += 1
                    self._remove(entry)
                    continue
                entry.buffer = buffers[position]
                entry.digest = digests[position]
                entry.staged_at = now
                entry.state = EntryState.STAGED
                self._expiry.append(entry)
                self._counts.prefetched_blocks += 1
            self._reading = False
            self._reader_idle.set()


class StagedReads:
    """The tier's backend as its :class:`~kvtier.tiering.tier.SecondaryTier` sees it: loads
    are served from the staging memory first, and what tells of a changed backend copy (a probe
    answering absent, a failed read, a store, a delete) drops the staged copy. Everything else
    is the backend's. Thread-safe (the backend is; the staging memory locks)."""

    def __init__(self, backend: Backend, staging: PrefetchStaging) -> None:
        self._backend = backend
        self._staging = staging

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        served = self._staging.serve(keys, outs)
        rest = [index for index, ok in enumerate(served) if not ok]
        if not rest:
            return served
        loaded = self._backend.get_many([keys[index] for index in rest],
                                        [outs[index] for index in rest])
        failed = [keys[index] for index, ok in zip(rest, loaded, strict=False) if ok is not True]
        if failed:
            self._staging.discard(failed)
        for index, ok in zip(rest, loaded, strict=False):
            served[index] = ok is True
        return served

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        self._staging.discard(keys, keep_queued=True)
        return self._backend.put_many(keys, payloads)

    def probe(self, keys: Sequence[BlockKey]) -> list[bool]:
        present = self._backend.probe(keys)
        gone = [key for key, ok in zip(keys, present, strict=False) if not ok]
        if gone:
            self._staging.discard(gone)
        return present

    def delete(self, keys: Sequence[BlockKey]) -> None:
        self._staging.discard(keys)
        self._backend.delete(keys)

    def close(self) -> None:
        self._staging.shutdown()
        self._backend.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def open_staging(backend: Backend, *, prefetch_bytes: int, ttl_s: float, block_bytes: int,
                 batch_blocks: int, where: str) -> PrefetchStaging | None:
    """The staging memory ``prefetch_bytes`` configures (None: 0, off); a budget smaller than
    one block is a :class:`~kvtier.settings.ConfigError` naming it."""
    if prefetch_bytes == 0:
        return None
    if prefetch_bytes < block_bytes:
        raise ConfigError(f"{where}.prefetch_bytes: {prefetch_bytes} bytes holds no block of "
                          f"this deployment ({block_bytes} bytes); expected 0 (off) or at "
                          f"least {block_bytes}")
    return PrefetchStaging(backend, budget_bytes=prefetch_bytes, block_bytes=block_bytes,
                           ttl_s=ttl_s, batch_blocks=batch_blocks, name=backend.url)


def chain_of(req_context: object) -> list[BlockKey]:
    """A finished vLLM request's block chain, in prefix order.

    vLLM's offloading connector records the end-token position of every offload key of the
    request, the ones its GPU prefix cache served included, in the request's ``ReqContext``
    (``set_offload_key_position``); the secondary tier gets that context in
    ``on_request_finished``. vLLM gives no public way to list them, so this reads the record
    itself and is empty where a vLLM version lacks it (no prefetch then).
    """
    positions = getattr(req_context, "_offload_key_positions", None)
    if not isinstance(positions, dict) or not positions:
        return []
    return [bytes(key) for key, _ in sorted(positions.items(), key=lambda item: item[1])]
