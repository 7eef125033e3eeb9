"""The tiering layer: ``TieringManager`` (the step loop and public API) over the primary pool
and one ``SecondaryTier`` per configured backend (a backend, its lookup manager, its jobs).

Names are re-exported lazily so that importing one submodule (``kvtier.tiering.io_pool``) does
not import the whole manager.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.tiering.manager import LookupResult, TieringManager, open_manager

__all__ = ["LookupResult", "TieringManager", "open_manager"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvtier.tiering' has no attribute {name!r}")
    return getattr(importlib.import_module("kvtier.tiering.manager"), name)
