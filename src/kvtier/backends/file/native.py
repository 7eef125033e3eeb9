"""The file tier's compiled part, ``_batchio`` (``_batchio.c``): batch reads, looks and stores
that release the interpreter lock once per batch instead of once per system call. Optional: an
install without a C compiler has none, and the file tier then makes its calls from Python.

State and owners: ``BATCHIO``, set once at import (the module, or None).
"""

from __future__ import annotations

import enum
import importlib
from types import ModuleType

__all__ = ["BATCHIO", "NativeIO", "native_io_for", "require_batchio"]

BATCHIO: ModuleType | None
try:
    BATCHIO = importlib.import_module("kvtier.backends.file._batchio")
except ImportError:  # no C compiler at install
    BATCHIO = None


class NativeIO(enum.Enum):
    """Whether the file tier makes its batch calls through the extension."""

    ACTIVE = "active"
    OFF = "off"  # turned off by the ``native_io`` setting
    UNAVAILABLE = "unavailable"  # the extension was not built (no C compiler at install)


def native_io_for(wanted: bool) -> NativeIO:
    """The state a backend asking for native calls (``wanted``) gets on this install."""
    if not wanted:
        return NativeIO.OFF
    return NativeIO.ACTIVE if BATCHIO is not None else NativeIO.UNAVAILABLE


def require_batchio() -> ModuleType:
    """The extension, for a backend whose :class:`NativeIO` is ACTIVE (which needs it)."""
    if BATCHIO is None:
        raise RuntimeError("file backend: native calls active without the extension")
    return BATCHIO
