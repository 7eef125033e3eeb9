"""The file tier's common store as one loop: a batch of frames written and published with the
raw write + rename's four system calls per block and no call of ours in between.

Used where the store needs nothing else (buffered, no fsync, RENAME_NOREPLACE; under
``max_bytes`` the backend reserves the whole batch first); the backend (:mod:`.backend`) passes
what the loop cannot decide itself to its own slow paths. :func:`put_sealed` goes one step
further for the unkeyed store: the native call seals each trailer too (key echo, xxh3), so a
batch costs no Python pass per block at all.

State and owners: none of its own. ``view`` (its fan-out cache, :mod:`.dirs`) and ``stored``
are the calling thread's for the call; the temp-name counter is process-wide (``next`` is
atomic).
"""

from __future__ import annotations

import array
import enum
import errno
import itertools
import mmap
import operator
import os
from collections.abc import Callable, Sequence
from itertools import repeat
from types import ModuleType

from kvtier.backends.base import Outcome, StoredFrame
from kvtier.backends.file.dirs import Guard, View
from kvtier.backends.file.layout import (
    _ALIGN,
    _CREATE_FLAGS,
    _FILE_MODE,
    _O_DIRECT,
    _SUFFIX,
    _write_all,
    is_aligned,
)
from kvtier.backends.file.publish import RENAME_NOREPLACE, name_taken
from kvtier.backends.file.publish import renameat2 as _renameat2
from kvtier.codec.record import _CHECK_OFFSET, _KEY_OFFSET
from kvtier.keys import BlockKey

__all__ = ["StoreStage", "put_native", "put_plain", "put_sealed"]

Slow = Callable[[StoredFrame], Outcome]
"""Stores one frame the careful way and reports what went wrong (the backend's ``_put_one``)."""
Rare = Callable[[int, bytes, StoredFrame, bool], Outcome]
"""Cleans up after a temp file under a fan-out descriptor that was not published (``True``: a
file holds the block's name) and answers for the frame (the backend's ``_put_rare``)."""


def put_plain(view: View, frames: list[StoredFrame], stored: list[tuple[BlockKey, int]], *,
              temp_prefix: bytes, counter: itertools.count[int], slow: Slow,
              rare: Rare) -> list[Outcome]:
    """Store ``frames`` under ``view``: create ``<temp_prefix><n>`` under the cached fan-out
    directory, ``writev`` payload and trailer (no join: the payload is never copied), close,
    ``renameat2(RENAME_NOREPLACE)``. Each published block is appended to ``stored`` as (key,
    file size). A long key or a fan-out directory that cannot be cached goes to ``slow``; a
    failed write or rename to ``rare``."""
    outcomes = [Outcome.OK] * len(frames)
    add = stored.append
    for index, frame in enumerate(frames):
        key, trailer, payload = frame
        key_hex = key.hex()
        fan = view.block_fan(key_hex, create=True)
        if fan < 0:
            outcomes[index] = slow(frame)
            continue
        temp = b"%s%d" % (temp_prefix, next(counter))
        try:
            fd = os.open(temp, _CREATE_FLAGS, _FILE_MODE, dir_fd=fan)
        except OSError:
            outcomes[index] = slow(frame)
            continue
        size = payload.nbytes + len(trailer)
        try:
            written = os.writev(fd, (payload, trailer))
            if written != size:  # a short write: rare
                _write_all(fd, [payload, trailer], skip=written)
        except OSError:
            written = -1
        os.close(fd)
        if written >= 0 and _renameat2(fan, temp, fan, (key_hex + _SUFFIX).encode(),
                                       RENAME_NOREPLACE) == 0:
            add((key, size))
            continue
        outcomes[index] = rare(fan, temp, frame, written >= 0 and name_taken())
    return outcomes


class StoreStage(enum.IntEnum):
    """Where a native store (``write_frames``, ``store_sealed`` in ``_batchio.c``) left a block."""

    STORED = 0
    OPEN_FAILED = 1  # no temp file was created
    WRITE_FAILED = 2  # the temp file stands: its write, cut or close failed
    RENAME_FAILED = 3  # the temp file stands: it was not published (errno EEXIST: name taken)
    SKIPPED = 4  # store_sealed only: not its block (another shape, an uncached fan-out directory)


