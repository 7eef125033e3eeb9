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
time the operating system gave the core to other threads and processes). Before each round the
heap is collected and frozen (``gc.freeze()``), as vLLM's engine core does once it has started
(``freeze_gc_heap``); the collector otherwise runs with its defaults, on both.

How the two are paired (``--interleave step``, the default for ``--scan continue``). Each
contender runs in a child process of its own (a fresh interpreter: its own heap, garbage
collector and specialized bytecode), and the parent steps both through the same round in
lockstep: each step one runs its step, then the other (who goes first alternates step by step
and round by round), then both models run. Why: on this VM the machine's speed drifts by a
quarter or more over seconds, alike for both contenders (in one 9-round run of whole rounds
taken in turn, 3 s each, kvtier ranged 67-95 us a request and vLLM 79-119 us, CPU time alike, so
it is not preemption), which put the per-round ratio anywhere from 0.58 to 1.11; stepping both
through one round cancels any drift slower than a step. They need separate processes, not
threads of one: in one interpreter the garbage collections (gen-0 and gen-1, about 10 % of the
time) fell on whichever contender pushed the shared young generation over its threshold, the
same one every round of the same order, which gave one of two identical kvtier managers 41 gen-0
and 4 gen-1 collections to the other's 33 and 2 (ratios 0.95 / 1.04 by order), and the shared
step code flipped its call sites between the two managers' types every step (kvtier came out at
0.77x there against 0.83x here: it flattered kvtier). With a process each, the same manager
against itself gives 0.99-1.03 (kvtier) and 0.94-1.02 (vLLM) over 8 rounds. ``--warmup`` rounds
(default 1) run first and are not counted; ``--interleave round`` is the old method (one whole
round each, in turn, in this process). The price of the lockstep: both share each step's wall
time, which lasts until both workers answered. With ``--scan continue`` either worker answers a
step in about 0.6 ms, inside the 2 ms step, and each gets the replay it gets alone (the same
lookups per request and steps waited; a step lasts about a tenth longer, for the other's step
and the hand-offs, which can only cost kvtier verdict-cache hits, as ``verdict_ttl_s`` then
covers fewer steps). With ``--scan stop`` vLLM's worker makes one call per waiting request,
about ten a step (5 ms or more): kvtier's steps stretch with it, its ``verdict_ttl_s`` covers
fewer of them, and it waits 8.9 steps a request instead of the 6.2 it waits alone; so the stop
scan is compared in whole rounds (``--interleave auto``, the default, picks step for continue
and round for stop).

Reported per scan style and contender: medians over ``--rounds`` rounds of the scheduler time
per request and per step, ``lookup()`` calls per request and ns per call, backend calls, probes
per probed key (how often each probed key was asked), and steps a request waited for its answer;
then each round's parts (finish, drain, scan, flush) for both and its ratio. Ratios are kvtier /
vLLM; the verdict is the median over rounds of the ratio within each round (the paired ratio).
The same paired median of the CPU times follows: on a busy machine the wall time of a round
also holds the moments the thread waited for a core (the worker it has just woken, other jobs),
which the CPU time leaves out, so its spread is the smaller one there.
Both must give every request the same number of hit blocks; the benchmark fails if they do not.
With ``--max-ratio X`` it also fails (exit 2) when that paired median is above X on any scan.

