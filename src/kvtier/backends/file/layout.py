"""The file tier's on-disk layout and the system-call helpers its backend uses. Stateless,
except ``_TEMP_COUNTER`` (temp-file numbers shared by every instance in this process; ``next``
is atomic) and ``_Scratch`` (one aligned buffer per thread, owned by that thread).

Layout: ``<root>/<namespace digest hex>/<k0k1>/<key hex>.kvb`` (one fan-out level: at most 256
directories per namespace); keys whose hex would not fit one file name are split into nested
directories of 200 hex digits below the fan-out directory. Every component is hex, so no key can
name a path outside the root. The layout before it had two fan-out levels
(``<k0k1>/<k2k3>/<key hex>.kvb``, :attr:`Layout.TWO_LEVEL`): the restart scan moves such blocks
into the current layout, and ``usage`` / ``purge`` count and remove them.
"""

from __future__ import annotations

import enum
import errno
import itertools
import mmap
import os
import threading

import numpy as np

from kvtier import codec
from kvtier.backends.base import Buffer
from kvtier.keys import MAX_KEY_BYTES

_SUFFIX = ".kvb"
MANIFEST_NAME = "namespace.json"
"""The namespace manifest's file name in ``<root>/<digest>/``; never a block's name (those end
in ``.kvb`` one directory further down)."""
_TEMP_PREFIX = ".tmp-"
_TEMP_PREFIX_BYTES = os.fsencode(_TEMP_PREFIX)
_ALIGN = 4096
_MAX_NAME_HEX = 248  # longest hex in one file name (NAME_MAX is 255 with the suffix)
_CHUNK_HEX = 200
_DIR_MODE = 0o700
_FILE_MODE = 0o600
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW
# open() of a non-regular file at a block path: a symlink (ELOOP with O_NOFOLLOW), a socket
# (ENXIO), a FIFO without a writer never blocks thanks to O_NONBLOCK.
_NOT_REGULAR_ERRNOS = {errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.EMLINK}
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}
_MISSING_ERRNOS = {errno.ENOENT, errno.ENOTDIR}
# A read of what open() let through that is no regular file: a FIFO (ESPIPE: no pread on a
# pipe) or a directory (EISDIR).
_NOT_READABLE_ERRNOS = {errno.ESPIPE, errno.EISDIR}
# Temp-file sequence numbers, shared by every instance in this process (next() is atomic).
_TEMP_COUNTER = itertools.count()



class DirectIO(enum.Enum):
    """Whether the file backend uses O_DIRECT."""

    OFF = "off"  # not requested
    ACTIVE = "active"  # requested and working
    UNSUPPORTED = "unsupported"  # requested, the filesystem refused it: buffered I/O instead

def _claimed_length(header: Buffer) -> int:
    """The payload length a header claims (-1 if it is not even a frame header)."""
    try:
        return codec.payload_length(header)
    except codec.FrameError:
        return -1


