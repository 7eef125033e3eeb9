"""In-process backend: framed blocks in a dict, private to the instance.

State and owners (any caller thread; all guarded by ``MemoryBackend._lock``):

- ``_frames``: key -> (stored frame, a view of its payload where this instance encoded it,
  else None), least recently used first.
- ``_used_bytes``: sum of the stored frame sizes.

Frames are encoded and verified by the same template as every other backend. A frame this
instance encoded itself sits in private process memory that nothing else can write, so its
checksum (or MAC) pass is skipped on reads: only its size is checked, and the payload is copied
into the destination once, here. A frame written through the test hook ``_raw_write`` is
verified completely. URL: ``memory://``; option ``max_bytes``
(0 = unlimited) bounds the stored frame bytes with LRU eviction.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import (
    COMMON_SETTINGS,
    COPIED_FETCH,
    MISSING_FETCH,
    AuthKey,
    Backend,
    Fetched,
    Outcome,
    StoredFrame,
    load_auth_key,
)
from kvtier.backends.manifest import NamespaceUsage
from kvtier.backends.registry import FunctionKind
from kvtier.codec import HEADER_BYTES
from kvtier.keys import BlockKey, Namespace
from kvtier.settings import Kind, Setting, SettingsTable

_log = logging.getLogger(__name__)

SETTINGS = SettingsTable("memory backend", (
    Setting("max_bytes", Kind.SIZE, 0, help="bound on stored frame bytes, LRU eviction "
                                           "(0 = unlimited)"),
    *COMMON_SETTINGS,
))


class MemoryBackend(Backend):
    """A thread-safe in-process block store (see module docstring)."""

    EXTRA_COUNTERS = ("evictions",)

    def __init__(self, namespace: Namespace, *, max_bytes: int | str = 0,
                 auth_key: AuthKey | None = None) -> None:
        super().__init__(namespace, name=f"memory backend for {namespace.digest_hex}"
                         if isinstance(namespace, Namespace) else "memory backend",
                         logger=_log, auth_key=auth_key)
        self._max_bytes: int = SETTINGS["max_bytes"].parse(max_bytes)
        self._lock = threading.Lock()
        self._frames: OrderedDict[BlockKey, tuple[bytes | bytearray, memoryview | None]] = \
            OrderedDict()
        self._used_bytes = 0

    @property
    def url(self) -> str:
        return "memory://"

    def _m_exists(self, keys: list[BlockKey]) -> list[Outcome]:
        with self._lock:
            return [Outcome.OK if key in self._frames else Outcome.MISSING for key in keys]

    def _m_store(self, frames: list[StoredFrame]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        evicted: list[BlockKey] = []
        for frame in frames:
            with self._lock:
                present = frame.key in self._frames
            if present:
                outcomes.append(Outcome.PRESENT)
                continue
            size = frame.nbytes
            if self._max_bytes and size > self._max_bytes:
                outcomes.append(Outcome.FAILED)
                continue
            joined = frame.joined()
            with self._lock:
                if frame.key in self._frames:  # a racing put of the same key won
                    outcomes.append(Outcome.PRESENT)
                    continue
                while self._max_bytes and self._used_bytes + size > self._max_bytes:
                    old_key, (old, _trusted) = self._frames.popitem(last=False)
                    self._used_bytes -= len(old)
                    evicted.append(old_key)
                self._frames[frame.key] = (joined, memoryview(joined)[HEADER_BYTES:])
                self._used_bytes += size
            outcomes.append(Outcome.OK)
        if evicted:
            self._stats.add("evictions", len(evicted))
            self.evicted.note(evicted)
        return outcomes

    def _m_fetch(self, keys: list[BlockKey], outs: list[memoryview]) -> list[Fetched]:
        frames = self._frames
        with self._lock:  # one acquisition per batch; the copies run outside it
            entries = [frames.get(key) for key in keys]
            move = frames.move_to_end
            for key, entry in zip(keys, entries, strict=True):
                if entry is not None:
                    move(key)
        fetched: list[Fetched] = []
        append = fetched.append
        for out, entry in zip(outs, entries, strict=True):
            if entry is None:
                append(MISSING_FETCH)
                continue
            frame, payload = entry  # never changed once stored: safe to read without the lock
            if payload is not None:
                # A frame this instance encoded: one copy of its payload view, nothing to check
                # (a destination of another size refuses the copy and is judged below).
                try:
                    out[:] = payload
                except ValueError:
                    pass
                else:
                    append(COPIED_FETCH)
                    continue
            append(Fetched(Outcome.OK, frame=memoryview(frame), token=frame,
                           trusted=payload is not None))
        return fetched

    def _m_remove_bad(self, bad: list[tuple[BlockKey, Fetched]]) -> None:
        with self._lock:
            for key, item in bad:
                entry = self._frames.get(key)
                if entry is not None and entry[0] is item.token:
                    del self._frames[key]
                    self._used_bytes -= len(entry[0])

    def _m_delete(self, keys: list[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                entry = self._frames.pop(key, None)
                if entry is not None:
                    self._used_bytes -= len(entry[0])

    def _m_close(self) -> None:
        with self._lock:
            self._frames.clear()
            self._used_bytes = 0

    def _m_extra_stats(self) -> dict[str, int]:
        with self._lock:
            return {"blocks": len(self._frames), "used_bytes": self._used_bytes}

    # Test hooks: raw access to the stored objects, used by the contract suite to inject faults.
    def _raw_read(self, key: BlockKey) -> bytes | None:
        with self._lock:
            entry = self._frames.get(key)
        return None if entry is None else bytes(entry[0])

    def _raw_write(self, key: BlockKey, frame: bytes) -> None:
        with self._lock:
            old = self._frames.get(key)
            if old is not None:
                self._used_bytes -= len(old[0])
            self._frames[key] = (bytes(frame), None)  # not ours: verified on every read
            self._used_bytes += len(frame)


def from_url(url: str, namespace: Namespace, options: dict[str, Any]) -> MemoryBackend:
    """Build a :class:`MemoryBackend` from ``memory://`` (options: ``max_bytes``, auth)."""
    parts, merged = split_url_options(url, options)
    if parts.scheme != "memory":
        raise ValueError(f"memory backend URL must start with memory://, got {redact_url(url)!r}")
    if parts.netloc or parts.path not in ("", "/"):
        raise ValueError(
            f"memory backend URL takes no host or path, got {redact_url(url)!r}; expected 'memory://'"
        )
    parsed = SETTINGS.parse(merged, "memory")
    return MemoryBackend(namespace, max_bytes=parsed["max_bytes"],
                         auth_key=load_auth_key(parsed, "memory"))


def _list_namespaces(url: str, options: dict[str, Any]) -> list[NamespaceUsage]:
    """Nothing: a ``memory://`` store is private to its instance, so a new one is empty."""
    from_url(url, Namespace(model="kvtier-usage"), options).close()  # validates the URL
    return []


def _delete_namespaces(url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
    return 0


KIND = FunctionKind(("memory",), SETTINGS, from_url, remote=False, lister=_list_namespaces,
                    deleter=_delete_namespaces)
"""``memory://``: in-process, private to its instance (its inventory is always empty)."""
