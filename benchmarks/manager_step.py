"""Scheduler time per engine step through the TieringManager, against plain dict lookups.

One step = ``lookup_prefix`` for every running request + ``on_schedule_end()``. Scenarios:

- ``resident``: every prefix block is in the primary pool (the steady-state HIT path);
- ``tiered``: the first half of each prefix is resident, the rest is known absent in a secondary
  tier (the MISS path through the tier's lookup manager, one probe per key, then verdicts).

The baseline, measured in the same run on the same keys, is the cheapest possible scheduler:
a dict of resident keys and a loop counting each request's leading hits. Run::

    .venv/bin/python benchmarks/manager_step.py [--requests 64] [--keys 32] [--steps 300]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from kvtier.factory import open_manager
from kvtier.keys import Namespace, RequestContext, chain_keys
from kvtier.tiering.manager import TieringManager

BLOCK = 4096


def make_prefixes(requests: int, keys_per_request: int) -> list[list[bytes]]:
    """Half of every prefix is shared by all requests (a system prompt), half is private."""
    namespace = Namespace(model="bench")
    shared = keys_per_request // 2
    system = list(range(shared * 16))
    prefixes = []
    for index in range(requests):
        private = [100_000 + index * 10_000 + t for t in range((keys_per_request - shared) * 16)]
        prefixes.append(chain_keys(system + private, 16, namespace))
    return prefixes


def fill(manager: TieringManager, keys: list[bytes]) -> None:
    ctx = RequestContext("fill")
    for start in range(0, len(keys), 256):
        plan = manager.prepare_store(keys[start : start + 256], ctx)
        if plan is None:
            raise SystemExit("pool too small for the benchmark's resident set")
        manager.complete_store(plan.keys, ctx)
    manager.on_request_finished(ctx)


def time_steps(step: Callable[[], None], steps: int) -> float:
    """Median nanoseconds per step."""
    for _ in range(20):
        step()
    samples = []
    for _ in range(steps):
        started = time.perf_counter_ns()
        step()
        samples.append(time.perf_counter_ns() - started)
    return statistics.median(samples)


def run(scenario: str, requests: int, keys_per_request: int, steps: int) -> dict[str, float]:
    prefixes = make_prefixes(requests, keys_per_request)
    distinct = sorted({key for prefix in prefixes for key in prefix})
    if scenario == "resident":
        resident = distinct
    else:
        resident = sorted({key for prefix in prefixes for key in prefix[: keys_per_request // 2]})
    tiers = [] if scenario == "resident" else [
        {"url": "memory://", "lookup": {"verdict_ttl_s": 3600.0}}]
    manager = open_manager({
        "block_bytes": BLOCK, "primary_bytes": BLOCK * (len(distinct) + 64),
        "namespace": {"model": "bench"}, "secondary_tiers": tiers,
        "metrics_registry": "private",
    })
    try:
        fill(manager, resident)
        manager.on_schedule_end()
        manager.wait_idle(30)
        contexts = [RequestContext(f"req-{i}") for i in range(requests)]
        answers: list[int | None] = []

        def manager_step() -> None:
            answers.clear()
            for ctx, prefix in zip(contexts, prefixes, strict=True):
                answers.append(manager.lookup_prefix(prefix, ctx))
            manager.on_schedule_end()

        # settle the tier verdicts (first step probes, the next applies the answers)
        for _ in range(3):
            manager_step()
            manager.wait_idle(30)
        expected = keys_per_request if scenario == "resident" else keys_per_request // 2
        if answers != [expected] * requests:
            raise SystemExit(f"unexpected answers in {scenario}: {answers[:4]}...")
        manager_ns = time_steps(manager_step, steps)
        stats = manager.get_stats()

        table = dict.fromkeys(resident, 0)

        def baseline_step() -> None:
            answers.clear()
            for prefix in prefixes:
                count = 0
                for key in prefix:
                    if key not in table:
                        break
                    count += 1
                answers.append(count)

        baseline_ns = time_steps(baseline_step, steps)
        if answers != [expected] * requests:
            raise SystemExit("baseline disagrees with the manager")
        backend_calls = sum(t["backend_calls"] for t in stats["tiers"].values())
    finally:
        manager.shutdown()
    keys_per_step = requests * keys_per_request
    return {"manager_us": manager_ns / 1000, "baseline_us": baseline_ns / 1000,
            "ratio": manager_ns / baseline_ns,
            "manager_ns_per_key": manager_ns / keys_per_step,
            "baseline_ns_per_key": baseline_ns / keys_per_step,
            "backend_calls_total": backend_calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--keys", type=int, default=32, help="prefix blocks per request")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(f"{args.requests} requests x {args.keys} prefix blocks per step "
          f"(half shared), median of {args.steps} steps")
    print(f"{'scenario':<10} {'manager us/step':>16} {'dict us/step':>13} {'ratio':>7} "
          f"{'mgr ns/key':>11} {'dict ns/key':>12} {'backend calls':>14}")
    for scenario in ("resident", "tiered"):
        r = run(scenario, args.requests, args.keys, args.steps)
        print(f"{scenario:<10} {r['manager_us']:>16.1f} {r['baseline_us']:>13.1f} "
              f"{r['ratio']:>6.1f}x {r['manager_ns_per_key']:>11.0f} "
              f"{r['baseline_ns_per_key']:>12.0f} {r['backend_calls_total']:>14.0f}")


if __name__ == "__main__":
    main()
