"""Agentic sessions whose working set outgrows the CPU pool: hits against the ideal.

The workload is the case tiering exists for. ``six``: six agentic sessions of 8 turns (contexts
growing from 1,700 to 3,100 64-token blocks, 200 new blocks a turn, each turn waiting for the
previous one) through a 4,000-block CPU pool and a 4,000-block GPU model, the default file tier
(working set 4.6x the pool). ``agentic``: ``builtin:agentic --sessions N`` at default settings.

Each configuration is one full replay (real TieringManagers, a file tier in /dev/shm, every
loaded byte verified). The baseline, in the same run and interleaved round by round, is the same
replay loading each prefix all at once (``lookup_prefix``: a prefix ends where the pool's room
ends) against kvtier's default, piece by piece (``lookup_piece``). Medians of ``--rounds``.
Run::

    .venv/bin/python benchmarks/beyond_pool.py                      # six sessions, 3 rounds
    .venv/bin/python benchmarks/beyond_pool.py --workload agentic --sessions 50 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from typing import Any

from kvtier.replay.agentic import generate_trace
from kvtier.replay.engine import ReplayOptions, replay
from kvtier.replay.options import PrefixLoading
from kvtier.replay.results import ReplayResult
from kvtier.replay.trace import HashConvention, Trace, TraceRequest

SIX_SESSIONS = 6
SIX_TURNS = 8
SIX_START_BLOCKS = 1_700
SIX_GROWTH_BLOCKS = 200
SIX_POOL_BLOCKS = 4_000


def six_sessions() -> Trace:
    """The six-session trace: each turn extends its session's context by 200 blocks."""
    requests: list[TraceRequest] = []
    next_id = 0
    for session in range(SIX_SESSIONS):
        ids = list(range(next_id, next_id + SIX_START_BLOCKS + SIX_GROWTH_BLOCKS * SIX_TURNS))
        next_id += len(ids)
        for turn in range(SIX_TURNS):
            blocks = SIX_START_BLOCKS + SIX_GROWTH_BLOCKS * turn
            after = len(requests) - 1 if turn else None
            requests.append(TraceRequest(len(requests) + 1, session * 10_000.0 + turn * 1_000.0,
                                         blocks * 64, 64, tuple(ids[:blocks]), session, after,
                                         0.0 if after is None else 1_000.0))
    ordered = sorted(requests, key=lambda r: (r.timestamp_ms, r.session or 0))
    position = {request.line: place for place, request in enumerate(ordered)}
    renumbered = tuple(
        replace(request, line=place + 1,
                after=None if request.after is None else position[requests[request.after].line])
        for place, request in enumerate(ordered))
    return Trace("beyond-pool:six", "six-sessions-v1", 64, renumbered, 0, (), True,
                 HashConvention.FLOOR.value, SIX_SESSIONS)


def summary(result: ReplayResult) -> dict[str, Any]:
    tier = result.manager_stats[0]["tiers"]["file"]
    return {
        "hit_over_ideal": result.block_hits / result.ideal_block_hits,
        "block_hit_ratio": result.block_hit_ratio,
        "ideal_block_hit_ratio": result.ideal_block_hit_ratio,
        "wall_s": result.wall_s,
        "steps_waited": result.steps_waited,
        "tier_write_s": tier.value("counters.write_seconds"),
        "probe_timeouts": tier.value("lookup.probe_timeouts"),
        "breaker_opens": tier.value("lookup.breaker_opens"),
        "hit_sources": result.hit_sources,
        "lost_hits": result.lost_hits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=("six", "agentic"), default="six")
    parser.add_argument("--sessions", type=int, default=50, help="agentic sessions")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()
    if args.workload == "six":
        trace = six_sessions()
        options = ReplayOptions(cpu_blocks=SIX_POOL_BLOCKS, gpu_blocks=SIX_POOL_BLOCKS)
    else:
        trace = generate_trace(sessions=args.sessions)
        options = ReplayOptions()
    runs: dict[str, list[dict[str, Any]]] = {mode.value: [] for mode in PrefixLoading}
    for _ in range(args.rounds):
        for mode in (PrefixLoading.WHOLE, PrefixLoading.PIECES):
            result = replay(trace, replace(options, prefix_loading=mode))
            runs[mode.value].append(summary(result))
    print(f"{trace.name}: {len(trace.requests)} requests, {trace.total_blocks:,} block "
          f"references, {args.rounds} round(s), medians")
    print(f"{'loading':>8} {'hit/ideal':>9} {'hit':>7} {'ideal':>7} {'wall s':>7} "
          f"{'waited':>7} {'write s':>8} {'timeouts':>8} {'breaker':>7}")
    for mode, results in runs.items():
        def med(name: str, results: list[dict[str, Any]] = results) -> float:
            return float(statistics.median(r[name] for r in results))

        print(f"{mode:>8} {med('hit_over_ideal'):>9.3f} {med('block_hit_ratio'):>7.4f} "
              f"{med('ideal_block_hit_ratio'):>7.4f} {med('wall_s'):>7.1f} "
              f"{med('steps_waited'):>7.0f} {med('tier_write_s'):>8.1f} "
              f"{med('probe_timeouts'):>8.0f} {med('breaker_opens'):>7.0f}")
    print("pieces / whole (hit over ideal): "
          f"{statistics.median(r['hit_over_ideal'] for r in runs['pieces']) / statistics.median(r['hit_over_ideal'] for r in runs['whole']):.2f}x")  # noqa: E501
    for mode, results in runs.items():  # issue 18: the tier's write time below the run's wall
        busy = statistics.median(r["tier_write_s"] / r["wall_s"] for r in results)
        print(f"{mode}: tier write time / wall time {busy:.2f} (target < 1)")
    last = runs["pieces"][-1]
    print(f"hit sources (pieces, last round): {last['hit_sources']}; lost: {last['lost_hits']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"trace": trace.name, "rounds": args.rounds, "runs": runs}, out, indent=1)


if __name__ == "__main__":
    main()
