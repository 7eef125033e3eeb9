"""The primary tier: one contiguous CPU arena of fixed-size block slots.

Thread ownership:

- The slot metadata (key <-> slot maps, slot states, pin counts, free list) and the eviction
  policy are owned by the engine scheduler thread; no method is thread-safe.
- The arena *bytes* are shared: the engine (or an engine worker process mapping the shared
  memory / file) writes a slot between ``reserve`` and ``commit``, and I/O threads of secondary
  tiers read or write a slot while the scheduler keeps it out of reach of eviction (a pin, or the
  ``FILLING`` state). The pool never touches the bytes itself.

Arena ownership: a ``shared_memory`` or ``mmap_file`` arena is created exclusively
(``O_CREAT|O_EXCL``, never an existing file or segment, never truncating one) and held under an
exclusive ``flock`` for the pool's life, so a second manager given the same name or path is refused
with :class:`ArenaError`. The pool removes what it created at :meth:`PrimaryPool.close`, and at
interpreter exit if it was never closed (a ``weakref.finalize``); only ``kill -9`` (or a signal
with no handler) can leave one behind, and the next manager then refuses the leftover by name.

A slot is ``FREE``, ``FILLING`` (reserved for a key whose bytes are being written: not readable,
not evictable) or ``RESIDENT`` (readable, evictable unless pinned); a slot whose load was
abandoned while its I/O may still write it is ``RETIRED`` (no key, never handed out) until
``reclaim``. A full pool is not an error:
``reserve`` answers None when every slot is filling or pinned.

Eviction order: the policy's (LRU, ARC), unless a ``victim_chooser`` is set (the manager's
prefetcher, which knows which resident blocks the engine above still holds itself): its pick,
when it names an evictable key, goes first, and the policy decides when it names none.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import mmap
import os
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import ClosedError, KvtierError
from kvtier.keys import BlockKey
from kvtier.policies import EvictionPolicy, PolicyName, SkipPredicate, make_policy
from kvtier.settings import ConfigError


class SlotState(enum.Enum):
    FREE = "free"
    FILLING = "filling"
    RESIDENT = "resident"


class PrimaryBacking(enum.Enum):
    """Where the arena's bytes live; the value is the config spelling."""

    HEAP = "heap"                    # private numpy buffer
    SHARED_MEMORY = "shared_memory"  # multiprocessing.shared_memory, mappable by name
    MMAP_FILE = "mmap_file"          # a file mapped MAP_SHARED (e.g. under /dev/shm or hugetlbfs)


class PoolError(KvtierError, RuntimeError):
    """A caller broke the pool's contract (pinning an absent key, committing twice, ...)."""


PoolClosedError = ClosedError  # the one closed error; this name is kept for callers


class ArenaError(ConfigError):
    """The arena cannot be created: the name or path is taken, refused, or too big for the
    memory there is. A :class:`~kvtier.settings.ConfigError`, so ``open_manager`` callers and
    the ``kvtier`` command report it as bad configuration naming the path."""


@dataclass(frozen=True, slots=True)
class PoolOccupancy:
    """A snapshot of the pool's slots: free, resident, filling, pinned (slots with a pin),
    ``pins`` (the pins summed) and retired (out of use until an abandoned load's I/O ends)."""

    free: int
    resident: int
    filling: int
    pinned: int
    pins: int
    retired: int


@dataclass(slots=True, frozen=True)
class Reservation:
    """A slot reserved for ``key``; ``evicted`` is the key that had to leave it, if any."""

    key: BlockKey
    slot: int
    evicted: BlockKey | None