_STORED, _OPEN_FAILED, _WRITE_FAILED = StoreStage.STORED, StoreStage.OPEN_FAILED, \
    StoreStage.WRITE_FAILED


def put_native(view: View, frames: list[StoredFrame], stored: list[tuple[BlockKey, int]], *,
               temp_prefix: bytes, counter: itertools.count[int], slow: Slow, rare: Rare,
               native: ModuleType, direct: bool = False) -> list[Outcome]:
    """:func:`put_plain`'s loop in one native call (``write_frames``: the same four system calls
    per block with the interpreter lock released once); its answers are read as
    :func:`put_plain` reads its own calls'. ``direct``: O_DIRECT, as
    :func:`.frameio.write_direct` writes it (a payload of whole aligned pages from where it is,
    its trailer from a page of its own, the file cut to the frame's size); any other payload
    goes to ``slow``, which copies it into an aligned buffer."""
    outcomes = [Outcome.OK] * len(frames)
    taken = None if direct else _common_batch(view, frames, temp_prefix, counter)
    if taken is None:
        taken = _sorted_batch(view, frames, outcomes, temp_prefix, counter, slow, direct)
    batch, fan_fds, temps, finals = taken
    if not batch:
        return outcomes
    results = array.array("q", bytes(16 * len(batch)))
    whole = len(batch) == len(frames)
    payloads = list(map(_PAYLOAD, frames)) if whole else [frames[i].payload for i in batch]
    if direct:
        _write_direct(native, frames, batch, fan_fds, temps, finals, payloads, results)
    else:
        headers = list(map(_HEADER, frames)) if whole else [frames[i].header for i in batch]
        native.write_frames(fan_fds, temps, finals, payloads, headers, results, _CREATE_FLAGS,
                            _FILE_MODE)
        if whole and results.count(_STORED) == len(results):
            # Every frame published (the common case): no pass per frame in Python. (A payload
            # is a flat byte view: its len is its nbytes.)
            stored.extend(zip(map(_KEY, frames), map(operator.add, map(len, payloads),
                                                     map(len, headers)), strict=True))
            return outcomes
    for slot, index in enumerate(batch):
        stage, code = results[2 * slot], results[2 * slot + 1]
        frame = frames[index]
        if stage == _STORED:
            stored.append((frame.key, frame.payload.nbytes + len(frame.header)))
        elif stage == _OPEN_FAILED:
            outcomes[index] = slow(frame)
        else:  # the temp file stands: its write or rename failed
            outcomes[index] = rare(fan_fds[slot], temps[slot], frame,
                                   stage != _WRITE_FAILED and code == errno.EEXIST)
    return outcomes


_KEY, _HEADER, _PAYLOAD = map(operator.itemgetter, range(3))  # StoredFrame's fields
_Taken = tuple[Sequence[int], list[int], list[bytes], list[bytes]]
"""The frames the native call takes: their indexes, fan-out descriptors, temp and final names."""


def _common_batch(view: View, frames: list[StoredFrame], temp_prefix: bytes,
                  counter: itertools.count[int]) -> _Taken | None:
    """The whole batch, built without a Python loop per frame, where every key is short and
    its fan-out directory cached (the common store); None for :func:`_sorted_batch`."""
    hexes = [key.hex() for key in map(_KEY, frames)]
    fan_fds = view.cached_fans(hexes)
    if fan_fds is None:
        return None
    temps = [b"%s%d" % (temp_prefix, number) for number in itertools.islice(counter, len(hexes))]
    finals = [(key_hex + _SUFFIX).encode() for key_hex in hexes]
    return range(len(frames)), fan_fds, temps, finals


