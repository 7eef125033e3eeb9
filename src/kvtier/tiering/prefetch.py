"""Session-aware prefetch: between an agent's turns, its finished chain goes back into the pool.

Thread ownership: the **scheduler thread** owns all of it: the keys each running request showed
the manager (``_seen``: looked up, stored), the sessions with a request running (``_active``),
the chains of finished requests by session (``_chains``, oldest finish first, each with the
positions of its keys that left the pool, heard from the event log's ``removed_listener``, so
no step scans a chain; and ``_owner``, the chain each key belongs to), the prefetches in
flight (``_in_flight``), the prefetched blocks not used yet (``_unused``) and the counters
(:class:`PrefetchCounters`). The tables it reads and changes (pool, promotions, write-back, the
tiers' lookup managers) are the manager's, on the same thread; the tiers' I/O threads only move
the bytes.

The session of a request is ``RequestContext.session_id``; without one, the first key it showed
the manager (a conversation's turns share their first block). When a request finishes, its chain
(what the engine passes to ``on_request_finished``, else the keys it looked up, then the keys it
stored) becomes its session's paused chain, replacing the last one.

The engine has a cache of its own above kvtier (vLLM's GPU blocks) that keeps the most recent
chains: a block kvtier holds that the engine holds too is worth little, and one the engine
dropped is worth its next turn's load. The prefetcher learns how deep the engine's cache reaches
(``_horizon``, in blocks of chains finished since): a next turn that asks from its chain's first
key says the engine lost it, one that asks from further in says the engine still held its
start. A prefix cache serves only a prefix, so once a chain's first block is deeper than that
horizon the next turn loads the *whole* chain from below the engine, and until then none of it.

Keep, then prefetch. The pool's eviction goes by value (``PrimaryPool.victim_chooser``): first
the blocks of sessions that ended (``NextTurn.NONE``: never needed again), then the blocks of
paused chains the engine still holds (newest chain first, each from its tail: the engine keeps
them longest; only blocks a tier holds; that order is rebuilt only when a chain finishes,
resumes or the horizon moves, so an eviction costs O(1)), and only then the pool's own order
(LRU) among the rest. So the chains the engine lost stay in the pool (*kept*, counted at their
next turn) and the pool holds what the engine does not, instead of a copy of the engine's
newest chains. That order checks itself: a chain counted held when it finished may be lost by
its next turn (running requests or one long prompt swept the engine's cache, which the depth in
finished chains cannot see), and then what was given up of it comes back from a tier on
demand. So the next turns of chains deemed held are counted (``demoted_right_blocks``,
``demoted_wrong_blocks``), and while too many of the recent ones found their chain lost
(:mod:`.held_check`), held chains are not evicted first
(``held_order`` false; measured at 50 sessions: 128,172 blocks given up wrongly against 61,912
rightly); the check goes on, so the order comes back when the engine holds them again.
Every step, the chains the engine has lost by then whose blocks left the pool anyway are
promoted back, newest chain first (for the heavy-tailed pauses of agents, a session that paused
a short while ago is the likeliest to come back next), within two budgets: the prefetched
blocks not used yet plus those in flight hold at most ``pool_fraction`` of the pool, and each
tier runs at most ``io_fraction`` of its I/O threads' worth of prefetch load jobs. A prefetch
takes a free slot or the one the value order names (an ended session's block, or one the engine
holds), never the pool's LRU victim (another chain the engine lost: no gain, and the scan of a
protected LRU order cost the scheduler thread more than the rest of the prefetcher).

Prefetch never costs a demand load:

- it runs only on an idle tier: in a step in which a request was told to ask again (its
  probes or promotions in flight, or waiting for room or its turn: ``note_demand_wait``, from
  the manager's lookups), prefetch starts nothing and probes nothing (``demand_steps``), so
  its loads never share the I/O threads, and its probes never the probe batch, with a
  request's (measured: with prefetch running beside demand, a 16-session replay waited 17 %
  more steps than without);
- its loads run at ``LoadPriority.PREFETCH`` (an I/O thread takes one only when no demand load
  and no store waits), and a request that joins a prefetch in flight moves it to the demand
  queue (:class:`~kvtier.tiering.promotions.PromotionTable`);
- a slot for a prefetch never costs a block of a chain the engine lost, of a session with a
  request running, or a pinned or held one;
- its lookups probe at most ``PROBES_PER_STEP`` keys a step, so a demand lookup's probe batch
  stays small;
- when the pool needs the room (a store deferred or refused, a promotion without a slot, a piece
  waiting: the manager's counters moved this step), prefetch starts nothing for
  ``PRESSURE_COOLDOWN_STEPS`` steps, and the prefetches that land meanwhile give their slot
  back at once (``cancelled``).

Counters (blocks): ``started = prefetched + cancelled + failed + in flight`` and
``prefetched = used + wasted + unused``: used = loaded by a request (``prepare_load``), wasted =
evicted unused, or still unused when its session's next request finished, its chain expired
(``chain_ttl_s``) or the manager shut down; in flight at shutdown counts as cancelled.
``kept_blocks``: blocks of chains the engine had lost that were still resident (never
prefetched) when their session's next turn asked; ``demoted_blocks``: evictions the value order
chose instead of the pool's own. Steps: ``steps = cooldown_steps + waited_steps + budget_steps +
open_steps`` (why prefetch could not start in a step, the first reason counted: the pool needed
the room, a request waited, the I/O or pool budget was spent; or it was free to), so a low
coverage says whether prefetch had the tier and the pool to work with at all.
"""

