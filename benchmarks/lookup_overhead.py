"""Scheduler-thread cost of kvtier's lookup manager against vLLM 0.32's, on a real trace.

One command: ``python benchmarks/lookup_overhead.py`` (``--help`` for the knobs). Run it with a
Python that can import ``vllm`` to get the comparison; without it only kvtier is measured.

Trace mode (the default) replays the first ``--requests`` requests (default 1,500) of each given
trace (``--trace``, repeatable; default ``builtin:conversation``; ``builtin:agentic`` is for
``--scan continue``: with ``stop`` a request asks one unknown key per step, and its 2,500-key
prompts wait thousands of steps) the way an engine scheduler scans them. Requests arrive in
trace order, their relative timing compressed so that ``--arrivals`` requests (default 1) arrive
per step on average. Every step the scheduler:

1. finishes the requests that got their answer ``--run-steps`` steps ago (default 32):
   ``cleanup()``, and their stores land: the blocks a request computed (those after its hit
   prefix) are added to the tier, and kvtier is told with ``note_stored()`` as its tiering
   layer does (vLLM's manager has no such call; it learns of them from its next probe);
2. ``drain_results()``;
3. for each waiting request, scans its keys with ``lookup()``: True counts, False ends the
   prefix, and None ("not yet") defers the request to the next step. What the scan does after a
   None is ``--scan``: ``stop`` (the scan ends there for this step, as kvtier's own tiering
   finder does) or ``continue`` (the scan goes on so every unknown key gets its probe started,
   as vLLM's ``_maximal_prefix_lookup`` does); ``both`` (the default) reports each. A request
   with no None has its answer and leaves the waiting list;
4. ``flush()`` once.

Then the model runs (untimed) for ``--step-ms`` (default 2 ms). With ``--pacing answered`` (the
default) the step also lasts until the probe worker answered its batch, as when a model step
(tens of ms) is longer than a probe: the steps a request waits then depend on the manager, not
on how busy the machine is. With ``--pacing paced`` the next step starts on time whatever the
worker did; on a busy machine a worker that makes one call per request then falls behind, and
the replay measures that backlog.

The tier starts with every block that two or more of the replayed requests share (a warm tier),
so the blocks that stores add are ones no later request asks for, and the two managers' answers
do not depend on when a store lands. Its ``batch_lookup`` sleeps 0.5 ms + 2 us per key on the
probe worker thread (``--call-us``, ``--key-us``). Both managers see the same scan and the same
tier; vLLM's is ``vllm.v1.kv_offload.tiering.async_lookup.AsyncLookupManager``, kvtier's runs
with its defaults.

Timed: everything the scheduler thread spends in steps 1-4, including the scan loop itself, as
wall time (the measure) and as the thread's CPU time (``time.thread_time_ns``: without the
time the operating system gave the core to other threads and processes, which on a busy machine
is most of the spread between rounds).
Reported per scan style and contender, median over ``--rounds`` rounds run interleaved (kvtier,
vLLM, vLLM, kvtier, ...): scheduler time per request and per step, ``lookup()`` calls per
request and ns per call, backend calls, probes per probed key (how often each probed key was
asked), and steps a request waited for its answer. Ratios are kvtier / vLLM. Both must give
every request the same number of hit blocks; the benchmark fails if they do not. With
``--max-ratio X`` it also fails (exit 2) when kvtier's median time per request is above X times
vLLM's on any scan.

``--mode synthetic`` runs the older synthetic step (64 requests x 32 keys, half shared, instant
tier); it does not look like a scheduler scanning a trace and is kept only for comparison.
"""

from __future__ import annotations

import argparse
import enum
import gc
import hashlib
import importlib
import queue
import statistics
import sys
import threading
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.keys import KEY_BYTES, BlockKey, Namespace, RequestContext, chain_keys
from kvtier.lookup.manager import AsyncLookupManager
from kvtier.replay.reader import read_trace
from kvtier.replay.trace import BUILTIN_PREFIX

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

    running = [new_request() for _ in range(args.synthetic_requests)]
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




