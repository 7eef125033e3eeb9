"""The file tier's kind: ``file://`` URLs, and its inventory (namespace directories under the
root, walked by descriptor with ``O_NOFOLLOW``: symlinks are never followed, non-regular files
never counted, and only kvtier's own names are counted or removed).

Stateless: every call walks the medium afresh.
"""

from __future__ import annotations

import contextlib
import os
import stat
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import Backend, NoTierError, OpenMode
from kvtier.backends.file.backend import SETTINGS, from_url
from kvtier.backends.file.dirs import DIR_FLAGS, DirRule, Sharing, anchor, walk
from kvtier.backends.file.layout import _READ_FLAGS, _TEMP_PREFIX, MANIFEST_NAME, key_from_location
from kvtier.backends.manifest import MAX_MANIFEST_BYTES, NamespaceUsage, is_digest, parse_manifest
from kvtier.backends.registry import FunctionKind
from kvtier.settings import ConfigError

__all__ = ["KIND"]


def _parse(url: str, options: Mapping[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The root directory of a file tier URL and its options (validated like ``from_url``)."""
    parts, merged = split_url_options(url, options)
    parsed = SETTINGS.parse(merged, "file")  # unknown or bad options fail as they do at open
    path = urllib.parse.unquote(parts.path)
    if parts.scheme != "file" or parts.netloc or not path.startswith("/"):
        raise ValueError(f"file backend URL {redact_url(url)!r}: expected file:///absolute/path")
    return Path(path), parsed


def _check_tier(root: Path) -> None:
    """:class:`NoTierError` unless ``root`` is a directory (a look never creates it)."""
    if not root.is_dir():
        problem = "does not exist" if not os.path.lexists(root) else "is not a directory"
        raise NoTierError(f"no kvtier tier at {root.as_uri()}: {str(root)!r} {problem}")


def _open_read_only(url: str, namespace: Any, options: dict[str, Any]) -> Backend:
    """``OpenMode.READ_ONLY``: no root, namespace directory or manifest is created, no stray
    temp file removed, nothing evicted; a missing root is :class:`NoTierError`."""
    root, _options = _parse(url, options)  # a bad URL or option: ValueError, before the look
    _check_tier(root)
    return from_url(url, namespace, options, OpenMode.READ_ONLY)


def _open_root(url: str, options: Mapping[str, Any]) -> int:
    """The root's descriptor, reached like the tier reaches it (``O_NOFOLLOW`` from ``/``).
    No owner or mode check: listing and purging read and remove only kvtier's own names."""
    root = _parse(url, options)[0]
    _check_tier(root)
    try:
        return anchor(str(root), DirRule(os.geteuid(), Sharing.SHARED), create=False)[0]
    except (OSError, ConfigError):  # replaced meanwhile
        raise NoTierError(f"no kvtier tier at {root.as_uri()}: {str(root)!r} is not a "
                          "directory") from None


def _namespace_dirs(root_fd: int) -> Iterator[tuple[str, int]]:
    """(digest, descriptor) of every namespace directory under the root, sorted; a symlink or
    anything that is not a directory is skipped. Each descriptor lives until the next item."""
    listing = os.open(".", DIR_FLAGS, dir_fd=root_fd)  # our own: scandir moves its offset
    try:
        with os.scandir(listing) as entries:
            names = sorted(entry.name for entry in entries
                           if is_digest(entry.name) and entry.is_dir(follow_symlinks=False))
    finally:
        os.close(listing)
    for name in names:
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
        except OSError:
            continue  # removed meanwhile, or swapped for a symlink
        try:
            yield name, fd
        finally:
            os.close(fd)


def _read_manifest(ns_fd: int) -> bytes | None:
    try:
        fd = os.open(MANIFEST_NAME, _READ_FLAGS, dir_fd=ns_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)


def _list_namespaces(url: str, options: dict[str, Any]) -> list[NamespaceUsage]:
    """One :class:`kvtier.ops.inventory.NamespaceUsage` per namespace directory under the root:
    regular files at block names of either layout (:class:`.layout.Layout`) are counted."""
    found = []
    root_fd = _open_root(url, options)
    try:
        for digest, ns_fd in _namespace_dirs(root_fd):
            item = NamespaceUsage(digest=digest,
                                  fields=parse_manifest(_read_manifest(ns_fd), digest))
            for parts, dir_fd, files, _subdirs in walk(ns_fd):
                with contextlib.suppress(OSError):
                    # st_blocks is in 512-byte units (POSIX); every directory walked, files below
                    item.add_disk(os.fstat(dir_fd).st_blocks * 512)
                for name in files:
                    try:
                        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while we walked
                    item.add_disk(info.st_blocks * 512)
                    if stat.S_ISREG(info.st_mode) and key_from_location(parts, name) is not None:
                        item.add_block(info.st_size, info.st_mtime)
            found.append(item)
    finally:
        os.close(root_fd)
    return found


def _delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    """Remove the blocks (either layout), temp files and manifest of each namespace, then its
    directories."""
    wanted = set(digests)
    deleted = 0
    root_fd = _open_root(url, options)
    try:
        for digest, ns_fd in _namespace_dirs(root_fd):
            if digest not in wanted:
                continue
            for parts, dir_fd, files, subdirs in walk(ns_fd):
                for name in files:
                    if key_from_location(parts, name) is None and \
                            not name.startswith(_TEMP_PREFIX) and \
                            not (name == MANIFEST_NAME and not parts):
                        continue
                    try:
                        os.unlink(name, dir_fd=dir_fd)
                    except FileNotFoundError:
                        continue
                    deleted += 1
                for subdir in subdirs:
                    # Not empty: something that is not ours, or a block written meanwhile.
                    with contextlib.suppress(OSError):
                        os.rmdir(subdir, dir_fd=dir_fd)
        for digest in sorted(wanted):
            with contextlib.suppress(OSError):
                os.rmdir(digest, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    return deleted


KIND = FunctionKind(("file",), SETTINGS, from_url, remote=False, lister=_list_namespaces,
                    deleter=_delete_namespaces, url_check=_parse,
                    read_only_opener=_open_read_only)
"""``file:///absolute/path``: one framed file per block under the directory."""
