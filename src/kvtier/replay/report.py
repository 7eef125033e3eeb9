"""Presenting a replay: rich tables, a JSON document and a hit-ratio-over-time plot.

Pure presentation; this module owns no state.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.replay.results import ReplayReport, ReplayResult, TierKind, TierResult

JSON_SCHEMA_VERSION = 1


class ReportError(RuntimeError):
    """The report could not be written (missing optional package, unwritable path)."""


def _bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _ratio(value: float) -> str:
    return f"{value:.4f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def tier_table(result: ReplayResult) -> Table:
    """Hits and traffic per tier, next to the ideal (infinite cache)."""
    table = Table(
        title=(
            f"kvtier replay: {result.trace_name}, {result.requests:,} requests, "
            f"{result.instances} instance(s), strategy {result.strategy}"
        ),
        title_justify="left",
    )
    for header in ("tier", "block hits", "block hit ratio", "token hit ratio", "read",
                   "written", "GB/s"):
        table.add_column(header, justify="left" if header == "tier" else "right")
    for tier in result.tiers:
        moved = tier.kind is not TierKind.GPU
        table.add_row(
            tier.name,
            f"{tier.block_hits:,}",
            _ratio(tier.block_hits / result.block_refs if result.block_refs else 0.0),
            _ratio(tier.token_hits / result.total_tokens if result.total_tokens else 0.0),
            _bytes(tier.bytes_read) if moved else "-",
            _bytes(tier.bytes_written) if moved else "-",
            f"{tier.gb_per_s(result.wall_s):.3g}" if moved else "-",
        )
    table.add_section()
    table.add_row(
        "all tiers", f"{result.block_hits:,}", _ratio(result.block_hit_ratio),
        _ratio(result.token_hit_ratio), "", "", "", style="bold",
    )
    table.add_row(
        "ideal (infinite cache)", f"{result.ideal_block_hits:,}",
        _ratio(result.ideal_block_hit_ratio), _ratio(result.ideal_token_hit_ratio),
        "", "", "", style="dim",
    )
    table.caption = (
        "GB/s: secondary tiers over their I/O threads' busy time; CPU over the run's wall time"
    )
    return table


def lookup_table(result: ReplayResult) -> Table:
    """What the secondary tiers' lookup managers and transfers did."""
    table = Table(title="secondary-tier lookups and transfers", title_justify="left")
    for header in ("tier", "lookups", "backend calls", "probes", "in-flight reuses",
                   "verdict-cache hits", "failed loads", "failed stores", "shed stores",
                   "probe errors", "backend errors"):
        table.add_column(header, justify="left" if header == "tier" else "right")
    for tier in result.tiers:
        if tier.kind is not TierKind.SECONDARY:
            continue
        table.add_row(
            tier.name, _count(tier.lookups), _count(tier.backend_calls), _count(tier.probes),
            _count(tier.inflight_reuses), _count(tier.verdict_cache_hits),
            _count(tier.failed_loads), _count(tier.failed_stores), _count(tier.shed_stores),
            _count(tier.probe_errors), _count(tier.backend_errors),
        )
    return table