# ---------------------------------------------------------------------------- trace mode


@dataclass(slots=True)
class _Request:
    req_id: str
    arrival_step: int
    keys: list[BlockKey]


@dataclass(slots=True)
class _Plan:
    trace: str
    requests: list[_Request]
    present: frozenset[BlockKey]


@dataclass(slots=True)
class _Round:
    """One contender's numbers for one replay of the plan."""

    sched_ns: int = 0
    cpu_ns: int = 0
    drain_ns: int = 0
    scan_ns: int = 0
    flush_ns: int = 0
    cleanup_ns: int = 0
    steps: int = 0
    requests: int = 0
    lookups: int = 0
    backend_calls: int = 0
    probed_keys: int = 0
    unique_probed_keys: int = 0
    steps_waited: int = 0
    hits: list[int] = field(default_factory=list)

    @property
    def us_per_request(self) -> float:
        return self.sched_ns / self.requests / 1e3

    @property
    def cpu_us_per_request(self) -> float:
        return self.cpu_ns / self.requests / 1e3

    @property
    def drain_us(self) -> float:
        return self.drain_ns / self.requests / 1e3

    @property
    def scan_us(self) -> float:
        return self.scan_ns / self.requests / 1e3

    @property
    def flush_us(self) -> float:
        return self.flush_ns / self.requests / 1e3

    @property
    def cleanup_us(self) -> float:
        return self.cleanup_ns / self.requests / 1e3

    @property
    def us_per_step(self) -> float:
        return self.sched_ns / self.steps / 1e3

    @property
    def lookups_per_request(self) -> float:
        return self.lookups / self.requests

    @property
    def ns_per_lookup(self) -> float:
        return self.sched_ns / self.lookups if self.lookups else 0.0

    @property
    def probes_per_key(self) -> float:
        return self.probed_keys / self.unique_probed_keys if self.unique_probed_keys else 0.0

    @property
    def mean_steps_waited(self) -> float:
        return self.steps_waited / self.requests


class _ModelledBackend:
    """The tier: a frozen set, answered after a modelled latency on the probe worker thread."""

    def __init__(self, present: frozenset[BlockKey], call_s: float, key_s: float) -> None:
        self._present = set(present)
        self._call_s = call_s
        self._key_s = key_s
        self.calls = 0
        self.keys = 0
        self.unique: set[BlockKey] = set()
        self.worker_threads: set[int] = set()

    def answer(self, keys: list[Any]) -> list[bool]:
        self.calls += 1
        self.keys += len(keys)
        self.unique.update(keys)
        time.sleep(self._call_s + self._key_s * len(keys))
        present = self._present
        return [key in present for key in keys]

    def store(self, keys: list[BlockKey]) -> None:
        """Stores landed (on the scheduler thread; one set update is atomic under the GIL)."""
        self._present.update(keys)


def _load_plan(source: str, args: argparse.Namespace) -> _Plan:
    trace = read_trace(source, max_requests=args.requests)
    raw = trace.requests
    span = max(raw[-1].timestamp_ms - raw[0].timestamp_ms, 1e-9)
    steps_for_trace = len(raw) / args.arrivals
    key_of: dict[int, BlockKey] = {}

    def key(hash_id: int) -> BlockKey:
        found = key_of.get(hash_id)
        if found is None:
            digest = hashlib.blake2b(hash_id.to_bytes(8, "little", signed=True),
                                     digest_size=KEY_BYTES, person=b"bench-trace")
            found = key_of[hash_id] = digest.digest()
        return found

    requests = []
    seen: dict[BlockKey, int] = {}
    for index, item in enumerate(raw):
        step = int((item.timestamp_ms - raw[0].timestamp_ms) / span * steps_for_trace)
        keys = [key(hash_id) for hash_id in item.hash_ids]
        for block in set(keys):
            seen[block] = seen.get(block, 0) + 1
        requests.append(_Request(f"req-{index}", step, keys))
    present = frozenset(block for block, count in seen.items() if count >= 2)
    return _Plan(trace.name, requests, present)


