"""The file tier's scan of its namespace directory at open: the blocks it holds (the capacity
index is rebuilt from them), temp files of dead processes removed, and blocks of the old
two-level layout moved into the current one (and their emptied directories away).

State and owners: none. Every call walks the directory afresh under the caller's held view;
failures are reported through the caller's ``fail`` and ``unlink``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from typing import NamedTuple

from kvtier.backends.file.dirs import View, walk
from kvtier.backends.file.layout import (
    _TEMP_PREFIX,
    Layout,
    is_stray_temp,
    key_from_location,
    locate,
)
from kvtier.backends.file.publish import Publisher
from kvtier.keys import BlockKey

__all__ = ["Scanned", "scan_blocks"]

Fail = Callable[[str, object, BaseException], object]
"""The backend's ``_fail``: count and log one failure of (operation, what)."""
Unlink = Callable[[int, str, BlockKey | None], None]
"""The backend's ``_unlink_quietly``: remove a name under a directory, a missing one is fine."""


class Scanned(NamedTuple):
    """What a scan found and did."""

    blocks: list[tuple[BlockKey, int]]  # (key, size on disk), least recently modified first
    removed: int  # stray temp files removed
    moved: int  # two-level-layout blocks moved into the current layout


def scan_blocks(view: View, pid: int, *, writing: bool, publisher: Publisher,
                unlink: Unlink, fail: Fail) -> Scanned:
    """Walk the namespace directory held by ``view``. Not ``writing`` (READ_ONLY): no temp-file
    removal, no move; two-level-layout blocks are then not indexed."""
    found: list[tuple[int, BlockKey, int]] = []
    removed = moved = 0
    for parts, dir_fd, files, subdirs in walk(view.fd):
        for name in files:
            if name.startswith(_TEMP_PREFIX):
                if writing and is_stray_temp(name, pid):
                    unlink(dir_fd, name, None)
                    removed += 1
                continue
            located = key_from_location(parts, name)
            if located is None:
                continue
            try:
                info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            key, layout = located
            if layout is Layout.TWO_LEVEL:
                if not writing or not move_to_current(view, key, dir_fd, name, publisher, fail):
                    continue
                moved += 1
            found.append((info.st_mtime_ns, key, info.st_size))
        for subdir in subdirs if writing else ():  # the two-level layout's, emptied
            if len(parts) + 1 >= 2 and len((*parts, subdir)[1]) == 2:
                # not empty: a live writer's temp file, or not ours
                with contextlib.suppress(OSError):
                    os.rmdir(subdir, dir_fd=dir_fd)
    found.sort(key=lambda entry: entry[0])
    return Scanned([(key, size) for _mtime, key, size in found], removed, moved)


def move_to_current(view: View, key: BlockKey, dir_fd: int, name: str, publisher: Publisher,
                    fail: Fail) -> bool:
    """Rename a two-level-layout block to its current place; False where a block is there
    already (then this copy is removed) or the move failed."""
    parts, final = locate(key)
    try:
        target, owned = view.key_dir(parts, create=True)
        try:
            return publisher.publish(dir_fd, name, target, final)
        finally:
            if owned:
                os.close(target)
    except OSError as exc:
        fail("move to the current layout", key, exc)
        return False
