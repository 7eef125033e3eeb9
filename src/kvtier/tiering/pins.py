"""The pin ledger: who holds which primary-pool pins, so every pin is released exactly once.

Thread ownership: the **scheduler thread** owns all of it:

- request pins (``prepare_load`` .. ``complete_load`` / ``on_request_finished``), per request;
- holds: a pending request's resident prefix blocks (and promotions that landed for it) stay
  pinned until it looks up again, loads, finishes, or the hold expires ``HOLD_STEPS`` steps
  after its latest refresh, so other requests' promotions cannot evict them in between (no
  promotion ping-pong). One hold per request with one expiry step, so holding and releasing a
  10k-block prefix is one pin / unpin per key; holds never pin more than ``MAX_HELD_FRACTION``
  of the pool;
- cascade pins: the pool pins held by queued or in-flight write-through cascades (one per block
  per tier), bounded by ``MAX_CASCADE_PIN_FRACTION`` of the pool;
- store pins: per submitted store job, which payloads are pinned primary slots.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvtier.keys import BlockKey
from kvtier.primary import PrimaryPool
from kvtier.tiering.events import Counters

__all__ = ["HOLD_STEPS", "MAX_CASCADE_PIN_FRACTION", "MAX_HELD_FRACTION", "Hold", "PinLedger"]

HOLD_STEPS = 8                  # a request's hold on its prefix blocks lasts this many steps
MAX_HELD_FRACTION = 0.75        # holds never pin more than this share of the pool
MAX_CASCADE_PIN_FRACTION = 0.5  # pool share write-through cascades may pin (queued + in flight)


@dataclass(slots=True)
class Hold:
    keys: set[BlockKey]
    expiry: int


class PinLedger:
    """Request pins, holds, cascade pins and store-job pins over one primary pool."""

    __slots__ = ("_cascade_pins", "_counters", "_held", "_hold_expiries", "_holds",
                 "_max_cascade_pins", "_max_held", "_pool", "_request_pins", "_step",
                 "_store_pins")

    def __init__(self, pool: PrimaryPool, counters: Counters, num_tiers: int) -> None:
        self._pool = pool
        self._counters = counters
        self._request_pins: dict[str, Counter[BlockKey]] = {}
        self._step = 0  # engine steps so far: the clock of hold expiries
        self._holds: dict[str, Hold] = {}
        self._hold_expiries: deque[tuple[int, str]] = deque()
        self._held = 0
        self._max_held = int(pool.num_slots * MAX_HELD_FRACTION)
        self._cascade_pins = 0
        # The budget is a share of the pool's blocks; each block takes one pin per tier.
        self._max_cascade_pins = max(1, int(pool.num_slots * MAX_CASCADE_PIN_FRACTION)) * max(
            1, num_tiers)
        # (tier index, store job id) -> per key: is the payload a pinned primary slot?
        self._store_pins: dict[tuple[int, int], tuple[bool, ...]] = {}

    # ---- request pins ------------------------------------------------------------------------
    def pin_for_request(self, req_id: str, keys: Sequence[BlockKey]) -> list[int]:
        """Pin every (resident) key once for ``req_id``; their slots."""
        pins = self._request_pins.get(req_id)
        if pins is None:
            pins = self._request_pins[req_id] = Counter()
        slots = []
        for key in keys:
            slots.append(self._pool.pin(key))
            pins[key] += 1
        return slots

    def unpin_for_request(self, req_id: str, keys: Iterable[BlockKey]) -> None:
        """One pin of ``req_id`` per key goes; a key it does not pin is counted, not unpinned."""
        pins = self._request_pins.get(req_id)
        for key in keys:
            if pins is None or pins[key] <= 0:
                self._counters.unexpected_completions += 1
                continue
            pins[key] -= 1
            if pins[key] == 0:
                del pins[key]
            self._pool.unpin(key)
        if pins is not None and not pins:
            del self._request_pins[req_id]

    def release_request(self, req_id: str) -> None:
        """``req_id`` finished: its hold and every pin it still holds go."""
        self.release_hold(req_id)
        pins = self._request_pins.pop(req_id, None)
        if pins:
            for key, count in pins.items():
                for _ in range(count):
                    self._pool.unpin(key)
                self._counters.pins_released_at_finish += count

    # ---- holds -------------------------------------------------------------------------------
    def hold(self, req_id: str, key: BlockKey) -> None:
        """Pin ``key`` for ``req_id`` until its hold ends; refused beyond the cap."""
        hold = self._renew(req_id)
        if key in hold.keys:
            return
        if self._held >= self._max_held or not self._pool.is_resident(key):
            self._counters.holds_refused += 1
            return
        self._pool.pin(key)
        hold.keys.add(key)
        self._held += 1
        self._counters.holds_placed += 1

    def hold_many(self, req_id: str, keys: set[BlockKey], previous: Hold | None) -> None:
        """Hold ``keys`` (all resident) for ``req_id``; of ``previous`` (its old hold, taken
        with :meth:`take_hold` and still pinned) the keys not in ``keys`` are released."""
        if previous is not None:
            self._holds[req_id] = previous
            stale = previous.keys - keys
            if stale:
                self.unpin_held(stale)
                previous.keys -= stale
        held = self._renew(req_id).keys
        room = self._max_held - self._held
        pin = self._pool.pin
        placed = 0
        for key in keys:
            if key in held:
                continue
            if placed >= room:
                self._counters.holds_refused += 1
                continue
            pin(key)
            held.add(key)
            placed += 1
        self._held += placed
        self._counters.holds_placed += placed

    def take_hold(self, req_id: str) -> Hold | None:
        """Remove ``req_id``'s hold from the ledger, its keys still pinned (settle it with
        :meth:`hold_many` or :meth:`unpin_held`)."""
        return self._holds.pop(req_id, None) if self._holds else None

    def unpin_held(self, keys: set[BlockKey]) -> None:
        unpin = self._pool.unpin
        for key in keys:
            unpin(key)
        self._held -= len(keys)

    def release_hold(self, req_id: str) -> None:
        hold = self._holds.pop(req_id, None) if self._holds else None
        if hold is not None and hold.keys:
            self.unpin_held(hold.keys)

    def release_held(self, req_id: str, keys: Iterable[BlockKey]) -> None:
        """Unpin ``keys`` from ``req_id``'s hold (a loaded piece); the rest stays held."""
        hold = self._holds.get(req_id) if self._holds else None
        if hold is None or not hold.keys:
            return
        loaded = hold.keys.intersection(keys)
        if loaded:
            hold.keys -= loaded
            self.unpin_held(loaded)

    def advance_step(self) -> None:
        """One engine step passed: release every hold that expires at it."""
        self._step += 1
        expiries = self._hold_expiries
        step = self._step
        while expiries and expiries[0][0] <= step:
            expiry, req_id = expiries.popleft()
            hold = self._holds.get(req_id)
            if hold is None or hold.expiry != expiry:
                continue  # released or refreshed since
            del self._holds[req_id]
            if hold.keys:
                self.unpin_held(hold.keys)
                self._counters.holds_expired += len(hold.keys)

    def _renew(self, req_id: str) -> Hold:
        expiry = self._step + HOLD_STEPS
        hold = self._holds.get(req_id)
        if hold is None:
            hold = self._holds[req_id] = Hold(set(), expiry)
        elif hold.expiry == expiry:
            return hold
        hold.expiry = expiry
        self._hold_expiries.append((expiry, req_id))
        return hold

    # ---- cascade and store-job pins ----------------------------------------------------------
    def cascade_room(self, num_tiers: int) -> int:
        """How many more blocks write-through may pin for ``num_tiers`` tier writes each."""
        return (self._max_cascade_pins - self._cascade_pins) // num_tiers

    def pin_cascade(self, key: BlockKey, writes: int) -> int:
        """Pin resident ``key`` once per tier write; its slot."""
        slot = self._pool.pin(key)
        for _ in range(writes - 1):
            self._pool.pin(key)
        self._cascade_pins += writes
        return slot

    def unpin_cascade(self, key: BlockKey) -> None:
        self._pool.unpin(key)
        self._cascade_pins -= 1

    def note_store_job(self, tier_index: int, job_id: int, pinned: tuple[bool, ...]) -> None:
        self._store_pins[(tier_index, job_id)] = pinned

    def pop_store_job(self, tier_index: int, job_id: int) -> tuple[bool, ...] | None:
        return self._store_pins.pop((tier_index, job_id), None)

    # ---- sizes, lifecycle --------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Engine steps so far (the clock of holds and of staging turns)."""
        return self._step

    @property
    def held(self) -> int:
        return self._held

    @property
    def cascade_pins(self) -> int:
        return self._cascade_pins

    @property
    def requests_with_pins(self) -> int:
        return len(self._request_pins)

    def clear(self) -> None:
        """Forget every pin (the pool is being closed)."""
        self._request_pins.clear()
        self._holds.clear()
        self._hold_expiries.clear()
        self._held = 0
