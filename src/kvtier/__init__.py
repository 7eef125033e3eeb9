"""kvtier: a tiered KV cache for LLM inference engines.

The public API is re-exported here; everything else is private. Heavy submodules are imported
lazily so that ``import kvtier`` stays cheap and never needs optional packages.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from kvtier.keys import BlockKey, Namespace, RequestContext, chain_keys

if TYPE_CHECKING:
    from kvtier.backends import Backend, open_backend
    from kvtier.factory import open_manager
    from kvtier.lookup.manager import AsyncLookupManager, LookupPhase, LookupStats
    from kvtier.ops.inventory import NamespaceUsage, PurgeResult, purge, usage
    from kvtier.tiering.manager import KeyStatus, TieringManager

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "AsyncLookupManager": "kvtier.lookup.manager",
    "LookupPhase": "kvtier.lookup.manager",
    "LookupStats": "kvtier.lookup.manager",
    "Backend": "kvtier.backends",
    "open_backend": "kvtier.backends",
    "TieringManager": "kvtier.tiering.manager",
    "KeyStatus": "kvtier.tiering.manager",
    "open_manager": "kvtier.factory",
    "NamespaceUsage": "kvtier.ops.inventory",
    "PurgeResult": "kvtier.ops.inventory",
    "purge": "kvtier.ops.inventory",
    "usage": "kvtier.ops.inventory",
}

__all__ = [
    "AsyncLookupManager",
    "Backend",
    "BlockKey",
    "KeyStatus",
    "LookupPhase",
    "LookupStats",
    "Namespace",
    "NamespaceUsage",
    "PurgeResult",
    "RequestContext",
    "TieringManager",
    "chain_keys",
    "open_backend",
    "open_manager",
    "purge",
    "usage",
]


_DEPRECATED: dict[str, tuple[str, str]] = {
    # old name: (new name, since)
    "LookupResult": ("KeyStatus", "0.1.1"),
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new_name, since = _DEPRECATED[name]
        warnings.warn(f"kvtier.{name} is deprecated since kvtier {since} (it is not vLLM's "
                      f"LookupResult); use kvtier.{new_name}", DeprecationWarning, stacklevel=2)
        return __getattr__(new_name)
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
