"""The tiering layer: ``TieringManager`` (the step loop and public API) over the primary pool
and one ``SecondaryTier`` per configured backend (a backend, its lookup manager, its jobs).

The manager is imported lazily, so that importing a leaf module (``tiering.tier_settings``,
which the config loader reads) does not import the manager, which imports the config loader.
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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
