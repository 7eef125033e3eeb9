"""A secondary tier's counters (:class:`TierCounters`) and its typed snapshot (:class:`TierStats`).

Thread ownership: a tier's :class:`TierCounters` is its scheduler thread's (the only writer and
reader); :meth:`~kvtier.tiering.tier.SecondaryTier.stats` copies it into a frozen
:class:`TierStats`, which any thread may read.

:mod:`kvtier.ops.metrics` declares, per metric, the :class:`TierStats` field it reads
(``"counters.loaded_keys"``, ``"lookup.backend_calls"``, ``"backend.errors"``), so a new tier
metric is one declaration there and one increment here. :class:`TierStats` is also a read-only
mapping with the historical flat keys (lookup fields, counter fields, the snapshot sizes, and
the backend's counters as ``backend_<name>``) for the callers that read a tier's stats as a
dict (``TieringManager.get_stats()["tiers"]``, the run guard, the benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.lookup.manager import LookupStats

__all__ = ["TierCounters", "TierStats"]


@dataclass(slots=True)
class TierCounters:
    """The tier's counters (scheduler thread); :mod:`kvtier.ops.metrics` publishes them."""

    lookup_answers: int = 0  # lookups answered present or absent (not "ask again")
    lookup_hits: int = 0
    loads_submitted: int = 0
    load_keys: int = 0
    loaded_keys: int = 0
    load_keys_failed: int = 0
    stores_submitted: int = 0
    store_keys: int = 0
    stored_keys: int = 0
    store_keys_failed: int = 0
    stores_shed: int = 0
    store_keys_shed: int = 0
    store_waits: int = 0            # steps that waited for this tier's store backlog
    store_wait_seconds: float = 0.0  # scheduler time spent in those waits
    store_stalls: int = 0           # waits ended because the tier finished nothing in time
    store_keys_read_back: int = 0
    quarantines_lifted: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    job_errors: int = 0
    loads_declined: int = 0  # hits answered absent: loading them would not beat recomputing
    loads_abandoned: int = 0  # loads failed by their deadline while the backend call still ran
    invariant_violations: int = 0


@dataclass(slots=True, frozen=True)
class TierStats(Mapping[str, Any]):
    """One tier's counters at one moment. ``backend`` is None when ``backend.stats()`` failed
    (then every metric read from it is absent)."""

    lookup: LookupStats
    counters: TierCounters
    tracked_keys: int = 0
    outstanding_jobs: int = 0
    outstanding_store_bytes: int = 0
    abandoned_loads: int = 0  # still running, buffers not yet released
    backend: Mapping[str, Any] | None = field(default=None)

    def value(self, path: str) -> Any:
        """The field ``path`` names (``"counters.loaded_keys"``, ``"backend.errors"``,
        ``"outstanding_jobs"``); None where the backend does not report it."""
        section, _, name = path.partition(".")
        if not name:
            return getattr(self, section)
        owner = getattr(self, section)
        if owner is None:
            return None
        if isinstance(owner, Mapping):
            return owner.get(name)
        return getattr(owner, name)

    def flat(self) -> dict[str, Any]:
        """The historical flat dict (compatibility view, see the module docstring)."""
        result: dict[str, Any] = dict(self.lookup.as_dict())
        result["tracked_keys"] = self.tracked_keys
        result.update(asdict(self.counters))
        result["outstanding_jobs"] = self.outstanding_jobs
        result["outstanding_store_bytes"] = self.outstanding_store_bytes
        result["abandoned_loads"] = self.abandoned_loads
        for name, value in (self.backend or {}).items():
            result[f"backend_{name}"] = value
        return result

    def __getitem__(self, key: str) -> Any:
        return self.flat()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.flat())

    def __len__(self) -> int:
        return len(self.flat())
