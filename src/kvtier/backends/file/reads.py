"""The file tier's reads of a batch of blocks: in one native call per batch where the extension
``_batchio`` is built (:mod:`.native`), else one ``open`` + ``preadv`` + ``close`` per block
from Python.

Why native: every system call made from Python gives the interpreter lock up and takes it back.
Under an engine whose scheduler thread steps in Python back to back, each take-back waits for
that thread, so a read of three system calls per block ran at half the disk's speed inside vLLM
(``benchmarks/engine_load.py --modes direct --trace``: 96-106 ms for 256 blocks of 256 KiB where
vLLM's own ``fs`` tier, native too, took 53-69 ms; 55-64 ms through the native call). The native
call opens and reads a whole batch with the lock released once (the namespace directory's
check made inside it, :meth:`TierDirs.acquire_guarded`); what the results mean, and
every trust rule (``O_NOFOLLOW |
O_NONBLOCK``, descriptors relative to the held fan-out directories, a read of exactly the
frame's size, verification by the template) stays here and in the backend. Where the tier has
no ``auth_key`` the same call also checks each block read whole against the codec's trailer
template for its key (``FrameCodec.is_current``'s rule, xxh3 included, while the payload is
still in cache): such a block needs nothing more; any other goes to the template's judge.

State and owners: ``_BatchBuffers`` (per thread: the trailer pages a batch lands in and the
result array; owned by the reading thread, reused by its next batch once every descriptor of
the last one is closed). :class:`FileReads` is a mixin of the backend and keeps no state of its
own.
"""

from __future__ import annotations

import array
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterator
from functools import partial

from kvtier import codec
from kvtier.backends.base import COPIED_FETCH, FAILED_FETCH, MISSING_FETCH, Fetched, Outcome
from kvtier.backends.file.capacity import CapacityIndex
from kvtier.backends.file.dirs import Guard, GuardRefused, NamespaceGoneError, TierDirs, View
from kvtier.backends.file.frameio import inode_of, read_whole
from kvtier.backends.file.layout import (
    _ALIGN,
    _MISSING_ERRNOS,
    _O_DIRECT,
    _READ_FLAGS,
    _SUFFIX,
    DirectIO,
    _Scratch,
    is_aligned,
    is_trailer,
)
from kvtier.backends.file.native import BATCHIO, NativeIO, require_batchio
from kvtier.backends.stats import BackendStats
from kvtier.codec import FrameCodec
from kvtier.codec.record import _CHECK_OFFSET, _KEY_OFFSET
from kvtier.keys import BlockKey

__all__ = ["BATCH_KEYS", "FileReads"]

BATCH_KEYS = 64
"""Blocks per native call (and descriptors a reading thread holds open at once)."""

_SUFFIX_BYTES = os.fsencode(_SUFFIX)
_NOT_TAKEN = BATCHIO.NOT_TAKEN if BATCHIO is not None else -(1 << 62)
"""A result slot the native call skipped, or whose descriptor it closed (never an errno)."""


class _BatchBuffers(threading.local):
    """One page per block of a batch for its trailer, and the int64 result pairs."""

    def __init__(self) -> None:
        self.pages = mmap.mmap(-1, BATCH_KEYS * _ALIGN)  # page-aligned, as O_DIRECT needs
        self.page_views = [memoryview(self.pages)[i * _ALIGN : (i + 1) * _ALIGN]
                           for i in range(BATCH_KEYS)]
        # Every slot starts as "no descriptor": close_fds after a call that raised before
        # filling them closes nothing (close_fds marks what it closed the same way).
        self.results = array.array("q", [_NOT_TAKEN, 0] * BATCH_KEYS)
        self.verified = bytearray(BATCH_KEYS)  # read_frames' seal verdicts (1: exact frame)


_BUFFERS = _BatchBuffers()


def _batch_names(view: View, keys: list[BlockKey],
                 outs: list[memoryview] | None = None) -> tuple[list[int], list[bytes]]:
    """Each key's held fan-out directory and file name for one native call; -1 (and no name)
    for a key the call is not to take: a long key, a directory that cannot be held, or with
    ``outs`` (O_DIRECT) a destination that is not whole aligned pages."""
    dir_fds: list[int] = []
    names: list[bytes] = []
    for index, key in enumerate(keys):
        key_hex = key.hex()
        dir_fd = -1 if outs is not None and not is_aligned(outs[index]) else \
            view.block_fan(key_hex, create=False)
        dir_fds.append(dir_fd)
        names.append(key_hex.encode() + _SUFFIX_BYTES if dir_fd >= 0 else b"")
    return dir_fds, names


def _judged_then_closed(item: Fetched, fd: int) -> Iterator[Fetched]:
    """``item``, then its descriptor closed (-1: none). The descriptor stays open while the
    template judges the item: a bad frame's token (its inode) is taken from it then, and only
    then."""
    try:
        yield item
    finally:
        if fd >= 0:
            os.close(fd)