class _Scan(enum.Enum):
    """What the scheduler's scan of one request does after a None."""

    STOP = "stop"  # the scan ends for this step (kvtier's tiering finder)
    CONTINUE = "continue"  # the scan goes on until a False (vLLM's _maximal_prefix_lookup)


def _replay(plan: _Plan, args: argparse.Namespace, scan: _Scan,
            make_context: Callable[[str], Any], manager: Any, backend: _ModelledBackend,
            note_stored: Callable[[list[BlockKey]], None] | None,
            wait_for_answers: Callable[[], None]) -> _Round:
    """Drive ``manager`` through the plan like a scheduler; see the module docstring. Between
    two steps the model runs (untimed): until the worker answered (``--pacing answered``) or
    until the next step is due (``--pacing paced``)."""
    lookup, flush = manager.lookup, manager.flush
    drain, cleanup = manager.drain_results, manager.cleanup
    stop_at_none = scan is _Scan.STOP
    paced = args.pacing == "paced"
    step_s = args.step_ms / 1e3
    arrivals: dict[int, list[tuple[Any, list[BlockKey], str, int]]] = {}
    for request in plan.requests:
        arrivals.setdefault(request.arrival_step, []).append(
            (make_context(request.req_id), request.keys, request.req_id, request.arrival_step))
    last_arrival = plan.requests[-1].arrival_step
    waiting: list[tuple[Any, list[BlockKey], str, int]] = []
    finishing: dict[int, list[tuple[str, list[BlockKey]]]] = {}
    result = _Round(requests=len(plan.requests))
    hits_of: dict[str, int] = {}
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

    def finish(req_id: str, computed: list[BlockKey]) -> None:
        cleanup(req_id)
        if computed:  # the request's stores land (the blocks it computed)
            backend.store(computed)
            if note_stored is not None:
                note_stored(computed)

    # Objects from before the round (the interpreter's, vLLM's and torch's when imported) are
    # frozen: a full collection during the round then walks what the round allocated (each
    # manager's own state), not a heap that belongs to neither (about 0.2 s on this machine).
    # The round's caller unfreezes them when the round ends.
    gc.collect()
    gc.freeze()
    step = 0
    lookups = 0
    next_start = time.perf_counter()
    while step <= last_arrival or waiting:
        cpu_start = cpu_clock()
        start = clock()
        for req_id, computed in finishing.pop(step, ()):  # the last step's model run ended
            finish(req_id, computed)
        finished = clock()
        drain()
        drained = clock()
        waiting.extend(arrivals.get(step, ()))
        still_waiting = []
        for entry in waiting:
            context, keys = entry[0], entry[1]
            deferred = False
            hits = 0
            for block in keys:
                lookups += 1
                verdict = lookup(block, context)
                if verdict is None:
                    deferred = True
                    if stop_at_none:
                        break
                elif verdict:
                    hits += 1
                else:
                    break
            if deferred:
                still_waiting.append(entry)
            else:
                hits_of[entry[2]] = hits
                result.steps_waited += step - entry[3]
                finishing.setdefault(step + args.run_steps, []).append((entry[2], keys[hits:]))
        waiting = still_waiting
        scanned = clock()
        flush()
        end = clock()
        result.cpu_ns += cpu_clock() - cpu_start
        result.sched_ns += end - start
        result.cleanup_ns += finished - start
        result.drain_ns += drained - finished
        result.scan_ns += scanned - drained
        result.flush_ns += end - scanned
        step += 1
        # The model runs for a step; with --pacing answered at least until the worker answered.
        if not paced:
            wait_for_answers()
        next_start += step_s
        pause = next_start - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    cpu_start = cpu_clock()
    start = clock()
    for finished_now in finishing.values():  # the tail: requests still running finish at once
        for req_id, computed in finished_now:
            finish(req_id, computed)
    end = clock()
    result.cpu_ns += cpu_clock() - cpu_start
    result.sched_ns += end - start
    result.cleanup_ns += end - start
    result.steps = step
    result.hits = [hits_of[request.req_id] for request in plan.requests]
    result.lookups = lookups
    result.backend_calls = backend.calls
    result.probed_keys = backend.keys
    result.unique_probed_keys = len(backend.unique)
    return result


