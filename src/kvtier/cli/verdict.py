"""The verdict on secondary tiers after a run: a tier that failed for most of it fails the run.

No state: pure functions of the managers' ``get_stats()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FAILED_FRACTION = 0.5
"""A tier whose operations failed for more than this fraction of the run failed the run."""


@dataclass(frozen=True, slots=True)
class TierHealth:
    """One secondary tier's operations over a run, summed over instances."""

    name: str
    attempts: int
    failures: int

    @property
    def failed(self) -> bool:
        return self.attempts > 0 and self.failures > FAILED_FRACTION * self.attempts

    def summary(self) -> str:
        share = self.failures / self.attempts if self.attempts else 0.0
        return (f"tier {self.name!r} failed {self.failures:,} of {self.attempts:,} operations "
                f"({share:.0%}: probes, loads and stores that errored, timed out, were cut off "
                f"by the circuit breaker or were shed)")


def tier_health(manager_stats: Iterable[Mapping[str, Any]]) -> list[TierHealth]:
    """Health of every secondary tier from the managers' ``get_stats()``."""
    totals: dict[str, list[int]] = {}
    for stats in manager_stats:
        for name, tier in stats.get("tiers", {}).items():
            attempts = (tier.get("probes_submitted", 0) + tier.get("breaker_short_circuits", 0)
                        + tier.get("load_keys", 0)
                        + tier.get("store_keys", 0) + tier.get("store_keys_shed", 0))
            failures = (tier.get("probe_errors", 0) + tier.get("probe_timeouts", 0)
                        + tier.get("breaker_short_circuits", 0)
                        + tier.get("load_keys_failed", 0) + tier.get("store_keys_failed", 0)
                        + tier.get("store_keys_shed", 0))
            total = totals.setdefault(name, [0, 0])
            total[0] += attempts
            total[1] += failures
    return [TierHealth(name, attempts, failures) for name, (attempts, failures) in totals.items()]
