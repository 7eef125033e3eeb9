"""Block storage backends and :func:`open_backend`.

This module owns no state. Backend modules are imported lazily, so that opening a ``file://``
tier never imports redis-py or boto3.

URL schemes::

    memory://                              in-process, private to the instance
    file:///abs/path                       one file per block under the directory
    redis://host:port/db, rediss://...     Redis / Valkey (TLS with rediss)
    redis+cluster://host:port              Redis Cluster (any node as the seed)
    s3://bucket/prefix?endpoint_url=...    any S3-compatible object store

Options come from keyword arguments or from the URL's query string (not both for one name).
"""

from __future__ import annotations

import enum
import importlib
import logging
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from kvtier.backends.base import (
    STANDARD_COUNTERS,
    Backend,
    BackendClosedError,
    BackendStats,
    BackendUnavailableError,
    Buffer,
    Fetched,
    Outcome,
    RateLimitedLog,
    StoredFrame,
    check_get_args,
    check_keys,
    check_put_args,
)
from kvtier.keys import Namespace
from kvtier.settings import SettingsTable

__all__ = [
    "REMOTE_SCHEMES",
    "SCHEMES",
    "STANDARD_COUNTERS",
    "Backend",
    "BackendClosedError",
    "BackendFactory",
    "BackendStats",
    "BackendUnavailableError",
    "Buffer",
    "Fetched",
    "OpenMode",
    "Outcome",
    "RateLimitedLog",
    "StoredFrame",
    "backend_module",
    "backend_settings",
    "check_get_args",
    "check_keys",
    "check_put_args",
    "open_backend",
    "redact_url",
    "redacted_options",
    "register_scheme",
    "registered_schemes",
    "split_url_options",
]

BackendFactory = Callable[[str, Namespace, dict[str, Any]], Backend]
"""``factory(url, namespace, options)``: opens a backend; raises ``ValueError`` for bad input."""

_BUILTIN_MODULES: dict[str, str] = {
    "memory": "kvtier.backends.memory",
    "file": "kvtier.backends.file",
    "redis": "kvtier.backends.redis",
    "rediss": "kvtier.backends.redis",
    "redis+cluster": "kvtier.backends.redis",
    "rediss+cluster": "kvtier.backends.redis",
    "s3": "kvtier.backends.s3",
}
SCHEMES: tuple[str, ...] = tuple(_BUILTIN_MODULES)
"""The built-in backend URL schemes (see :func:`registered_schemes` for all of them)."""
REMOTE_SCHEMES: frozenset[str] = frozenset(SCHEMES) - {"memory", "file"}
"""The built-in schemes whose backend is shared over the network (the others live on this host)."""


class _Registration:
    """A scheme registered from outside: its factory and its settings table."""

    __slots__ = ("factory", "settings")

    def __init__(self, factory: BackendFactory, settings: SettingsTable) -> None:
        self.factory = factory
        self.settings = settings


# Written by register_scheme under _registry_lock (any thread, usually at import time); read
# without the lock (a dict lookup of an immutable registration).
_registry: dict[str, _Registration] = {}
_registry_lock = threading.Lock()


def register_scheme(scheme: str, factory: BackendFactory,
                    settings: SettingsTable | None = None) -> None:
    """Make ``open_backend`` open ``scheme://...`` URLs with ``factory``.

    ``settings`` declares the scheme's options (an empty table if omitted); config loaders
    validate against it through :func:`backend_settings`. A built-in scheme cannot be replaced,
    and registering one scheme twice is an error unless it is the same factory.
    """
    if not isinstance(scheme, str) or not scheme or not all(
        char.isalnum() or char in "+-." for char in scheme
    ) or not scheme[0].isalpha():
        raise ValueError(f"backend scheme {scheme!r}: expected letters, digits, '+', '-', '.' "
                         "starting with a letter (without '://')")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    name = scheme.lower()
    if name in _BUILTIN_MODULES:
        raise ValueError(f"backend scheme {name!r} is built in and cannot be replaced")
    table = settings if settings is not None else SettingsTable(f"{name} backend", ())
    with _registry_lock:
        existing = _registry.get(name)
        if existing is not None and existing.factory is not factory:
            raise ValueError(f"backend scheme {name!r} is already registered")
        _registry[name] = _Registration(factory, table)


def registered_schemes() -> tuple[str, ...]:
    """Every scheme :func:`open_backend` accepts now: the built-in ones and the registered ones."""
    return (*SCHEMES, *sorted(_registry))


def backend_settings(scheme: str) -> SettingsTable:
    """The options table of ``scheme`` (``ValueError`` for an unknown scheme).

    Importing a built-in scheme's table imports its backend module (and its client library).
    """
    name = scheme.lower().removesuffix("://")
    module_name = _BUILTIN_MODULES.get(name)
    if module_name is not None:
        table: SettingsTable = importlib.import_module(module_name).SETTINGS
        return table
    registration = _registry.get(name)
    if registration is None:
        raise ValueError(f"unknown backend URL scheme {name + '://'!r}; expected one of "
                         f"{[s + '://' for s in registered_schemes()]}")
    return registration.settings