def summary_table(report: ReplayReport, result: ReplayResult) -> Table:
    table = Table(show_header=False, title="run", title_justify="left")
    table.add_column("what", no_wrap=True)
    table.add_column("value", max_width=100, overflow="fold")
    rows: list[tuple[str, str]] = [
        ("trace", f"{report.trace_source} (sha256 {report.trace_sha256[:12]}...)"),
        ("requests replayed", f"{result.requests:,}"),
        ("bad lines skipped", f"{result.skipped_lines:,}"),
        ("block references", f"{result.block_refs:,}"),
        ("prefill tokens saved", f"{result.token_hits:,} of {result.total_tokens:,} "
                                 f"({result.token_hit_ratio:.1%}; ideal "
                                 f"{result.ideal_token_hit_ratio:.1%})"),
        ("blocks loaded and verified byte for byte", f"{result.verified_blocks:,}"),
        ("engine steps (each instance steps once per step)", f"{result.steps:,}"),
        ("steps waited on lookups (request-steps)", f"{result.steps_waited:,}"),
        ("requests that waited", f"{result.requests_waited:,}"),
        ("store plans refused (pool pinned full)", f"{result.store_plans_refused:,}"),
        ("requests rejected (more blocks than the GPU model)",
         f"{result.requests_rejected:,} ({result.rejected_blocks:,} blocks; GPU model "
         f"{result.gpu_blocks:,} blocks)"),
        ("admission", result.admission_rule + (f", {result.sessions:,} sessions"
                                               if result.sessions else "")),
        ("hash convention (hashed blocks per prompt)", result.hash_convention),
        ("stored blocks deferred (streamed) / shed", f"{result.store_blocks_deferred:,} / "
                                                     f"{result.store_blocks_shed:,}"),
        ("cascades shed / promoted blocks lost before load",
         f"{result.cascades_shed:,} / {result.promotions_lost:,}"),
        ("scheduler time per step p50 / p99", f"{_ms(result.step_time_p50_s)} / "
                                               f"{_ms(result.step_time_p99_s)}"),
        ("wall time", f"{result.wall_s:.1f} s"),
        ("secondary tiers", ", ".join(result.tier_urls) or "none"),
        ("validation vs published numbers", report.validation_note),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def compare_table(results: Sequence[ReplayResult]) -> Table:
    """The strategies side by side (``--compare``)."""
    from kvtier.replay.strategies import Strategy

    table = Table(title="lookup strategies on the same trace", title_justify="left")
    for header in ("strategy", "block hit ratio", "token hit ratio", "backend calls", "probes",
                   "in-flight reuses", "verdict-cache hits", "steps waited",
                   "sched p50 / p99", "wall"):
        table.add_column(header, justify="left" if header == "strategy" else "right")
    notes: list[str] = []
    for result in results:
        if result.strategy in {strategy.value for strategy in Strategy}:
            notes.append(f"{result.strategy}: {Strategy(result.strategy).description}")
        table.add_row(
            result.strategy,
            _ratio(result.block_hit_ratio),
            _ratio(result.token_hit_ratio),
            f"{result.secondary_total('backend_calls'):,}",
            f"{result.secondary_total('probes'):,}",
            f"{result.secondary_total('inflight_reuses'):,}",
            f"{result.secondary_total('verdict_cache_hits'):,}",
            f"{result.steps_waited:,}",
            f"{_ms(result.step_time_p50_s)} / {_ms(result.step_time_p99_s)}",
            f"{result.wall_s:.1f} s",
        )
    table.caption = "; ".join(notes)
    return table


def print_report(report: ReplayReport, console: Console) -> None:
    for result in report.results:
        console.print(tier_table(result))
        console.print(lookup_table(result))
    console.print(summary_table(report, report.results[0]))
    if len(report.results) > 1:
        console.print(compare_table(report.results))


def _tier_json(tier: TierResult, result: ReplayResult) -> dict[str, Any]:
    data = asdict(tier)
    data["kind"] = tier.kind.value
    data["block_hit_ratio"] = tier.block_hits / result.block_refs if result.block_refs else 0.0
    data["token_hit_ratio"] = tier.token_hits / result.total_tokens if result.total_tokens else 0.0
    data["gb_per_s"] = tier.gb_per_s(result.wall_s)
    return data


def _result_json(result: ReplayResult) -> dict[str, Any]:
    data: dict[str, Any] = {
        key: value for key, value in asdict(result).items() if key not in {"tiers", "timeline"}
    }
    data["tiers"] = [_tier_json(tier, result) for tier in result.tiers]
    data["timeline"] = [asdict(point) for point in result.timeline]
    data.update(
        block_hits=result.block_hits,
        token_hits=result.token_hits,
        block_hit_ratio=result.block_hit_ratio,
        token_hit_ratio=result.token_hit_ratio,
        ideal_block_hit_ratio=result.ideal_block_hit_ratio,
        ideal_token_hit_ratio=result.ideal_token_hit_ratio,
        prefill_tokens_saved=result.token_hits,
        backend_calls=result.secondary_total("backend_calls"),
        probes=result.secondary_total("probes"),
        inflight_reuses=result.secondary_total("inflight_reuses"),
        verdict_cache_hits=result.secondary_total("verdict_cache_hits"),
        lookups=result.secondary_total("lookups"),
    )
    return data


def report_json(report: ReplayReport) -> dict[str, Any]:
    """Everything the tables show, and more (timeline, raw manager stats), as plain JSON types."""
    validation: dict[str, Any] | None = None
    if report.validation is not None:
        validation = {
            "trace": report.validation.trace_name,
            "passed": report.validation.passed,
            "checks": [
                {"label": c.label, "computed": c.computed, "published": c.published,
                 "passed": c.passed}
                for c in report.validation.checks
            ],
        }
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "trace": {"source": report.trace_source, "sha256": report.trace_sha256},
        "settings": report.settings,
        "validation": validation,
        "validation_note": report.validation_note,
        "results": [_result_json(result) for result in report.results],
    }


def write_json(report: ReplayReport, path: Path) -> None:
    text = json.dumps(report_json(report), indent=2, default=str) + "\n"
    try:  # 0600: a report names hosts, buckets and settings; it is nobody else's business
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(text)
    except OSError as exc:
        raise ReportError(f"could not write JSON report to {path}: {exc.strerror}") from exc


def write_plot(report: ReplayReport, path: Path) -> None:
    """Hit ratio per window of requests, per tier, against the ideal; one panel per strategy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ReportError(
            "--plot needs matplotlib, which is not installed; install it with "
            "`pip install 'kvtier[plot]'`"
        ) from exc
    results = report.results
    figure, axes = plt.subplots(
        len(results), 1, figsize=(10, 3.6 * len(results)), squeeze=False, sharex=True
    )
    for axis, result in zip(axes[:, 0], results, strict=True):
        xs = [point.requests_done for point in result.timeline]
        for tier in result.tiers:
            ys = [
                point.tier_hits.get(tier.name, 0) / point.block_refs if point.block_refs else 0.0
                for point in result.timeline
            ]
            axis.plot(xs, ys, label=tier.name)
        totals = [
            sum(point.tier_hits.values()) / point.block_refs if point.block_refs else 0.0
            for point in result.timeline
        ]
        axis.plot(xs, totals, label="all tiers", color="black", linewidth=2)
        ideal = [
            point.ideal_hits / point.block_refs if point.block_refs else 0.0
            for point in result.timeline
        ]
        axis.plot(xs, ideal, label="ideal (infinite cache)", color="grey", linestyle="--")
        axis.set_ylabel("block hit ratio")
        axis.set_ylim(0, 1)
        axis.set_title(f"{result.trace_name}: strategy {result.strategy}")
        axis.grid(True, alpha=0.3)
        axis.legend(loc="upper left", fontsize="small", ncol=3)
    axes[-1, 0].set_xlabel("requests scheduled")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise ReportError(f"could not write plot to {path}: {exc.strerror}") from exc
    finally:
        plt.close(figure)
