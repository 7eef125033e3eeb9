"""The report of ``kvtier bench serve``: one configuration's numbers from the client's JSON and
the server's ``/metrics`` deltas, medians over rounds, the table, the targets, the output
comparison and the TTFT CDF plot.

No state: pure functions of the results (the plot writes the file it is given).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.serve_config import (
    ConfigResult,
    PassResult,
    ServeBenchError,
)
from kvtier.replay.stats import Interpolation, percentile
from kvtier.text import Sheet

# -- summary -------------------------------------------------------------------------------


def _linear(values: Sequence[float], percent: float) -> float:
    return percentile(values, percent, interpolation=Interpolation.LINEAR, empty=math.nan)


def metrics_delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def summarize(name: str, passed: PassResult, startup_s: float,
              result_files: list[str], later: Sequence[bool] = ()) -> ConfigResult:
    """``later``: per request (in trace order, as the client reports them), whether it is a
    turn after its session's first."""
    raw, delta = passed.raw, passed.metrics_delta
    ttfts = [float(value) for value in raw.get("ttfts", []) if value]
    later_ttfts = [float(value) for value, is_later in zip(raw.get("ttfts", []), later,
                                                            strict=False) if value and is_later]
    itls = [float(value) for chunk in raw.get("itls", []) for value in chunk]
    # The counter's samples only: its ``_created`` timestamps carry the same source labels.
    by_source = {key.partition("[")[2].rstrip("]"): int(value) for key, value in delta.items()
                 if key.startswith("vllm:prompt_tokens_cached_by_source_total[")}
    kvtier = {key.removeprefix("vllm:kvtier_"): int(value) for key, value in delta.items()
              if key.startswith("vllm:kvtier_") and not key.endswith("_created") and value}
    return ConfigResult(
        name=name, ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        ttft_p50_s=_linear(ttfts, 50), ttft_p99_s=_linear(ttfts, 99),
        itl_p50_s=_linear(itls, 50), throughput_req_s=float(raw["request_throughput"]),
        requests=int(raw["completed"]), failed=int(raw.get("failed", 0)),
        cached_prompt_tokens=int(delta.get("vllm:prompt_tokens_cached_total", 0)),
        prompt_tokens=int(delta.get("vllm:prompt_tokens_total", 0)),
        cached_by_source=by_source, kvtier_counters=kvtier, startup_s=startup_s,
        ttfts_s=ttfts, generated_texts=list(raw.get("generated_texts", [])),
        result_files=result_files, ttft_p50_later_turns_s=_linear(later_ttfts, 50),
    )


def kvtier_loaded_blocks(result: ConfigResult) -> int:
    """Blocks kvtier loaded in the measured pass (``vllm:kvtier_loaded_blocks_total``)."""
    return result.kvtier_counters.get("loaded_blocks_total", 0)


def kvtier_stored_blocks(result: ConfigResult) -> int:
    return result.kvtier_counters.get("stored_blocks_total", 0)


def _ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else math.nan


def format_table(results: Mapping[str, ConfigResult]) -> str:
    base = results.get("prefix-cache-only")
    fs = results.get("vllm-fs")
    header = (f"{'config':<21} {'TTFT mean':>9} {'p50':>7} {'later':>7} {'p99':>7} "
              f"{'ITL p50':>7} "
              f"{'req/s':>6} {'cached':>7} {'kvtier':>6} {'/pc':>5} {'/fs':>5}")
    lines = [header, "-" * len(header)]
    for name, result in results.items():
        loaded = kvtier_loaded_blocks(result)
        vs_base = _ratio(result.ttft_p50_s, base.ttft_p50_s) if base else math.nan
        vs_fs = _ratio(result.ttft_p50_s, fs.ttft_p50_s) if fs else math.nan
        lines.append(
            f"{name:<21} {result.ttft_mean_s:>8.3f}s {result.ttft_p50_s:>6.3f}s "
            f"{result.ttft_p50_later_turns_s:>6.3f}s {result.ttft_p99_s:>6.3f}s "
            f"{result.itl_p50_s * 1000:>5.1f}ms "
            f"{result.throughput_req_s:>6.2f} {result.cached_prompt_tokens:>7} {loaded:>6} "
            f"{vs_base:>5.2f} {vs_fs:>5.2f}")
    lines.append("TTFT p50 ratios: /pc vs prefix-cache-only, /fs vs vllm-fs; later = TTFT p50 "
                 "of the turns after each session's first (sessions only); cached = prompt "
                 "tokens from any cache; kvtier = blocks kvtier loaded (measured pass)")
    return "\n".join(lines)


def outcome_lines(report: Mapping[str, Any]) -> list[str]:
    """Each target met or missed, and whether the outputs matched (below the table)."""
    lines = []
    for row in report["targets"]:
        if math.isnan(row["measured"]):
            lines.append(f"target {row['target']}: not measured (a configuration was not run)")
            continue
        verdict = "met" if row["met"] else "MISSED"
        lines.append(f"target {row['target']}: {row['measured']:.3f} (<= {row['limit']}) "
                     f"{verdict}")
    for pair, same in report["outputs_match"].items():
        if same is not None:
            lines.append(f"outputs {pair}: {'identical' if same else 'DIFFERENT'}")
    return lines


