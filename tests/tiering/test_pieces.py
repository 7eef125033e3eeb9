"""lookup_piece: a prefix of any length loads whole, piece by piece, through a small pool, and
long requests take turns (real file tier, real bytes; steps wait for the I/O to land)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.keys import RequestContext
from kvtier.tiering.finder import PIECE_FRACTION
from kvtier.tiering.manager import (
    BlockPromoted,
    BlockReadmitted,
    PrefixPiece,
    StoreMode,
    TieringManager,
)

from .test_manager import (
    Factory,
    assert_no_state,
    data,
    k,
    make,  # noqa: F401  (the fixture)
    put_in_tier,
    step,
)

pytestmark = pytest.mark.timeout(60)


def load_in_pieces(m: TieringManager, requests: Sequence[tuple[RequestContext, list[bytes]]],
                   max_steps: int) -> tuple[dict[str, int], int, dict[str, list[int]]]:
    """Drive every request the way an engine does: each step, ask for the next piece, load what
    is ready (checking every byte), and stop when ``more`` is False. Returns the loaded count
    per request, the steps taken and the sizes of the pieces each request loaded."""
    loaded = {ctx.req_id: 0 for ctx, _ in requests}
    pieces: dict[str, list[int]] = {ctx.req_id: [] for ctx, _ in requests}
    done: set[str] = set()
    for steps in range(1, max_steps + 1):
        for ctx, keys in requests:
            if ctx.req_id in done:
                continue
            start = loaded[ctx.req_id]
            piece = m.lookup_piece(keys[start:], ctx)
            assert isinstance(piece, PrefixPiece)
            if piece.ready:
                part = keys[start : start + piece.ready]
                plan = m.prepare_load(part, ctx)
                assert [bytes(m.primary_view(slot)) for slot in plan.slots] == [
                    data(key) for key in part]
                m.complete_load(part, ctx)
                loaded[ctx.req_id] += piece.ready
                pieces[ctx.req_id].append(piece.ready)
            if not piece.more:
                done.add(ctx.req_id)
                m.on_request_finished(ctx)
        if len(done) == len(requests):
            return loaded, steps, pieces
        step(m)
    raise AssertionError(f"not loaded within {max_steps} steps: {loaded}")


def test_a_prefix_five_times_the_pool_loads_whole_in_pieces(make: Factory,  # noqa: F811
                                                             tmp_path: Path) -> None:
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=8)
    keys = [k(i) for i in range(40)]
    put_in_tier(m, keys)
    ctx = RequestContext("long")
    assert m.lookup_prefix(keys, ctx) is None  # the all-at-once answer: probing first
    step(m)
    m.on_request_finished(ctx)  # (lookup_prefix would end where the room ends, below)
    loaded, steps, pieces = load_in_pieces(m, [(RequestContext("pieces"), keys)], 60)
    assert loaded == {"pieces": 40}
    piece = int(8 * PIECE_FRACTION)
    assert max(pieces["pieces"]) <= piece + 8  # a staged piece, plus what was resident
    assert steps <= 40 // piece + 4  # a piece a step once probed
    promoted = [key for event in m.take_events() if isinstance(event, BlockPromoted)
                for key in event.keys]
    assert sorted(promoted) == sorted(keys)  # every block read from the tier exactly once
    stats = m.get_stats()["manager"]
    assert stats["promotions_lost"] == 0 and stats["misses"] == 0
    assert stats["pieces_served"] >= 40 // (piece + 8)
    step(m)
    assert_no_state(m)


def test_whole_prefix_lookups_still_end_where_the_room_ends(make: Factory,  # noqa: F811
                                                            tmp_path: Path) -> None:
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=8)
    keys = [k(i) for i in range(40)]
    put_in_tier(m, keys)
    ctx = RequestContext("whole")
    answer = None
    for _ in range(6):
        answer = m.lookup_prefix(keys, ctx)
        if answer is not None:
            break
        step(m)
    assert answer is not None and 1 <= answer <= 8
    m.on_request_finished(ctx)
    step(m)
    assert_no_state(m)


def test_concurrent_long_requests_take_turns_and_never_evict_each_others_pieces(
        make: Factory, tmp_path: Path) -> None:  # noqa: F811
    """Three requests of 30 blocks on a 16-slot pool: loaded whole, every block read from the
    tier once (no request's promotions evicted another's staged blocks), and while one stages
    beyond its resident run the others wait for their turn."""
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=16)
    requests = [(RequestContext(f"r{r}"), [k(100 * r + i) for i in range(30)])
                for r in range(3)]
    for _, keys in requests:
        put_in_tier(m, keys)
    loaded, _steps, _pieces = load_in_pieces(m, requests, 120)
    assert loaded == {"r0": 30, "r1": 30, "r2": 30}
    promoted = [key for event in m.take_events() if isinstance(event, BlockPromoted)
                for key in event.keys]
    assert len(promoted) == 90 and len(set(promoted)) == 90
    assert m.get_stats()["manager"]["piece_waits"] > 0  # some waited for room or a turn
    step(m)
    assert_no_state(m)


def test_copies_of_unwritten_blocks_are_readmitted_piece_by_piece(make: Factory,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    """Write-back: 24 blocks stored through an 8-slot pool leave copies of the evicted ones
    (stores wait while a quarter of the pool is copies: back-pressure); a request for all 24
    gets every one back, copies re-admitted (no tier read for them) or promoted."""
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=8, write_policy="write_back")
    writer = RequestContext("writer")
    keys = [k(i) for i in range(24)]
    backlog = list(keys)
    for _ in range(100):
        plan = m.prepare_store(backlog, writer, StoreMode.PREFIX)
        assert plan is not None
        for key, slot in zip(plan.keys, plan.slots, strict=True):
            m.primary_view(slot)[:] = data(key)
        m.complete_store(plan.keys, writer)
        backlog = list(plan.deferred)
        if not backlog:
            break
        m.on_schedule_end()  # the copies are sent; the next step's stores wait for them
        if not plan.keys:
            step(m)
    assert not backlog
    m.on_request_finished(writer)
    m.take_events()
    loaded, _steps, _pieces = load_in_pieces(m, [(RequestContext("reader"), keys)], 60)
    assert loaded == {"reader": 24}
    events = m.take_events()
    readmitted = {key for e in events if isinstance(e, BlockReadmitted) for key in e.keys}
    promoted = {key for e in events if isinstance(e, BlockPromoted) for key in e.keys}
    assert readmitted | promoted | set(keys[-8:]) >= set(keys)
    step(m)
    assert_no_state(m)


def test_a_request_that_stops_asking_loses_its_turn(make: Factory,  # noqa: F811
                                                    tmp_path: Path) -> None:
    """The first in line stops asking (the engine's batch is full, say): after one step
    without a call its turn passes on, so the next long request is not starved."""
    m = make(tiers=[f"file://{tmp_path / 'f'}"], slots=8)
    first = (RequestContext("first"), [k(i) for i in range(20)])
    second = (RequestContext("second"), [k(100 + i) for i in range(20)])
    for _, keys in (first, second):
        put_in_tier(m, keys)
    for _ in range(3):  # both ask; "first" ran out of room first: it is first in line
        for ctx, keys in (first, second):
            m.lookup_piece(keys, ctx)
        step(m)
    loaded, steps, _pieces = load_in_pieces(m, [second], 60)  # "first" never asks again
    assert loaded == {"second": 20} and steps <= 30
    m.on_request_finished(first[0])
    step(m)
    assert_no_state(m)
