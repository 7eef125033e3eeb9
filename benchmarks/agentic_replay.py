"""Scheduler cost of long-context agentic sessions: ``builtin:agentic`` at 1 and 4 instances.

Each configuration is one full ``kvtier replay`` (real TieringManagers, a file tier in
/dev/shm, every loaded byte verified), reporting wall time, scheduler time per step (p50, p99,
and per block reference), and the hit ratio against the ideal. The baseline, measured in the
same run on the same trace, is the cheapest possible scheduler: the reference simulation (a dict
of block ids, one pass over each request's keys), timed per block reference. Rounds interleave
the configurations; medians are reported. Run::

    .venv/bin/python benchmarks/agentic_replay.py [--rounds 1] [--instances 1 4] [--sessions 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvtier.replay import reference
from kvtier.replay.agentic import generate_trace
from kvtier.replay.engine import ReplayOptions, replay
from kvtier.replay.results import ReplayResult


def baseline_ns_per_block(trace_blocks: int, seconds: float) -> float:
    return seconds / trace_blocks * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    trace = generate_trace(seed=args.seed, sessions=args.sessions)
    largest = max(len(r.hash_ids) for r in trace.requests)
    print(f"builtin:agentic seed {args.seed}: {len(trace.requests)} requests, "
          f"{trace.total_blocks:,} block references, largest request {largest:,} blocks")
    results: dict[int, list[ReplayResult]] = {n: [] for n in args.instances}
    baseline: list[float] = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        reference.ideal(trace)
        baseline.append(baseline_ns_per_block(trace.total_blocks, time.perf_counter() - started))
        for instances in args.instances:
            results[instances].append(replay(trace, ReplayOptions(instances=instances)))
    base = statistics.median(baseline)
    print(f"baseline (dict of block ids, one pass per request): {base:.0f} ns per block ref")
    header = (f"{'instances':>9} {'wall s':>7} {'steps':>6} {'sched p50 ms':>12} "
              f"{'sched p99 ms':>12} {'ns/block':>9} {'x base':>7} {'hit/ideal':>9}")
    print(header)
    for instances, runs in results.items():
        wall = statistics.median(r.wall_s for r in runs)
        steps = statistics.median(r.steps for r in runs)
        p50 = statistics.median(r.step_time_p50_s for r in runs) * 1e3
        p99 = statistics.median(r.step_time_p99_s for r in runs) * 1e3
        per_block = statistics.median(r.scheduler_s / r.block_refs * 1e9 for r in runs)
        ratio = statistics.median(r.block_hits / r.ideal_block_hits for r in runs)
        print(f"{instances:>9} {wall:>7.1f} {steps:>6.0f} {p50:>12.2f} {p99:>12.1f} "
              f"{per_block:>9.0f} {per_block / base:>7.1f} {ratio:>9.4f}")


if __name__ == "__main__":
    main()
