"""The tiering layer: ``TieringManager`` (the step loop and public API) over the primary pool
and one ``SecondaryTier`` per configured backend (a backend, its lookup manager, its jobs).

The manager's names are imported lazily, so that ``kvtier.config`` can import
``kvtier.tiering.io_pool`` without importing the manager (which imports the config).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.tiering.manager import LookupResult, TieringManager, open_manager

__all__ = ["LookupResult", "TieringManager", "open_manager"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvtier.tiering.manager"), name)
    raise AttributeError(f"module 'kvtier.tiering' has no attribute {name!r}")
