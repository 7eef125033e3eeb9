"""One block's frame (payload, then its trailer; :mod:`.layout`) written to or read from an
open descriptor: buffered or ``O_DIRECT``, and the rare path that reads a file whole to judge it.

A buffered read lands in the caller's buffer (``preadv`` of header and payload, one verification
pass); ``o_direct`` reads and unaligned ``o_direct`` writes go through a page-aligned per-thread
buffer.

State and owners: none of its own. ``scratch`` is the caller's ``_Scratch`` (one aligned buffer
per thread, owned by that thread); whether O_DIRECT is used is the caller's, told through
``on_direct_refused`` when a filesystem refuses it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from functools import partial

from kvtier import codec
from kvtier.backends.base import Fetched, Outcome
from kvtier.backends.file.layout import (
    _ALIGN,
    _CREATE_FLAGS,
    _FILE_MODE,
    _O_DIRECT,
    _claimed_length,
    _round_up,
    _Scratch,
    _write_all,
    is_aligned,
    is_trailer,
)

__all__ = ["inode_of", "read_frame", "read_whole", "write_direct", "write_temp"]

_MAX_WHOLE_READ = 1 << 30
"""The largest file the rare path reads whole to judge it (a bigger one is no block)."""


def inode_of(fd: int) -> int | None:
    """The inode of the open file ``fd`` (the token of a block found bad), None if unknown."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


# ------------------------------------------------------------------ writes

def write_temp(dir_fd: int, temp: str | bytes, trailer: bytes, view: memoryview, *,
               direct: bool, fsync: bool, scratch: _Scratch,
               on_direct_refused: Callable[[OSError], None]) -> None:
    """Write the frame (payload, then its trailer) to ``temp``. Raises OSError.

    Where O_DIRECT is refused (EINVAL at open or at write), ``on_direct_refused`` is told and
    the frame written buffered."""
    if direct:
        try:
            fd = os.open(temp, _CREATE_FLAGS | _O_DIRECT, _FILE_MODE, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            on_direct_refused(exc)
            return write_temp(dir_fd, temp, trailer, view, direct=False, fsync=fsync,
                              scratch=scratch, on_direct_refused=on_direct_refused)
    else:
        fd = os.open(temp, _CREATE_FLAGS, _FILE_MODE, dir_fd=dir_fd)
    try:
        if direct:
            try:
                write_direct(fd, trailer, view, scratch)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # Some filesystems accept O_DIRECT at open and refuse it at write.
                os.close(fd)
                fd = -1
                os.unlink(temp, dir_fd=dir_fd)
                on_direct_refused(exc)
                return write_temp(dir_fd, temp, trailer, view, direct=False, fsync=fsync,
                                  scratch=scratch, on_direct_refused=on_direct_refused)
        else:
            written = os.writev(fd, (view, trailer))
            if written != view.nbytes + len(trailer):  # a short write: rare
                _write_all(fd, [view, trailer], skip=written)
        if fsync:
            os.fsync(fd)
    finally:
        if fd >= 0:
            os.close(fd)
    return None


def write_direct(fd: int, trailer: bytes, view: memoryview, scratch: _Scratch) -> None:
    """O_DIRECT: whole pages from aligned memory, then the file cut to the frame's size.

    A page-aligned payload of whole pages (an engine's pool slot) is written from where it
    is, its trailer from a page of its own; any other payload is copied once into the
    per-thread aligned buffer."""
    nbytes = view.nbytes
    frame_len = nbytes + len(trailer)
    if is_aligned(view):
        page = scratch.trailer_page()
        page[: len(trailer)] = trailer
        page[len(trailer):] = bytes(_ALIGN - len(trailer))
        _write_all(fd, [view, page])
    else:
        size = _round_up(frame_len)
        buffer = scratch.get(size)
        buffer[:nbytes] = view
        buffer[nbytes:frame_len] = trailer
        buffer[frame_len:size] = bytes(size - frame_len)
        _write_all(fd, [buffer[:size]])
    os.ftruncate(fd, frame_len)


# ------------------------------------------------------------------ reads

def read_frame(fd: int, out: memoryview, direct: bool, scratch: _Scratch) -> Fetched:
    """One ``preadv``: the payload straight into ``out``, the trailer into a page of this
    thread's (O_DIRECT where ``out`` is page-aligned whole pages; else the whole frame
    through the aligned buffer, one copy)."""
    nbytes = out.nbytes
    expected = nbytes + codec.HEADER_BYTES
    page = scratch.trailer_page()
    if not direct or is_aligned(out):
        count = os.preadv(fd, (out, page), 0)
        if count == expected and is_trailer(page):
            return Fetched(Outcome.OK, header=page[: codec.HEADER_BYTES],
                           payload_bytes=nbytes, token=partial(inode_of, fd))
        return read_whole(fd, scratch)
    buffer = scratch.get(_round_up(expected) + _ALIGN)
    count = os.preadv(fd, (buffer,), 0)
    if count == expected and is_trailer(buffer[nbytes:]):
        return Fetched(Outcome.OK, frame=buffer[:expected], token=partial(inode_of, fd))
    return read_whole(fd, scratch)


def read_whole(fd: int, scratch: _Scratch) -> Fetched:
    """The rare path: a file that is not a format-4 frame of the caller's size.

    It may be a valid block of another size (kept for the template to count and remove), a
    format-3 block written before format 4 (served; the next store rewrites it), a newer
    kvtier's (refused, left) or a damaged one. The file is read whole (bounded) and handed
    to the template, cut to the frame its header states where it is a padded format-3 one;
    a file that is not regular, or too large to be a block, is corrupt.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a FIFO, directory or device: never read
        return Fetched(Outcome.CORRUPT, token=info.st_ino)
    size = info.st_size
    if size < codec.HEADER_BYTES or size > _MAX_WHOLE_READ:
        return Fetched(Outcome.CORRUPT, token=info.st_ino)
    capacity = _round_up(size) + _ALIGN
    buffer = scratch.get(capacity)
    count = os.preadv(fd, [buffer[:capacity]], 0)
    if count != size:
        return Fetched(Outcome.CORRUPT, token=info.st_ino)
    frame = buffer[:size]
    if codec.record_offset(frame) == 0 and _claimed_length(frame) >= 0:
        frame_len = codec.HEADER_BYTES + _claimed_length(frame)
        if size == _round_up(frame_len) > frame_len:  # a padded O_DIRECT format-3 file
            frame = buffer[:frame_len]
    return Fetched(Outcome.OK, frame=frame, token=info.st_ino)
