"""The backend kinds: one registered object per medium, looked up by URL scheme.

A :class:`BackendKind` is everything kvtier knows about a medium: its URL schemes, its settings
table, how to open a backend, how to validate a URL without opening one, and its inventory
(list and delete namespaces; the manifest itself is written by the backend). ``open_backend``,
the config loader, ``kvtier usage`` and ``kvtier purge`` all go through this registry, so a kind
registered from outside (:func:`register_kind`) gets YAML config, usage and purge for free.

State: ``_kinds`` (scheme -> kind or the dotted path of a built-in kind, imported on first use so
that a ``file://`` tier never imports redis-py or obstore). Written under ``_lock`` by
registration (any thread, usually at import time); read without it (one dict lookup).
"""

from __future__ import annotations

import abc
import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.keys import Namespace
from kvtier.settings import SettingsTable

if TYPE_CHECKING:
    from kvtier.backends.base import Backend
    from kvtier.backends.manifest import NamespaceUsage

__all__ = [
    "BackendFactory",
    "BackendKind",
    "FunctionKind",
    "InventoryUnsupportedError",
    "kind_for",
    "register_kind",
    "register_scheme",
    "registered_kinds",
    "registered_schemes",
]

BackendFactory = Callable[[str, Namespace, dict[str, Any]], "Backend"]
"""``factory(url, namespace, options)``: opens a backend; raises ``ValueError`` for bad input."""


class InventoryUnsupportedError(ValueError):
    """The medium's kind keeps no inventory (``kvtier usage`` / ``purge`` cannot list it)."""


