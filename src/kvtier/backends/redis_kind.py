"""The Redis / Valkey kind: ``redis://``, ``rediss://`` and their ``+cluster`` forms, and its
inventory (SCAN ``kvtier:*`` on every primary). Stateless: every call opens its own connection.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import redis
import redis.cluster

from kvtier.backends.manifest import (
    NamespaceUsage,
    is_block_name,
    is_digest,
    parse_manifest,
)
from kvtier.backends.redis import (
    _KEY_PREFIX,
    MANIFEST_SUFFIX,
    SETTINGS,
    RedisBackend,
    from_url,
    parse_redis_url,
    read_manifest_value,
)
from kvtier.backends.registry import FunctionKind
from kvtier.keys import Namespace

__all__ = ["KIND"]

_SCAN_COUNT: Final = 1000


def _primaries(url: str, options: dict[str, Any]) -> tuple[RedisBackend, list[redis.Redis]]:
    """A connection to the standalone server, or to every Cluster primary (the caller closes
    the returned backend). Bad credentials raise ``ValueError``."""
    backend = RedisBackend(Namespace(model="kvtier-usage"), parse_redis_url(url, options))
    try:
        return backend, backend.primary_clients()
    except BaseException:
        backend.close()
        raise


def _split_name(name: bytes) -> tuple[str, bytes] | None:
    """(digest, suffix) of a ``kvtier:<digest>:<suffix>`` name, else None."""
    if not name.startswith(_KEY_PREFIX):
        return None
    digest, separator, suffix = name[len(_KEY_PREFIX):].partition(b":")
    text = digest.decode("ascii", "replace")
    return (text, suffix) if separator and is_digest(text) else None


def _is_ours(name: bytes) -> bool:
    """A block or the manifest of a namespace; a foreign key under the prefix is left alone."""
    split = _split_name(name)
    return split is not None and (split[1] == MANIFEST_SUFFIX or is_block_name(split[1]))


def _scan(node: redis.Redis, pattern: bytes) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for name in node.scan_iter(match=pattern, count=_SCAN_COUNT):
        batch.append(bytes(name))
        if len(batch) >= _SCAN_COUNT:
            yield batch
            batch = []
    if batch:
        yield batch


def _list_namespaces(url: str, options: dict[str, Any]) -> list[NamespaceUsage]:
    """SCAN ``kvtier:*`` on every primary; STRLEN and OBJECT IDLETIME per block, pipelined."""
    found: dict[str, NamespaceUsage] = {}
    manifests: dict[str, bytes | None] = {}
    now = time.time()
    backend, nodes = _primaries(url, options)
    try:
        for node in nodes:
            for batch in _scan(node, _KEY_PREFIX + b"*"):
                blocks: list[tuple[str, bytes]] = []
                for name in batch:
                    split = _split_name(name)
                    if split is None:
                        continue
                    digest, suffix = split
                    found.setdefault(digest, NamespaceUsage(digest=digest))
                    if suffix == MANIFEST_SUFFIX:
                        manifests[digest] = read_manifest_value(node, name)
                    elif is_block_name(suffix):
                        blocks.append((digest, name))
                    # anything else under kvtier:<digest>: is not ours: neither counted nor purged
                pipe = node.pipeline(transaction=False)
                for _digest, name in blocks:
                    pipe.object("idletime", name)  # before STRLEN, which would reset it
                    pipe.strlen(name)
                replies = pipe.execute(raise_on_error=False)
                for index, (digest, _name) in enumerate(blocks):
                    idle, size = replies[2 * index], replies[2 * index + 1]
                    if not isinstance(size, int) or size == 0:
                        continue  # gone meanwhile
                    when = now - idle if isinstance(idle, int) else None
                    found[digest].add_block(size, when)
    finally:
        backend.close()
    for digest, item in found.items():
        item.fields = parse_manifest(manifests.get(digest), digest)
    return list(found.values())


def _delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    """SCAN ``kvtier:<digest>:*`` on every primary and UNLINK what it finds, one key per command
    (a Cluster refuses multi-key commands across slots)."""
    deleted = 0
    backend, nodes = _primaries(url, options)
    try:
        for node in nodes:
            for digest in digests:
                for batch in _scan(node, _KEY_PREFIX + digest.encode() + b":*"):
                    ours = [name for name in batch if _is_ours(name)]
                    if not ours:
                        continue
                    pipe = node.pipeline(transaction=False)
                    for name in ours:
                        pipe.unlink(name)
                    deleted += sum(int(reply) for reply in pipe.execute())
    finally:
        backend.close()
    return deleted


KIND = FunctionKind(("redis", "rediss", "redis+cluster", "rediss+cluster"), SETTINGS, from_url,
                    remote=True, lister=_list_namespaces, deleter=_delete_namespaces,
                    url_check=parse_redis_url)
"""Redis or Valkey, standalone or Cluster, one key per block."""
