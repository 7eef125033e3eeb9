"""The manager's events, its bounded event buffer and its counters.

Thread ownership: the **scheduler thread** owns the :class:`EventLog` (events since the last
``take_events``, oldest dropped beyond ``max_events``) and the :class:`Counters`; the tables
(pins, promotions, write-back) share both with the manager on that same thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.keys import BlockKey

__all__ = [
    "PRIMARY",
    "BlockPrefetched",
    "BlockPromoted",
    "BlockReadmitted",
    "BlockRemoved",
    "BlockStored",
    "Counters",
    "EventLog",
    "ManagerEvent",
    "PromotionFailed",
    "StoreShed",
]

PRIMARY = "primary"


@dataclass(frozen=True, slots=True)
class _TierEvent:
    keys: tuple[BlockKey, ...]
    tier: str


class BlockStored(_TierEvent):
    """``keys`` are now held by ``tier`` ("primary" or a secondary tier's name)."""

    __slots__ = ()


class BlockRemoved(_TierEvent):
    """``keys`` left ``tier`` (primary evictions)."""

    __slots__ = ()


class BlockPromoted(_TierEvent):
    """``keys`` were promoted into the primary pool from secondary tier ``tier`` (each promotion
    also emits ``BlockStored(keys, "primary")``, just before this event)."""

    __slots__ = ()


class BlockPrefetched(_TierEvent):
    """``keys`` were promoted into the primary pool from secondary tier ``tier`` by prefetch,
    with no request waiting for them (each also emits ``BlockStored(keys, "primary")`` just
    before this event; a prefetch a request joined before it landed is a ``BlockPromoted``)."""

    __slots__ = ()


class BlockReadmitted(_TierEvent):
    """``keys`` came back into the primary pool from the in-memory copy kept while their write
    to the secondary tiers was pending (no tier read; ``tier`` is "primary"; each also emits
    ``BlockStored(keys, "primary")`` just before this event)."""

    __slots__ = ()


class PromotionFailed(_TierEvent):
    """Loading ``keys`` from ``tier`` failed (missing, I/O error or corrupt); they recompute."""

    __slots__ = ()


class StoreShed(_TierEvent):
    """Cascading ``keys`` to ``tier`` was dropped because the tier was backlogged."""

    __slots__ = ()


ManagerEvent = (BlockStored | BlockRemoved | BlockPromoted | BlockPrefetched | BlockReadmitted
                | PromotionFailed | StoreShed)


@dataclass(slots=True)
class Counters:
    lookups: int = 0
    hits: int = 0
    hit_pending: int = 0
    retries: int = 0
    misses: int = 0
    promotions_started: int = 0
    promotions_joined: int = 0
    promotions_succeeded: int = 0
    promotions_failed: int = 0
    promotions_no_slot: int = 0
    promotions_lost: int = 0
    stores_prepared: int = 0
    stores_rejected: int = 0
    stores_deferred: int = 0
    cascades_waited: int = 0
    stores_completed: int = 0
    stores_aborted: int = 0
    cascades_queued: int = 0
    cascades_stored: int = 0
    cascades_failed: int = 0
    cascades_shed: int = 0
    write_backs: int = 0
    copies_readmitted: int = 0
    pieces_served: int = 0
    piece_waits: int = 0
    evictions: int = 0
    unexpected_completions: int = 0
    pins_released_at_finish: int = 0
    holds_placed: int = 0
    holds_expired: int = 0
    holds_refused: int = 0
    events_dropped: int = 0
    invariant_violations: int = 0


class EventLog:
    """Events since the last :meth:`take`, at most ``max_events`` (the oldest are dropped and
    counted in ``counters.events_dropped``). ``removed_listener`` (the prefetcher's) hears of
    every block that leaves the primary pool, whether or not the event is kept."""

    __slots__ = ("_counters", "_events", "removed_listener")

    def __init__(self, max_events: int, counters: Counters) -> None:
        self._events: deque[ManagerEvent] = deque(maxlen=max(0, max_events))
        self._counters = counters
        self.removed_listener: Callable[[tuple[BlockKey, ...]], None] | None = None

    def emit(self, event: ManagerEvent) -> None:
        if self.removed_listener is not None and isinstance(event, BlockRemoved):
            self.removed_listener(event.keys)
        if len(self._events) == self._events.maxlen:
            self._counters.events_dropped += 1
            if not self._events.maxlen:
                return
        self._events.append(event)

    def take(self) -> list[ManagerEvent]:
        events = list(self._events)
        self._events.clear()
        return events