``--mode synthetic`` runs the older synthetic step (64 requests x 32 keys, half shared, instant
tier); it does not look like a scheduler scanning a trace and is kept only for comparison.
"""

from __future__ import annotations

import argparse
import enum
import gc
import hashlib
import importlib
import multiprocessing
import queue
import statistics
import sys
import threading
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
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


class _Replayer:
    """One contender's replay of the plan, driven one scheduler step at a time (see the module
    docstring) so that several contenders can be stepped in lockstep."""

    def __init__(self, name: str, plan: _Plan, args: argparse.Namespace, scan: _Scan,
                 make_context: Callable[[str], Any], manager: Any, backend: _ModelledBackend,
                 note_stored: Callable[[list[BlockKey]], None] | None,
                 wait_for_answers: Callable[[], None], close: Callable[[], None]) -> None:
        self.name = name
        self._plan = plan
        self._run_steps = args.run_steps
        self._paced = args.pacing == "paced"
        self._stop_at_none = scan is _Scan.STOP
        self._manager = manager
        self._backend = backend
        self._note_stored = note_stored
        self._wait_for_answers = wait_for_answers
        self.close = close
        self._arrivals: dict[int, list[tuple[Any, list[BlockKey], str, int]]] = {}
        for request in plan.requests:
            self._arrivals.setdefault(request.arrival_step, []).append(
                (make_context(request.req_id), request.keys, request.req_id,
                 request.arrival_step))
        self._last_arrival = plan.requests[-1].arrival_step
        self._waiting: list[tuple[Any, list[BlockKey], str, int]] = []
        self._finishing: dict[int, list[tuple[str, list[BlockKey]]]] = {}
        self._hits_of: dict[str, int] = {}
        self._step = 0
        self._lookups = 0
        self.result = _Round(requests=len(plan.requests))

    @property
    def done(self) -> bool:
        return self._step > self._last_arrival and not self._waiting

    def _finish(self, req_id: str, computed: list[BlockKey]) -> None:
        self._manager.cleanup(req_id)
        if computed:  # the request's stores land (the blocks it computed)
            self._backend.store(computed)
            if self._note_stored is not None:
                self._note_stored(computed)

    def run_step(self) -> None:
        """Steps 1-4 of one scheduler step, timed."""
        manager, result, step = self._manager, self.result, self._step
        lookup, stop_at_none = manager.lookup, self._stop_at_none
        clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
        cpu_start = cpu_clock()
        start = clock()
        for req_id, computed in self._finishing.pop(step, ()):  # the last model run ended
            self._finish(req_id, computed)
        finished = clock()
        manager.drain_results()
        drained = clock()
        waiting = self._waiting
        waiting.extend(self._arrivals.get(step, ()))
        still_waiting = []
        lookups = 0
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
                self._hits_of[entry[2]] = hits
                result.steps_waited += step - entry[3]
                self._finishing.setdefault(step + self._run_steps, []).append(
                    (entry[2], keys[hits:]))
        self._waiting = still_waiting
        scanned = clock()
        manager.flush()
        end = clock()
        result.cpu_ns += cpu_clock() - cpu_start
        result.sched_ns += end - start
        result.cleanup_ns += finished - start
        result.drain_ns += drained - finished
        result.scan_ns += scanned - drained
        result.flush_ns += end - scanned
        self._lookups += lookups
        self._step = step + 1

    def model_runs(self) -> None:
        """Untimed, after a step: with --pacing answered, until the worker answered."""
        if not self._paced:
            self._wait_for_answers()

    def finish_tail(self) -> _Round:
        """The requests still running finish at once (timed); the round's totals."""
        result = self.result
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        for finished_now in self._finishing.values():
            for req_id, computed in finished_now:
                self._finish(req_id, computed)
        end = time.perf_counter_ns()
        result.cpu_ns += time.thread_time_ns() - cpu_start
        result.sched_ns += end - start
        result.cleanup_ns += end - start
        result.steps = self._step
        result.hits = [self._hits_of[request.req_id] for request in self._plan.requests]
        result.lookups = self._lookups
        result.backend_calls = self._backend.calls
        result.probed_keys = self._backend.keys
        result.unique_probed_keys = len(self._backend.unique)
        return result


def _kvtier_replayer(plan: _Plan, args: argparse.Namespace, scan: _Scan) -> _Replayer:
    backend = _ModelledBackend(plan.present, args.call_us / 1e6, args.key_us / 1e6)

    class ModelledTier(AsyncLookupManager):
        def batch_lookup(self, keys: list[BlockKey],
                         req_context: RequestContext) -> Sequence[bool]:
            return backend.answer(keys)

    tier = ModelledTier("bench")

    def wait_for_answers() -> None:
        if not tier._wait_for_results(60.0):
            raise RuntimeError("kvtier's probe worker did not answer within 60 s")

    return _Replayer("kvtier", plan, args, scan, RequestContext, tier, backend,
                     tier.note_stored, wait_for_answers, lambda: tier.shutdown(timeout=10.0))