def _kvtier_round(plan: _Plan, args: argparse.Namespace, scan: _Scan) -> _Round:
    backend = _ModelledBackend(plan.present, args.call_us / 1e6, args.key_us / 1e6)

    class ModelledTier(AsyncLookupManager):
        def batch_lookup(self, keys: list[BlockKey],
                         req_context: RequestContext) -> Sequence[bool]:
            return backend.answer(keys)

    tier = ModelledTier("bench")

    def wait_for_answers() -> None:
        if not tier._wait_for_results(60.0):
            raise RuntimeError("kvtier's probe worker did not answer within 60 s")

    try:
        return _replay(plan, args, scan, RequestContext, tier, backend, tier.note_stored,
                       wait_for_answers)
    finally:
        gc.unfreeze()
        tier.shutdown(timeout=10.0)


def _vllm_round(plan: _Plan, args: argparse.Namespace, scan: _Scan, module: Any) -> _Round:
    from vllm.v1.kv_offload.base import ReqContext

    backend = _ModelledBackend(plan.present, args.call_us / 1e6, args.key_us / 1e6)

    class ModelledTier(module.AsyncLookupManager):  # type: ignore[misc]
        def batch_lookup(self, keys: list[bytes], req_context: Any) -> list[bool]:
            return backend.answer(keys)

    tier = ModelledTier("bench")
    sent = [0, 0]  # batches handed to vLLM's worker, answers seen

    class Counting:
        """vLLM has no test hook: count the flushes that hand keys to the worker (``--pacing
        answered`` only; one call per step, the rest is vLLM's own methods)."""

        lookup, drain_results, cleanup = tier.lookup, tier.drain_results, tier.cleanup

        @staticmethod
        def flush() -> None:
            before = len(tier._lookup_batch)
            tier.flush()
            sent[0] += bool(before)

    def wait_for_answers() -> None:
        # vLLM's worker posts one item per batch; take each new one and hand it back unread
        # (the next step's drain applies it). A batch of only stale keys posts nothing.
        while sent[1] < sent[0]:
            try:
                item = tier._pending_results.get(timeout=1.0)
            except queue.Empty:
                sent[1] = sent[0]
                return
            tier._pending_results.put(item)
            sent[1] += 1

    try:
        return _replay(plan, args, scan, lambda req_id: ReqContext(req_id=req_id),
                       tier if args.pacing == "paced" else Counting, backend, None,
                       wait_for_answers)
    finally:
        gc.unfreeze()
        tier.shutdown()


def _default_traces() -> list[str]:
    # Not builtin:agentic by default: with --scan stop a request asks one unknown key per step,
    # so its 2,500-key prompts wait thousands of steps (give it with --scan continue).
    return [BUILTIN_PREFIX + "conversation"]


def _median_of(rounds: list[_Round], attribute: str) -> float:
    return float(statistics.median(getattr(item, attribute) for item in rounds))


_ROWS: tuple[tuple[str, str, str], ...] = (
    ("scheduler us / request", "us_per_request", "{:.1f}"),
    ("  of it on the CPU", "cpu_us_per_request", "{:.1f}"),
    ("  finish (cleanup, stores)", "cleanup_us", "{:.1f}"),
    ("  drain_results()", "drain_us", "{:.1f}"),
    ("  scan (lookup() calls)", "scan_us", "{:.1f}"),
    ("  flush()", "flush_us", "{:.1f}"),
    ("scheduler us / step", "us_per_step", "{:.1f}"),
    ("lookup() calls / request", "lookups_per_request", "{:.1f}"),
    ("step ns / lookup() call", "ns_per_lookup", "{:.0f}"),
    ("backend calls", "backend_calls", "{:,.0f}"),
    ("probes / probed key", "probes_per_key", "{:.2f}"),
    ("steps waited / request", "mean_steps_waited", "{:.2f}"),
    ("steps", "steps", "{:,.0f}"),
)


