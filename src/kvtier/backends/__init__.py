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

import logging
import urllib.parse
from collections.abc import Mapping
from typing import Any

from kvtier.backends.args import check_get_args, check_keys, check_put_args
from kvtier.backends.base import (
    Backend,
    BackendUnavailableError,
    Buffer,
    Fetched,
    NoTierError,
    OpenMode,
    Outcome,
    StoredFrame,
    UnkeyedWriterError,
)
from kvtier.backends.lifecycle import BackendClosedError
from kvtier.backends.registry import (
    BUILTIN_SCHEMES,
    BackendFactory,
    BackendKind,
    FunctionKind,
    InventoryUnsupportedError,
    kind_for,
    register_kind,
    register_scheme,
    registered_kinds,
    registered_schemes,
)
from kvtier.backends.stats import STANDARD_COUNTERS, BackendStats, RateLimitedLog
from kvtier.keys import Namespace
from kvtier.settings import SettingsTable
from kvtier.text import first_line

__all__ = [
    "REMOTE_SCHEMES",
    "SCHEMES",
    "STANDARD_COUNTERS",
    "Backend",
    "BackendClosedError",
    "BackendFactory",
    "BackendKind",
    "BackendStats",
    "BackendUnavailableError",
    "Buffer",
    "Fetched",
    "FunctionKind",
    "InventoryUnsupportedError",
    "NoTierError",
    "OpenMode",
    "Outcome",
    "RateLimitedLog",
    "StoredFrame",
    "UnkeyedWriterError",
    "backend_settings",
    "check_get_args",
    "check_keys",
    "check_put_args",
    "kind_for",
    "kind_of",
    "open_backend",
    "redact_url",
    "redacted_options",
    "register_kind",
    "register_scheme",
    "registered_kinds",
    "registered_schemes",
    "split_url_options",
    "url_password",
]

SCHEMES: tuple[str, ...] = BUILTIN_SCHEMES
"""The built-in backend URL schemes (see :func:`registered_schemes` for all of them)."""

REMOTE_SCHEMES: frozenset[str] = frozenset(SCHEMES) - {"memory", "file"}
"""The built-in schemes whose backend is shared over the network (the others live on this host)."""


def backend_settings(scheme: str) -> SettingsTable:
    """The options table of ``scheme`` (``ValueError`` for an unknown scheme).

    Importing a built-in scheme's table imports its backend module (and its client library).
    """
    return kind_for(scheme).settings


def _scheme_of(url: str) -> str:
    scheme, separator, _rest = url.partition("://")
    if not separator or not scheme:
        raise ValueError(
            f"backend URL {redact_url(url)!r} has no scheme; expected one of "
            f"{[s + '://' for s in registered_schemes()]}{path_hint(url)}"
        )
    return scheme.lower()


def path_hint(url: str) -> str:
    """``"; did you mean file:///abs/dir?"`` for a URL that is a bare absolute path (a file
    tier meant), else ``""``."""
    if not url.startswith("/") or "://" in url:
        return ""
    return f"; did you mean {redact_url('file://' + urllib.parse.quote(url))}?"


def kind_of(url: str) -> BackendKind:
    """The kind of ``url``'s scheme; ``ValueError`` (URL redacted) for an unknown one."""
    scheme = _scheme_of(url)
    try:
        return kind_for(scheme)
    except ValueError:
        raise ValueError(
            f"unknown backend URL scheme {scheme + '://'!r} in {redact_url(url)!r}; expected "
            f"one of {[s + '://' for s in registered_schemes()]}"
        ) from None


def open_backend(
    url: str, namespace: Namespace, *, mode: OpenMode = OpenMode.READ_WRITE, **options: Any
) -> Backend:
    """Open the backend named by ``url`` for blocks of ``namespace``.

    With ``mode=OpenMode.READ_WRITE`` (the default) the namespace manifest is written to the
    medium, so that ``kvtier usage`` can name the model of every stored digest, and checked
    first: a writer without ``auth_key`` on a tier whose manifest says keyed raises
    :class:`UnkeyedWriterError` (a ``ConfigError``). With ``OpenMode.READ_ONLY`` nothing is
    created or written at open (no directory, no manifest), and a medium that is not there
    raises :class:`NoTierError`.

    Raises ``ValueError`` naming the bad part of the URL or the unknown option, and
    ``TypeError`` for arguments of the wrong type.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    kind = kind_of(url)
    backend = (kind.open(url, namespace, dict(options)) if mode is OpenMode.READ_WRITE
               else kind.open_read_only(url, namespace, dict(options)))
    if not isinstance(backend, Backend):
        raise TypeError(f"the {_scheme_of(url)}:// kind returned {type(backend).__name__}, "
                        "not a kvtier Backend")
    if mode is OpenMode.READ_WRITE:
        _write_manifest(backend)
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
    """``url`` with any password (and sensitive query values) replaced by ``***``.

    The password is found on the raw text, not on what a URL parser makes of it: a password
    with an unescaped ``/``, ``?`` or ``#`` (``redis://u:ab/SECRET@host``) would otherwise hide
    its ``@`` from the parser. Everything between the first ``:`` after the scheme and the last
    ``@`` is hidden (a path that happens to hold both is over-redacted, never leaked).
    """
    scheme, separator, rest = url.partition("://")
    if url_password(url) is not None:
        userinfo, _, hostinfo = rest.rpartition("@")
        rest = f"{userinfo.partition(':')[0]}:***@{hostinfo}"
    try:
        parts = urllib.parse.urlsplit(f"{scheme}{separator}{rest}")
    except ValueError:
        return "<unparseable URL>"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{name}={'***' if _is_secret(name) else value}" for name, value in pairs)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment))


def url_password(url: str) -> str | None:
    """The password of ``url`` as written (between the first ``:`` after the scheme and the
    last ``@``), found on the raw text: a password holding ``/``, ``?`` or ``#`` hides its
    ``@`` from a URL parser. None when the URL has no password."""
    _scheme, separator, rest = url.partition("://")
    if not separator or "@" not in rest:
        return None
    _user, has_password, password = rest.rpartition("@")[0].partition(":")
    return password if has_password else None


def _is_secret(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in ("password", "secret", "token", "key_id", "auth"))


def redacted_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the value of every credential-like name replaced by ``'***'``."""
    return {name: "***" if _is_secret(name) and value is not None else value
            for name, value in options.items()}


_log = logging.getLogger(__name__)


def _write_manifest(backend: Backend) -> None:
    """Check and store the namespace manifest next to the blocks. Best effort: a medium that is
    down at open is not an error for a backend, so a failed read or write is logged, never
    raised; only a refusal (:class:`UnkeyedWriterError`) is, after closing the backend."""
    try:
        backend.open_for_writing()
    except UnkeyedWriterError:
        backend.close()
        raise
    except Exception as exc:
        _log.warning("%s: could not write the namespace manifest of %s: %s: %s",
                     backend.url, backend.namespace.digest_hex, type(exc).__name__,
                     first_line(exc))