_CONFIG_COLUMNS = ("ttft_mean_s", "ttft_p50_s", "ttft_p50_later_turns_s", "ttft_p99_s",
                   "itl_p50_s", "throughput_req_s", "requests", "failed",
                   "cached_prompt_tokens", "prompt_tokens", "startup_s")


def outcome_sheets(report: Mapping[str, Any],
                   results: Mapping[str, ConfigResult]) -> list[Sheet]:
    """The ``--format plain`` tables: configurations, targets, output comparisons."""
    configs = Sheet(("config", *_CONFIG_COLUMNS, "kvtier_loaded_blocks", "kvtier_stored_blocks"),
                    tuple((name, *(getattr(result, column) for column in _CONFIG_COLUMNS),
                           kvtier_loaded_blocks(result), kvtier_stored_blocks(result))
                          for name, result in results.items()))
    goals = Sheet(("target", "measured", "limit", "met"),
                  tuple((row["target"], None if math.isnan(row["measured"]) else row["measured"],
                         row["limit"], row["met"]) for row in report["targets"]))
    outputs = Sheet(("pair", "identical"), tuple(report["outputs_match"].items()))
    return [configs, goals, outputs]


def targets(results: Mapping[str, ConfigResult]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it was met."""
    def p50(name: str) -> float:
        return results[name].ttft_p50_s if name in results else math.nan

    def later(name: str) -> float:
        return results[name].ttft_p50_later_turns_s if name in results else math.nan

    def thr(name: str) -> float:
        return results[name].throughput_req_s if name in results else math.nan

    rows = [
        ("kvtier-file TTFT p50 / prefix-cache-only", _ratio(p50("kvtier-file"),
                                                            p50("prefix-cache-only")), 0.2),
        ("kvtier-file TTFT p50 / vllm-fs", _ratio(p50("kvtier-file"), p50("vllm-fs")), 0.9),
        ("kvtier-redis TTFT p50 / vllm-fs", _ratio(p50("kvtier-redis"), p50("vllm-fs")), 1.0),
        ("kvtier-file-prefetch TTFT p50 of later turns / vllm-fs",
         _ratio(later("kvtier-file-prefetch"), later("vllm-fs")), 0.7),
        ("kvtier-file-restart TTFT p50 / kvtier-file",
         _ratio(p50("kvtier-file-restart"), p50("kvtier-file")), 1.5),
        ("no-reuse TTFT p50 kvtier / baseline",
         _ratio(p50("no-reuse-kvtier"), p50("no-reuse-baseline")), 1.03),
        ("no-reuse throughput baseline / kvtier",
         _ratio(thr("no-reuse-baseline"), thr("no-reuse-kvtier")), 1.03),
    ]
    return [{"target": name, "measured": value, "limit": limit,
             "met": (not math.isnan(value)) and value <= limit} for name, value, limit in rows]


def outputs_match(results: Mapping[str, ConfigResult], left: str, right: str,
                  rounds: Sequence[Mapping[str, ConfigResult]] = ()) -> bool | None:
    """Whether ``left`` generated exactly ``right``'s texts (in every round given)."""
    if left not in results or right not in results:
        return None
    for each in rounds or (results,):
        if each[left].generated_texts != each[right].generated_texts:
            return False
    return True


def plot_cdf(results: Mapping[str, ConfigResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for name, result in results.items():
        values = sorted(result.ttfts_s)
        if not values:
            continue
        fractions = [(index + 1) / len(values) for index in range(len(values))]
        axes.step(values, fractions, where="post", label=name, linewidth=1.6)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (s, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title("TTFT CDF per configuration (measured pass)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _median(values: Sequence[float]) -> float:
    finite = [value for value in values if not math.isnan(value)]
    return statistics.median(finite) if finite else math.nan


def combine_rounds(rounds: Sequence[ConfigResult]) -> ConfigResult:
    """One configuration over its rounds: the median of each per-round statistic; the TTFT
    samples and result files of every round (the CDF shows them all)."""
    if not rounds:
        raise ServeBenchError("combine_rounds needs at least one round")
    first = rounds[0]

    def median_int(values: Iterable[int]) -> int:
        return int(statistics.median(list(values)))

    def median_counts(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
        names = sorted({name for count in counts for name in count})
        return {name: median_int(count.get(name, 0) for count in counts) for name in names}

    return ConfigResult(
        name=first.name,
        ttft_mean_s=_median([r.ttft_mean_s for r in rounds]),
        ttft_p50_s=_median([r.ttft_p50_s for r in rounds]),
        ttft_p99_s=_median([r.ttft_p99_s for r in rounds]),
        itl_p50_s=_median([r.itl_p50_s for r in rounds]),
        throughput_req_s=_median([r.throughput_req_s for r in rounds]),
        requests=first.requests, failed=sum(r.failed for r in rounds),
        cached_prompt_tokens=median_int(r.cached_prompt_tokens for r in rounds),
        prompt_tokens=median_int(r.prompt_tokens for r in rounds),
        cached_by_source=median_counts([r.cached_by_source for r in rounds]),
        kvtier_counters=median_counts([r.kvtier_counters for r in rounds]),
        startup_s=_median([r.startup_s for r in rounds]),
        ttfts_s=[value for r in rounds for value in r.ttfts_s],
        generated_texts=first.generated_texts,
        result_files=[path for r in rounds for path in r.result_files],
        ttft_p50_later_turns_s=_median([r.ttft_p50_later_turns_s for r in rounds]),
    )