class FileReads:
    """``_m_fetch`` of :class:`~kvtier.backends.file.backend.FileBackend` (a mixin: the
    attributes and methods below are the backend's)."""

    _dirs: TierDirs
    _direct_io: DirectIO
    _capacity: CapacityIndex
    _scratch: _Scratch
    _native_io: NativeIO
    _stats: BackendStats
    _codec: FrameCodec
    # The backend's and the template's (annotations only: a stub here would shadow them).
    _fetch_one: Callable[[View, BlockKey, memoryview], tuple[Fetched, int]]
    _open_failed: Callable[..., Fetched | None]  # (key, exc, *, direct)
    _evict_files: Callable[..., None]  # (view, victims, *, count=True)
    _fail: Callable[[str, object, BaseException], Outcome]
    _exists_one: Callable[[View, BlockKey], Outcome]

    def _m_fetch(self, keys: list[BlockKey], outs: list[memoryview]) -> Iterator[Fetched]:
        if self._native_io is NativeIO.ACTIVE:
            with self._dirs.guarded() as guarded:
                if guarded is not None:
                    view, guard = guarded
                    try:
                        yield from self._fetch_batches(view, keys, outs, guard)
                        return
                    except GuardRefused:
                        pass  # nothing was read: the careful path below looks again
        try:
            view = self._dirs.acquire()
        except NamespaceGoneError:
            yield from (MISSING_FETCH for _key in keys)
            return
        except OSError as exc:
            for key in keys:
                self._fail("get", key, exc)
                yield FAILED_FETCH
            return
        try:
            if self._native_io is NativeIO.ACTIVE:
                yield from self._fetch_batches(view, keys, outs, None)
            elif self._direct_io is DirectIO.ACTIVE or self._capacity.bounded:
                yield from self._fetch_each(view, keys, outs)
            else:
                yield from self._fetch_buffered(view, keys, outs)
        finally:
            self._dirs.release(view)

    def _exists_guarded(self, keys: list[BlockKey]) -> list[Outcome] | None:
        """:meth:`_exists_native` with the namespace directory checked inside the call; None
        where that cannot answer (the view is due for replacement, or the check did not hold):
        the caller takes the careful path."""
        with self._dirs.guarded() as guarded:
            if guarded is None:
                return None
            view, guard = guarded
            return self._exists_native(view, keys, guard)

    def _exists_native(self, view: View, keys: list[BlockKey],
                       guard: Guard | None = None) -> list[Outcome] | None:
        """Each key's file looked at in one native call (no symlink followed): a regular file
        is OK, an absent one MISSING, anything else MISSING too (a read removes it). A key the
        call does not take (its fan-out directory not held, a long key) or whose look failed
        otherwise is looked at by :meth:`_exists_one`, which also counts the failure. None
        where ``guard`` did not hold (nothing was looked at)."""
        native = require_batchio()
        dir_fds, names = _batch_names(view, keys)
        modes = array.array("q", bytes(8 * len(keys)))
        if not native.stat_names(dir_fds, names, modes, guard):
            return None
        outcomes: list[Outcome] = []
        for key, mode in zip(keys, modes, strict=True):
            if mode >= 0:
                outcomes.append(Outcome.OK if stat.S_ISREG(mode) else Outcome.MISSING)
            elif -mode in _MISSING_ERRNOS:
                outcomes.append(Outcome.MISSING)
            else:  # not taken, or an error: the careful path answers and counts
                outcomes.append(self._exists_one(view, key))
        return outcomes

    def _fetch_each(self, view: View, keys: list[BlockKey],
                    outs: list[memoryview]) -> Iterator[Fetched]:
        """Block by block through :meth:`_fetch_one` (O_DIRECT or a size cap, in Python)."""
        for key, out in zip(keys, outs, strict=True):
            yield from _judged_then_closed(*self._fetch_one(view, key, out))

    def _fetch_buffered(self, view: View, keys: list[BlockKey],
                        outs: list[memoryview]) -> Iterator[Fetched]:
        """Buffered and unbounded, in Python: ``_fetch_one``'s good path inline (one open and
        one preadv per block, no call per step); anything else (a fan-out directory missing, an
        error, a short read) goes through ``_fetch_one``."""
        page = self._scratch.trailer_page()
        for key, out in zip(keys, outs, strict=True):
            key_hex = key.hex()
            dir_fd = view.block_fan(key_hex, create=False)
            item: Fetched | None = None
            fd = -1
            if dir_fd >= 0:
                try:
                    fd = os.open(key_hex + _SUFFIX, _READ_FLAGS, dir_fd=dir_fd)
                except OSError as exc:
                    item = self._open_failed(key, exc, direct=False)
                else:
                    item = self._read_buffered(fd, out, page)
                    if item is None:  # the read raised: _fetch_one gives the answer
                        os.close(fd)
                        fd = -1
            if item is None:
                item, fd = self._fetch_one(view, key, out)
            yield from _judged_then_closed(item, fd)

    def _read_buffered(self, fd: int, out: memoryview, page: mmap.mmap) -> Fetched | None:
        """The buffered read of an open block file: the payload into ``out``, the trailer into
        ``page``; None where the read raised (the caller asks :meth:`_fetch_one`)."""
        try:
            count = os.preadv(fd, (out, page), 0)
        except OSError:
            return None
        if count == out.nbytes + codec.HEADER_BYTES and is_trailer(page):
            return Fetched(Outcome.OK, header=page[: codec.HEADER_BYTES],
                           payload_bytes=out.nbytes, token=partial(inode_of, fd))
        try:
            return read_whole(fd, self._scratch)
        except OSError:
            return None

    def _fetch_batches(self, view: View, keys: list[BlockKey], outs: list[memoryview],
                       guard: Guard | None) -> Iterator[Fetched]:
        """:meth:`_fetch_native` batch by batch, the first one checking ``guard`` (raises
        :class:`GuardRefused` before any item where it does not hold)."""
        for start in range(0, len(keys), BATCH_KEYS):
            yield from self._fetch_native(view, keys[start : start + BATCH_KEYS],
                                          outs[start : start + BATCH_KEYS],
                                          guard if start == 0 else None)

    def _fetch_native(self, view: View, keys: list[BlockKey], outs: list[memoryview],
                      guard: Guard | None) -> Iterator[Fetched]:
        """At most ``BATCH_KEYS`` blocks opened and read in one native call; a block it does not
        take (a fan-out directory not held, a name too long for one level, an O_DIRECT
        destination that is not whole aligned pages) goes through :meth:`_fetch_one`. Raises
        :class:`GuardRefused` (having read nothing) where ``guard`` does not hold."""
        direct = self._direct_io is DirectIO.ACTIVE
        native = require_batchio()
        dir_fds, names = _batch_names(view, keys, outs if direct else None)
        buffers = _BUFFERS
        results, verified = buffers.results, buffers.verified
        template = self._codec.seal_template(len(keys[0]), outs[0].nbytes)
        seal = None if template is None else (keys, template, len(keys[0]), outs[0].nbytes,
                                              _KEY_OFFSET, _CHECK_OFFSET, verified)
        left_open: int | None = None  # unknown until the call returns: close what it reported
        try:
            left_open = native.read_frames(dir_fds, names, outs, buffers.pages, _ALIGN, results,
                                           _READ_FLAGS | (_O_DIRECT if direct else 0), seal,
                                           guard)
            if left_open == native.GUARD_REFUSED:
                raise GuardRefused
            self._stats.add_many({"native_reads": sum(fd >= 0 for fd in dir_fds),
                                  "sealed_reads": 0 if seal is None
                                  else verified.count(1, 0, len(keys))})
            adopt = self._capacity.bounded
            for index, (key, out) in enumerate(zip(keys, outs, strict=True)):
                if seal is not None and verified[index]:
                    # Read whole and exactly the current frame of this key (checked in the call,
                    # FrameCodec.is_current's rule): nothing left to judge.
                    if adopt:
                        self._evict_files(view, self._capacity.adopt(
                            key, out.nbytes + codec.HEADER_BYTES))
                    yield COPIED_FETCH
                else:
                    yield from self._answer(view, key, out, index, direct)
        finally:
            if left_open is None or left_open > 0:  # an exact block's was closed in the call
                native.close_fds(results, len(keys))

    def _answer(self, view: View, key: BlockKey, out: memoryview, index: int,
                direct: bool) -> Iterator[Fetched]:
        """What slot ``index`` of the batch holds (one item)."""
        results = _BUFFERS.results
        fd, got = results[2 * index], results[2 * index + 1]
        item: Fetched | None = None
        if fd != _NOT_TAKEN and fd < 0:  # the open failed: -errno
            item = self._open_failed(key, OSError(-fd, os.strerror(-fd)), direct=direct)
        elif fd >= 0 and got == out.nbytes + codec.HEADER_BYTES and \
                is_trailer(page := _BUFFERS.page_views[index]):
            item = Fetched(Outcome.OK, header=bytes(page[: codec.HEADER_BYTES]),
                           payload_bytes=out.nbytes, token=partial(inode_of, fd))
        elif fd >= 0 and got >= 0:  # another size or format: read whole, judged by the template
            try:
                item = read_whole(fd, self._scratch)
            except OSError:
                item = None
        if item is None:  # not taken, the read failed, or O_DIRECT refused: the careful path
            yield from _judged_then_closed(*self._fetch_one(view, key, out))
            return
        if self._capacity.bounded and item.outcome is Outcome.OK:
            self._evict_files(view, self._capacity.adopt(key, out.nbytes + codec.HEADER_BYTES))
        yield item
