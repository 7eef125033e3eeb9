"""The S3-compatible kind: ``s3://bucket[/prefix]`` URLs, and its inventory (LIST the prefix,
one ``<digest>/`` per namespace). Stateless: every call makes its own client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import obstore
from obstore.exceptions import NotFoundError
from obstore.store import S3Store

from kvtier.backends.manifest import NamespaceUsage, is_digest, parse_manifest
from kvtier.backends.registry import FunctionKind
from kvtier.backends.s3 import (
    MANIFEST_NAME,
    SETTINGS,
    _make_store,
    from_url,
    parse_s3_url,
)

__all__ = ["KIND"]

_DELETE_CHUNK = 1000  # the most keys one S3 DeleteObjects request takes


def _usage_store(url: str, options: dict[str, Any]) -> tuple[S3Store, str]:
    """A client for the bucket of ``url`` and the object prefix above the namespaces."""
    settings = parse_s3_url(url, options)
    return _make_store(settings), f"{settings.prefix}/" if settings.prefix else ""


def _list_namespaces(url: str, options: dict[str, Any]) -> list[NamespaceUsage]:
    """LIST the prefix; one entry per ``<digest>/`` with its blocks' sizes and LastModified."""
    store, base = _usage_store(url, options)
    found: dict[str, NamespaceUsage] = {}
    manifests: list[str] = []
    for chunk in obstore.list(store, prefix=base or None, chunk_size=1000):
        for meta in chunk:
            digest, _, name = meta["path"][len(base):].partition("/")
            if not is_digest(digest) or not name or "/" in name:
                continue
            item = found.setdefault(digest, NamespaceUsage(digest=digest))
            if name == MANIFEST_NAME:
                manifests.append(digest)
            else:
                item.add_block(int(meta["size"]), meta["last_modified"].timestamp())
    for digest in manifests:
        try:
            data = bytes(obstore.get(store, f"{base}{digest}/{MANIFEST_NAME}").bytes())
        except (NotFoundError, FileNotFoundError):
            data = None  # purged meanwhile
        found[digest].fields = parse_manifest(data, digest)
    return list(found.values())


def _delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    """LIST each ``<prefix>/<digest>/`` and delete what it holds, 1,000 keys per request."""
    store, base = _usage_store(url, options)
    deleted = 0
    for digest in digests:
        names = [meta["path"] for chunk in obstore.list(store, prefix=f"{base}{digest}/")
                 for meta in chunk]
        for start in range(0, len(names), _DELETE_CHUNK):
            part = names[start : start + _DELETE_CHUNK]
            obstore.delete(store, part)
            deleted += len(part)
    return deleted


KIND = FunctionKind(("s3",), SETTINGS, from_url, remote=True, lister=_list_namespaces,
                    deleter=_delete_namespaces, url_check=parse_s3_url)
"""Any S3-compatible object store, one object per block."""
