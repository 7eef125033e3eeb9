"""Reading per-tier counters out of ``TieringManager.get_stats()``, and the one percentile
helper (replay step times, ``kvtier bench serve`` TTFTs). Owns no state."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.replay.results import TierKind, TierResult

# TierResult field <- the tier's stats key (SecondaryTier.stats(): lookup counters, transfer
# counters, backend counters prefixed "backend_"). A backend whose stats() failed has no
# "backend_*" keys: those fields then stay None.
_COUNTERS: dict[str, str] = {
    "lookups": "lookups",
    "backend_calls": "backend_calls",
    "probes": "probes_submitted",
    "inflight_reuses": "inflight_reuses",
    "verdict_cache_hits": "verdict_cache_hits",
    "failed_loads": "load_keys_failed",
    "failed_stores": "store_keys_failed",
    "shed_stores": "store_keys_shed",
    "probe_errors": "probe_errors",
    "backend_errors": "backend_errors",
    "corrupt_objects": "backend_corrupt_objects",
}


def secondary_tier_results(
    tier_names: Sequence[str], manager_stats: Sequence[Mapping[str, Any]]
) -> list[TierResult]:
    """One TierResult per secondary tier, counters summed over every instance's manager.

    ``read_seconds`` / ``write_seconds`` are each tier's busy seconds (``SecondaryTier.stats()``).
    """
    results: list[TierResult] = []
    for name in tier_names:
        tier = TierResult(name=name, kind=TierKind.SECONDARY)
        io_seconds = 0.0
        for stats in manager_stats:
            tier_stats = stats["tiers"].get(name, {})
            for attribute, key in _COUNTERS.items():
                value = tier_stats.get(key)
                if value is not None:
                    setattr(tier, attribute, (getattr(tier, attribute) or 0) + int(value))
            tier.bytes_read += int(tier_stats.get("backend_bytes_read", 0))
            tier.bytes_written += int(tier_stats.get("backend_bytes_written", 0))
            read_s, write_s = tier_stats.get("read_seconds"), tier_stats.get("write_seconds")
            if read_s is not None and write_s is not None:
                io_seconds += float(read_s) + float(write_s)
        tier.io_seconds = io_seconds or None
        results.append(tier)
    return results


class Interpolation(enum.Enum):
    """How :func:`percentile` picks a value between two samples."""

    NEAREST_RANK = "nearest-rank"  # the sample at index int(percent / 100 * n)
    LINEAR = "linear"  # between the samples around (n - 1) * percent / 100


def percentile(values: Sequence[float], percent: float, *,
               interpolation: Interpolation = Interpolation.NEAREST_RANK,
               empty: float = 0.0) -> float:
    """The ``percent`` (0..100) percentile of ``values``; ``empty`` when there are none."""
    if not values:
        return empty
    ordered = sorted(values)
    if interpolation is Interpolation.NEAREST_RANK:
        return ordered[min(len(ordered) - 1, int(percent / 100 * len(ordered)))]
    rank = (len(ordered) - 1) * percent / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
