"""Eviction policies for the primary pool: LRU and ARC.

Thread ownership: a policy instance is owned by the thread that owns its :class:`PrimaryPool`
(the engine scheduler thread). It holds no locks and must never be shared between threads.

A policy tracks only the keys that are *resident* in the pool. It never decides *when* to evict;
the pool asks for a :meth:`EvictionPolicy.victim` when it needs a slot, passing a predicate that
says which keys may not be evicted right now (pinned slots). The victim is removed from the
policy's resident set by that call.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from kvtier.errors import KvtierError
from kvtier.keys import BlockKey

SkipPredicate = Callable[[BlockKey], bool]


class PolicyName(enum.Enum):
    """The eviction policies kvtier ships; the value is the config spelling."""

    LRU = "lru"
    ARC = "arc"


class PolicyError(KvtierError, RuntimeError):
    """A caller broke the policy's contract (inserting a resident key, removing an absent one)."""


class EvictionPolicy(Protocol):
    """What the primary pool needs from an eviction policy."""

    @property
    def capacity(self) -> int: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def insert(self, key: BlockKey) -> None:
        """``key`` became resident (after a miss). Raises :class:`PolicyError` if it already is."""

    def touch(self, key: BlockKey) -> None:
        """``key`` was used (a hit). Unknown keys are ignored."""

    def remove(self, key: BlockKey) -> None:
        """``key`` left the pool other than by eviction (no ghost is kept). Unknown: no-op."""

    def victim(self, skip: SkipPredicate, incoming: BlockKey | None = None) -> BlockKey | None:
        """Choose, remove and return a resident key for which ``skip`` is False; None if none.

        ``incoming`` is the key the slot is wanted for (ARC adapts on ghost hits).
        """


class LRUPolicy:
    """Least recently used: the victim is the oldest unskipped key."""

    __slots__ = ("_capacity", "_order")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"LRU capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: BlockKey) -> None:
        if key in self._order:
            raise PolicyError(f"LRU insert of resident key {key.hex()}")
        self._order[key] = None

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victim(self, skip: SkipPredicate, incoming: BlockKey | None = None) -> BlockKey | None:
        """The oldest unskipped key. A skipped (pinned or protected) key is in use right now, so
        it counts as recently used and moves to the recent end: a long run of pinned keys at the
        old end (a 10k-block prefix being loaded) is scanned once, not by every call."""
        order = self._order
        skipped: list[BlockKey] = []
        found: BlockKey | None = None
        for key in order:
            if not skip(key):
                found = key
                break
            skipped.append(key)
        if found is not None:
            del order[found]
        move_to_end = order.move_to_end
        for key in skipped:
            move_to_end(key)
        return found


class _ArcList(enum.Enum):
    T1 = "t1"
    T2 = "t2"
    B1 = "b1"
    B2 = "b2"


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

    ``T1`` holds keys seen once recently, ``T2`` keys seen at least twice; ``B1``/``B2`` are their
    ghost lists (evicted keys, no data). A hit on a ghost in ``B1`` grows the target size ``p`` of
    ``T1`` (recency was undervalued); a hit in ``B2`` shrinks it. The victim comes from ``T1``
    when it is larger than ``p`` (or equal to it and the incoming key is a ``B2`` ghost), else from
    ``T2``; pinned keys are skipped, falling back to the other list when one has no candidate.
    Ghost lists are trimmed so that ``|T1|+|B1| <= c`` and ``|T1|+|T2|+|B1|+|B2| <= 2c``.
    """

    __slots__ = ("_adapted_for", "_b1", "_b2", "_capacity", "_p", "_t1", "_t2")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ARC capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._p = 0.0
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        # The ghost hit that victim() already adapted p for, so insert() does not adapt twice.
        self._adapted_for: BlockKey | None = None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def target_t1(self) -> float:
        """ARC's adaptive target size ``p`` for ``T1``."""
        return self._p

    def sizes(self) -> dict[str, int]:
        """Sizes of the four lists (for tests and stats)."""
        return {"t1": len(self._t1), "t2": len(self._t2), "b1": len(self._b1),
                "b2": len(self._b2)}

    def where(self, key: BlockKey) -> str | None:
        """Which list holds ``key`` ("t1", "t2", "b1", "b2") or None."""
        for name, entries in (
            (_ArcList.T1, self._t1), (_ArcList.T2, self._t2),
            (_ArcList.B1, self._b1), (_ArcList.B2, self._b2),
        ):
            if key in entries:
                return name.value
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def _adapt(self, key: BlockKey) -> None:
        if key in self._b1:
            self._p = min(float(self._capacity),
                          self._p + max(len(self._b2) / len(self._b1), 1.0))
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))

    def insert(self, key: BlockKey) -> None:
        if key in self._t1 or key in self._t2:
            raise PolicyError(f"ARC insert of resident key {key.hex()}")
        ghost_hit = key in self._b1 or key in self._b2
        if ghost_hit:
            if self._adapted_for != key:
                self._adapt(key)
            self._b1.pop(key, None)
            self._b2.pop(key, None)
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._adapted_for = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        capacity = self._capacity
        while len(self._t1) + len(self._b1) > capacity and self._b1:
            self._b1.popitem(last=False)
        while (len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * capacity
               and (self._b2 or self._b1)):
            (self._b2 or self._b1).popitem(last=False)

    def touch(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def victim(self, skip: SkipPredicate, incoming: BlockKey | None = None) -> BlockKey | None:
        if (incoming is not None and (incoming in self._b1 or incoming in self._b2)
                and self._adapted_for != incoming):
            self._adapt(incoming)
            self._adapted_for = incoming
        t1_size = len(self._t1)
        prefer_t1 = t1_size > 0 and (
            t1_size > self._p or (incoming is not None and incoming in self._b2
                                  and t1_size == self._p)
        )
        order = ((self._t1, self._b1), (self._t2, self._b2))
        if not prefer_t1:
            order = (order[1], order[0])
        for resident, ghosts in order:
            for key in resident:
                if not skip(key):
                    del resident[key]
                    ghosts[key] = None
                    self._trim_ghosts()
                    return key
        return None


def make_policy(name: PolicyName | str, capacity: int) -> EvictionPolicy:
    """Build the policy called ``name`` ("lru" or "arc") for ``capacity`` slots."""
    try:
        kind = name if isinstance(name, PolicyName) else PolicyName(name)
    except ValueError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of "
            f"{[p.value for p in PolicyName]}"
        ) from None
    if kind is PolicyName.ARC:
        return ARCPolicy(capacity)
    return LRUPolicy(capacity)
