"""What the manager answers the engine: lookup results, load and store plans, store modes.

Owns no state: immutable values built by the scheduler thread and handed to the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.errors import KvtierError
from kvtier.keys import BlockKey

__all__ = ["KeyNotResidentError", "KeyStatus", "LoadPlan", "NextTurn", "PrefixPiece", "StoreMode",
           "StorePlan"]


class LoadPriority(enum.Enum):
    """Whose load it is: a request's (``DEMAND``, first in line) or a prefetch's (run only
    when no demand load and no store waits for an I/O thread; one part per job)."""

    DEMAND = "demand"
    PREFETCH = "prefetch"


class NextTurn(enum.Enum):
    """What the engine knows, when a request finishes, about its session's next turn."""

    EXPECTED = "expected"  # the session goes on, or the engine does not know (the default)
    NONE = "none"          # the session ended (an agent's loop returned its final answer):
    #                        its chain is never prefetched and its blocks are evicted first


class KeyStatus(enum.Enum):
    HIT = "hit"                  # resident in the primary pool: loadable now
    HIT_PENDING = "hit_pending"  # a promotion from a secondary tier is in flight
    RETRY = "retry"              # a secondary tier has not answered yet: ask next step
    MISS = "miss"                # nowhere (or no slot to promote into): recompute


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Where to read each key: ``slots[i]`` holds ``keys[i]`` (pinned until complete_load)."""

    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixPiece:
    """``lookup_piece``'s answer: the leading ``ready`` keys are resident now (load them with
    ``prepare_load`` this step); ``more``: keys after them may still be loadable (their
    promotions are in flight or waiting for room): load the piece, then ask again with the keys
    after it. ``more`` False: the loadable prefix ends after the ``ready`` keys."""

    ready: int
    more: bool


class StoreMode(enum.Enum):
    """What ``prepare_store`` does when the pool cannot take every new key now."""

    ALL = "all"        # reserve every new key or none (returns None)
    PREFIX = "prefix"  # reserve the leading new keys that fit; the rest is ``deferred``


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Write ``keys[i]`` into ``slots[i]``; ``evicted`` lists every key this call evicted;
    ``deferred`` the new keys that did not fit now (``StoreMode.PREFIX``), in order."""

    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[BlockKey, ...]
    deferred: tuple[BlockKey, ...] = ()


class KeyNotResidentError(KvtierError, ValueError):
    """``prepare_load`` was asked for a key that is not resident in the primary pool."""


class WritePolicy(enum.Enum):
    """When stored blocks are cascaded to the secondary tiers; the value is the config spelling."""

    WRITE_THROUGH = "write_through"  # at complete_store, to every tier
    WRITE_BACK = "write_back"        # when the primary evicts the block, and at shutdown()