def _vllm_replayer(plan: _Plan, args: argparse.Namespace, scan: _Scan,
                   module: Any) -> _Replayer:
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

    return _Replayer("vllm", plan, args, scan, lambda req_id: ReqContext(req_id=req_id),
                     tier if args.pacing == "paced" else Counting, backend, None,
                     wait_for_answers, tier.shutdown)


def _solo_round(replayer: _Replayer, args: argparse.Namespace) -> _Round:
    """One contender replays the plan alone, in this process (``--interleave round``)."""
    step_s = args.step_ms / 1e3
    _freeze_heap()
    try:
        next_start = time.perf_counter()
        while not replayer.done:
            replayer.run_step()
            replayer.model_runs()
            next_start += step_s
            pause = next_start - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        return replayer.finish_tail()
    finally:
        gc.unfreeze()
        replayer.close()


def _freeze_heap() -> None:
    # Objects from before the round (the interpreter's, vLLM's and torch's when imported) are
    # frozen: a full collection during the round then walks what the round allocated (the
    # manager's own state), not a heap that belongs to neither (about 0.2 s on this machine).
    # vLLM's engine does the same (gc.freeze() once it has started). Unfrozen after the round.
    gc.collect()
    gc.freeze()


def _contender_process(conn: Connection, source: str, args: argparse.Namespace, scan: str,
                       contender: str) -> None:
    """A child process that replays the plan through one contender, a step per command from
    the parent (``--interleave step``): "new" (a fresh manager), "step" (answers whether the
    replay is done), "model" (the untimed model run), "tail" (answers the round), "stop"."""
    module = importlib.import_module(_VLLM_MODULE) if contender == "vllm" else None
    plan = _load_plan(source, args)
    replayer: _Replayer | None = None
    conn.send(None)  # ready
    while True:
        command = conn.recv()
        if command == "stop":
            return
        if command == "new":
            replayer = (_kvtier_replayer(plan, args, _Scan(scan)) if module is None
                        else _vllm_replayer(plan, args, _Scan(scan), module))
            _freeze_heap()
            conn.send(None)
            continue
        if replayer is None:
            raise RuntimeError(f"{command!r} before 'new'")
        if command == "step":
            replayer.run_step()
            conn.send(replayer.done)
        elif command == "model":
            replayer.model_runs()
            conn.send(None)
        elif command == "tail":
            try:
                conn.send(replayer.finish_tail())
            finally:
                gc.unfreeze()
                replayer.close()
                replayer = None
        else:
            raise RuntimeError(f"unknown command {command!r}")


class _Contender:
    """The parent's handle on one contender's child process."""

    def __init__(self, source: str, args: argparse.Namespace, scan: _Scan,
                 contender: str) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter, no inherited threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_contender_process, args=(child_conn, source, args, scan.value, contender),
            name=f"lookup-overhead-{contender}", daemon=True)
        self._process.start()
        child_conn.close()
        self._ask(None)  # the child loaded the plan
        self.done = False

    def _ask(self, command: str | None) -> Any:
        if command is not None:
            self._conn.send(command)
        if not self._conn.poll(120.0):
            raise RuntimeError(f"{self._process.name} did not answer {command!r} within 120 s")
        return self._conn.recv()

    def new(self) -> None:
        self._ask("new")
        self.done = False

    def step(self) -> None:
        self.done = bool(self._ask("step"))

    def model(self) -> None:
        self._ask("model")

    def tail(self) -> _Round:
        result = self._ask("tail")
        if not isinstance(result, _Round):
            raise RuntimeError(f"{self._process.name} answered {result!r}")
        return result

    def stop(self) -> None:
        if self._process.is_alive():
            self._conn.send("stop")
        self._process.join(10.0)
        if self._process.is_alive():
            self._process.kill()