def _report(plan: _Plan, scan: _Scan, ours: list[_Round], theirs: list[_Round]) -> float | None:
    """Print one table; return kvtier's median time per request over vLLM's (None: no vLLM)."""
    print(f"\n{plan.trace}, scan {scan.value}: {len(plan.requests):,} requests, "
          f"{sum(len(r.keys) for r in plan.requests):,} keys, {len(plan.present):,} held by the "
          f"tier at the start; median of {len(ours)} interleaved rounds")
    header = f"{'':26}{'kvtier':>12}"
    if theirs:
        header += f"{'vLLM 0.32':>12}{'kvtier/vLLM':>13}"
    print(header)
    for label, attribute, spec in _ROWS:
        mine = _median_of(ours, attribute)
        line = f"{label:26}{spec.format(mine):>12}"
        if theirs:
            other = _median_of(theirs, attribute)
            ratio = f"{mine / other:.2f}x" if other else "-"
            line += f"{spec.format(other):>12}{ratio:>13}"
        print(line)
    if not theirs:
        return None
    spread = sorted(mine.us_per_request / other.us_per_request
                    for mine, other in zip(ours, theirs, strict=True))
    print("per-request ratio by round: " + ", ".join(f"{x:.2f}" for x in spread))
    return _median_of(ours, "us_per_request") / _median_of(theirs, "us_per_request")


def _owner_check_ns() -> float:
    """What an owner-thread check (one get_ident() and a compare) costs per call."""
    owner = threading.get_ident()
    get_ident = threading.get_ident
    loops = 200_000
    check = min(timeit.repeat(lambda: get_ident() != owner, number=loops, repeat=5))
    empty = min(timeit.repeat(lambda: None, number=loops, repeat=5))
    return max(0.0, check - empty) / loops * 1e9


def _scans(args: argparse.Namespace) -> list[_Scan]:
    return list(_Scan) if args.scan == "both" else [_Scan(args.scan)]


def _compare(plan: _Plan, args: argparse.Namespace, scan: _Scan,
             vllm_module: Any) -> tuple[list[_Round], list[_Round]]:
    ours: list[_Round] = []
    theirs: list[_Round] = []
    for index in range(args.rounds):
        # alternate who goes first so drift hits both contenders alike
        order = ("kvtier", "vllm") if index % 2 == 0 else ("vllm", "kvtier")
        for contender in order:
            if contender == "kvtier":
                ours.append(_kvtier_round(plan, args, scan))
            elif vllm_module is not None:
                theirs.append(_vllm_round(plan, args, scan, vllm_module))
    return ours, theirs


def _trace_main(args: argparse.Namespace, vllm_module: Any) -> int:
    over: list[str] = []
    for source in args.trace or _default_traces():
        plan = _load_plan(source, args)
        for scan in _scans(args):
            ours, theirs = _compare(plan, args, scan, vllm_module)
            for mine, other in zip(ours, theirs or ours, strict=True):  # no vLLM: nothing
                if mine.hits != other.hits:
                    differ = sum(a != b for a, b in zip(mine.hits, other.hits, strict=True))
                    print(f"{plan.trace}, scan {scan.value}: kvtier and vLLM disagree on the "
                          f"hits of {differ} requests", file=sys.stderr)
                    return 1
            ratio = _report(plan, scan, ours, theirs)
            if ratio is not None and args.max_ratio is not None and ratio > args.max_ratio:
                over.append(f"{plan.trace} scan {scan.value}: {ratio:.2f}x")
    print(f"\nowner-thread check: {_owner_check_ns():.0f} ns per scheduler call "
          "(get_ident() and a compare), included in kvtier's numbers")
    pacing = (f"steps every {args.step_ms} ms" if args.pacing == "paced"
              else f"steps every {args.step_ms} ms or when the worker answered, if later")
    print(f"python {sys.version.split()[0]}; {pacing}, "
          f"{args.arrivals} arrivals per step, backend {args.call_us} us + {args.key_us} us/key")
    if over:
        print(f"kvtier above --max-ratio {args.max_ratio}: " + "; ".join(over), file=sys.stderr)
        return 2
    return 0