def _sorted_batch(view: View, frames: list[StoredFrame], outcomes: list[Outcome],
                  temp_prefix: bytes, counter: itertools.count[int], slow: Slow,
                  direct: bool) -> _Taken:
    """The frames the native call can take, one by one (fan-out directories opened as needed);
    the others go to ``slow`` now, their outcome set."""
    batch: list[int] = []
    fan_fds: list[int] = []
    temps: list[bytes] = []
    finals: list[bytes] = []
    for index, frame in enumerate(frames):
        key_hex = frame.key.hex()
        fan = view.block_fan(key_hex, create=True)
        if fan < 0 or (direct and not is_aligned(frame.payload)):
            outcomes[index] = slow(frame)
            continue
        batch.append(index)
        fan_fds.append(fan)
        temps.append(b"%s%d" % (temp_prefix, next(counter)))
        finals.append((key_hex + _SUFFIX).encode())
    return batch, fan_fds, temps, finals


def _write_direct(native: ModuleType, frames: list[StoredFrame], batch: Sequence[int],
                  fan_fds: list[int], temps: list[bytes], finals: list[bytes],
                  payloads: list[memoryview], results: array.array[int]) -> None:
    """``write_frames`` with O_DIRECT: each trailer from a zeroed page of its own, each file
    cut to its frame's size."""
    pages = mmap.mmap(-1, _ALIGN * len(batch))  # zeroed, page-aligned: the trailer pages
    trailers: list[bytes | memoryview] = []
    for slot, index in enumerate(batch):
        header = frames[index].header
        pages[slot * _ALIGN : slot * _ALIGN + len(header)] = header
        trailers.append(memoryview(pages)[slot * _ALIGN : (slot + 1) * _ALIGN])
    lengths = [payload.nbytes + len(frames[i].header) for payload, i in zip(payloads, batch,
                                                                            strict=True)]
    native.write_frames(fan_fds, temps, finals, payloads, trailers, results,
                        _CREATE_FLAGS | _O_DIRECT, _FILE_MODE, lengths)
    trailers.clear()  # no view left on the pages
    pages.close()


Unpublished = tuple[int, StoreStage, int, bytes]
"""A block :func:`put_sealed` did not publish: its index, stage, errno and temp file name."""


def put_sealed(view: View, keys: list[BlockKey], payloads: list[memoryview],
               stored: list[tuple[BlockKey, int]], *, template: bytes, temp_prefix: bytes,
               counter: itertools.count[int], native: ModuleType,
               guard: Guard | None = None, direct: bool = False) -> list[Unpublished] | None:
    """:func:`put_native` for an unkeyed batch, with each trailer sealed in the same native call
    (``store_sealed``): ``template`` (:meth:`.FrameCodec.seal_template` of the first block's
    key and payload lengths) gets the block's key echo and xxh3 check there, so that nothing
    runs in Python per block. Each published block is appended to ``stored`` as (key, file
    size); the others are returned, for the backend's careful paths: SKIPPED and OPEN_FAILED
    left nothing behind, WRITE_FAILED and RENAME_FAILED left their temp file under the block's
    fan-out directory (``view.fan_table``). ``direct``: O_DIRECT, as :func:`put_native`
    writes it (a payload that is not whole aligned pages is skipped). None, having written
    nothing, where ``guard`` (:meth:`.TierDirs.acquire_guarded`) did not hold."""
    count = len(keys)
    numbers = list(itertools.islice(counter, count))
    results = array.array("q", bytes(16 * count))
    if not native.store_sealed(view.fan_table, keys, payloads, numbers, template, len(keys[0]),
                               payloads[0].nbytes, _KEY_OFFSET, _CHECK_OFFSET, temp_prefix,
                               _SUFFIX_BYTES, results,
                               _CREATE_FLAGS | (_O_DIRECT if direct else 0), _FILE_MODE, guard):
        return None
    record = len(template)
    if results.count(0) == len(results):  # every block published, every errno 0
        stored.extend(zip(keys, map(operator.add, map(len, payloads), repeat(record)),
                          strict=True))
        return []
    unpublished: list[Unpublished] = []
    for index, key in enumerate(keys):
        stage = StoreStage(results[2 * index])
        if stage is StoreStage.STORED:
            stored.append((key, payloads[index].nbytes + record))
        else:
            unpublished.append((index, stage, results[2 * index + 1],
                                b"%s%d" % (temp_prefix, numbers[index])))
    return unpublished


_SUFFIX_BYTES = _SUFFIX.encode()
