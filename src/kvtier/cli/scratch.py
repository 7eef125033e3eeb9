"""Scratch directories of ``kvtier replay``'s default file tier, and their cleanup after a crash.

The default file tier lives in ``kvtier-run-<pid>-<random>`` under the scratch parent, with an
``owner`` file naming the pid and its start time. A later run removes such directories whose
owner is gone (pid dead, or reused by another process), so a ``kill -9`` costs disk space only
until the next run.

Thread ownership: :class:`ScratchDir` owns its directory and is used on the command's main
thread; the functions here keep no state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SCRATCH_PREFIX = "kvtier-run-"
_OWNER_FILE = "owner"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _owner_alive(directory: Path) -> bool:
    try:
        pid_text, _, started = (directory / _OWNER_FILE).read_text().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return False  # no readable owner: a directory we never finished creating, or foreign
    current = _start_time(pid)
    return current is not None and current == started


def remove_stale_scratch(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove ``kvtier-run-*`` directories under ``parent`` that this user owns and whose owner
    process is gone; returns what was removed. Never raises."""
    removed: list[Path] = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(SCRATCH_PREFIX):
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not entry.is_dir() or entry.is_symlink() or info.st_uid != uid:
            continue
        if _owner_alive(entry):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    return removed


class ScratchDir:
    """A private run directory under ``parent`` that records its owner and is removed at exit."""

    __slots__ = ("path",)

    def __init__(self, parent: str | os.PathLike[str]) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=parent))
        (self.path / _OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> ScratchDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def check_scratch_parent(parent: str) -> str | None:
    """Why ``parent`` cannot hold scratch directories, or None when it can."""
    path = Path(parent)
    if not path.exists():
        return f"{parent!r} does not exist"
    if not path.is_dir():
        return f"{parent!r} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{parent!r} is not writable by this user"
    return None