class PrimaryPool:
    """``num_slots`` slots of ``block_bytes`` in one contiguous buffer, with pins and eviction."""

    def __init__(
        self,
        block_bytes: int,
        num_slots: int,
        policy: EvictionPolicy | PolicyName | str = PolicyName.LRU,
        *,
        backing: PrimaryBacking | str = PrimaryBacking.HEAP,
        path: str | None = None,
    ) -> None:
        if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes < 1:
            raise ValueError(f"block_bytes must be an int >= 1, got {block_bytes!r}")
        if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 1:
            raise ValueError(
                f"num_slots must be an int >= 1 (primary_bytes must hold at least one block), "
                f"got {num_slots!r}"
            )
        try:
            self._backing = PrimaryBacking(backing)
        except ValueError:
            raise ValueError(
                f"unknown primary backing {backing!r}; expected one of "
                f"{[b.value for b in PrimaryBacking]}"
            ) from None
        self._block_bytes = block_bytes
        self._num_slots = num_slots
        total = block_bytes * num_slots
        self._shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        self._path = path
        self._array: npt.NDArray[np.uint8]
        if self._backing is PrimaryBacking.HEAP and path is not None:
            raise ValueError("primary path is only valid with shared_memory or mmap_file")
        if self._backing is PrimaryBacking.MMAP_FILE and (not path or not os.path.isabs(path)):
            raise ValueError(f"mmap_file backing needs an absolute file path, got {path!r}")
        check_arena_fits(total, self._backing, path)
        self._owned: _OwnedArena | None = None
        if self._backing is PrimaryBacking.HEAP:
            try:
                # Anonymous mmap, not np.zeros: page-aligned slots (np.zeros' large blocks sit
                # 16 bytes into a page), so an O_DIRECT file tier reads and writes them in place.
                self._array = np.frombuffer(mmap.mmap(-1, max(total, 1)), dtype=np.uint8)[:total]
            except (MemoryError, OSError):
                raise ArenaError(f"primary pool of {total:,} bytes ({num_slots:,} slots of "
                                 f"{block_bytes:,}): not enough memory") from None
        elif self._backing is PrimaryBacking.SHARED_MEMORY:
            self._shm, self._owned = _create_shared_memory(path, total)
            self._path = self._shm.name
            self._array = np.ndarray((total,), dtype=np.uint8, buffer=self._shm.buf)
        else:
            if path is None:  # checked above; narrows the type
                raise ValueError("mmap_file backing needs an absolute file path, got None")
            self._mmap, self._owned = _create_arena_file(path, total)
            self._array = np.ndarray((total,), dtype=np.uint8, buffer=self._mmap)
        # Runs at close(), or at interpreter exit when the pool was never closed.
        self._release_owned = weakref.finalize(self, _release_arena, self._owned)
        self._arena: memoryview | None = memoryview(self._array.data).cast("B")
        self._policy: EvictionPolicy = (
            make_policy(policy, num_slots) if isinstance(policy, (str, PolicyName)) else policy
        )
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[BlockKey, int] = {}
        self._filling: set[BlockKey] = set()
        self._retired: set[int] = set()  # slots an abandoned load may still write
        self._pins: dict[BlockKey, int] = {}
        self.evictions = 0
        # The lowest-value resident key for which the predicate is False, or None (see the
        # module docstring); set by the owner of the pool, on the scheduler thread.
        self.victim_chooser: Callable[[SkipPredicate], BlockKey | None] | None = None
        self.chooser_refused = 0  # picks that named no evictable key (fell back to the policy)

    # ---- geometry -------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def path(self) -> str | None:
        """The shared-memory name or the mapped file's path, for another process to map."""
        return self._path

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def arena(self) -> memoryview:
        """The whole buffer (``num_slots * block_bytes`` bytes, writable)."""
        if self._arena is None:
            raise PoolClosedError("the primary pool is closed")
        return self._arena

    def as_array(self) -> npt.NDArray[np.uint8]:
        """The arena as a ``(num_slots, block_bytes)`` uint8 array (no copy)."""
        if self._arena is None:
            raise PoolClosedError("the primary pool is closed")
        return self._array.reshape(self._num_slots, self._block_bytes)

    def view(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes (writable, ``block_bytes`` long)."""
        if not isinstance(slot, int) or not 0 <= slot < self._num_slots:
            raise ValueError(f"slot must be an int in [0, {self._num_slots}), got {slot!r}")
        start = slot * self._block_bytes
        return self.arena[start : start + self._block_bytes]

    # ---- queries --------------------------------------------------------------------------
    def state_of(self, key: BlockKey) -> SlotState:
        if key not in self._slot_of:
            return SlotState.FREE
        return SlotState.FILLING if key in self._filling else SlotState.RESIDENT

    def is_resident(self, key: BlockKey) -> bool:
        return key in self._slot_of and key not in self._filling

    def resident_prefix_length(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are resident (the scheduler's hot path, kept tight)."""
        slot_of, filling = self._slot_of, self._filling
        count = 0
        for key in keys:
            if key not in slot_of or key in filling:
                break
            count += 1
        return count

    def slot_of(self, key: BlockKey) -> int | None:
        return self._slot_of.get(key)

    def pin_count(self, key: BlockKey) -> int:
        return self._pins.get(key, 0)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def occupancy(self) -> PoolOccupancy:
        """How the slots are used now (one snapshot; all counts are slots except ``pins``)."""
        return PoolOccupancy(
            free=len(self._free),
            resident=len(self._slot_of) - len(self._filling),
            filling=len(self._filling),
            pinned=len(self._pins),
            pins=sum(self._pins.values()),
            retired=len(self._retired),
        )

    # ---- transitions ----------------------------------------------------------------------
    def reserve(
        self, key: BlockKey, protect: Collection[BlockKey] = ()
    ) -> Reservation | None:
        """Reserve a slot for ``key`` (state FILLING), evicting an unpinned resident if needed.

        Keys in ``protect`` are not evicted either. None when no slot can be had.
        """
        if key in self._slot_of:
            raise PoolError(f"key {key.hex()} already has slot {self._slot_of[key]}")
        if self._arena is None:
            raise PoolClosedError("the primary pool is closed")
        evicted: BlockKey | None = None
        if self._free:
            slot = self._free.pop()
        else:
            pins = self._pins
            skip: Callable[[BlockKey], bool] = (
                (lambda k: k in pins or k in protect) if protect else pins.__contains__
            )
            evicted = None
            if self.victim_chooser is not None:
                evicted = _chosen_victim(self.victim_chooser, skip, self._slot_of, self._filling)
                if evicted is None or evicted is _STALE:
                    self.chooser_refused += evicted is _STALE
                    evicted = None
                else:
                    self._policy.remove(evicted)
            if evicted is None:
                evicted = self._policy.victim(skip, key)
            if evicted is None:
                return None
            slot = self._slot_of.pop(evicted)
            self.evictions += 1
        self._slot_of[key] = slot
        self._filling.add(key)
        return Reservation(key, slot, evicted)

    def evictable_count(self, protect: Collection[BlockKey] = ()) -> int:
        """How many slots ``reserve`` could hand out right now (free + unpinned resident)."""
        protected = sum(
            1 for key in protect if self.is_resident(key) and key not in self._pins
        )
        resident = len(self._slot_of) - len(self._filling)
        return len(self._free) + resident - len(self._pins) - protected

    def reserve_many(
        self, keys: Sequence[BlockKey], protect: Collection[BlockKey] = ()
    ) -> list[Reservation] | None:
        """Reserve a slot for every key, or for none (None) when the pool cannot hold them all."""
        if len(set(keys)) != len(keys):
            raise PoolError("reserve_many got duplicate keys")
        if self.evictable_count(protect) < len(keys):
            return None
        result: list[Reservation] = []
        for key in keys:
            reservation = self.reserve(key, protect)
            if reservation is None:  # cannot happen after the count check; stay safe anyway
                for done in result:
                    self.abort(done.key)
                return None
            result.append(reservation)
        return result

    def commit(self, key: BlockKey) -> int:
        """FILLING -> RESIDENT; returns the slot."""
        if key not in self._filling:
            raise PoolError(f"commit of key {key.hex()} that is not filling "
                            f"(state {self.state_of(key).value})")
        self._filling.discard(key)
        self._policy.insert(key)
        return self._slot_of[key]

    def abort(self, key: BlockKey) -> None:
        """FILLING -> FREE (the bytes never arrived)."""
        if key not in self._filling:
            raise PoolError(f"abort of key {key.hex()} that is not filling "
                            f"(state {self.state_of(key).value})")
        self._filling.discard(key)
        self._release_slot(key)

    def retire(self, key: BlockKey) -> int:
        """FILLING -> RETIRED: the load into ``key``'s slot was abandoned while its I/O may
        still write there, so the slot leaves circulation until :meth:`reclaim`. Returns it."""
        if key not in self._filling:
            raise PoolError(f"retire of key {key.hex()} that is not filling "
                            f"(state {self.state_of(key).value})")
        self._filling.discard(key)
        slot = self._slot_of.pop(key)
        self._retired.add(slot)
        return slot

    def reclaim(self, slot: int) -> None:
        """RETIRED -> FREE: nothing writes the slot any more."""
        if slot not in self._retired:
            raise PoolError(f"reclaim of slot {slot} that is not retired")
        self._retired.discard(slot)
        self._free.append(slot)

    def discard(self, key: BlockKey) -> bool:
        """RESIDENT and unpinned -> FREE. False (nothing done) when absent or pinned."""
        if not self.is_resident(key) or key in self._pins:
            return False
        self._policy.remove(key)
        self._release_slot(key)
        return True

    def _release_slot(self, key: BlockKey) -> None:
        self._free.append(self._slot_of.pop(key))

    def pin(self, key: BlockKey) -> int:
        """Protect a resident key's slot from eviction; pins nest. Returns the slot."""
        if not self.is_resident(key):
            raise PoolError(f"pin of key {key.hex()} that is not resident "
                            f"(state {self.state_of(key).value})")
        self._pins[key] = self._pins.get(key, 0) + 1
        return self._slot_of[key]

    def unpin(self, key: BlockKey) -> None:
        count = self._pins.get(key, 0)
        if count <= 0:
            raise PoolError(f"unpin of key {key.hex()} that is not pinned")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1

    def touch(self, key: BlockKey) -> None:
        if self.is_resident(key):
            self._policy.touch(key)

    def close(self) -> None:
        """Release the buffer (and unlink shared memory). Idempotent.

        Views handed out earlier must have been released; if one is still alive the mapping is
        left to the garbage collector instead of failing.
        """
        if self._arena is None:
            return
        with contextlib.suppress(BufferError):
            self._arena.release()
        self._arena = None
        self._array = np.zeros(0, dtype=np.uint8)
        if self._shm is not None:
            with contextlib.suppress(BufferError):
                self._shm.close()
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
        self._release_owned()

    def __enter__(self) -> PrimaryPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_STALE = b""  # a chooser's pick that is not evictable (never a real key: keys are not empty)


def _chosen_victim(chooser: Callable[[SkipPredicate], BlockKey | None], skip: SkipPredicate,
                   slot_of: dict[BlockKey, int], filling: set[BlockKey]) -> BlockKey | None:
    """The chooser's pick; None when it names none, ``_STALE`` when it names a key that is
    not evictable (the chooser's view of the pool was stale: counted, the policy decides)."""
    key = chooser(skip)
    if key is None:
        return None
    if key not in slot_of or key in filling or skip(key):
        return _STALE
    return key


class ArenaMapping:
    """Another process's mapping of a pool's arena (an engine worker reading/writing slots).

    Owned by the thread that created it. Slot metadata stays with the pool's owner; this only
    maps the bytes. For shared memory it detaches from Python's resource tracker, which would
    otherwise unlink the segment when this process exits (Python < 3.13 behaviour).
    """

    def __init__(self, backing: PrimaryBacking | str, path: str, block_bytes: int,
                 num_slots: int) -> None:
        kind = PrimaryBacking(backing)
        total = block_bytes * num_slots
        self._block_bytes = block_bytes
        self._num_slots = num_slots
        self._shm: shared_memory.SharedMemory | None = None
        self._mmap: mmap.mmap | None = None
        if kind is PrimaryBacking.SHARED_MEMORY:
            self._shm = shared_memory.SharedMemory(name=path, create=False)
            _untrack_shared_memory(self._shm)
            buffer: Any = self._shm.buf
        elif kind is PrimaryBacking.MMAP_FILE:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if size < total:
                    raise ValueError(f"arena {path!r} holds {size} bytes, expected at least "
                                     f"{total} ({num_slots} slots of {block_bytes})")
                self._mmap = mmap.mmap(fd, total, mmap.MAP_SHARED,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            buffer = self._mmap
        else:
            raise ValueError("a heap arena is private to its process; use shared_memory or "
                             "mmap_file backing to map it from another process")
        if len(buffer) < total:
            raise ValueError(f"arena {path!r} holds {len(buffer)} bytes, expected at least "
                             f"{total} ({num_slots} slots of {block_bytes})")
        self._array: npt.NDArray[np.uint8] = np.ndarray(
            (num_slots, block_bytes), dtype=np.uint8, buffer=buffer)

    def as_array(self) -> npt.NDArray[np.uint8]:
        """The arena as a ``(num_slots, block_bytes)`` uint8 array (no copy)."""
        return self._array

    def view(self, slot: int) -> memoryview:
        if not isinstance(slot, int) or not 0 <= slot < self._num_slots:
            raise ValueError(f"slot must be an int in [0, {self._num_slots}), got {slot!r}")
        return memoryview(self._array[slot].data).cast("B")

    def close(self) -> None:
        """Unmap (never unlinks: the pool's owner does that). Idempotent."""
        self._array = np.zeros((0, 0), dtype=np.uint8)
        if self._shm is not None:
            with contextlib.suppress(BufferError):
                self._shm.close()
            self._shm = None
        if self._mmap is not None:
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    def __enter__(self) -> ArenaMapping:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _untrack_shared_memory(segment: shared_memory.SharedMemory) -> None:
    from multiprocessing import resource_tracker

    with contextlib.suppress(Exception):
        resource_tracker.unregister(getattr(segment, "_name", "/" + segment.name),
                                    "shared_memory")



# --------------------------------------------------------------------------- arena ownership

@dataclass(slots=True)
class _OwnedArena:
    """What a pool created and must remove: a file (or /dev/shm segment) and its locked fd.

    ``inode`` identifies our file, so a path that was replaced meanwhile is left alone.
    """

    path: str
    fd: int
    inode: tuple[int, int]
    segment: shared_memory.SharedMemory | None = None


def _release_arena(owned: _OwnedArena | None) -> None:
    """Unlink the arena we created (if the path still names it) and drop the lock. Never
    raises: it also runs at interpreter exit."""
    if owned is None:
        return
    with contextlib.suppress(OSError):
        info = os.lstat(owned.path)
        if (info.st_dev, info.st_ino) == owned.inode:
            if owned.segment is not None:
                owned.segment.unlink()  # also tells Python's resource tracker
            else:
                os.unlink(owned.path)
    with contextlib.suppress(OSError):
        os.close(owned.fd)


def _lock_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _taken_message(what: str, path: str) -> str:
    """Why an existing file or segment at ``path`` is refused (never adopted, never truncated)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        held = False
    else:
        try:
            held = not _lock_exclusive(fd)
        finally:
            os.close(fd)
    if held:
        return (f"{what} {path!r} is the arena of another running kvtier manager (it holds the "
                f"lock); two managers never share an arena: give each its own primary_path")
    return (f"{what} {path!r} already exists and is not this manager's arena; kvtier never "
            f"adopts or truncates an existing file: choose another primary_path, or remove it "
            f"if it is left over from a kvtier process that was killed")


def _create_arena_file(path: str, total: int) -> tuple[mmap.mmap, _OwnedArena]:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ArenaError(_taken_message("primary_path", path)) from None
    except OSError as exc:
        raise ArenaError(f"primary_path {path!r}: cannot create the arena file: "
                         f"{exc.strerror or exc}") from None
    info = os.fstat(fd)
    owned = _OwnedArena(path, fd, (info.st_dev, info.st_ino))
    try:
        if not _lock_exclusive(fd):  # another process locked it between create and lock
            raise ArenaError(_taken_message("primary_path", path))
        os.ftruncate(fd, total)
        arena = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        _release_arena(owned)
        raise ArenaError(f"primary_path {path!r}: cannot size or map {total:,} bytes: "
                         f"{exc.strerror or exc}") from None
    except BaseException:
        _release_arena(owned)
        raise
    return arena, owned


def _create_shared_memory(name: str | None,
                          total: int) -> tuple[shared_memory.SharedMemory, _OwnedArena]:
    shown = name if name is not None else "(generated)"
    try:
        segment = shared_memory.SharedMemory(name=name, create=True, size=total)
    except FileExistsError:
        raise ArenaError(_taken_message("shared-memory segment",
                                        _shm_path(name or ""))) from None
    except (OSError, ValueError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        hint = " (a name is letters, digits, '-', '_', no '/')" if (
            isinstance(exc, OSError) and exc.errno == errno.EINVAL) else ""
        raise ArenaError(f"primary_path {shown!r}: cannot create a shared-memory segment of "
                         f"{total:,} bytes: {detail}{hint}") from None
    seg_path = _shm_path(segment.name)
    fd = os.open(seg_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    owned = _OwnedArena(seg_path, fd, (info.st_dev, info.st_ino), segment=segment)
    if not _lock_exclusive(fd):
        segment.close()
        _release_arena(owned)
        raise ArenaError(_taken_message("shared-memory segment", seg_path))
    return segment, owned


def _shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def available_memory_bytes(backing: PrimaryBacking | str,
                           path: str | None = None) -> int | None:
    """Bytes an arena of ``backing`` can have now: ``MemAvailable`` for the heap, the free
    space of ``/dev/shm`` or of ``path``'s filesystem for shared backings; None if unknown."""
    kind = PrimaryBacking(backing)
    try:
        if kind is PrimaryBacking.HEAP:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "/dev/shm" if kind is PrimaryBacking.SHARED_MEMORY else os.path.dirname(
            path or "/") or "/"
        stat = os.statvfs(where)
        if stat.f_blocks == 0:  # a pseudo filesystem (proc, sysfs) reports no size at all
            return None
        return stat.f_bavail * stat.f_frsize
    except (OSError, ValueError):
        return None


def check_arena_fits(total: int, backing: PrimaryBacking | str, path: str | None = None) -> None:
    """:class:`ArenaError` when an arena of ``total`` bytes cannot fit in the memory available
    to ``backing`` now (checked up front: a heap allocation would raise MemoryError, a shared
    mapping would crash the process with SIGBUS when the filesystem fills)."""
    available = available_memory_bytes(backing, path)
    if available is not None and total > available:
        kind = PrimaryBacking(backing)
        where = {PrimaryBacking.HEAP: "available memory (MemAvailable)",
                 PrimaryBacking.SHARED_MEMORY: "free space in /dev/shm",
                 PrimaryBacking.MMAP_FILE: f"free space next to {path!r}"}[kind]
        raise ArenaError(f"a primary pool of {total:,} bytes does not fit in the {where}: "
                         f"{available:,} bytes; lower primary_bytes (or --cpu-blocks / "
                         f"--block-bytes)")
