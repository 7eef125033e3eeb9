"""Publishing a written temp file as a block without ever overwriting one.

``renameat2(RENAME_NOREPLACE)`` where the C library and filesystem have it, else ``link`` +
``unlink``, else (no hard links) a check then ``replace``, where a racing writer of the same key
may replace the file with its identical frame. Every name is relative to a held directory
descriptor.

State and owners: :class:`Publisher` ``_mode`` is downgraded (never upgraded) by any caller
thread without a lock when the filesystem refuses a way: a stale read costs one more refusal.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import logging
import os
from typing import Any

from kvtier.backends.file.layout import _NO_LINK_ERRNOS

__all__ = ["RENAME_NOREPLACE", "LinkMode", "Publisher", "name_taken", "rename_noreplace",
           "renameat2"]

_log = logging.getLogger(__name__)
RENAME_NOREPLACE = 1


class LinkMode(enum.Enum):
    """How a temp file is published without overwriting, best first."""

    RENAME_NOREPLACE = "rename_noreplace"  # renameat2(RENAME_NOREPLACE): one atomic syscall
    HARD_LINK = "hard_link"  # link + unlink: atomic, two syscalls
    CHECK_THEN_REPLACE = "check_then_replace"  # racy fallback for filesystems without links


def _load_renameat2() -> Any:
    """glibc's ``renameat2`` (2.28+), or None where the C library lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    # No argtypes: every call passes small ints (descriptors, the flag) and bytes, which ctypes
    # converts to int and char* itself; declared argtypes cost 0.6 us a call (of ~3 us, with the
    # system call) on the store path.
    function.restype = ctypes.c_int
    return function


_renameat2 = _load_renameat2()
renameat2 = _renameat2
"""glibc's ``renameat2(src_dir, temp, dst_dir, final, flags)`` (bytes names; 0 or -1 with the
C ``errno`` set; see :func:`name_taken`), for the store loop that calls it inline; only where
:attr:`Publisher.refuses_existing` (else None)."""


def _rename_noreplace(src_dir: int, temp: str | bytes, dst_dir: int, final: str | bytes) -> None:
    """Atomically rename ``temp`` (under ``src_dir``) to ``final`` (under ``dst_dir``);
    FileExistsError if ``final`` exists."""
    if _renameat2(src_dir, temp if type(temp) is bytes else os.fsencode(temp), dst_dir,
                  final if type(final) is bytes else os.fsencode(final),
                  RENAME_NOREPLACE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), final)


def rename_noreplace(src_dir: int, temp: bytes, dst_dir: int, final: str) -> bool | None:
    """One ``renameat2(RENAME_NOREPLACE)``: True if published, False if ``final`` exists, None
    for any other failure (``temp`` is left; :class:`Publisher` handles and reports it).
    Only where :attr:`Publisher.refuses_existing`."""
    if _renameat2(src_dir, temp, dst_dir, final.encode(), RENAME_NOREPLACE) == 0:
        return True
    return False if ctypes.get_errno() == errno.EEXIST else None


def name_taken() -> bool:
    """Whether the last failed :data:`renameat2` of this thread found the name taken."""
    return ctypes.get_errno() == errno.EEXIST


class Publisher:
    """Publishes temp files under held directories (``fsync``: the directory too)."""

    __slots__ = ("_fsync", "_mode", "_where")

    def __init__(self, *, fsync: bool, where: str) -> None:
        self._fsync = fsync
        self._where = where
        self._mode = LinkMode.HARD_LINK if _renameat2 is None else LinkMode.RENAME_NOREPLACE

    @property
    def refuses_existing(self) -> bool:
        """Publishing refuses an existing name atomically (``RENAME_NOREPLACE``)."""
        return self._mode is LinkMode.RENAME_NOREPLACE

    def publish(self, src_dir: int, temp: str | bytes, dst_dir: int, final: str | bytes) -> bool:
        """Make ``temp`` visible as ``final`` unless it exists; True if ours was published
        (else ``temp`` is removed). Raises OSError."""
        published = True
        if self._mode is LinkMode.RENAME_NOREPLACE:
            try:
                _rename_noreplace(src_dir, temp, dst_dir, final)
            except FileExistsError:
                published = False
                os.unlink(temp, dir_fd=src_dir)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                _log.info("file backend: no RENAME_NOREPLACE under %s (%s); using hard links",
                          self._where, exc)
                self._mode = LinkMode.HARD_LINK
                return self.publish(src_dir, temp, dst_dir, final)
        elif self._mode is LinkMode.HARD_LINK:
            try:
                os.link(temp, final, src_dir_fd=src_dir, dst_dir_fd=dst_dir,
                        follow_symlinks=False)
            except FileExistsError:
                published = False
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS:
                    raise
                _log.info("file backend: no hard links under %s (%s); using replace",
                          self._where, exc)
                self._mode = LinkMode.CHECK_THEN_REPLACE
                return self.publish(src_dir, temp, dst_dir, final)
            os.unlink(temp, dir_fd=src_dir)
        else:
            try:
                os.stat(final, dir_fd=dst_dir, follow_symlinks=False)
            except FileNotFoundError:
                os.replace(temp, final, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
            else:
                published = False
                os.unlink(temp, dir_fd=src_dir)
        if self._fsync and published:
            os.fsync(dst_dir)
        return published