class BackendKind(abc.ABC):
    """One medium. Subclasses set ``schemes`` and implement ``settings`` and ``open``."""

    schemes: tuple[str, ...] = ()
    remote: bool = True
    """Whether the medium is shared over the network (the vLLM tier reports REMOTE for it)."""

    @property
    @abc.abstractmethod
    def settings(self) -> SettingsTable:
        """The kind's URL / keyword options."""

    @abc.abstractmethod
    def open(self, url: str, namespace: Namespace, options: dict[str, Any]) -> Backend:
        """A backend for ``namespace`` at ``url``; ``ValueError`` names a bad URL or option."""

    def open_read_only(self, url: str, namespace: Namespace, options: dict[str, Any]) -> Backend:
        """Like :meth:`open`, but creating nothing on the medium (``OpenMode.READ_ONLY``);
        raises :class:`~kvtier.backends.base.NoTierError` when there is no tier at ``url``.
        The default is :meth:`open`, for media whose open creates nothing (the manifest is
        written by ``open_backend``, and only for writing)."""
        return self.open(url, namespace, options)

    def parse_url(self, url: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """Validate ``url`` and ``options`` without touching the medium: the parsed options."""
        from kvtier.backends import split_url_options

        _parts, merged = split_url_options(url, options)
        return self.settings.parse(merged, self.schemes[0] if self.schemes else "backend")

    def list_namespaces(self, url: str, options: dict[str, Any]) -> list[NamespaceUsage]:
        """Every kvtier namespace stored at ``url`` (blocks, bytes, manifest fields)."""
        raise InventoryUnsupportedError(
            f"backend kind {type(self).__name__} ({self._scheme_list()}) keeps no inventory: "
            "kvtier usage and purge cannot list it")

    def delete_namespaces(self, url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
        """Remove every object of the namespaces ``digests``; how many were deleted."""
        raise InventoryUnsupportedError(
            f"backend kind {type(self).__name__} ({self._scheme_list()}) keeps no inventory: "
            "kvtier purge cannot delete from it")

    def _scheme_list(self) -> str:
        return ", ".join(scheme + "://" for scheme in self.schemes)


Lister = Callable[[str, dict[str, Any]], "list[NamespaceUsage]"]
Deleter = Callable[[str, dict[str, Any], Sequence[str]], int]
UrlCheck = Callable[[str, dict[str, Any]], object]


class FunctionKind(BackendKind):
    """A kind declared from functions: how each built-in medium declares its kind in one
    statement. ``url_check(url, options)`` validates without touching the medium (it raises
    ``ValueError``); without it the settings table does. ``read_only_opener`` opens without
    creating anything (a medium whose ``opener`` creates directories needs one)."""

    def __init__(self, schemes: tuple[str, ...], settings: SettingsTable, opener: BackendFactory,
                 *, remote: bool, lister: Lister | None = None, deleter: Deleter | None = None,
                 url_check: UrlCheck | None = None,
                 read_only_opener: BackendFactory | None = None) -> None:
        self.schemes = schemes
        self.remote = remote
        self._settings = settings
        self._opener = opener
        self._lister = lister
        self._deleter = deleter
        self._url_check = url_check
        self._read_only_opener = read_only_opener

    @property
    def settings(self) -> SettingsTable:
        return self._settings

    def open(self, url: str, namespace: Namespace, options: dict[str, Any]) -> Backend:
        return self._opener(url, namespace, options)

    def open_read_only(self, url: str, namespace: Namespace, options: dict[str, Any]) -> Backend:
        opener = self._read_only_opener or self._opener
        return opener(url, namespace, options)

    def parse_url(self, url: str, options: Mapping[str, Any]) -> dict[str, Any]:
        if self._url_check is None:
            return super().parse_url(url, options)
        self._url_check(url, dict(options))
        return dict(options)

    def list_namespaces(self, url: str, options: dict[str, Any]) -> list[NamespaceUsage]:
        if self._lister is None:
            return super().list_namespaces(url, options)
        return self._lister(url, options)

    def delete_namespaces(self, url: str, options: dict[str, Any], digests: Sequence[str]) -> int:
        if self._deleter is None:
            return super().delete_namespaces(url, options, digests)
        return self._deleter(url, options, digests)


def _checked_by_the_factory(url: str, options: dict[str, Any]) -> None:
    """A bare factory (:func:`register_scheme`) validates its own options when it opens."""


_BUILTIN: dict[str, str] = {
    "memory": "kvtier.backends.memory:KIND",
    "file": "kvtier.backends.file.kind:KIND",
    "redis": "kvtier.backends.redis_kind:KIND",
    "rediss": "kvtier.backends.redis_kind:KIND",
    "redis+cluster": "kvtier.backends.redis_kind:KIND",
    "rediss+cluster": "kvtier.backends.redis_kind:KIND",
    "s3": "kvtier.backends.s3_kind:KIND",
}
BUILTIN_SCHEMES: tuple[str, ...] = tuple(_BUILTIN)
_kinds: dict[str, BackendKind | str] = dict(_BUILTIN)
_loaded: dict[str, BackendKind] = {}
_lock = threading.Lock()


def _check_scheme(scheme: object) -> str:
    if not isinstance(scheme, str) or not scheme or not scheme[0].isalpha() or not all(
            char.isalnum() or char in "+-." for char in scheme):
        raise ValueError(f"backend scheme {scheme!r}: expected letters, digits, '+', '-', '.' "
                         "starting with a letter (without '://')")
    return scheme.lower()


def register_kind(kind: BackendKind) -> BackendKind:
    """Make every scheme of ``kind`` known to ``open_backend``, config, usage and purge.

    A built-in scheme cannot be replaced; registering a scheme again is an error unless it is
    the same kind object."""
    if not isinstance(kind, BackendKind):
        raise TypeError(f"expected a BackendKind, got {type(kind).__name__}")
    if not kind.schemes:
        raise ValueError(f"backend kind {type(kind).__name__} declares no URL scheme")
    names = [_check_scheme(scheme) for scheme in kind.schemes]
    with _lock:
        for name in names:
            if name in _BUILTIN:
                raise ValueError(f"backend scheme {name!r} is built in and cannot be replaced")
            existing = _kinds.get(name)
            if existing is not None and not _same(existing, kind):
                raise ValueError(f"backend scheme {name!r} is already registered")
        for name in names:
            _kinds[name] = kind
    return kind


def _same(existing: BackendKind | str, kind: BackendKind) -> bool:
    if existing is kind:
        return True
    return (isinstance(existing, FunctionKind) and isinstance(kind, FunctionKind)
            and existing._opener is kind._opener)


def register_scheme(scheme: str, factory: BackendFactory,
                    settings: SettingsTable | None = None) -> None:
    """Make ``open_backend`` open ``scheme://...`` URLs with ``factory`` (a kind without
    inventory; use :func:`register_kind` for one that ``kvtier usage`` can list)."""
    name = _check_scheme(scheme)
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    table = settings if settings is not None else SettingsTable(f"{name} backend", ())
    register_kind(FunctionKind((name,), table, factory, remote=True,
                               url_check=_checked_by_the_factory))


def registered_schemes() -> tuple[str, ...]:
    """Every scheme :func:`open_backend` accepts now: the built-in ones, then the registered."""
    return (*BUILTIN_SCHEMES, *sorted(set(_kinds) - set(_BUILTIN)))


def registered_kinds() -> tuple[BackendKind, ...]:
    """Each registered kind once (built-in kinds are imported here)."""
    unique: dict[int, BackendKind] = {}
    for scheme in registered_schemes():
        kind = kind_for(scheme)
        unique.setdefault(id(kind), kind)
    return tuple(unique.values())


def kind_for(scheme: str) -> BackendKind:
    """The kind of ``scheme`` (case-insensitive, ``://`` optional); ``ValueError`` if unknown."""
    name = scheme.lower().removesuffix("://")
    entry = _kinds.get(name)
    if entry is None:
        raise ValueError(f"unknown backend URL scheme {name + '://'!r}; expected one of "
                         f"{[s + '://' for s in registered_schemes()]}")
    if isinstance(entry, BackendKind):
        return entry
    loaded = _loaded.get(entry)
    if loaded is None:
        module_name, _, attribute = entry.partition(":")
        loaded = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(loaded, BackendKind):
            raise TypeError(f"{entry} is not a BackendKind")
        _loaded[entry] = loaded
    return loaded
