"""The file tier's kind: ``file://`` URLs, and its inventory (namespace directories under the
root, read with ``lstat``: symlinks and non-regular files are never followed or counted).

Stateless: every call walks the medium afresh.
"""

from __future__ import annotations

import contextlib
import os
import stat
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import Backend, NoTierError, OpenMode
from kvtier.backends.file.backend import SETTINGS, from_url
from kvtier.backends.file.layout import _SUFFIX, _TEMP_PREFIX, MANIFEST_NAME
from kvtier.backends.manifest import NamespaceUsage, is_digest, parse_manifest
from kvtier.backends.registry import FunctionKind

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


def _namespace_dirs(root: Path) -> list[Path]:
    _check_tier(root)
    return sorted(entry for entry in root.iterdir()
                  if is_digest(entry.name) and entry.is_dir() and not entry.is_symlink())


def _list_namespaces(url: str, options: dict[str, Any]) -> list[NamespaceUsage]:
    """One :class:`kvtier.ops.inventory.NamespaceUsage` per namespace directory under the root."""
    found = []
    for directory in _namespace_dirs(_parse(url, options)[0]):
        manifest = directory / MANIFEST_NAME
        data = manifest.read_bytes() if manifest.is_file() and not manifest.is_symlink() else None
        item = NamespaceUsage(digest=directory.name, fields=parse_manifest(data, directory.name))
        with contextlib.suppress(FileNotFoundError):
            item.add_disk(os.lstat(directory).st_blocks * 512)
        for parent, subdirs, files in os.walk(directory):
            for name in (*subdirs, *files):
                try:
                    info = os.lstat(os.path.join(parent, name))
                except FileNotFoundError:
                    continue  # removed while we walked
                item.add_disk(info.st_blocks * 512)  # st_blocks is in 512-byte units (POSIX)
                if name.endswith(_SUFFIX) and stat.S_ISREG(info.st_mode):
                    item.add_block(info.st_size, info.st_mtime)
        found.append(item)
    return found


def _delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    """Remove the blocks, temp files and manifest of each namespace, then its directories."""
    root = _parse(url, options)[0]
    wanted = set(digests)
    deleted = 0
    for directory in _namespace_dirs(root):
        if directory.name not in wanted:
            continue
        for parent, _subdirs, files in os.walk(directory, topdown=False):
            for name in files:
                if name.endswith(_SUFFIX) or name.startswith(_TEMP_PREFIX) or \
                        name == MANIFEST_NAME:
                    try:
                        os.unlink(os.path.join(parent, name))
                    except FileNotFoundError:
                        continue
                    deleted += 1
            # Not empty: something that is not ours, or a block written meanwhile.
            with contextlib.suppress(OSError):
                os.rmdir(parent)
    return deleted


KIND = FunctionKind(("file",), SETTINGS, from_url, remote=False, lister=_list_namespaces,
                    deleter=_delete_namespaces, url_check=_parse,
                    read_only_opener=_open_read_only)
"""``file:///absolute/path``: one framed file per block under the directory."""
