"""``kvtier bench serve``: time to first token of a real ``vllm serve`` under a real client.

Each configuration gets a fresh ``vllm serve`` process on loopback (a random-weight Llama built
locally, no download) and is driven by vLLM's own ``vllm bench serve`` client replaying the
bundled Mooncake conversation trace with ``timed_trace``. The trace window is replayed twice on
one server: a *warm* pass that fills the engine and the tiers, then the *measured* pass (the
same requests again), so reuse exists within the run while the engine's KV cache is too small
to hold the working set. ``kvtier-file-restart`` is a second server on the warm file tier of
``kvtier-file`` that runs only the measured pass; the no-reuse pair replays a copy of the window
in which every block is distinct, once.

The client's own JSON result is kept per configuration and pass and parsed; prompt tokens served
from cache come from the server's ``/metrics`` (deltas over the measured pass).

The pieces live in :mod:`~kvtier.bench.serve_config` (presets, settings, records),
:mod:`~kvtier.bench.serve_inputs` (model, traces), :mod:`~kvtier.bench.serve_procs` (servers,
client) and :mod:`~kvtier.bench.serve_report`; this module runs them and owns the command line.

State: everything here runs on the calling thread; every server process and Valkey started is
owned by a context manager that stops it (and removes vLLM's ``/dev/shm`` offload files).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.bench.serve_config import (
    ALL_CONFIG_NAMES,
    CONFIG_NAMES,
    DIAGNOSTIC_CONFIG_NAMES,
    MIB,
    PRESETS,
    SERVED_MODEL,
    BenchSettings,
    ConfigResult,
    ModelShape,
    Pass,
    PassResult,
    Preset,
    ServeBenchError,
    ServerSpec,
    ServeTier,
    TraceKind,
)
from kvtier.bench.serve_inputs import (
    TRACES,
    build_random_llama,
    bundled_trace_rows,
    later_turns,
    trace_rows,
    write_trace,
)
from kvtier.bench.serve_procs import (
    RunningServer,
    free_port,
    kv_transfer_config,
    run_client,
    scrape_metrics,
    valkey_server,
    vllm_server,
)
from kvtier.bench.serve_report import (
    combine_rounds,
    format_table,
    kvtier_loaded_blocks,
    kvtier_stored_blocks,
    metrics_delta,
    outcome_lines,
    outcome_sheets,
    outputs_match,
    plot_cdf,
    summarize,
    targets,
)

__all__ = [
    "CONFIG_NAMES",
    "DESCRIPTION",
    "MIB",
    "PRESETS",
    "SERVED_MODEL",
    "TRACES",
    "BenchSettings",
    "ConfigResult",
    "ModelShape",
    "Pass",
    "PassResult",
    "Preset",
    "RunningServer",
    "ServeBenchError",
    "ServeTier",
    "ServerSpec",
    "TraceKind",
    "add_arguments",
    "build_random_llama",
    "bundled_trace_rows",
    "combine_rounds",
    "format_table",
    "free_port",
    "kv_transfer_config",
    "kvtier_loaded_blocks",
    "kvtier_stored_blocks",
    "later_turns",
    "machine_info",
    "main",
    "outputs_match",
    "plot_cdf",
    "round_order",
    "run_benchmark",
    "run_client",
    "run_from_args",
    "run_one",
    "run_rounds",
    "scrape_metrics",
    "server_specs",
    "settings_from_args",
    "summarize",
    "targets",
    "trace_rows",
    "valkey_server",
    "vllm_server",
    "write_trace",
]

DESCRIPTION = ("TTFT of a real vllm serve driven by vllm bench serve (timed_trace), "
               "prefix cache only vs vLLM's fs tier vs kvtier tiers.")


# -- orchestration -------------------------------------------------------------------------


def server_specs(settings: BenchSettings, root: Path | None = None) -> list[ServerSpec]:
    """The configurations to run, their tier directories under ``root`` (one per round, so
    every round starts on empty tiers; default the workdir)."""
    root = settings.workdir if root is None else root
    file_dir = root / "kvtier-file-tier"
    # Sessions measure each later turn against its own earlier turns: one pass. Otherwise a
    # warm pass fills the tiers and the same requests are measured again.
    both = ((Pass.MEASURED,) if settings.trace == "agentic"
            else (Pass.WARM, Pass.MEASURED))
    staging = settings.prefetch_bytes
    specs = {
        "prefix-cache-only": ServerSpec("prefix-cache-only", ServeTier.NONE, TraceKind.REUSE,
                                        both),
        "vllm-fs": ServerSpec("vllm-fs", ServeTier.VLLM_FS, TraceKind.REUSE, both,
                              root / "vllm-fs-tier"),
        "kvtier-file": ServerSpec("kvtier-file", ServeTier.KVTIER_FILE, TraceKind.REUSE, both,
                                  file_dir),
        "kvtier-file-restart": ServerSpec("kvtier-file-restart", ServeTier.KVTIER_FILE,
                                          TraceKind.REUSE, (Pass.MEASURED,), file_dir),
        "kvtier-redis": ServerSpec("kvtier-redis", ServeTier.KVTIER_REDIS, TraceKind.REUSE,
                                   both),
        "kvtier-memory": ServerSpec("kvtier-memory", ServeTier.KVTIER_MEMORY, TraceKind.REUSE,
                                    both),
        "kvtier-file-prefetch": ServerSpec("kvtier-file-prefetch", ServeTier.KVTIER_FILE,
                                           TraceKind.REUSE, both,
                                           root / "kvtier-file-prefetch-tier", staging),
        "kvtier-redis-prefetch": ServerSpec("kvtier-redis-prefetch", ServeTier.KVTIER_REDIS,
                                            TraceKind.REUSE, both, None, staging),
        "no-reuse-baseline": ServerSpec("no-reuse-baseline", ServeTier.NONE, TraceKind.NO_REUSE,
                                        (Pass.MEASURED,)),
        "no-reuse-kvtier": ServerSpec("no-reuse-kvtier", ServeTier.KVTIER_FILE,
                                      TraceKind.NO_REUSE, (Pass.MEASURED,),
                                      root / "no-reuse-file-tier"),
    }
    if "kvtier-file-restart" in settings.configs and "kvtier-file" not in settings.configs:
        raise ServeBenchError("kvtier-file-restart needs kvtier-file in the same run (it "
                              "restarts on kvtier-file's warm tier)")
    return [specs[name] for name in ALL_CONFIG_NAMES if name in settings.configs]


def round_order(specs: Sequence[ServerSpec], round_index: int) -> list[ServerSpec]:
    """Round ``round_index``'s order: the configurations rotated by one per round, so each
    runs early and late on a machine that drifts; kvtier-file-restart stays right after
    kvtier-file (it restarts on that server's warm tier)."""
    units: list[list[ServerSpec]] = [[spec] for spec in specs
                                     if spec.name != "kvtier-file-restart"]
    restart = [spec for spec in specs if spec.name == "kvtier-file-restart"]
    for unit in units:
        if unit[0].name == "kvtier-file":
            unit.extend(restart)
    shift = round_index % len(units) if units else 0
    return [spec for unit in units[shift:] + units[:shift] for spec in unit]


def run_one(settings: BenchSettings, spec: ServerSpec, model_dir: Path,
            traces: Mapping[TraceKind, Path], redis_url: str | None,
            root: Path | None = None, later: Sequence[bool] = ()) -> ConfigResult:
    """One configuration on a fresh server; ``later`` marks the requests that are a later
    turn of their session (for ``ttft_p50_later_turns_s``)."""
    result_dir = (settings.workdir if root is None else root) / "results"
    result_dir.mkdir(parents=True, exist_ok=True)
    if spec.tier_dir is not None:
        spec.tier_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    transfer = kv_transfer_config(settings, spec.tier, spec.tier_dir, redis_url,
                                  spec.prefetch_bytes)
    log_path = result_dir / f"{spec.name}.server.log"
    measured: PassResult | None = None
    files: list[str] = []
    with vllm_server(settings, model_dir, transfer, log_path) as server:
        for run_pass in spec.passes:
            label = f"{spec.name}.{run_pass.value}"
            before = scrape_metrics(server.base_url)
            raw = run_client(settings, server, model_dir, traces[spec.trace],
                             settings.requests, result_dir, label)
            time.sleep(1.0)  # let the last step's stats reach the metrics endpoint
            delta = metrics_delta(scrape_metrics(server.base_url), before)
            files.append(str(result_dir / f"{label}.json"))
            if run_pass is Pass.MEASURED:
                measured = PassResult(raw, delta, files[-1])
        startup = server.startup_s
    if measured is None:
        raise ServeBenchError(f"{spec.name}: no measured pass")
    return summarize(spec.name, measured, startup, files,
                     later if spec.trace is TraceKind.REUSE else ())


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "python": platform.python_version()}
    try:
        cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
        info["cpu_model"] = cpu.partition(":")[2].strip()
    except (OSError, StopIteration):
        pass
    try:
        from kvtier.integrations.vllm.vllm_cli import installed_vllm_version

        info["vllm"] = installed_vllm_version()
    except Exception as exc:  # reported in the JSON, not fatal
        info["vllm"] = f"unknown ({exc})"
    return info


