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
import urllib.parse
from collections.abc import Mapping
from types import ModuleType
from typing import Any, cast

from kvtier.backends.base import (
    Backend,
    BackendClosedError,
    BackendStats,
    BackendUnavailableError,
    Buffer,
    RateLimitedLog,
    check_get_args,
    check_keys,
    check_put_args,
    parse_bool_option,
    parse_float_option,
    parse_int_option,
    parse_size_option,
    reject_unknown_options,
)
from kvtier.keys import Namespace

__all__ = [
    "REMOTE_SCHEMES",
    "SCHEMES",
    "Backend",
    "BackendClosedError",
    "BackendStats",
    "BackendUnavailableError",
    "Buffer",
    "OpenMode",
    "RateLimitedLog",
    "backend_module",
    "check_get_args",
    "check_keys",
    "check_put_args",
    "open_backend",
    "parse_bool_option",
    "parse_float_option",
    "parse_int_option",
    "parse_size_option",
    "redact_url",
    "reject_unknown_options",
    "split_url_options",
]

_SCHEME_MODULES: dict[str, str] = {
    "memory": "kvtier.backends.memory",
    "file": "kvtier.backends.file",
    "redis": "kvtier.backends.redis",
    "rediss": "kvtier.backends.redis",
    "redis+cluster": "kvtier.backends.redis",
    "rediss+cluster": "kvtier.backends.redis",
    "s3": "kvtier.backends.s3",
}
SCHEMES: tuple[str, ...] = tuple(_SCHEME_MODULES)
"""Every backend URL scheme :func:`open_backend` accepts."""
REMOTE_SCHEMES: frozenset[str] = frozenset(SCHEMES) - {"memory", "file"}
"""The schemes whose backend is shared over the network (the others live on this host)."""


def _scheme_of(url: str) -> str:
    scheme, separator, _rest = url.partition("://")
    if not separator or not scheme:
        raise ValueError(
            f"backend URL {redact_url(url)!r} has no scheme; expected one of "
            f"{[s + '://' for s in _SCHEME_MODULES]}"
        )
    return scheme.lower()


class OpenMode(enum.Enum):
    """What an opened backend is for."""

    READ_WRITE = "read-write"
    """Storing blocks: the namespace manifest is written next to them (see kvtier.inventory)."""
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
    module = backend_module(url)
    backend = cast(Backend, module.from_url(url, namespace, dict(options)))
    if mode is OpenMode.READ_WRITE:
        _write_manifest(module, backend)
    return backend


def split_url_options(
    url: str, options: Mapping[str, Any]
) -> tuple[urllib.parse.SplitResult, dict[str, Any]]:
    """Split ``url`` and merge its query-string options with the keyword ``options``.

    Query values arrive as strings (parse them with the ``parse_*_option`` helpers). A name given
    both ways, or twice in the query, raises ``ValueError``.
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


# ------------------------------------------------------------------ usage (kvtier.inventory)

_log = logging.getLogger(__name__)


def backend_module(url: str) -> ModuleType:
    """The module implementing ``url``'s scheme: ``from_url`` and, for ``kvtier.inventory``,
    ``list_namespaces`` / ``delete_namespaces`` (and ``write_manifest`` where the medium is
    shared). Raises ``ValueError`` for a URL without a known scheme."""
    scheme = _scheme_of(url)
    module_name = _SCHEME_MODULES.get(scheme)
    if module_name is None:
        raise ValueError(
            f"unknown backend URL scheme {scheme + '://'!r} in {redact_url(url)!r}; expected one "
            f"of {[s + '://' for s in _SCHEME_MODULES]}"
        )
    return importlib.import_module(module_name)


def _write_manifest(module: ModuleType, backend: Backend) -> None:
    """Store the namespace manifest next to the blocks. Best effort: a medium that is down at
    open is not an error for a backend, so a failed write is logged, never raised."""
    write = getattr(module, "write_manifest", None)
    if write is None:
        return
    from kvtier.inventory import manifest_document

    try:
        write(backend, manifest_document(backend.namespace))
    except Exception as exc:
        _log.warning("%s: could not write the namespace manifest of %s: %s: %s",
                     backend.url, backend.namespace.digest_hex, type(exc).__name__,
                     str(exc).strip().splitlines()[0] if str(exc).strip() else "")