def _scheme_of(url: str) -> str:
    scheme, separator, _rest = url.partition("://")
    if not separator or not scheme:
        raise ValueError(
            f"backend URL {redact_url(url)!r} has no scheme; expected one of "
            f"{[s + '://' for s in registered_schemes()]}"
        )
    return scheme.lower()


class OpenMode(enum.Enum):
    """What an opened backend is for."""

    READ_WRITE = "read-write"
    """Storing blocks: the namespace manifest is written next to them (see kvtier.ops.inventory)."""
    INSPECT = "inspect"
    """Looking only (``kvtier inspect``): nothing is written to the medium at open."""


def open_backend(
    url: str, namespace: Namespace, *, mode: OpenMode = OpenMode.READ_WRITE, **options: Any
) -> Backend:
    """Open the backend named by ``url`` for blocks of ``namespace``.

    With ``mode=OpenMode.READ_WRITE`` (the default) the namespace manifest is written to the
    medium, so that ``kvtier usage`` can name the model of every stored digest.

    Raises ``ValueError`` naming the bad part of the URL or the unknown option, and
    ``TypeError`` for arguments of the wrong type.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    scheme = _scheme_of(url)
    module_name = _BUILTIN_MODULES.get(scheme)
    if module_name is not None:
        factory: BackendFactory = importlib.import_module(module_name).from_url
    else:
        registration = _registry.get(scheme)
        if registration is None:
            raise ValueError(
                f"unknown backend URL scheme {scheme + '://'!r} in {redact_url(url)!r}; expected "
                f"one of {[s + '://' for s in registered_schemes()]}"
            )
        factory = registration.factory
    backend = factory(url, namespace, dict(options))
    if not isinstance(backend, Backend):
        raise TypeError(f"the factory of {scheme}:// returned {type(backend).__name__}, "
                        "not a kvtier Backend")
    if mode is OpenMode.READ_WRITE and module_name is not None:
        _write_manifest(importlib.import_module(module_name), backend)
    return backend


def split_url_options(
    url: str, options: Mapping[str, Any]
) -> tuple[urllib.parse.SplitResult, dict[str, Any]]:
    """Split ``url`` and merge its query-string options with the keyword ``options``.

    Query values arrive as strings (the scheme's :class:`SettingsTable` parses both). A name
    given both ways, or twice in the query, raises ``ValueError``.
    """
    parts = urllib.parse.urlsplit(url)
    merged: dict[str, Any] = dict(options)
    seen: set[str] = set()
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if name in seen:
            raise ValueError(f"option {name!r} appears twice in the URL query string")
        if name in merged:
            raise ValueError(
                f"option {name!r} is given both in the URL query string and as a keyword"
            )
        seen.add(name)
        merged[name] = value
    return parts, merged


def redact_url(url: str) -> str:
    """``url`` with any password (and sensitive query values) replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        user, has_password, _password = userinfo.partition(":")
        netloc = f"{user}:***@{hostinfo}" if has_password else f"{user}@{hostinfo}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{name}={'***' if _is_secret(name) else value}" for name, value in pairs)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in ("password", "secret", "token", "key_id", "auth"))


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the value of every credential-like name replaced by ``'***'``."""
    return {name: "***" if _is_secret(name) and value is not None else value
            for name, value in options.items()}


# ------------------------------------------------------------------ usage (kvtier.ops.inventory)

_log = logging.getLogger(__name__)


def backend_module(url: str) -> ModuleType:
    """The module implementing ``url``'s scheme: ``from_url`` and, for ``kvtier.ops.inventory``,
    ``list_namespaces`` / ``delete_namespaces`` (and ``write_manifest`` where the medium is
    shared). Raises ``ValueError`` for a URL without a known scheme."""
    scheme = _scheme_of(url)
    module_name = _BUILTIN_MODULES.get(scheme)
    if module_name is None:
        known = "registered" if scheme in _registry else "unknown"
        raise ValueError(
            f"{known} backend URL scheme {scheme + '://'!r} in {redact_url(url)!r}: usage and "
            f"purge know the built-in schemes {[s + '://' for s in _BUILTIN_MODULES]}"
        )
    return importlib.import_module(module_name)


def _write_manifest(module: ModuleType, backend: Backend) -> None:
    """Store the namespace manifest next to the blocks. Best effort: a medium that is down at
    open is not an error for a backend, so a failed write is logged, never raised."""
    write = getattr(module, "write_manifest", None)
    if write is None:
        return
    from kvtier.ops.inventory import manifest_document

    try:
        write(backend, manifest_document(backend.namespace))
    except Exception as exc:
        _log.warning("%s: could not write the namespace manifest of %s: %s: %s",
                     backend.url, backend.namespace.digest_hex, type(exc).__name__,
                     str(exc).strip().splitlines()[0] if str(exc).strip() else "")