def run_benchmark(settings: BenchSettings) -> dict[str, Any]:
    settings.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = settings.model_dir or settings.workdir / "model"
    build_random_llama(model_dir, settings.model, settings.max_model_len)
    max_prompt = settings.max_model_len - settings.output_len
    rows = trace_rows(settings.trace, settings.window_start + settings.requests,
                      sessions=settings.sessions, speed=settings.speed,
                      max_blocks=max(1, max_prompt // settings.block_size))
    window = rows[settings.window_start : settings.window_start + settings.requests]
    if len(window) < settings.requests:
        raise ServeBenchError(f"--requests {settings.requests} from --window-start "
                              f"{settings.window_start}: the trace has {len(rows)} rows")
    later = later_turns(window)
    traces = {kind: settings.workdir / f"trace-{kind.value}.jsonl" for kind in TraceKind}
    trace_info = {kind.value: write_trace(window, traces[kind], kind=kind,
                                          block_size=settings.block_size,
                                          max_prompt_tokens=max_prompt,
                                          output_len=settings.output_len)
                  for kind in TraceKind}
    per_round = run_rounds(settings, model_dir, traces, later)
    names = [spec.name for spec in server_specs(settings)]
    results = {name: combine_rounds([each[name] for each in per_round]) for name in names}
    return {
        "machine": machine_info(),
        "model": {"preset": settings.preset, **asdict(settings.model),
                  "parameters": settings.model.parameters(),
                  "kv_bytes_per_token": settings.model.kv_bytes_per_token(),
                  "block_size": settings.block_size, "max_model_len": settings.max_model_len,
                  "engine_kv_cache_bytes": settings.kv_cache_bytes,
                  "cpu_tier_bytes": settings.cpu_tier_bytes},
        "trace": {"name": TRACES[settings.trace], "window_start": settings.window_start,
                  "requests": settings.requests, "output_len": settings.output_len,
                  "passes": ("measured (sessions: one pass)" if settings.trace == "agentic"
                             else "warm + measured (same requests); restart and no-reuse: "
                             "measured"),
                  "max_concurrency": settings.max_concurrency,
                  "request_rate": settings.request_rate,
                  "sessions": (settings.sessions if settings.trace == "agentic" else None),
                  "speed": (settings.speed if settings.trace == "agentic" else None),
                  "later_turns": sum(later), **trace_info},
        "prefetch_bytes": settings.prefetch_bytes,
        "rounds": settings.rounds,
        "statistic": "per-config median over interleaved rounds (order rotated each round)",
        "configs": {name: {**_config_json(result),
                           "per_round": [_round_json(each[name]) for each in per_round]}
                    for name, result in results.items()},
        "targets": targets(results),
        "outputs_match": {f"{name} vs prefix-cache-only":
                          outputs_match(results, name, "prefix-cache-only", per_round)
                          for name in ("vllm-fs", "kvtier-file", "kvtier-redis", "kvtier-memory",
                                       "kvtier-file-prefetch", "kvtier-redis-prefetch",
                                       "kvtier-file-restart")},
        "_results": results,
    }


def run_rounds(settings: BenchSettings, model_dir: Path, traces: Mapping[TraceKind, Path],
               later: Sequence[bool] = ()) -> list[dict[str, ConfigResult]]:
    """Every configuration once per round, each round on fresh tiers, the order rotated."""
    specs = server_specs(settings)
    needs_redis = any(spec.tier is ServeTier.KVTIER_REDIS for spec in specs)
    per_round: list[dict[str, ConfigResult]] = []
    with _maybe_valkey(needs_redis, settings.workdir / "valkey") as redis_url:
        for index in range(settings.rounds):
            root = settings.workdir / f"round-{index + 1}"
            results: dict[str, ConfigResult] = {}
            for spec in round_order(server_specs(settings, root), index):
                print(f"== round {index + 1}/{settings.rounds} {spec.name}: starting vllm "
                      "serve", file=sys.stderr, flush=True)
                if spec.tier is ServeTier.KVTIER_REDIS and redis_url is not None:
                    _flush_valkey(redis_url)  # every round starts on an empty tier
                results[spec.name] = run_one(settings, spec, model_dir, traces, redis_url,
                                             root, later)
                print(f"== round {index + 1} {spec.name}: TTFT p50 "
                      f"{results[spec.name].ttft_p50_s:.3f}s", file=sys.stderr, flush=True)
            per_round.append(results)
    return per_round


def _flush_valkey(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def _round_json(result: ConfigResult) -> dict[str, Any]:
    return {"ttft_p50_s": result.ttft_p50_s,
            "ttft_p50_later_turns_s": result.ttft_p50_later_turns_s,
            "ttft_p99_s": result.ttft_p99_s,
            "ttft_mean_s": result.ttft_mean_s, "throughput_req_s": result.throughput_req_s,
            "cached_prompt_tokens": result.cached_prompt_tokens,
            "cached_by_source": result.cached_by_source}


def _config_json(result: ConfigResult) -> dict[str, Any]:
    payload = asdict(result)
    payload.pop("generated_texts")
    return payload


@contextmanager
def _maybe_valkey(needed: bool, workdir: Path) -> Iterator[str | None]:
    if not needed:
        yield None
        return
    with valkey_server(workdir) as url:
        yield url


# -- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model/cache sizes: cpu (2-core default) or gpu (Llama-3-8B shape)")
    parser.add_argument("--hidden-size", type=int, help="model hidden size (preset's)")
    parser.add_argument("--layers", type=int, help="model layers (preset's)")
    parser.add_argument("--max-model-len", type=int, help="context length in tokens")
    parser.add_argument("--block-size", type=int,
                        help="engine block size = timed_trace chunk hash size (multiple of 32)")
    parser.add_argument("--kv-cache-mib", type=int, help="engine KV cache (MiB)")
    parser.add_argument("--cpu-tier-mib", type=int, help="CPU offload tier (MiB)")
    parser.add_argument("--requests", type=int, help="trace requests per pass")
    parser.add_argument("--trace", choices=sorted(TRACES), default="conversation",
                        help="bundled trace to replay: the Mooncake conversation trace or "
                        "builtin:agentic (sessions with think time, each session's prompts "
                        "scaled to --max-model-len)")
    parser.add_argument("--sessions", type=int, default=4,
                        help="builtin:agentic: sessions generated (default 4)")
    parser.add_argument("--speed", type=float, default=5.0,
                        help="builtin:agentic: replay speed, think times at 1/speed "
                        "(default 5)")
    parser.add_argument("--prefetch-mib", type=int, default=64,
                        help="staging memory of the *-prefetch configs (MiB, default 64)")
    parser.add_argument("--window-start", type=int, default=0,
                        help="first trace row of the window (default 0)")
    parser.add_argument("--output-len", type=int, help="output tokens per request")
    parser.add_argument("--max-concurrency", type=int, default=1,
                        help="client concurrency (default 1: TTFT without queueing)")
    parser.add_argument("--request-rate", default="inf",
                        help="client request rate in req/s (default inf, bounded by "
                        "--max-concurrency)")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU, the same for every config")
    parser.add_argument("--hash-seed", type=int, default=0, help="PYTHONHASHSEED")
    parser.add_argument("--io-mode", choices=("direct", "buffered"), default="direct",
                        help="kvtier file tier I/O (vLLM's fs tier uses O_DIRECT where it can)")
    parser.add_argument("--configs", default=",".join(CONFIG_NAMES),
                        help="comma-separated subset of " + ",".join(CONFIG_NAMES)
                        + " (default: all of them), or the diagnostic "
                        + ",".join(DIAGNOSTIC_CONFIG_NAMES) + " (only when named)")
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temp dir, "
                        "removed unless --keep)")
    parser.add_argument("--model-dir", type=Path, help="reuse a model built earlier")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds (order rotated each round, fresh tiers); "
                        "the report gives per-config medians (default 1)")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    parser.add_argument("--plot", type=Path, help="write a TTFT CDF per config (PNG)")
    from kvtier.cli.output import add_format_option

    add_format_option(parser)


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    preset = PRESETS[args.preset]
    shape = preset.model
    if args.hidden_size or args.layers:
        hidden = args.hidden_size or shape.hidden_size
        shape = ModelShape(hidden, args.layers or shape.num_layers, shape.num_heads,
                           shape.num_kv_heads, hidden * shape.intermediate_size //
                           shape.hidden_size, shape.vocab_size, shape.dtype)
    configs = tuple(name.strip() for name in args.configs.split(",") if name.strip())
    unknown = [name for name in configs if name not in ALL_CONFIG_NAMES]
    if unknown:
        raise ServeBenchError(f"unknown --configs {unknown}; expected some of "
                              f"{list(ALL_CONFIG_NAMES)}")
    block = args.block_size or preset.block_size
    if block % 32:
        raise ServeBenchError(f"--block-size {block}: vLLM's CPU attention needs a multiple "
                              f"of 32")
    for flag, value in (("--requests", args.requests), ("--max-concurrency",
                                                        args.max_concurrency),
                        ("--output-len", args.output_len), ("--rounds", args.rounds),
                        ("--sessions", args.sessions), ("--prefetch-mib", args.prefetch_mib)):
        if value is not None and value < 1:
            raise ServeBenchError(f"{flag} must be >= 1, got {value}")
    if not args.speed > 0:
        raise ServeBenchError(f"--speed must be > 0, got {args.speed}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvtier-serve-bench-"))
    return BenchSettings(
        preset=args.preset, model=shape, block_size=block,
        max_model_len=args.max_model_len or preset.max_model_len,
        kv_cache_bytes=(args.kv_cache_mib or preset.kv_cache_bytes // MIB) * MIB,
        cpu_tier_bytes=(args.cpu_tier_mib or preset.cpu_tier_bytes // MIB) * MIB,
        requests=args.requests or preset.requests, window_start=args.window_start,
        output_len=args.output_len or preset.output_len, max_concurrency=args.max_concurrency,
        request_rate=str(args.request_rate), reserved_cpus=args.reserved_cpus,
        hash_seed=args.hash_seed, o_direct=args.io_mode == "direct", configs=configs,
        workdir=workdir, model_dir=args.model_dir, keep_workdir=bool(args.keep or args.workdir),
        rounds=args.rounds, trace=args.trace, sessions=args.sessions, speed=args.speed,
        prefetch_bytes=args.prefetch_mib * MIB,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier bench serve", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through every context manager: servers stopped, /dev/shm cleaned.
    raise SystemExit(128 + signum)


def print_outcome(args: argparse.Namespace, report: Mapping[str, Any],
                  results: Mapping[str, ConfigResult]) -> None:
    """The results on stdout in ``--format`` (the JSON is what ``--json FILE`` writes)."""
    from kvtier.cli.output import Output

    Output.for_args(args).emit(
        tables=lambda: [format_table(results), *outcome_lines(report)],
        sheets=lambda: outcome_sheets(report, results),
        document=lambda: report,
    )


def run_from_args(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        settings = settings_from_args(args)
        report = run_benchmark(settings)
    except ServeBenchError as exc:
        print(f"kvtier bench serve: {exc}", file=sys.stderr)
        return 1
    results: dict[str, ConfigResult] = report.pop("_results")
    print_outcome(args, report, results)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if args.plot:
        plot_cdf(results, args.plot)
    if not settings.keep_workdir:
        shutil.rmtree(settings.workdir, ignore_errors=True)
    else:
        print(f"results kept in {settings.workdir}", file=sys.stderr)
    return 0 if all(report["outputs_match"].get(pair) is not False
                    for pair in report["outputs_match"]) else 2
