"""``kvtier replay``: a request trace through simulated engines that use real kvtier stacks.

Also the pieces ``kvtier bench`` shares with it: the replay options, one replay per strategy
and the removal of what a run stored in the given tiers. No state: everything runs on the
command's main thread (the replayed managers own their own I/O threads).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvtier.cli import common
from kvtier.cli.common import (
    DEFAULT_TRACE,
    EXIT_FAILED,
    EXIT_OK,
    REPLAY_MODEL,
    UsageError,
    add_stack_options,
    choice,
    generated_sessions,
    int_at_least,
    redact,
    speed_factor,
    step_ms,
    ttl_seconds,
)
from kvtier.cli.output import Output, add_format_option

DEFAULT_TRACE_REQUESTS = 3_000
"""Requests of the bundled conversation trace replayed when no trace is given."""
DEFAULT_REPLAY_TTL_S = 3600.0
"""Expiry of replay blocks in redis tiers, in case the run dies before it removes them."""


def register(commands: Any) -> None:
    """Add the ``replay`` sub-parser."""
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
    add_stack_options(replay)
    replay.add_argument("--instances", type=int_at_least(1), default=1, metavar="N",
                        help="engines sharing the secondary tiers (default 1)")
    replay.add_argument("--route", type=choice, choices=("round_robin", "hash"),
                        default="round_robin",
                        help="how requests are spread over instances (default round_robin)")
    replay.add_argument("--speed", type=speed_factor, default=None, metavar="X",
                        help="replay arrivals at X times real time (default: as fast as "
                             "possible, in arrival order)")
    replay.add_argument("--max-running", type=int_at_least(1), default=32, metavar="N",
                        help="running batch size per instance (default 32)")
    replay.add_argument("--decode-tokens-per-step", type=int_at_least(1), default=64,
                        metavar="N", help="output tokens a request produces per step; it stays "
                        "in the batch 1 + ceil(output_length / N) steps (default 64)")
    replay.add_argument("--step-ms", type=step_ms, default=10.0, metavar="MS",
                        help="modelled forward-pass time per step: the scheduler idles for the "
                             "rest of each step while the tiers' I/O threads run (default 10; "
                             "0 = no pause)")
    replay.add_argument("--trace-block-tokens", type=int_at_least(1), default=512, metavar="N",
                        help="tokens per hash id in the trace (default 512)")
    replay.add_argument("--hash-convention", type=choice, choices=("auto", "ceil", "floor"),
                        default="auto",
                        help="hash ids per prompt: ceil = the partial last block is hashed "
                             "(Mooncake), floor = only full blocks (vLLM), auto = either, line "
                             "by line (default auto; the report says which it found)")
    replay.add_argument("--seed", type=int_at_least(0), default=0, metavar="N",
                        help="seed of builtin:agentic and of the session interleaving of a "
                             "directory of session files (default 0)")
    replay.add_argument("--sessions", type=generated_sessions, default=None, metavar="N",
                        help="sessions of builtin:agentic (default 8; 1 to 10,000)")
    replay.add_argument("--max-requests", type=int_at_least(1), default=None, metavar="N",
                        help="replay only the first N requests")
    replay.add_argument("--skip-bad-lines", action="store_true",
                        help="skip malformed trace lines (counted in the report) instead of "
                             "failing")
    replay.add_argument("--eviction-policy", type=choice, choices=("lru", "arc"), default="lru",
                        help="eviction policy of the CPU pool (default lru)")
    replay.add_argument("--write-policy", type=choice, choices=("write_through", "write_back"),
                        default="write_through",
                        help="write each stored block to the secondary tiers at once "
                             "(write_through, the default) or when the CPU pool evicts it")
    replay.add_argument("--prefetch", type=choice, choices=("on", "off"), default="off",
                        help="between a session's turns, promote its chain back into the CPU "
                             "pool when it left (default off, as in the library: see "
                             "benchmarks/session_prefetch.py for what it gains and costs)")
    replay.add_argument("--compare", action="store_true",
                        help="also replay with per-request lookups (vLLM-style) and with no "
                             "in-flight reuse, and show the three side by side")
    replay.add_argument("--namespace-tag", default="", metavar="TAG",
                        help="namespace revision of the replayed blocks (default: fresh per run, "
                             "so earlier runs against a persistent tier give no free hits)")
    replay.add_argument("--scratch-dir", default=None, metavar="DIR",
                        help="parent of the default file tier's temporary directory (default: "
                             "/dev/shm when it has room, else the system temporary directory)")
    add_format_option(replay)
    replay.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write every number as JSON to FILE (the document --format "
                             "json prints)")
    replay.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help="plot hit ratio over time per tier (needs kvtier[plot])")
    replay.add_argument("--no-progress", action="store_true", help="no live progress bar")
    replay.add_argument("--keep", action="store_true",
                        help="keep the blocks the run stored in --tier tiers (default: remove "
                             "them at the end, like the default temporary file tier)")
    replay.add_argument("--ttl-s", type=ttl_seconds, default=DEFAULT_REPLAY_TTL_S,
                        metavar="S",
                        help="expiry of the blocks stored in redis tiers whose URL sets no "
                             f"ttl_s (default {DEFAULT_REPLAY_TTL_S:.0f}); S3 and file tiers "
                             "have no TTL")
    replay.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import ConfigError
    from kvtier.replay.errors import ReplayError
    from kvtier.replay.report import ReportError, report_json, report_tables, write_json, write_plot
    from kvtier.replay.results import ReplayReport
    from kvtier.replay.strategies import Strategy
    from kvtier.replay.summary import report_sheets

    common.check_output_file("--json", args.json)
    common.check_output_file("--plot", args.plot)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(
                "--plot needs matplotlib, which is not installed; install it with "
                "`pip install 'kvtier[plot]'`"
            ) from None
    common.check_memory(args)
    trace = _load_trace(args)
    out = Output.for_args(args)
    console = out.notes  # progress and messages; the report goes to stdout in every format
    strategies = list(Strategy) if args.compare else [Strategy.KVTIER]
    validation, note = _validation_for(trace)
    with _scratch_for(args, trace) as scratch:
        options = replay_options(args, **({} if scratch is None else
                                           {"scratch_dir": str(scratch.path)}))
        try:
            results = replay_all(trace, options, strategies, not args.no_progress, console,
                                  keep=args.keep)
        except ReplayError as exc:
            print(args.scrub(f"kvtier replay: FAILED: {exc}"), file=sys.stderr)
            return EXIT_FAILED
        except ConfigError as exc:
            # Configuration rejected by the manager or a backend (bad tier URL, bad option).
            raise UsageError(str(exc)) from None
    _redact_results(results)
    report = ReplayReport(
        trace_source=trace.source,
        trace_sha256=trace.sha256,
        results=results,
        validation=validation,
        validation_note=note,
        settings=_settings(args, options),
    )
    out.emit(tables=lambda: report_tables(report, out.console.width),
             sheets=lambda: report_sheets(report), document=lambda: report_json(report))
    try:
        if args.json is not None:
            write_json(report, args.json)
            out.note(f"JSON report written to {args.json}")
        if args.plot is not None:
            write_plot(report, args.plot)
            out.note(f"plot written to {args.plot}")
    except ReportError as exc:
        print(f"kvtier replay: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        after_replay(options, console, args.keep)
    if validation is not None and not validation.passed:
        print(f"kvtier replay: validation FAILED: {validation.summary()}", file=sys.stderr)
        return EXIT_FAILED
    return _tiers_verdict("replay", results)


class _NoScratch:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _scratch_for(args: argparse.Namespace, trace: Any) -> Any:
    """The run's own scratch directory for the default file tier (None with --tier); stale
    ones of dead runs under the same parent are removed first."""
    import tempfile

    from kvtier.cli.scratch import ScratchDir, check_scratch_parent, remove_stale_scratch
    from kvtier.replay.engine import default_scratch_dir

    if args.tiers:
        return _NoScratch()
    if args.scratch_dir is not None:
        problem = check_scratch_parent(args.scratch_dir)
        if problem is not None:
            raise UsageError(f"--scratch-dir: {problem}; expected a writable directory")
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
    from kvtier.cli.verdict import tier_health

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
    settings["prefetch"] = options.prefetch.value
    from kvtier.backends import redact_url

    settings["tiers"] = ([redact_url(url) for url in options.tier_urls]
                         or ["file tier in a temporary directory"])
    settings["trace_block_tokens"] = args.trace_block_tokens
    settings["max_requests"] = args.max_requests
    settings["hash_convention"] = getattr(args, "hash_convention", "auto")
    settings["seed"] = getattr(args, "seed", 0)
    settings["sessions"] = getattr(args, "sessions", None)
    return settings


def _load_trace(args: argparse.Namespace) -> Any:
    from kvtier.replay.reader import read_trace
    from kvtier.replay.trace import TraceFormatError

    source = args.trace or DEFAULT_TRACE
    sessions = getattr(args, "sessions", None)
    if sessions is not None and source != "builtin:agentic":
        raise UsageError(f"--sessions {sessions} applies to builtin:agentic only (a generated "
                         f"trace); {source!r} has its own sessions")
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
            sessions=sessions,
        )
    except TraceFormatError as exc:
        from kvtier.replay.trace import EXPECTED_FORMAT

        hint = "" if args.skip_bad_lines or exc.line is None or EXPECTED_FORMAT in str(exc) else (
            " (use --skip-bad-lines to skip malformed lines)"
        )
        raise UsageError(f"bad trace: {exc}{hint}") from None
    except RecursionError:
        raise UsageError(f"bad trace {source!r}: a line is nested too deeply to be a "
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


def replay_options(args: argparse.Namespace, **extra: Any) -> Any:
    from kvtier.replay.engine import Prefetch, ReplayOptions, Route
    from kvtier.replay.options import DEFAULT_PREFETCH

    try:
        return ReplayOptions(
            tier_urls=tuple(
                _with_ttl(url, getattr(args, "ttl_s", DEFAULT_REPLAY_TTL_S)) for url in args.tiers
            ),
            instances=getattr(args, "instances", 1),
            route=Route(choice(getattr(args, "route", "round_robin"))),
            speed=getattr(args, "speed", None),
            max_running=getattr(args, "max_running", 32),
            gpu_blocks=args.gpu_blocks,
            cpu_blocks=args.cpu_blocks,
            block_bytes=args.block_bytes,
            decode_tokens_per_step=getattr(args, "decode_tokens_per_step", 64),
            step_ms=getattr(args, "step_ms", 10.0),
            eviction_policy=getattr(args, "eviction_policy", "lru"),
            write_policy=getattr(args, "write_policy", "write_through"),
            prefetch=Prefetch(getattr(args, "prefetch", DEFAULT_PREFETCH.value)),
            # Always a known tag, so that the run can find (and remove) what it stored.
            namespace_tag=getattr(args, "namespace_tag", "") or uuid.uuid4().hex[:12],
            **{"scratch_dir": getattr(args, "scratch_dir", None), **extra},
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def replay_all(trace: Any, options: Any, strategies: Sequence[Any], show_progress: bool,
                console: Any, *, keep: bool = False) -> list[Any]:
    """Replay once per strategy. A run that fails removes what it stored in the given tiers
    (unless ``keep``) before raising; after a run that succeeds the caller does, once the
    report is out (:func:`after_replay`)."""
    from kvtier.replay.engine import replay

    results: list[Any] = []
    try:
        _replay_each(trace, options, strategies, show_progress, console, results, replay)
    except BaseException:
        after_replay(options, console, keep)
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
        # Off when its console is not a terminal: a pipe or a log would get a stray empty line.
        TimeElapsedColumn(), console=console, transient=True,
        disable=not show_progress or not console.is_terminal,
    ) as progress:
        for strategy in strategies:
            task = progress.add_task(f"replay ({strategy.value})", total=len(trace.requests))

            def advance(done: int, _total: int, task_id: Any = task) -> None:
                progress.update(task_id, completed=done, total=_total)

            results.append(replay(trace, options, strategy, progress=advance))


def _with_ttl(url: str, ttl_s: float) -> str:
    """``url`` with ``ttl_s`` added where the medium has a TTL (redis) and the URL sets none."""
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if not parts.scheme.startswith("redis"):
        return url
    if "ttl_s" in urllib.parse.parse_qs(parts.query, keep_blank_values=True):
        return url
    value = float(ttl_s)
    # Exact digits, never an exponent: "1.2096e+06" in a query would read back as "1.2096e 06".
    text = str(int(value)) if value.is_integer() else repr(value)
    pair = urllib.parse.urlencode({"ttl_s": text})
    query = f"{parts.query}&{pair}" if parts.query else pair
    return urllib.parse.urlunsplit(parts._replace(query=query))


def replay_revisions(tag: str) -> frozenset[str]:
    """The namespace revisions a replay tagged ``tag`` writes (one per strategy): exactly these,
    so cleaning up run ``foo`` never touches run ``foo-bar``."""
    from kvtier.replay.strategies import Strategy

    return frozenset(f"{tag}-{strategy.value}" for strategy in Strategy)


def _replay_namespaces(url: str, tag: str) -> list[Any]:
    from kvtier.ops.inventory import usage

    revisions = replay_revisions(tag)
    return [
        item for item in usage(url)
        if item.fields is not None and item.fields.get("model") == REPLAY_MODEL
        and str(item.fields.get("revision", "")) in revisions
    ]


def after_replay(options: Any, console: Any, keep: bool) -> None:
    """Remove (or, with ``keep``, list) what the run stored in the given tiers. A signal during
    the removal lets it finish; a second one stops it, and the run then says exactly what it
    left and the commands that remove it (:func:`kvtier.cli.signals.cleanup_phase`)."""
    from kvtier.cli.signals import CleanupAborted, cleanup_phase, cleanup_starts

    urls = list(options.tier_urls)
    if not urls:
        return
    with cleanup_phase():
        done = 0
        try:
            cleanup_starts()  # a test hook, off unless its environment variable is set
            for url in urls:
                _after_replay_in(url, options.namespace_tag, console, keep)
                done += 1
        except CleanupAborted:
            _report_left(urls[done:], options.namespace_tag)


def _after_replay_in(url: str, tag: str, console: Any, keep: bool) -> None:
    from rich.markup import escape

    from kvtier.cli.signals import cleanup_left
    from kvtier.ops.inventory import MediumError, delete
    from kvtier.ops.inventory import UsageError as InventoryError
    from kvtier.replay.report import format_bytes
    from kvtier.text import printable

    shown = redact(url)
    try:
        found = _replay_namespaces(url, tag)
        blocks, size = sum(i.blocks for i in found), format_bytes(sum(i.bytes for i in found))
        if keep:
            expiry = ("they expire after their ttl_s" if url.startswith("redis")
                      else "they have no expiry")
            revisions = sorted(printable(i.fields["revision"]) for i in found)
            console.print(escape(
                f"kept {blocks:,} blocks ({size}) in {shown} ({expiry})"
                + ("; remove them with:\n  " + "\n  ".join(common.purge_commands(
                    url, revisions)) if revisions else "")), soft_wrap=True)
            return
        if not found:
            return  # nothing stored (a run that failed at open): nothing to report
        delete(url, found)
    except (InventoryError, MediumError) as exc:
        cleanup_left()
        print(f"kvtier: warning: could not remove the replay's blocks from {shown}: {exc}; "
              f"remove them later with:\n  {_purge_lines(url, replay_revisions(tag))}",
              file=sys.stderr)
        return
    console.print(f"removed the {blocks:,} blocks ({size}) this run stored in {shown}",
                  soft_wrap=True)


def _purge_lines(url: str, revisions: Iterable[str]) -> str:
    from kvtier.text import printable

    return "\n  ".join(common.purge_commands(url, sorted(printable(r) for r in revisions)))


def _report_left(urls: Sequence[str], tag: str) -> None:
    """After a signal stopped the cleanup: what each tier still holds, counted again (a further
    signal skips the count), and the commands that remove it."""
    from kvtier.cli.signals import CleanupAborted
    from kvtier.ops.inventory import MediumError
    from kvtier.ops.inventory import UsageError as InventoryError
    from kvtier.replay.report import format_bytes

    for url in urls:
        shown = redact(url)
        try:
            found = _replay_namespaces(url, tag)
        except (CleanupAborted, InventoryError, MediumError):
            print(f"kvtier: cleanup stopped: the blocks left in {shown} were not counted; "
                  f"remove them with:\n  {_purge_lines(url, replay_revisions(tag))}",
                  file=sys.stderr)
            continue
        if not found:
            print(f"kvtier: cleanup stopped: nothing left in {shown}", file=sys.stderr)
            continue
        blocks, size = sum(i.blocks for i in found), format_bytes(sum(i.bytes for i in found))
        revisions = [str(item.fields["revision"]) for item in found if item.fields]
        print(f"kvtier: cleanup stopped: {blocks:,} blocks ({size}) left in {shown}; remove "
              f"them with:\n  {_purge_lines(url, revisions)}", file=sys.stderr)