from __future__ import annotations

import enum
import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.keys import BlockKey, RequestContext
from kvtier.policies import SkipPredicate
from kvtier.primary import PrimaryPool
from kvtier.tiering.events import PRIMARY, BlockRemoved, Counters, EventLog
from kvtier.tiering.held_check import HeldOrderCheck
from kvtier.tiering.plans import NextTurn
from kvtier.tiering.promotions import PREFETCH_CHUNK_KEYS, PromotionTable
from kvtier.tiering.tier import SecondaryTier
from kvtier.tiering.tier_settings import PrefetchSettings
from kvtier.tiering.writeback import WriteBack

__all__ = ["PRESSURE_COOLDOWN_STEPS", "SCAN_KEYS_PER_STEP", "PrefetchCounters", "Prefetcher"]

PRESSURE_COOLDOWN_STEPS = 8   # steps without new prefetches after the pool needed room
SCAN_KEYS_PER_STEP = 1024     # chain keys checked per step at most (the scheduler's time)
STARTS_PER_STEP = 128         # prefetches started per step at most (the scheduler's time)
EVICTION_CHECK_STEPS = 16     # prefetched blocks are checked for eviction this often
PROBES_PER_STEP = 512         # prefetch lookups a tier may have to probe, per step at most
HORIZON_SAMPLES = 64          # recent next turns the engine's horizon is learned from
HORIZON_MARGIN = 0.9          # start on a chain a little before the engine's cache drops it
_CTX_PREFIX = "kvtier-prefetch:"


class _Start(enum.Enum):
    STARTED = "started"
    PENDING = "pending"  # a tier has not answered yet: try again next step
    ABSENT = "absent"    # in no tier
    NO_IO = "no_io"      # the tier's prefetch I/O budget is spent this step
    NO_SLOT = "no_slot"  # every slot is pinned or protected
    NO_PROBE = "no_probe"  # this step's prefetch probes are spent


@dataclass(slots=True)
class PrefetchCounters:
    """Blocks, not calls; see the module docstring for how they add up."""

    started_blocks: int = 0
    prefetched_blocks: int = 0
    used_blocks: int = 0
    wasted_blocks: int = 0
    cancelled_blocks: int = 0
    failed_blocks: int = 0
    chains: int = 0          # chains recorded (finished requests)
    pressure_steps: int = 0  # steps in which the pool needed the room
    wasted_expired: int = 0  # of wasted_blocks: unused when the turn came, the chain expired,
    #                          or at shutdown (the rest were evicted unused)
    demoted_blocks: int = 0  # evictions chosen by value: a block the engine holds, or of an
    #                          ended session, instead of the pool's LRU victim
    engine_held: int = 0     # next turns that found their chain's start in the engine's cache
    kept_blocks: int = 0     # blocks of lost chains still resident (not prefetched) at the turn
    ended_sessions: int = 0  # requests finished with NextTurn.NONE
    demand_steps: int = 0    # steps in which a request waited, so prefetch started nothing
    # Every step, why prefetch could or could not start (``steps`` = the sum of the next four,
    # each step counted once, in this order): the pool needed the room (now or in the
    # cooldown), a request waited, the I/O or pool budget was spent, or it was free to start.
    steps: int = 0
    cooldown_steps: int = 0
    waited_steps: int = 0    # demand_steps less those already counted as cooldown_steps
    budget_steps: int = 0
    open_steps: int = 0


