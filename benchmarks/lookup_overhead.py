"""Scheduler-thread cost of ``lookup()`` and backend calls per step, kvtier vs vLLM.

One command: ``python benchmarks/lookup_overhead.py`` (add ``--help`` for the knobs).

Workload: ``--requests`` running requests (default 64), each looking up ``--keys`` keys
(default 32) every step; the first half of every request's keys is a prefix shared by all
requests, the second half is its own. Each request runs ``--lifetime`` steps (default 16) and is
then replaced by a new one, so every step brings new keys. The tier answers instantly from a
set. After each ``flush()`` the benchmark waits for the worker to post its answers (outside the
timed region) so both managers see the same state every step.

Timed: the step's ``lookup()`` calls on the scheduler thread (including the first-lookup drain
both managers do). Reported: median over ``--reps`` repetitions of ns per ``lookup()`` call, ns
per ``flush()``, and backend calls per step. The baseline measured in the same run is
``dict.get`` on the same keys (the floor of any lookup), and vLLM's own
``vllm.v1.kv_offload.tiering.async_lookup.AsyncLookupManager`` when ``vllm`` is importable.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import BlockKey, Namespace, RequestContext, chain_keys
from kvtier.lookup import AsyncLookupManager

_VLLM_MODULE = "vllm.v1.kv_offload.tiering.async_lookup"


@dataclass(slots=True)
class _Workload:
    steps: list[list[tuple[Any, list[BlockKey]]]]  # per step: (context, keys) per running request
    finished: list[list[str]]  # per step: request ids finishing after it


@dataclass(slots=True)
class _Measurement:
    lookup_ns: float
    flush_ns: float
    calls_per_step: float


def _build_workload(args: argparse.Namespace, make_context: Callable[[str], Any]) -> _Workload:
    namespace = Namespace(model="bench")
    shared = args.keys // 2
    shared_keys = chain_keys(list(range(shared * 16)), 16, namespace)
    serial = 0

    def new_request() -> tuple[Any, list[BlockKey], int]:
        nonlocal serial
        serial += 1
        own = chain_keys(
            [serial * 100_000 + t for t in range((args.keys - shared) * 16)], 16, namespace,
            parent=shared_keys[-1] if shared_keys else None,
        )
        return make_context(f"req-{serial}"), shared_keys + own, 0

    running = [new_request() for _ in range(args.requests)]
    # stagger ages so that a steady fraction finishes every step
    running = [(c, k, i % args.lifetime) for i, (c, k, _) in enumerate(running)]
    steps: list[list[tuple[Any, list[BlockKey]]]] = []
    finished: list[list[str]] = []
    for _ in range(args.steps):
        steps.append([(context, keys) for context, keys, _ in running])
        done: list[str] = []
        next_running = []
        for context, keys, age in running:
            if age + 1 >= args.lifetime:
                done.append(context.req_id)
                next_running.append(new_request())
            else:
                next_running.append((context, keys, age + 1))
        running = next_running
        finished.append(done)
    return _Workload(steps, finished)


def _present(workload: _Workload) -> set[BlockKey]:
    every = {key for step in workload.steps for _, keys in step for key in keys}
    return {key for key in every if key[0] % 2 == 0}


class _KvtierSetTier(AsyncLookupManager):
    def __init__(self, present: set[BlockKey]) -> None:
        self.present = present
        self.calls = 0
        super().__init__("bench", verdict_ttl_s=0)

    def batch_lookup(self, keys: list[BlockKey], req_context: RequestContext) -> Sequence[bool]:
        self.calls += 1
        present = self.present
        return [key in present for key in keys]


def _run_kvtier(workload: _Workload, present: set[BlockKey]) -> _Measurement:
    tier = _KvtierSetTier(present)
    try:
        return _drive(workload, tier.lookup, tier.flush, tier.cleanup,
                      lambda: tier._wait_for_results(60.0), lambda: tier.calls)
    finally:
        tier.shutdown(timeout=10.0)


def _run_vllm(workload: _Workload, present: set[BlockKey], module: Any) -> _Measurement:
    class VllmSetTier(module.AsyncLookupManager):  # type: ignore[misc]
        def __init__(self) -> None:
            self.calls = 0
            super().__init__("bench")

        def batch_lookup(self, keys: list[bytes], req_context: Any) -> list[bool]:
            self.calls += 1
            return [key in present for key in keys]

    tier = VllmSetTier()
    sent = [False]  # whether the last flush handed a batch to vLLM's worker

    def flush() -> None:
        sent[0] = bool(tier._lookup_batch)
        tier.flush()

    def wait() -> bool:
        # vLLM has no hook: block for the step's one result item, then hand it back unread.
        if sent[0]:
            item = tier._pending_results.get(timeout=60.0)
            tier._pending_results.put(item)
        return True

    try:
        return _drive(workload, tier.lookup, flush, tier.cleanup, wait, lambda: tier.calls)
    finally:
        tier.shutdown()


def _drive(
    workload: _Workload,
    lookup: Callable[[BlockKey, Any], bool | None],
    flush: Callable[[], None],
    cleanup: Callable[[str], None],
    wait: Callable[[], bool],
    calls: Callable[[], int],
) -> _Measurement:
    lookup_ns = 0
    flush_ns = 0
    lookups = 0
    clock = time.perf_counter_ns
    gc.collect()
    for step, done in zip(workload.steps, workload.finished, strict=True):
        start = clock()
        for context, keys in step:
            for key in keys:
                lookup(key, context)
        middle = clock()
        flush()
        flush_ns += clock() - middle
        lookup_ns += middle - start
        lookups += sum(len(keys) for _, keys in step)
        if not wait():
            raise RuntimeError("probe worker did not answer within 60 s")
        for req_id in done:
            cleanup(req_id)
    return _Measurement(lookup_ns / lookups, flush_ns / len(workload.steps),
                        calls() / len(workload.steps))


def _run_floor(workload: _Workload) -> _Measurement:
    table: dict[BlockKey, bool] = dict.fromkeys(_present(workload), True)
    get = table.get
    lookup_ns = 0
    lookups = 0
    clock = time.perf_counter_ns
    for step in workload.steps:
        start = clock()
        for _context, keys in step:
            for key in keys:
                get(key)
        lookup_ns += clock() - start
        lookups += sum(len(keys) for _, keys in step)
    return _Measurement(lookup_ns / lookups, 0.0, 0.0)


def _median(values: list[_Measurement]) -> _Measurement:
    return _Measurement(
        statistics.median(m.lookup_ns for m in values),
        statistics.median(m.flush_ns for m in values),
        statistics.median(m.calls_per_step for m in values),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="running requests per step")
    parser.add_argument("--keys", type=int, default=32, help="keys per request (half shared)")
    parser.add_argument("--lifetime", type=int, default=16, help="steps a request runs")
    parser.add_argument("--steps", type=int, default=200, help="steps per repetition")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (median reported)")
    args = parser.parse_args(argv)
    for name in ("requests", "keys", "lifetime", "steps", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    try:
        vllm_module: Any = importlib.import_module(_VLLM_MODULE)
    except ImportError as exc:
        vllm_module = None
        print(f"vLLM not importable ({exc.name}); comparing against dict.get only")

    ours_workload = _build_workload(args, RequestContext)
    present = _present(ours_workload)
    vllm_workload: _Workload | None = None
    if vllm_module is not None:
        from vllm.v1.kv_offload.base import ReqContext  # same keys, vLLM's context type

        vllm_workload = _build_workload(args, lambda req_id: ReqContext(req_id=req_id))

    floor_runs, ours_runs, vllm_runs = [], [], []
    for _ in range(args.reps):  # interleaved so drift hits every contender alike
        floor_runs.append(_run_floor(ours_workload))
        ours_runs.append(_run_kvtier(ours_workload, present))
        if vllm_workload is not None:
            vllm_runs.append(_run_vllm(vllm_workload, present, vllm_module))
    floor, ours = _median(floor_runs), _median(ours_runs)

    print(f"workload: {args.requests} requests x {args.keys} keys ({args.keys // 2} shared), "
          f"lifetime {args.lifetime} steps, {args.steps} steps x {args.reps} reps, "
          f"python {sys.version.split()[0]}")
    print(f"{'':22}{'ns/lookup':>10}{'ns/flush':>12}{'calls/step':>12}")
    print(f"{'dict.get (floor)':22}{floor.lookup_ns:10.1f}{'-':>12}{'-':>12}")
    print(f"{'kvtier':22}{ours.lookup_ns:10.1f}{ours.flush_ns:12.0f}{ours.calls_per_step:12.2f}")
    if vllm_runs:
        theirs = _median(vllm_runs)
        print(f"{'vLLM AsyncLookup':22}{theirs.lookup_ns:10.1f}{theirs.flush_ns:12.0f}"
              f"{theirs.calls_per_step:12.2f}")
        print(f"ratio kvtier/vLLM: lookup {ours.lookup_ns / theirs.lookup_ns:.2f}x, "
              f"flush {ours.flush_ns / theirs.flush_ns:.2f}x, "
              f"backend calls {ours.calls_per_step / theirs.calls_per_step:.3f}x")
    print(f"ratio kvtier/dict.get: lookup {ours.lookup_ns / floor.lookup_ns:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
