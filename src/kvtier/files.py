"""Reading a file a user named (a key file, a YAML config): only a regular file, never blocking.

Stateless. A FIFO, socket or device given where a file is expected would hang ``open`` or
``read`` forever (a FIFO blocks until a writer appears); here it is refused at once with a
:class:`~kvtier.settings.ConfigError` that names the path and what was expected.
"""

from __future__ import annotations

import os
import stat

from kvtier.settings import ConfigError

__all__ = ["read_regular_file"]

_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def read_regular_file(path: str | os.PathLike[str], what: str, *, max_bytes: int,
                      follow_symlinks: bool = True,
                      dir_fd: int | None = None) -> tuple[bytes, os.stat_result]:
    """The bytes of ``path`` (relative to ``dir_fd`` when given) and its ``fstat``;
    ``ConfigError`` for a missing, non-regular or larger-than-``max_bytes`` file (``what``
    names it in the message)."""
    flags = _FLAGS if follow_symlinks else _FLAGS | getattr(os, "O_NOFOLLOW", 0)
    shown = os.fspath(path)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise ConfigError(f"{what} {shown!r}: cannot read it: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what} {shown!r} is not a regular file (a FIFO, socket, device "
                              "or directory); expected a file")
        if info.st_size > max_bytes:
            raise ConfigError(f"{what} {shown!r} is {info.st_size:,} bytes; expected at most "
                              f"{max_bytes:,}")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:  # grew while we read it
        raise ConfigError(f"{what} {shown!r} is over {max_bytes:,} bytes; expected at most that")
    return data, info
