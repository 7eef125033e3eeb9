"""The lookup layer: the asynchronous, deduplicating "is block K in this tier?" manager.

``AsyncLookupManager`` (phases, in-flight reuse, orphans, generations, ``mark_miss``) with its
circuit breaker; one instance per secondary tier, owned by the engine's scheduler thread.
"""

from kvtier.lookup.breaker import BreakerState, CircuitBreaker
from kvtier.lookup.manager import (
    LOOKUP_SETTINGS,
    AsyncLookupManager,
    LookupManagerClosedError,
    LookupPhase,
    LookupStats,
    OwnerThreadError,
)

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
