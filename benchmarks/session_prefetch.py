"""Session-aware prefetch on against off: ``builtin:agentic`` replayed with think times.

Each round replays the same trace twice, prefetch on and prefetch off (the order alternates
from round to round), through real TieringManagers over the default file tier (every loaded byte
verified). Reported, as medians over the rounds:

- coverage: of the blocks served from below the GPU that had to come back from a secondary tier
  (they were not in the CPU pool any more), the share prefetch brought back before their request
  asked (``cpu_prefetched``) against those the request waited for (``promoted.<tier>``);
- wasted: prefetched blocks evicted or expired unused, over the blocks prefetched;
- block hit ratio, steps waited on lookups and the scheduler's time per step, on against off
  (same run, interleaved).

Run::

    .venv/bin/python benchmarks/session_prefetch.py [--sessions 50] [--speed 20] [--rounds 1]
        [--json FILE] [--max-requests N] [--cpu-blocks N] [--gpu-blocks N] [--thin N]

A cheaper proxy of the 50-session run (~2.5 min a replay instead of ~10-16):
``--sessions 50 --thin 8 --cpu-blocks 2000 --gpu-blocks 1758`` (every chain, the pool and the
GPU model 8 times smaller).

Targets (issue 21): coverage >= 0.80, wasted <= 0.25, hit ratio on >= off, steps waited on <=
off. The command exits 1 when one is missed.

Before the replays it prints the trace's think-time hazard at this speed: of the sessions paused
for at least t seconds, the share whose next turn arrives within the next ``HAZARD_WINDOW_S``.
Where that share falls as t grows, the session paused most recently is the likeliest to come back
next, which is the order the pool's LRU keeps already; a chain that left the pool is older than
every chain still in it, so bringing it back in time means evicting a likelier one
(docs/benchmarks.md, "Between turns").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.replay.engine import Prefetch, ReplayOptions, replay
from kvtier.replay.reader import read_trace
from kvtier.replay.results import ReplayResult
from kvtier.replay.trace import Trace


def thinned(trace: Trace, every: int) -> Trace:
    """``trace`` with only the blocks whose hash id is a multiple of ``every`` (a prefix of
    the ids stays a prefix, so each session's chains keep their shape, 1/``every`` as long)."""
    if every <= 1:
        return trace
    requests = []
    for request in trace.requests:
        ids = tuple(i for i in request.hash_ids if i % every == 0)
        requests.append(replace(request, hash_ids=ids,
                                input_length=len(ids) * trace.block_tokens))
    return replace(trace, requests=tuple(requests))


HAZARD_WINDOW_S = 0.25
HAZARD_POINTS_S = (0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


def think_time_hazard(trace: Trace, speed: float) -> list[dict[str, float]]:
    """For each t of ``HAZARD_POINTS_S``: the sessions still paused after t seconds (the
    recorded gaps at ``1/speed``) and the share of them back within ``HAZARD_WINDOW_S``."""
    gaps = [r.gap_ms / 1000.0 / speed for r in trace.requests if r.after is not None]
    rows = []
    for start in HAZARD_POINTS_S:
        paused = [gap for gap in gaps if gap >= start]
        back = sum(1 for gap in paused if gap < start + HAZARD_WINDOW_S)
        rows.append({"paused_s": start, "sessions_paused": len(paused),
                     "back_within_window": back / len(paused) if paused else 0.0})
    return rows


def coverage(result: ReplayResult) -> float:
    sources = result.hit_sources
    prefetched = sources.get("cpu_prefetched", 0)
    promoted = sum(count for cause, count in sources.items() if cause.startswith("promoted."))
    return prefetched / (prefetched + promoted) if prefetched + promoted else 0.0


def wasted_share(result: ReplayResult) -> float:
    prefetched = result.prefetch.get("prefetched_blocks", 0)
    return result.prefetch.get("wasted_blocks", 0) / prefetched if prefetched else 0.0


def prefetcher_totals(result: ReplayResult) -> dict[str, int]:
    """Every numeric prefetcher counter (kept, demoted, ended sessions...), summed over the
    replay's instances."""
    totals: dict[str, int] = {}
    for stats in result.manager_stats:
        for name, value in stats.get("prefetch", {}).items():
            if isinstance(value, int) and not isinstance(value, bool):
                totals[name] = totals.get(name, 0) + value
    return totals


def summary(runs: dict[str, list[ReplayResult]]) -> dict[str, Any]:
    on, off = runs["on"], runs["off"]
    med = statistics.median
    return {
        "rounds": len(on),
        "coverage": med(coverage(r) for r in on),
        "wasted_share": med(wasted_share(r) for r in on),
        "block_hit_ratio_on": med(r.block_hit_ratio for r in on),
        "block_hit_ratio_off": med(r.block_hit_ratio for r in off),
        "steps_waited_on": med(r.steps_waited for r in on),
        "steps_waited_off": med(r.steps_waited for r in off),
        "scheduler_step_p50_ms_on": med(r.step_time_p50_s for r in on) * 1e3,
        "scheduler_step_p50_ms_off": med(r.step_time_p50_s for r in off) * 1e3,
        "scheduler_step_p99_ms_on": med(r.step_time_p99_s for r in on) * 1e3,
        "scheduler_step_p99_ms_off": med(r.step_time_p99_s for r in off) * 1e3,
        "wall_s_on": med(r.wall_s for r in on),
        "wall_s_off": med(r.wall_s for r in off),
        "prefetch_last_round": on[-1].prefetch,
        "prefetcher_last_round": prefetcher_totals(on[-1]),
        "hit_sources_on_last_round": on[-1].hit_sources,
        "hit_sources_off_last_round": off[-1].hit_sources,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--speed", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--max-requests", type=int, default=None,
                        help="replay only the trace's first N requests (a cheaper proxy)")
    parser.add_argument("--cpu-blocks", type=int, default=ReplayOptions().cpu_blocks,
                        help="the CPU pool's size in blocks")
    parser.add_argument("--gpu-blocks", type=int, default=None,
                        help="the modelled GPU's size in blocks (default: sized from the trace)")
    parser.add_argument("--thin", type=int, default=1,
                        help="keep every N-th block of each request (chains N times shorter, "
                             "the same sessions and think times: a cheaper proxy; scale "
                             "--cpu-blocks and --gpu-blocks with it)")
    args = parser.parse_args()
    trace = thinned(read_trace("builtin:agentic", seed=args.seed, sessions=args.sessions,
                               max_requests=args.max_requests), args.thin)
    print(f"builtin:agentic seed {args.seed}, {args.sessions} sessions: "
          f"{len(trace.requests):,} requests, {trace.total_blocks:,} block references, "
          f"speed {args.speed:g}, CPU pool {args.cpu_blocks:,} blocks")
    hazard = think_time_hazard(trace, args.speed)
    print(f"think-time hazard at speed {args.speed:g} (share of the sessions paused >= t back "
          f"within {HAZARD_WINDOW_S:g} s):")
    print("  " + "  ".join(f"t={row['paused_s']:g}s {row['back_within_window']:.2f}"
                           for row in hazard))
    runs: dict[str, list[ReplayResult]] = {"on": [], "off": []}
    for number in range(args.rounds):
        order = ("on", "off") if number % 2 == 0 else ("off", "on")
        for mode in order:
            result = replay(trace, ReplayOptions(speed=args.speed, prefetch=Prefetch(mode),
                                                 cpu_blocks=args.cpu_blocks,
                                                 gpu_blocks=args.gpu_blocks))
            runs[mode].append(result)
            print(f"round {number + 1} prefetch {mode}: hit {result.block_hit_ratio:.4f}, "
                  f"steps waited {result.steps_waited:,}, coverage {coverage(result):.3f}, "
                  f"wasted {wasted_share(result):.3f}, scheduler per step p50/p99 "
                  f"{result.step_time_p50_s * 1e3:.2f}/{result.step_time_p99_s * 1e3:.1f} ms, "
                  f"wall {result.wall_s:.0f} s",
                  flush=True)
    report = summary(runs)
    report["think_time_hazard"] = hazard
    checks = {
        "coverage >= 0.80": report["coverage"] >= 0.80,
        "wasted <= 0.25": report["wasted_share"] <= 0.25,
        "hit ratio on >= off": report["block_hit_ratio_on"] >= report["block_hit_ratio_off"],
        "steps waited on <= off": report["steps_waited_on"] <= report["steps_waited_off"],
    }
    report["checks"] = checks
    print(f"medians of {args.rounds} round(s): coverage {report['coverage']:.3f}, wasted "
          f"{report['wasted_share']:.3f}, block hit {report['block_hit_ratio_on']:.4f} on / "
          f"{report['block_hit_ratio_off']:.4f} off, steps waited "
          f"{report['steps_waited_on']:,.0f} on / {report['steps_waited_off']:,.0f} off")
    print("prefetch (last round):", report["prefetch_last_round"])
    print("prefetcher (last round):", report["prefetcher_last_round"])
    print("hit sources on / off (last round):", report["hit_sources_on_last_round"], "/",
          report["hit_sources_off_last_round"])
    for label, passed in checks.items():
        print(f"  {'PASS' if passed else 'MISS'} {label}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         **report}, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