@dataclass(slots=True)
class _Seen:
    """What one running request showed the manager."""

    session: str
    looked_up: tuple[BlockKey, ...] = ()
    stored: list[BlockKey] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Chain:
    session: str
    keys: tuple[BlockKey, ...]
    seq: int                 # finish order: higher is newer
    finished_at: float
    ctx: RequestContext      # the prefetch's own lookups of this chain
    active: bool = False     # its session has a request running: demand owns it
    index: dict[BlockKey, int] = field(default_factory=dict)  # key -> its position
    missing: list[int] = field(default_factory=list)  # heap: positions that left the pool
    missing_set: set[int] = field(default_factory=set)
    demoted: int = 0         # keys from the tail given up for the engine holds them
    given_up: int = 0        # of them, the resident ones the value order evicted
    deemed_held: bool = False  # the engine held it when it finished (its tail may be given up)


class Prefetcher:
    """Paused chains, prefetches in flight and prefetched blocks (see the module docstring)."""

    def __init__(self, settings: PrefetchSettings, pool: PrimaryPool,
                 tiers: tuple[SecondaryTier, ...], promotions: PromotionTable,
                 writeback: WriteBack, counters: Counters, events: EventLog,
                 clock: Callable[[], float]) -> None:
        self._settings = settings
        self._enabled = settings.enabled and bool(tiers)
        self._pool = pool
        self._tiers = tiers
        self._promotions = promotions
        self._writeback = writeback
        self._manager_counters = counters
        self._events = events
        self._clock = clock
        self.counters = PrefetchCounters()
        self._budget = int(pool.num_slots * settings.pool_fraction)
        self._io_budget = [max(1, int(tier.io_threads * settings.io_fraction))
                           * PREFETCH_CHUNK_KEYS for tier in tiers]
        self._seen: dict[str, _Seen] = {}
        self._active: Counter[str] = Counter()
        self._chains: OrderedDict[str, _Chain] = OrderedDict()
        self._owner: dict[BlockKey, _Chain] = {}
        self._in_flight: dict[BlockKey, tuple[str, int]] = {}  # key -> (session, tier index)
        self._tier_in_flight = [0] * len(tiers)
        self._unused: dict[BlockKey, str] = {}  # prefetched, not loaded yet -> session
        self._next_seq = 0
        self._horizon = 0          # blocks of recent chains the engine itself still holds
        self._observed: deque[tuple[int, bool]] = deque(maxlen=HORIZON_SAMPLES)  # (depth, held)
        self._held_check = HeldOrderCheck()  # are the chains deemed held really held?
        self._evictions_seen = pool.evictions
        # keys of ended sessions, the first victims (more than the pool holds: never reached)
        self._ended: deque[BlockKey] = deque(maxlen=pool.num_slots)
        if self._enabled:
            events.removed_listener = self._on_removed
            pool.victim_chooser = self._choose_victim
        self._pressure_mark = self._pressure_signal()
        self._cooldown = 0
        self._probes_left = PROBES_PER_STEP
        self._demand_waited = False  # a request was told to ask again since the last step
        self._holders: list[_Chain] | None = None  # the victim order's held chains (cache)

    @property
    def enabled(self) -> bool:
        return self._enabled

    # ---- what requests show (manager hooks) --------------------------------------------------
    def note_lookup(self, ctx: RequestContext, keys: Sequence[BlockKey]) -> None:
        """A request asked for ``keys`` (a prefix, or the rest of one)."""
        seen = self._seen_for(ctx, keys)
        if seen is not None and len(keys) > len(seen.looked_up):
            seen.looked_up = tuple(keys)

    def note_stored(self, ctx: RequestContext, keys: Sequence[BlockKey]) -> None:
        seen = self._seen_for(ctx, keys)
        if seen is not None:
            seen.stored.extend(keys)

    def note_loaded(self, keys: Sequence[BlockKey]) -> None:
        """A request loads ``keys``: the prefetched ones among them were used."""
        if self._promotions.prefetch_outcomes:
            self._settle_landed()
        unused = self._unused
        if not unused:
            return
        for key in keys:
            if unused.pop(key, None) is not None:
                self.counters.used_blocks += 1

    def note_demand_wait(self) -> None:
        """A request's lookup must ask again (a probe, a promotion, room or its turn): demand
        waits, so this step's prefetch starts nothing (the tier is not idle)."""
        self._demand_waited = True

    def _seen_for(self, ctx: RequestContext, keys: Sequence[BlockKey]) -> _Seen | None:
        seen = self._seen.get(ctx.req_id)
        if seen is not None or not self._enabled:
            return seen
        if ctx.session_id is not None:
            session = ctx.session_id
        elif keys:
            session = "chain:" + keys[0].hex()
        else:
            return None
        seen = self._seen[ctx.req_id] = _Seen(session)
        self._active[session] += 1
        chain = self._chains.get(session)
        if chain is not None:
            chain.active = True  # the next turn arrived: its own lookups take over
            self._holders = None
            if keys:
                self._learn_horizon(chain, keys[0])
                held = keys[0] != chain.keys[0]
                if not held:  # the engine lost it: what did the pool keep?
                    self._count_kept(chain)
                if chain.deemed_held:  # was it? (:mod:`.held_check`)
                    self._held_check.record(held, chain.given_up)
        return seen

    def _count_kept(self, chain: _Chain) -> None:
        is_resident = self._pool.is_resident
        unused = self._unused
        self.counters.kept_blocks += sum(1 for key in chain.keys
                                         if is_resident(key) and key not in unused)

    def _learn_horizon(self, chain: _Chain, first: BlockKey) -> None:
        """The engine asks from ``first`` on: it held the blocks of ``chain`` before it (its own
        cache, a GPU), or none. Engines evict the least recently used first, so the chain's
        first block is its oldest: held or lost, it says how deep the engine's cache reaches
        (in blocks of the chains finished since, each session's once: its stack distance).
        A first key past the chain: it held all of it. The depths are those of finish order,
        which is not quite the engine's order, so one observation does not set the horizon: it
        is the depth that best separates the recent held from the recent lost ones."""
        depth = len(chain.keys)
        for newer in reversed(self._chains.values()):
            if newer is chain:
                break
            depth += len(newer.keys)
        held = first != chain.keys[0]
        if held:
            self.counters.engine_held += 1
        self._observed.append((depth, held))
        self._horizon = _best_threshold(self._observed)
        self._holders = None

    def on_finished(self, ctx: RequestContext, chain: Sequence[BlockKey] | None,
                    next_turn: NextTurn = NextTurn.EXPECTED) -> None:
        """``ctx`` finished: its chain becomes its session's paused chain, or, when the session
        ended, its blocks become the pool's first victims."""
        if not self._enabled:
            return
        seen = self._seen.pop(ctx.req_id, None)
        if seen is None:
            if not chain:
                return
            seen = _Seen(ctx.session_id or "chain:" + chain[0].hex())
            self._active[seen.session] += 1
        session = seen.session
        self._active[session] -= 1
        if self._active[session] <= 0:
            del self._active[session]
        keys = tuple(chain) if chain is not None else _merged(seen.looked_up, seen.stored)
        self._drop_chain(session)
        if not keys:  # the engine keeps no chain of it (``chain=()``): the cheapest victims
            self._ended.extend(_merged(seen.looked_up, seen.stored))
            return
        if next_turn is NextTurn.NONE and session not in self._active:
            self.counters.ended_sessions += 1
            self._ended.extend(keys)
            return
        record = _Chain(session, keys, self._next_seq, self._clock(),
                        RequestContext(f"{_CTX_PREFIX}{self._next_seq}"),
                        active=session in self._active)
        self._next_seq += 1
        self._chains[session] = record
        record.deemed_held = not self._lost(record, 0)
        self._holders = None
        owner = self._owner
        is_resident = self._pool.is_resident
        record.index = {key: position for position, key in enumerate(keys)}
        for position, key in enumerate(keys):
            owner[key] = record
            if not is_resident(key):
                record.missing_set.add(position)
        record.missing = sorted(record.missing_set)  # a sorted list is a heap
        self.counters.chains += 1
        while len(self._chains) > self._settings.max_chains:
            self._drop_chain(next(iter(self._chains)))

    def _on_removed(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` left the pool (evicted, demoted, cancelled): their chains' keys to bring
        back (the pool tells through the event log, so no step scans a chain)."""
        owner = self._owner
        for key in keys:
            chain = owner.get(key)
            if chain is not None:
                _mark_missing(chain, chain.index[key])

    def _drop_chain(self, session: str) -> None:
        """Forget ``session``'s chain; its prefetched blocks not used are wasted."""
        chain = self._chains.pop(session, None)
        if chain is None:
            return
        self._holders = None
        owner = self._owner
        for key in chain.keys:
            if owner.get(key) is chain:
                del owner[key]
        for tier in self._tiers:
            tier.cleanup(chain.ctx.req_id)
        stale = [key for key, owner_session in self._unused.items() if owner_session == session]
        for key in stale:
            del self._unused[key]
        self.counters.wasted_blocks += len(stale)
        self.counters.wasted_expired += len(stale)

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> None:
        """Once per engine step, before the step's loads are submitted."""
        if not self._enabled:
            return
        self._probes_left = PROBES_PER_STEP
        self._settle_landed()
        counters = self.counters
        counters.steps += 1
        if counters.steps % EVICTION_CHECK_STEPS == 0:
            self._count_evicted()
        self._expire()
        pressured = self._under_pressure()
        demand, self._demand_waited = self._demand_waited, False
        counters.demand_steps += demand
        if pressured:
            counters.cooldown_steps += 1
        elif demand:
            counters.waited_steps += 1
        elif not self._io_room() or self._pool_room() <= 0:
            counters.budget_steps += 1
        else:
            counters.open_steps += 1
            if self._chains:
                self._prefetch()

    def _io_room(self) -> bool:
        """Whether some tier may take another prefetch load this step."""
        return any(in_flight < budget
                   for in_flight, budget in zip(self._tier_in_flight, self._io_budget,
                                                strict=True))

    def _pool_room(self) -> int:
        """Blocks the pool budget lets prefetch start now."""
        return self._budget - len(self._unused) - len(self._in_flight)

    def _settle_landed(self) -> None:
        """Apply the prefetches that landed or failed since the last call."""
        outcomes = self._promotions.take_prefetch_outcomes()
        counters = self.counters
        for key, ok in outcomes:
            owner = self._in_flight.pop(key, None)
            if owner is None:
                continue
            session, tier_index = owner
            self._tier_in_flight[tier_index] -= 1
            if not ok:
                counters.failed_blocks += 1
                chain = self._owner.get(key)
                if chain is not None:
                    _mark_missing(chain, chain.index[key])
            elif self._cooldown and self._pool.discard(key):  # the pool needs the room
                counters.cancelled_blocks += 1
                self._events.emit(BlockRemoved((key,), PRIMARY))
            else:
                counters.prefetched_blocks += 1
                self._unused[key] = session

    def _count_evicted(self) -> None:
        evictions = self._pool.evictions
        if evictions == self._evictions_seen:
            return
        self._evictions_seen = evictions
        unused = self._unused
        if not unused:
            return
        is_resident = self._pool.is_resident
        gone = [key for key in unused if not is_resident(key)]
        for key in gone:
            del unused[key]
        self.counters.wasted_blocks += len(gone)

    def _expire(self) -> None:
        if not self._chains:
            return
        horizon = self._clock() - self._settings.chain_ttl_s
        while self._chains:
            oldest = next(iter(self._chains.values()))
            if oldest.finished_at > horizon:
                return
            self._drop_chain(oldest.session)

    def _pressure_signal(self) -> int:
        counters = self._manager_counters
        return (counters.stores_deferred + counters.stores_rejected
                + counters.promotions_no_slot + counters.piece_waits + counters.holds_refused)

    def _under_pressure(self) -> bool:
        signal = self._pressure_signal()
        if signal != self._pressure_mark:
            self._pressure_mark = signal
            self._cooldown = PRESSURE_COOLDOWN_STEPS
            self.counters.pressure_steps += 1
            return True
        if self._cooldown:
            self._cooldown -= 1
            return True
        return False

    def _lost(self, chain: _Chain, newer: int) -> bool:
        """Whether the engine has lost ``chain``'s first block by now (``newer``: blocks of
        the chains finished after it), so that its next turn loads all of it from below (a
        little early: ``HORIZON_MARGIN``); always, for an engine with no cache."""
        return len(chain.keys) + newer > int(self._horizon * HORIZON_MARGIN)

    def _prefetch(self) -> None:
        """Start prefetches for the paused chains the engine lost, newest first, within the
        budgets."""
        room = min(STARTS_PER_STEP, self._pool_room())
        scan = SCAN_KEYS_PER_STEP
        newer = 0
        for chain in reversed(self._chains.values()):
            if room <= 0 or scan <= 0:
                return
            lost = self._lost(chain, newer)
            newer += len(chain.keys)
            if chain.active or not lost or not chain.missing:
                continue
            started, scanned, blocked = self._prefetch_chain(chain, room, scan)
            room -= started
            scan -= scanned
            if blocked:  # no I/O room or no slot: nothing more this step
                return

    def _choose_victim(self, skip: SkipPredicate) -> BlockKey | None:
        """The pool's next victim by value (``PrimaryPool.victim_chooser``): a block of an
        ended session (or of a request the engine kept no chain of), else one of a paused
        chain the engine still holds (newest chain first, from its tail, which the engine
        keeps longest); only blocks a tier holds. None: the pool's own order decides (among
        the chains the engine lost)."""
        pool = self._pool
        unwritten = self._writeback.is_unwritten
        ended = self._ended
        while ended:
            key = ended.popleft()
            if (pool.is_resident(key) and not skip(key) and not unwritten(key)
                    and key not in self._owner):  # not a block a paused chain shares
                self.counters.demoted_blocks += 1
                return key
        if not self._held_check.trusted:
            return None
        holders = self._holders
        if holders is None:
            holders = self._holders = self._held_chains()
        while holders:
            chain = holders[-1]
            keys = chain.keys
            while chain.demoted < len(keys):
                key = keys[len(keys) - 1 - chain.demoted]
                chain.demoted += 1
                if (pool.is_resident(key) and not skip(key) and key not in self._unused
                        and not unwritten(key)):
                    self.counters.demoted_blocks += 1
                    chain.given_up += 1
                    return key
            holders.pop()  # nothing of it left to give up
        return None

    def _held_chains(self) -> list[_Chain]:
        """The paused chains the engine still holds with blocks left to give up, oldest
        first (the victim order takes the newest, from the end); the order is rebuilt only
        when the chains, their activity or the horizon changed (``_holders = None``), so an
        eviction costs O(1), not a walk of every paused chain."""
        held: list[_Chain] = []
        newer = 0
        for chain in reversed(self._chains.values()):
            if self._lost(chain, newer):
                break  # this one and every older one: the engine lost them
            newer += len(chain.keys)
            if not chain.active and chain.demoted < len(chain.keys):
                held.append(chain)
        held.reverse()
        return held

    def _demote_one(self) -> bool:
        """Free the slot of the lowest-value block (written to a tier), if there is one."""
        pins = self._pool.pin_count
        key = self._choose_victim(lambda candidate: pins(candidate) > 0)
        if key is None or not self._pool.discard(key):
            return False
        self._events.emit(BlockRemoved((key,), PRIMARY))
        return True

    def _lookup(self, tier: SecondaryTier, key: BlockKey, chain: _Chain) -> bool | None:
        """The tier's answer for ``key`` (None: a probe is in flight); each unanswered one
        spends one of this step's probes, so that prefetch never swells the probe batch a
        demand lookup waits for."""
        verdict = tier.lookup(key, chain.ctx)
        if verdict is None:
            self._probes_left -= 1
        return verdict

    def _prefetch_chain(self, chain: _Chain, room: int, scan: int) -> tuple[int, int, bool]:
        """Bring back ``chain``'s keys that left the pool, first positions first (the order
        its next turn loads them in); (started, keys looked at, blocked)."""
        pool = self._pool
        promotions = self._promotions
        copy_of = self._writeback.copy_of
        missing = chain.missing
        later: list[int] = []
        started = scanned = 0
        blocked = False
        while missing and started < room and scanned < scan:
            position = heapq.heappop(missing)
            chain.missing_set.discard(position)
            scanned += 1
            key = chain.keys[position]
            if (pool.is_resident(key) or key in promotions or pool.slot_of(key) is not None
                    or copy_of(key) is not None):  # a copy: demand re-admits it from memory
                continue
            outcome = self._start(key, chain)
            if outcome is _Start.STARTED:
                started += 1
            elif outcome is not _Start.ABSENT:
                later.append(position)  # not answered yet, or no room now: next step
                if outcome is not _Start.PENDING:
                    blocked = True
                    break
        for position in later:
            _mark_missing(chain, position)
        return started, scanned, blocked

    def _start(self, key: BlockKey, chain: _Chain) -> _Start:
        """Prefetch ``key`` from the first tier that holds it, into a free slot or the slot of
        the lowest-value block (never by the pool's own order: that would cost a chain the
        engine lost as much as it brings back, and scanning it costs the scheduler's time)."""
        for index, tier in enumerate(self._tiers):
            if self._probes_left <= 0:
                return _Start.NO_PROBE
            verdict = self._lookup(tier, key, chain)
            if verdict is None:
                return _Start.PENDING
            if not verdict:
                continue
            if self._tier_in_flight[index] >= self._io_budget[index]:
                return _Start.NO_IO
            if not self._pool.free_slots and not self._demote_one():
                return _Start.NO_SLOT
            reservation = self._pool.reserve(key)
            if reservation is None:
                return _Start.NO_SLOT
            if self._unused.pop(key, None) is not None:  # evicted unused, not counted yet
                self.counters.wasted_blocks += 1
            self._promotions.start_prefetch(key, index, reservation.slot)
            self._in_flight[key] = (chain.session, index)
            self._tier_in_flight[index] += 1
            self.counters.started_blocks += 1
            return _Start.STARTED
        return _Start.ABSENT

    # ---- stats, lifecycle -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        stats = asdict(self.counters)
        stats.update(mode=self._settings.mode if self._enabled else "off",
                     engine_horizon_blocks=self._horizon,
                     in_flight_blocks=len(self._in_flight), unused_blocks=len(self._unused),
                     paused_chains=sum(1 for c in self._chains.values() if not c.active),
                     held_order=self._held_check.trusted,
                     demoted_right_blocks=self._held_check.right_blocks,
                     demoted_wrong_blocks=self._held_check.wrong_blocks,
                     held_order_switches=self._held_check.switches,
                     budget_blocks=self._budget)
        return stats

    def close(self) -> None:
        """Shutdown: the landed prefetches are settled, the unused ones count as wasted, those
        still in flight as cancelled, and every table is emptied."""
        self._settle_landed()
        self._count_evicted()
        self.counters.wasted_blocks += len(self._unused)
        self.counters.wasted_expired += len(self._unused)
        self.counters.cancelled_blocks += len(self._in_flight)
        self._seen.clear()
        self._active.clear()
        self._chains.clear()
        self._owner.clear()
        self._in_flight.clear()
        self._unused.clear()
        self._ended.clear()
        self._holders = None
        self._pool.victim_chooser = None


def _best_threshold(observed: Sequence[tuple[int, bool]] | deque[tuple[int, bool]]) -> int:
    """The depth ``h`` with the fewest (held deeper than ``h``) + (lost at most ``h`` deep)
    among ``observed`` (depth, held); the deepest such ``h``, 0 when none was held."""
    ordered = sorted(observed)
    errors = sum(1 for _, held in ordered if held)  # h = 0: every held one is deeper
    best_errors, best = errors, 0
    for depth, held in ordered:
        errors += -1 if held else 1
        if errors <= best_errors:
            best_errors, best = errors, depth
    return best


def _mark_missing(chain: _Chain, position: int) -> None:
    if position not in chain.missing_set:
        chain.missing_set.add(position)
        heapq.heappush(chain.missing, position)


def _merged(looked_up: tuple[BlockKey, ...], stored: list[BlockKey]) -> tuple[BlockKey, ...]:
    """The request's chain: what it looked up, then what it stored that it had not."""
    if not stored:
        return looked_up
    known = set(looked_up)
    return looked_up + tuple(key for key in stored if key not in known)
