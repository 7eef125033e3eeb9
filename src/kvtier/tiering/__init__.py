"""The tiering layer: ``TieringManager`` (the step loop and public API) over the primary pool
and one ``SecondaryTier`` per configured backend (a backend, its lookup manager, its jobs).

The manager's names are imported lazily: importing one small module of the layer (the tier's
settings table, the I/O pool) does not import the whole manager. ``open_manager``, which builds
the stack from a config, lives one floor up in :mod:`kvtier.factory`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.tiering.manager import KeyStatus, TieringManager

__all__ = ["KeyStatus", "TieringManager"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvtier.tiering.manager"), name)
    raise AttributeError(f"module 'kvtier.tiering' has no attribute {name!r}")
