"""Reading per-tier counters out of ``TieringManager.get_stats()``. Owns no state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.replay.results import TierKind, TierResult

# TierResult field <- the tier's stats key (SecondaryTier.stats(): lookup counters, transfer
# counters, backend counters prefixed "backend_").
_COUNTERS: dict[str, tuple[str, ...]] = {
    "lookups": ("lookups",),
    "backend_calls": ("backend_calls",),
    "probes": ("probes_submitted",),
    "inflight_reuses": ("inflight_reuses",),
    "verdict_cache_hits": ("verdict_cache_hits",),
    "failed_loads": ("load_keys_failed",),
    "failed_stores": ("store_keys_failed",),
    "shed_stores": ("store_keys_shed",),
    "probe_errors": ("probe_errors",),
    "backend_errors": ("backend_errors",),
    "corrupt_objects": ("backend_corrupt_objects",),
}
_BYTES_READ = ("backend_bytes_read", "bytes_read")
_BYTES_WRITTEN = ("backend_bytes_written", "bytes_written")
_IO_SECONDS = (("load_seconds", "store_seconds"), ("read_seconds", "write_seconds"))


def _tier_stats(manager_stats: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    tiers = manager_stats.get("tiers")
    if isinstance(tiers, Mapping):
        found = tiers.get(name)
        if isinstance(found, Mapping):
            return found
    if isinstance(tiers, Sequence):
        for entry in tiers:
            if isinstance(entry, Mapping) and entry.get("name") == name:
                return entry
    return {}


def _first_int(stats: Mapping[str, Any], names: Sequence[str]) -> int | None:
    for name in names:
        value = stats.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def secondary_tier_results(
    tier_names: Sequence[str], manager_stats: Sequence[Mapping[str, Any]]
) -> list[TierResult]:
    """One TierResult per secondary tier, counters summed over every instance's manager."""
    results: list[TierResult] = []
    for name in tier_names:
        tier = TierResult(name=name, kind=TierKind.SECONDARY)
        io_seconds = 0.0
        for stats in manager_stats:
            tier_stats = _tier_stats(stats, name)
            for attribute, keys in _COUNTERS.items():
                value = _first_int(tier_stats, keys)
                if value is not None:
                    setattr(tier, attribute, (getattr(tier, attribute) or 0) + value)
            tier.bytes_read += _first_int(tier_stats, _BYTES_READ) or 0
            tier.bytes_written += _first_int(tier_stats, _BYTES_WRITTEN) or 0
            for read_key, write_key in _IO_SECONDS:
                read_s, write_s = tier_stats.get(read_key), tier_stats.get(write_key)
                if isinstance(read_s, (int, float)) and isinstance(write_s, (int, float)):
                    io_seconds += float(read_s) + float(write_s)
                    break
        tier.io_seconds = io_seconds or None
        results.append(tier)
    return results
