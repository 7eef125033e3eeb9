"""Reading per-tier counters out of ``TieringManager.get_stats()``. Owns no state.

Each tier's entry there is its ``SecondaryTier.stats()`` snapshot (a ``TierStats``); a replay
result field is named by the metric of :data:`kvtier.ops.metrics.VOCABULARY` it sums, so it
reads exactly the stats field the metric reads. A field whose metric the tier does not report
(a backend whose ``stats()`` failed) stays None. It also holds the one percentile helper
(replay step times, ``kvtier bench serve`` TTFTs).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.ops.metrics import VOCABULARY
from kvtier.replay.results import TierKind, TierResult
from kvtier.tiering.tier_stats import TierStats

_FIELD_OF_METRIC = {spec.name: spec.tier for spec in VOCABULARY if spec.tier}

# TierResult field -> the TierStats field it sums (by metric name where the vocabulary has one).
_SUMMED: tuple[tuple[str, str], ...] = (
    ("lookups", _FIELD_OF_METRIC["lookups"]),
    ("backend_calls", _FIELD_OF_METRIC["probe_calls"]),
    ("probes", "lookup.probes_submitted"),
    ("inflight_reuses", _FIELD_OF_METRIC["lookup_inflight_reuses"]),
    ("verdict_cache_hits", _FIELD_OF_METRIC["lookup_verdict_cache_hits"]),
    ("failed_loads", _FIELD_OF_METRIC["load_failed_blocks"]),
    ("failed_stores", _FIELD_OF_METRIC["store_failed_blocks"]),
    ("shed_stores", _FIELD_OF_METRIC["store_shed_blocks"]),
    ("probe_errors", _FIELD_OF_METRIC["probe_error_keys"]),
    ("backend_errors", _FIELD_OF_METRIC["backend_errors"]),
    ("corrupt_objects", _FIELD_OF_METRIC["backend_corrupt_objects"]),
    ("declined_loads", _FIELD_OF_METRIC["loads_declined"]),
)


def secondary_tier_results(
    tier_names: Sequence[str], manager_stats: Sequence[Mapping[str, Any]]
) -> list[TierResult]:
    """One TierResult per secondary tier, counters summed over every instance's manager.

    ``io_seconds`` is each tier's busy seconds (loads plus stores, ``TierStats.counters``).
    """
    results: list[TierResult] = []
    for name in tier_names:
        tier = TierResult(name=name, kind=TierKind.SECONDARY)
        io_seconds = 0.0
        for stats in manager_stats:
            tier_stats = stats["tiers"].get(name)
            if not isinstance(tier_stats, TierStats):
                continue
            for attribute, path in _SUMMED:
                value = tier_stats.value(path)
                if value is not None:
                    setattr(tier, attribute, (getattr(tier, attribute) or 0) + int(value))
            tier.bytes_read += int(tier_stats.value("backend.bytes_read") or 0)
            tier.bytes_written += int(tier_stats.value("backend.bytes_written") or 0)
            io_seconds += tier_stats.counters.read_seconds + tier_stats.counters.write_seconds
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