def _round_up(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def is_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can move ``view`` as it is: whole pages at a page-aligned address."""
    nbytes = view.nbytes
    if not nbytes or nbytes % _ALIGN:
        return False
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % _ALIGN == 0


def is_trailer(page: Buffer | mmap.mmap) -> bool:
    """Whether ``page`` starts with a record of format 4 or newer (magic and version only; the
    template verifies the rest)."""
    return page[:4] == codec.MAGIC and page[4] | page[5] << 8 >= codec.TRAILER_VERSION


class Layout(enum.Enum):
    """Where a block file sits below its namespace directory."""

    CURRENT = "current"  # <k0k1>/<key hex>.kvb
    TWO_LEVEL = "two_level"  # <k0k1>/<k2k3>/<key hex>.kvb: written before one level sufficed


_MAX_DEPTH = 4
"""The deepest directory (below the namespace directory) a block of either layout can sit in: a
255-byte key is 510 hex digits, three 200-digit chunks, so two chunk directories below the
fan-out levels. Scans never descend further (a planted deep tree is not walked)."""


def _key_location(key_hex: str, layout: Layout = Layout.CURRENT
                  ) -> tuple[tuple[str, ...], str]:
    """(directory components below the namespace directory, file name) of a key."""
    fan = key_hex.ljust(4, "0")
    levels = (fan[0:2],) if layout is Layout.CURRENT else (fan[0:2], fan[2:4])
    if len(key_hex) <= _MAX_NAME_HEX:
        return levels, key_hex + _SUFFIX
    chunks = [key_hex[i : i + _CHUNK_HEX] for i in range(0, len(key_hex), _CHUNK_HEX)]
    return (*levels, *chunks[:-1]), chunks[-1] + _SUFFIX


def locate(key: bytes) -> tuple[tuple[str, ...], str]:
    """``_key_location`` of a key in the current layout, without tuple building for the
    common case (keys up to 124 bytes)."""
    key_hex = key.hex()
    if len(key_hex) <= _MAX_NAME_HEX:
        return (key_hex[0:2],), key_hex + _SUFFIX
    return _key_location(key_hex)


def key_from_location(parts: tuple[str, ...], name: str) -> tuple[bytes, Layout] | None:
    """The key and layout of a block file at ``parts`` / ``name``, or None for anything else
    (a foreign file, a temp file, a name in the wrong directory)."""
    if not name.endswith(_SUFFIX) or not parts:
        return None
    for layout, fan_levels in ((Layout.CURRENT, 1), (Layout.TWO_LEVEL, 2)):
        key_hex = "".join(parts[fan_levels:]) + name[: -len(_SUFFIX)]
        try:
            key = bytes.fromhex(key_hex)
        except ValueError:
            continue
        if 1 <= len(key) <= MAX_KEY_BYTES and key.hex() == key_hex and \
                _key_location(key_hex, layout) == (parts, name):
            return key, layout
    return None


def is_stray_temp(name: str, own_pid: int) -> bool:
    """Whether the temp file ``name`` was left by a process that is gone (or is not ours)."""
    pid_text = name[len(_TEMP_PREFIX) :].partition("-")[0]
    if not pid_text.isdigit():
        return True
    pid = int(pid_text)
    # Our own pid: a sibling instance in this process may be writing it right now.
    return pid != own_pid and not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Scratch(threading.local):
    """Page-aligned buffers per thread (aligned for O_DIRECT): one grown on demand, and one
    page a read lands a frame's trailer in (and an O_DIRECT write sends it from)."""

    def __init__(self) -> None:
        self.buffer: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.page: mmap.mmap | None = None

    def trailer_page(self) -> mmap.mmap:
        """The page (an mmap: page-aligned, and slicing it yields bytes at once)."""
        page = self.page
        if page is None:
            self.page = page = mmap.mmap(-1, _ALIGN)
        return page

    def get(self, size: int) -> memoryview:
        view = self.view
        if view is None or view.nbytes < size:
            # The old buffer is dropped, not closed: a caller may still hold a view of it.
            capacity = max(_ALIGN, 1 << (size - 1).bit_length())
            self.buffer = mmap.mmap(-1, capacity)
            self.view = view = memoryview(self.buffer)
        return view


def _write_all(fd: int, buffers: list[memoryview | bytes | mmap.mmap], *, skip: int = 0) -> None:
    """``writev`` until every byte is written (regular files rarely write short, but may),
    the first ``skip`` bytes being written already."""
    remaining = [memoryview(buffer).cast("B") for buffer in buffers]
    written = skip
    while remaining and written >= remaining[0].nbytes:
        written -= remaining.pop(0).nbytes
    if remaining and written:
        remaining[0] = remaining[0][written:]
    while remaining:
        written = os.writev(fd, remaining)
        if written == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        while remaining and written >= remaining[0].nbytes:
            written -= remaining[0].nbytes
            remaining.pop(0)
        if remaining and written:
            remaining[0] = remaining[0][written:]
