"""Verdicts from our own stores and evictions for keys that have no state: one dict entry each.

Owner thread: the lookup manager's scheduler thread owns the whole :class:`NotedVerdicts`
(``entries``, the batches in note order, the count of keys in them); nothing is locked.

``note_stored`` / ``note_removed`` of keys that no request holds is the common store (the blocks
a finished request computed), and a scheduler does it for every finished request: so a noted
verdict is no object per key, only ``entries[key] = (verdict, expiry)``, one tuple shared by the
keys of one note, set by one C-level ``dict.update``. The order (for the sweep and the bound) is
kept per note, not per key: a batch is the note's tuple and its keys; a key whose entry is no
longer its batch's tuple (noted again since, read by a request, dropped) is skipped there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvtier.keys import BlockKey

__all__ = ["Noted", "NotedVerdicts"]

Noted = tuple[bool, float]  # the verdict and when it lapses

_COMPACT_SLACK = 1024  # dead keys the batches may hold beyond twice the live entries


class NotedVerdicts:
    """``entries`` (key -> ``(verdict, expiry)``, read by the manager's hot path directly) and
    the notes in order. A plain ``dict`` (not an ``OrderedDict``): an insertion costs a third."""

    __slots__ = ("_batched", "batches", "entries")

    def __init__(self) -> None:
        self.entries: dict[BlockKey, Noted] = {}
        # per note: its tuple and its keys, last key first (drop_oldest pops from the end)
        self.batches: deque[tuple[Noted, list[BlockKey]]] = deque()
        self._batched = 0  # keys in batches, live or dead

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, keys: Sequence[BlockKey], verdict: bool, expiry: float) -> None:
        """``keys`` answer ``verdict`` until ``expiry``: the newest entries."""
        entry = (verdict, expiry)
        self.entries.update(dict.fromkeys(keys, entry))
        self.batches.append((entry, list(reversed(keys))))  # pop() gives the first key
        self._batched += len(keys)
        if self._batched > 2 * len(self.entries) + _COMPACT_SLACK:
            self._compact()

    def oldest_expiry(self) -> float | None:
        """When the oldest note lapses (None: no note); its keys may all be dead already."""
        return self.batches[0][0][1] if self.batches else None

    def drop_oldest(self) -> bool:
        """Drop the oldest live entry (for the bound); False when there is none."""
        batches, entries = self.batches, self.entries
        while batches:
            entry, keys = batches[0]
            while keys:
                key = keys.pop()
                self._batched -= 1
                if entries.get(key) is entry:
                    del entries[key]
                    if not keys:
                        batches.popleft()
                    return True
            batches.popleft()
        return False

    def sweep(self, now: float) -> None:
        """Drop the notes that lapsed, oldest first, up to the first live one."""
        batches, entries = self.batches, self.entries
        while batches and batches[0][0][1] <= now:
            entry, keys = batches.popleft()
            self._batched -= len(keys)
            for key in keys:
                if entries.get(key) is entry:
                    del entries[key]

    def clear(self) -> None:
        self.entries.clear()
        self.batches.clear()
        self._batched = 0

    def _compact(self) -> None:
        """Drop the dead keys from the batches (amortised: at most once per as many notes of
        dead keys as there are live entries)."""
        entries = self.entries
        kept: deque[tuple[Noted, list[BlockKey]]] = deque()
        for entry, keys in self.batches:
            live = [key for key in dict.fromkeys(keys) if entries.get(key) is entry]
            if live:
                kept.append((entry, live))
        self.batches = kept
        self._batched = sum(len(keys) for _, keys in kept)
