"""The lookup layer: the asynchronous, deduplicating "is block K in this tier?" manager.

``AsyncLookupManager`` (manager.py: phases, in-flight reuse, orphans, generations,
``mark_miss``) over small pieces, each in its own module: the per-key table and verdict cache
(states.py), the application of probe results and timeouts (results.py), the expiry map shared
by the verdict cache and the quarantine (expiry.py), the probe worker thread (worker.py), the
circuit breaker (breaker.py), the settings table (settings.py) and the stats record (stats.py).
One manager per secondary tier, owned by the engine's scheduler thread.
"""

from kvtier.lookup.breaker import BreakerState, CircuitBreaker
from kvtier.lookup.manager import (
    AsyncLookupManager,
    LookupManagerClosedError,
    LookupPhase,
    LookupStats,
    OwnerThreadError,
)
from kvtier.lookup.settings import LOOKUP_SETTINGS

__all__ = [
    "LOOKUP_SETTINGS",
    "AsyncLookupManager",
    "BreakerState",
    "CircuitBreaker",
    "LookupManagerClosedError",
    "LookupPhase",
    "LookupStats",
    "OwnerThreadError",
]
