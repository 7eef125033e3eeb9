"""In-process backend: framed blocks in a dict, private to the instance.

State and owners (any caller thread; all guarded by ``MemoryBackend._lock``):

- ``_frames``: key -> stored frame, in least-recently-used-first order.
- ``_used_bytes``: sum of the stored frame sizes.

Frames are encoded and verified exactly as the remote backends do, so the memory backend
exercises the same integrity path and its tests mean something. URL: ``memory://``; option
``max_bytes`` (0 = unlimited) bounds the stored frame bytes with LRU eviction.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier import codec
from kvtier.backends import split_url_options
from kvtier.backends.base import (
    BackendStats,
    Buffer,
    ExistenceChecks,
    Lifecycle,
    check_get_args,
    check_keys,
    check_put_args,
    parse_size_option,
    reject_unknown_options,
)
from kvtier.keys import BlockKey, Namespace

_log = logging.getLogger(__name__)
_OPTIONS = ("max_bytes",)


class MemoryBackend(ExistenceChecks):
    """A thread-safe in-process block store (see module docstring)."""

    def __init__(self, namespace: Namespace, *, max_bytes: int = 0) -> None:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        self._namespace = namespace
        self._digest = namespace.digest
        self._max_bytes = parse_size_option("max_bytes", max_bytes)
        self._lock = threading.Lock()
        self._frames: OrderedDict[BlockKey, bytes | bytearray] = OrderedDict()
        self._used_bytes = 0
        self._stats = BackendStats(extra=("evictions",))
        self._lifecycle = Lifecycle(f"memory backend for {namespace.digest_hex}")

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def url(self) -> str:
        return "memory://"

    def _exists(self, keys: Sequence[BlockKey]) -> tuple[list[bool], int]:
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        with self._lock:
            result = [key in self._frames for key in key_list]
        self._stats.add("exists_calls")
        return result, 0

    def put_many(self, keys: Sequence[BlockKey], payloads: Sequence[Buffer]) -> list[bool]:
        key_list, views = check_put_args(keys, payloads)
        self._lifecycle.check_open()
        results: list[bool] = []
        written = evicted = 0
        for key, view in zip(key_list, views, strict=True):
            with self._lock:
                present = key in self._frames
            if present:
                results.append(True)
                continue
            size = codec.frame_size(view.nbytes)
            if self._max_bytes and size > self._max_bytes:
                results.append(False)
                continue
            frame = codec.encode(self._digest, key, view)
            with self._lock:
                if key not in self._frames:  # a racing put of the same key may have won
                    while self._max_bytes and self._used_bytes + size > self._max_bytes:
                        _old_key, old = self._frames.popitem(last=False)
                        self._used_bytes -= len(old)
                        evicted += 1
                    self._frames[key] = frame
                    self._used_bytes += size
                    written += view.nbytes
            results.append(True)
        self._stats.add_many(
            {"puts": len(key_list), "bytes_written": written, "evictions": evicted}
        )
        return results

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview]) -> list[bool]:
        key_list, views = check_get_args(keys, outs)
        self._lifecycle.check_open()
        results: list[bool] = []
        read = corrupt = 0
        for key, out in zip(key_list, views, strict=True):
            with self._lock:
                frame = self._frames.get(key)
                if frame is not None:
                    self._frames.move_to_end(key)
            if frame is None:
                results.append(False)
                continue
            try:
                codec.decode_checked(memoryview(frame), self._digest, key, out)
            except codec.OutputSizeMismatch:
                results.append(False)
                continue
            except codec.FrameError as exc:
                corrupt += 1
                _log.warning("memory backend: dropping corrupt block %s: %s", key.hex(), exc)
                with self._lock:
                    if self._frames.get(key) is frame:
                        del self._frames[key]
                        self._used_bytes -= len(frame)
                results.append(False)
                continue
            read += out.nbytes
            results.append(True)
        hits = sum(results)
        self._stats.add_many(
            {
                "gets": len(key_list),
                "hits": hits,
                "misses": len(key_list) - hits,
                "bytes_read": read,
                "corrupt_objects": corrupt,
            }
        )
        return results

    def delete(self, keys: Sequence[BlockKey]) -> None:
        key_list = check_keys(keys)
        self._lifecycle.check_open()
        with self._lock:
            for key in key_list:
                frame = self._frames.pop(key, None)
                if frame is not None:
                    self._used_bytes -= len(frame)
        self._stats.add("deletes", len(key_list))

    def close(self) -> None:
        if self._lifecycle.close():
            with self._lock:
                self._frames.clear()
                self._used_bytes = 0

    def stats(self) -> dict[str, int]:
        snapshot = self._stats.snapshot()
        with self._lock:
            snapshot["blocks"] = len(self._frames)
            snapshot["used_bytes"] = self._used_bytes
        return snapshot

    # Test hooks: raw access to the stored objects, used by the contract suite to inject faults.
    def _raw_read(self, key: BlockKey) -> bytes | None:
        with self._lock:
            frame = self._frames.get(key)
        return None if frame is None else bytes(frame)

    def _raw_write(self, key: BlockKey, frame: bytes) -> None:
        with self._lock:
            old = self._frames.get(key)
            if old is not None:
                self._used_bytes -= len(old)
            self._frames[key] = bytes(frame)
            self._used_bytes += len(frame)


def from_url(url: str, namespace: Namespace, options: dict[str, Any]) -> MemoryBackend:
    """Build a :class:`MemoryBackend` from ``memory://`` (options: ``max_bytes``)."""
    parts, merged = split_url_options(url, options)
    if parts.scheme != "memory":
        raise ValueError(f"memory backend URL must start with memory://, got {url!r}")
    if parts.netloc or parts.path not in ("", "/"):
        raise ValueError(
            f"memory backend URL takes no host or path, got {url!r}; expected 'memory://'"
        )
    reject_unknown_options("memory", merged, _OPTIONS)
    return MemoryBackend(namespace, max_bytes=merged.get("max_bytes", 0))  # parsed there


# ------------------------------------------------------------------ usage (kvtier.inventory)


def list_namespaces(url: str, options: dict[str, Any]) -> list[Any]:
    """Nothing: a ``memory://`` store is private to its instance, so a new one is empty."""
    from_url(url, Namespace(model="kvtier-usage"), options).close()  # validates the URL
    return []


def delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    """Nothing to delete (see :func:`list_namespaces`)."""
    return 0
