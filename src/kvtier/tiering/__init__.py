"""The tiering layer: ``TieringManager`` (the step loop and public API) over the primary pool
and one ``SecondaryTier`` per configured backend (a backend, its lookup manager, its jobs)."""

from kvtier.tiering.manager import LookupResult, TieringManager, open_manager

__all__ = ["LookupResult", "TieringManager", "open_manager"]