def _synthetic_main(args: argparse.Namespace, vllm_module: Any) -> int:
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

    print(f"workload: {args.synthetic_requests} requests x {args.keys} keys "
          f"({args.keys // 2} shared), lifetime {args.lifetime} steps, {args.steps} steps x "
          f"{args.reps} reps, python {sys.version.split()[0]}")
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--mode", choices=("trace", "synthetic"), default="trace")
    trace = parser.add_argument_group("trace mode")
    trace.add_argument("--trace", action="append", default=None, metavar="SOURCE",
                       help="a trace to replay (repeatable): builtin:NAME or a Mooncake JSONL "
                            "file; default: " + ", ".join(_default_traces()))
    trace.add_argument("--requests", type=int, default=1_500, help="requests per trace")
    trace.add_argument("--rounds", type=int, default=7,
                       help="interleaved rounds per contender (median reported)")
    trace.add_argument("--step-ms", type=float, default=2.0,
                       help="model time per engine step")
    trace.add_argument("--arrivals", type=float, default=1.0,
                       help="mean requests arriving per step")
    trace.add_argument("--run-steps", type=int, default=32,
                       help="steps a request runs after its answer before cleanup()")
    trace.add_argument("--pacing", choices=("answered", "paced"), default="answered",
                       help="when the next step starts: after --step-ms and once the probe "
                            "worker answered the step's batch (default; a model step is longer "
                            "than a probe), or after --step-ms whatever the worker did")
    trace.add_argument("--scan", choices=("both", *(scan.value for scan in _Scan)),
                       default="both", help="what a request's scan does after a None: stop "
                       "for this step, or continue to start every probe (default: both)")
    trace.add_argument("--max-ratio", type=float, default=None, metavar="X",
                       help="exit 2 when kvtier's time per request is above X times vLLM's")
    trace.add_argument("--call-us", type=float, default=500.0, help="backend latency per call")
    trace.add_argument("--key-us", type=float, default=2.0, help="backend latency per key")
    synthetic = parser.add_argument_group("synthetic mode")
    synthetic.add_argument("--synthetic-requests", type=int, default=64,
                           help="running requests per step")
    synthetic.add_argument("--keys", type=int, default=32, help="keys per request (half shared)")
    synthetic.add_argument("--lifetime", type=int, default=16, help="steps a request runs")
    synthetic.add_argument("--steps", type=int, default=200, help="steps per repetition")
    synthetic.add_argument("--reps", type=int, default=7, help="repetitions (median reported)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("requests", "rounds", "run_steps", "synthetic_requests", "keys", "lifetime",
                 "steps", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_ratio is not None and not args.max_ratio > 0:
        parser.error(f"--max-ratio must be > 0, got {args.max_ratio}")
    for name in ("step_ms", "arrivals"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("call_us", "key_us"):
        if not getattr(args, name) >= 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    try:
        vllm_module: Any = importlib.import_module(_VLLM_MODULE)
    except ImportError as exc:
        vllm_module = None
        print(f"vLLM not importable ({exc.name}); measuring kvtier only")
    if args.mode == "synthetic":
        return _synthetic_main(args, vllm_module)
    return _trace_main(args, vllm_module)


if __name__ == "__main__":
    raise SystemExit(main())