def _lockstep_round(contenders: list[_Contender], args: argparse.Namespace,
                    flip: bool) -> list[_Round]:
    """Both contenders replay the plan in one round, in lockstep: every step each one that is
    not done runs its step in its own process, one after the other (the order alternates step by
    step, starting reversed when ``flip``), then the model runs (untimed) for both."""
    step_s = args.step_ms / 1e3
    for contender in contenders:
        contender.new()
    step = 0
    next_start = time.perf_counter()
    while True:
        live = [contender for contender in contenders if not contender.done]
        if not live:
            break
        if (step % 2 == 1) != flip:
            live.reverse()
        for contender in live:
            contender.step()
        for contender in live:
            contender.model()
        step += 1
        next_start += step_s
        pause = next_start - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    return [contender.tail() for contender in contenders]


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
    """Print one table; return the median over rounds of kvtier's time per request over vLLM's
    in the same round (None: no vLLM)."""
    print(f"\n{plan.trace}, scan {scan.value}: {len(plan.requests):,} requests, "
          f"{sum(len(r.keys) for r in plan.requests):,} keys, {len(plan.present):,} held by the "
          f"tier at the start; medians of {len(ours)} rounds")
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
    ratios = [a.us_per_request / b.us_per_request for a, b in zip(ours, theirs, strict=True)]
    print("per round, us / request (cpu): kvtier finish + drain + scan + flush = total "
          "| vLLM ... | ratio")
    for index, (kvtier, vllm, paired_ratio) in enumerate(zip(ours, theirs, ratios, strict=True)):
        print(f"  {index + 1:2}: " + " | ".join(
            f"{item.cleanup_us:.1f} + {item.drain_us:.1f} + {item.scan_us:.1f} + "
            f"{item.flush_us:.1f} = {item.us_per_request:.1f} ({item.cpu_us_per_request:.1f})"
            for item in (kvtier, vllm)) + f" | {paired_ratio:.2f}")
    cpu_ratios = [a.cpu_us_per_request / b.cpu_us_per_request
                  for a, b in zip(ours, theirs, strict=True)]
    for label, values in (("paired ratio (kvtier / vLLM per round)", ratios),
                          ("  the same, CPU time", cpu_ratios)):
        print(f"{label}: median {statistics.median(values):.2f}x, range {min(values):.2f}-"
              f"{max(values):.2f}; sorted " + ", ".join(f"{x:.2f}" for x in sorted(values)))
    return float(statistics.median(ratios))


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


def _compare(source: str, plan: _Plan, args: argparse.Namespace, scan: _Scan,
             vllm_module: Any) -> tuple[list[_Round], list[_Round]]:
    ours: list[_Round] = []
    theirs: list[_Round] = []
    lockstep = vllm_module is not None and (
        args.interleave == "step" or (args.interleave == "auto" and scan is _Scan.CONTINUE))
    contenders = ([_Contender(source, args, scan, "kvtier"), _Contender(source, args, scan, "vllm")]
                  if lockstep else [])
    try:
        for index in range(args.warmup + args.rounds):
            flip = index % 2 == 1  # alternate who goes first so that order hits both alike
            if lockstep:
                mine, other = _lockstep_round(contenders, args, flip)
            elif vllm_module is None:
                mine, other = _solo_round(_kvtier_replayer(plan, args, scan), args), None
            elif flip:
                other = _solo_round(_vllm_replayer(plan, args, scan, vllm_module), args)
                mine = _solo_round(_kvtier_replayer(plan, args, scan), args)
            else:
                mine = _solo_round(_kvtier_replayer(plan, args, scan), args)
                other = _solo_round(_vllm_replayer(plan, args, scan, vllm_module), args)
            if index >= args.warmup:
                ours.append(mine)
                if other is not None:
                    theirs.append(other)
    finally:
        for contender in contenders:
            contender.stop()
    return ours, theirs


def _trace_main(args: argparse.Namespace, vllm_module: Any) -> int:
    over: list[str] = []
    for source in args.trace or _default_traces():
        plan = _load_plan(source, args)
        for scan in _scans(args):
            ours, theirs = _compare(source, plan, args, scan, vllm_module)
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
                       help="rounds per contender (median of the paired ratios reported)")
    trace.add_argument("--warmup", type=int, default=1,
                       help="rounds run first and not counted")
    trace.add_argument("--interleave", choices=("auto", "step", "round"), default="auto",
                       help="step: both contenders replay the plan in one round, step by step "
                            "in lockstep, each in its own process; round: one replay each, in "
                            "turn; auto (default): step for --scan continue, round for stop")
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
                       help="exit 2 when the median over rounds of kvtier's time per request "
                            "over vLLM's in the same round is above X")
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
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
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
