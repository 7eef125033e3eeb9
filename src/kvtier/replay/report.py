"""Presenting a replay: rich tables (opened by the verdict line and followed by the terms
they use, :mod:`kvtier.replay.summary`), a JSON document and a hit-ratio-over-time plot.

Pure presentation; this module owns no state.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.errors import KvtierError
from kvtier.replay.results import ReplayReport, ReplayResult, TierKind, TierResult
from kvtier.replay.summary import terms_text, verdict
from kvtier.text import json_document

JSON_SCHEMA_VERSION = 1


class ReportError(KvtierError, RuntimeError):
    """The report could not be written (missing optional package, unwritable path)."""


def format_bytes(count: int) -> str:
    """``count`` bytes in binary units, three significant digits: 512 B, 1.50 KiB, 72.8 MiB,
    864 MiB, 2.80 GiB (short, so that tables fit 80 columns)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{value:.0f} B"
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{digits}f} {unit}"
        value /= 1024
    return f"{value:.0f} TiB"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _ratio(value: float) -> str:
    return f"{value:.4f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def _wall_rate(count: int, wall_s: float) -> str:
    """Bytes per second of wall time, in decimal MB/s (what a user compares with a disk)."""
    return f"{count / wall_s / 1e6:,.1f}" if wall_s > 0 else "-"


def _busy_rate(tier: TierResult) -> str:
    seconds = tier.io_seconds
    moved = tier.bytes_read + tier.bytes_written
    return f"{moved / seconds / 1e9:.3g}" if seconds else "-"


def _fit_numbers(table: Table, rows: Sequence[Sequence[str]]) -> None:
    """Give every column after the first at least the width of its widest cell, so that rich
    wraps headers and labels, and never cuts a number, when the console is narrow."""
    table.columns[0].min_width = max(
        (len(word) for row in rows for word in row[0].split()), default=0
    )  # labels wrap between words, never inside one
    for index, column in enumerate(table.columns[1:], start=1):
        column.min_width = max((len(row[index]) for row in rows), default=0)
        column.justify = "right"


def _share_width(table: Table, width: int | None) -> None:
    """Fit ``table`` into ``width`` columns. Rich shrinks every column evenly when a table is
    too wide, below the minimum widths :func:`_fit_numbers` set, then crops the table's right
    edge; instead each column gets its minimum plus a share of the rest in proportion to how
    much more it would take."""
    if width is None:
        return
    least: list[int] = []
    most: list[int] = []
    for column in table.columns:
        texts = [str(column.header), *(str(cell) for cell in column.cells)]
        header_word = max((len(word) for word in str(column.header).split()), default=0)
        least.append(max(column.min_width or 0, header_word, 1))
        most.append(max(len(text) for text in texts))
    count = len(table.columns)
    available = width - (count + 1) - 2 * count  # borders, and one space each side of a cell
    spare = available - sum(least)
    if sum(most) <= available or spare < 0:
        return
    wants = [max(0, high - low) for low, high in zip(least, most, strict=True)]
    shares = [spare * want // sum(wants) for want in wants]
    shares[wants.index(max(wants))] += spare - sum(shares)
    for column, low, share in zip(table.columns, least, shares, strict=True):
        column.width = low + share


def _min_width(table: Table) -> int:
    measuring = Console(width=10_000, file=io.StringIO())
    return measuring.measure(table).minimum


def tier_table(result: ReplayResult, width: int | None = None) -> Table:
    """Hits and traffic per tier, next to the ideal (infinite cache). When the table cannot fit
    ``width`` columns without cutting numbers or tier labels, the token hit ratio column is
    dropped (the run table still gives the overall token figure), then labels wrap."""
    layouts = ((True, True), (False, True), (False, False)) if width is not None \
        else ((True, False),)
    for token_ratio, whole_labels in layouts:
        table = _tier_table(result, token_ratio=token_ratio, whole_labels=whole_labels)
        if width is None or _min_width(table) <= width:
            break
    _share_width(table, width)
    return table


def _tier_table(result: ReplayResult, *, token_ratio: bool, whole_labels: bool) -> Table:
    table = Table(
        title=(
            f"kvtier replay: {result.trace_name}, {result.requests:,} requests, "
            f"{result.instances} instance(s), strategy {result.strategy}"
        ),
        title_justify="left",
        caption_justify="left",
    )
    headers = ["tier", "block hits", "block hit ratio", "token hit ratio", "read", "written",
               "MB/s (wall)"]
    rows: list[list[str]] = []
    for tier in result.tiers:
        moved = tier.kind is not TierKind.GPU
        rows.append([
            tier.name,
            f"{tier.block_hits:,}",
            _ratio(tier.block_hits / result.block_refs if result.block_refs else 0.0),
            _ratio(tier.token_hits / result.total_tokens if result.total_tokens else 0.0),
            format_bytes(tier.bytes_read) if moved else "-",
            format_bytes(tier.bytes_written) if moved else "-",
            _wall_rate(tier.bytes_read + tier.bytes_written, result.wall_s) if moved else "-",
        ])
    totals = [
        ["all tiers", f"{result.block_hits:,}", _ratio(result.block_hit_ratio),
         _ratio(result.token_hit_ratio), "", "", ""],
        ["ideal", f"{result.ideal_block_hits:,}",  # explained below the report (terms)
         _ratio(result.ideal_block_hit_ratio),
         _ratio(result.ideal_token_hit_ratio), "", "", ""],
    ]
    if not token_ratio:
        for row in (headers, *rows, *totals):
            del row[3]
    for header in headers:
        table.add_column(header)
    for row in rows:
        table.add_row(*row)
    _fit_numbers(table, [*rows, *totals])
    if whole_labels:
        table.columns[0].min_width = max(len(row[0]) for row in (*rows, *totals))
    table.add_section()
    table.add_row(*totals[0], style="bold")
    table.add_row(*totals[1], style="dim")
    table.caption = (
        "MB/s (wall): bytes read + written over the run's wall time (the I/O threads' "
        "busy-time rate is in the next table)"
    )
    return table


_LOOKUP_ROWS: tuple[tuple[str, str], ...] = (
    ("lookups", "lookups"),
    ("backend calls", "backend_calls"),
    ("probes (keys sent to the backend)", "probes"),
    ("in-flight reuses", "inflight_reuses"),
    ("verdict-cache hits", "verdict_cache_hits"),
    ("failed loads", "failed_loads"),
    ("failed stores", "failed_stores"),
    ("shed stores", "shed_stores"),
    ("probe errors", "probe_errors"),
    ("backend errors", "backend_errors"),
)


def lookup_table(result: ReplayResult) -> Table:
    """What the secondary tiers' lookup managers and transfers did: one column per tier, so
    the table fits 80 columns however many counters there are."""
    tiers = [tier for tier in result.tiers if tier.kind is TierKind.SECONDARY]
    table = Table(title="secondary-tier lookups and transfers", title_justify="left")
    table.add_column("")
    for tier in tiers:
        table.add_column(tier.name)
    rows = [[label, *(_count(getattr(tier, attribute)) for tier in tiers)]
            for label, attribute in _LOOKUP_ROWS]
    if any(tier.declined_loads for tier in tiers):  # only where prefill_tokens_per_s is set
        rows.append(["declined loads (slower than recompute)",
                     *(_count(tier.declined_loads) for tier in tiers)])
    rows.append(["busy-time GB/s (bytes over the I/O threads' summed busy time)",
                 *(_busy_rate(tier) for tier in tiers)])
    for row in rows:
        table.add_row(*row)
    _fit_numbers(table, rows)
    return table


def _table_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {count:,}" for name, count in counts.items()) or "none"


def _prefetch_text(counts: dict[str, int]) -> str:
    if not counts.get("started_blocks"):
        return "none (off, or nothing left the pool between turns)"
    return (f"{counts['prefetched_blocks']:,} prefetched: {counts['used_blocks']:,} used, "
            f"{counts['wasted_blocks']:,} wasted; {counts['cancelled_blocks']:,} cancelled, "
            f"{counts['failed_blocks']:,} failed")


def summary_table(report: ReplayReport, result: ReplayResult) -> Table:
    table = Table(show_header=False, title="run", title_justify="left")
    table.add_column("what", ratio=2)
    table.add_column("value", ratio=3, overflow="fold")
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
        ("hit sources (blocks)", _table_text(result.hit_sources)),
        ("prefetch (blocks)", _prefetch_text(result.prefetch)),
        ("hits lost against the ideal (blocks, by cause)", _table_text(result.lost_hits)),
        ("cascades shed / promoted blocks lost before load",
         f"{result.cascades_shed:,} / {result.promotions_lost:,}"),
        ("waits for a backlogged tier (steps / seconds)",
         f"{result.store_waits:,} / {result.store_wait_s:.1f} s"),
        ("scheduler time per step p50 / p99", f"{_ms(result.step_time_p50_s)} / "
                                               f"{_ms(result.step_time_p99_s)}"),
        ("wall time", f"{result.wall_s:.1f} s"),
        ("secondary tiers", ", ".join(result.tier_urls) or "none"),
        ("validation vs published numbers", report.validation_note),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def _compare_rows(result: ReplayResult) -> list[str]:
    return [
        _ratio(result.block_hit_ratio),
        _ratio(result.token_hit_ratio),
        f"{result.secondary_total('backend_calls'):,}",
        f"{result.secondary_total('probes'):,}",
        f"{result.secondary_total('inflight_reuses'):,}",
        f"{result.secondary_total('verdict_cache_hits'):,}",
        f"{result.steps_waited:,}",
        _ms(result.step_time_p50_s),
        _ms(result.step_time_p99_s),
        f"{result.wall_s:.1f} s",
    ]


_COMPARE_LABELS = (
    "block hit ratio", "token hit ratio", "backend calls", "probes", "in-flight reuses",
    "verdict-cache hits", "steps waited on lookups", "scheduler time per step p50",
    "scheduler time per step p99", "wall time",
)


def compare_table(results: Sequence[ReplayResult], width: int | None = None) -> Table:
    """The strategies side by side (``--compare``): one row per strategy, or, when that cannot
    fit ``width`` columns without cutting numbers, one column per strategy."""
    table = _compare_table(results, by_row=True)
    if width is not None and _min_width(table) > width:
        table = _compare_table(results, by_row=False)
    _share_width(table, width)
    return table


def _compare_table(results: Sequence[ReplayResult], *, by_row: bool) -> Table:
    from kvtier.replay.strategies import Strategy

    table = Table(title="lookup strategies on the same trace", title_justify="left",
                  caption_justify="left")
    columns = [_compare_rows(result) for result in results]
    if by_row:
        headers = ["strategy", *_COMPARE_LABELS]
        rows = [[result.strategy, *column] for result, column in zip(results, columns,
                                                                      strict=True)]
    else:
        headers = ["", *(result.strategy for result in results)]
        rows = [[label, *(column[index] for column in columns)]
                for index, label in enumerate(_COMPARE_LABELS)]
    for header in headers:
        table.add_column(header)
    for row in rows:
        table.add_row(*row)
    _fit_numbers(table, rows)
    table.caption = "; ".join(
        f"{result.strategy}: {Strategy(result.strategy).description}" for result in results
        if result.strategy in {strategy.value for strategy in Strategy}
    )
    return table


def report_tables(report: ReplayReport, width: int | None = None) -> list[Any]:
    """What ``kvtier replay`` prints for people: the verdict line, the tables, the terms."""
    from rich.text import Text

    shown: list[Any] = [verdict(report).line()]  # one line, never wrapped
    for result in report.results:
        shown += [tier_table(result, width), lookup_table(result)]
    shown.append(summary_table(report, report.results[0]))
    if len(report.results) > 1:
        shown.append(compare_table(report.results, width))
    shown.append(Text(terms_text(), style="dim"))
    return shown


def print_report(report: ReplayReport, console: Console) -> None:
    for renderable in report_tables(report, console.width):  # a str: a line, as written
        console.print(renderable, soft_wrap=isinstance(renderable, str), markup=False,
                      highlight=False)


def _tier_json(tier: TierResult, result: ReplayResult) -> dict[str, Any]:
    data = asdict(tier)
    data["kind"] = tier.kind.value
    data["block_hit_ratio"] = tier.block_hits / result.block_refs if result.block_refs else 0.0
    data["token_hit_ratio"] = tier.token_hits / result.total_tokens if result.total_tokens else 0.0
    data["gb_per_s"] = tier.gb_per_s(result.wall_s)
    return data


def result_json(result: ReplayResult) -> dict[str, Any]:
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
    """Everything the tables show, and more (timeline, raw manager stats), as plain JSON types;
    ``verdict`` is the report's first line (:class:`kvtier.replay.summary.Verdict`)."""
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
        "verdict": verdict(report).to_json(),
        "results": [result_json(result) for result in report.results],
    }


def write_json(report: ReplayReport, path: Path) -> None:
    text = json_document(report_json(report))
    try:  # 0600: a report names hosts, buckets and settings; it is nobody else's business
        # O_NONBLOCK: a FIFO with no reader fails at once (ENXIO) instead of hanging the run.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ReportError(f"could not write JSON report to {path}: not a regular file "
                              "(a FIFO, socket or device); expected a file path")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), 0o600)
            handle.write(text)
    except OSError as exc:
        raise ReportError(f"could not write JSON report to {path}: {exc.strerror}") from exc


def write_plot(report: ReplayReport, path: Path) -> None:
    """Hit ratio per window of requests, per tier, against the ideal; with several strategies
    (``--compare``), one hit-ratio panel comparing them plus bars of what differs between them
    (backend calls, steps waited on lookups, scheduler time per step)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ReportError(
            "--plot needs matplotlib, which is not installed; install it with "
            "`pip install 'kvtier[plot]'`"
        ) from exc
    figure = plot_figure(report, plt)
    try:
        # "tight": the legends sit outside the axes (never over the lines) and must be kept.
        figure.savefig(path, dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise ReportError(f"could not write plot to {path}: {exc.strerror}") from exc
    finally:
        plt.close(figure)


def plot_figure(report: ReplayReport, plt: Any) -> Any:
    """The figure :func:`write_plot` saves (``plt``: ``matplotlib.pyplot``)."""
    results = report.results
    if len(results) == 1:
        figure, axis = plt.subplots(figsize=(10, 4.8))
        _plot_tiers(axis, results[0])
    else:
        figure = _plot_compare(plt, results)
    figure.tight_layout()
    return figure


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" if count == 1 else f"{count:,} {noun}s"


def _window_label(result: ReplayResult) -> str:
    points = result.timeline
    size = points[0].requests_done if points else 0
    if len(points) <= 1:
        return f"requests scheduled (one point: all {_plural(size, 'request')})"
    return (f"requests scheduled (each point: a window of {_plural(size, 'request')}, "
            f"{_plural(len(points), 'window')})")


_OUTSIDE_RIGHT: dict[str, Any] = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0),
                                  "borderaxespad": 0.0, "fontsize": "small"}
"""Legends go right of the axes: inside, they covered the lines of a short replay."""


def _ratios(result: ReplayResult, hits: Any) -> list[float]:
    return [hits(point) / point.block_refs if point.block_refs else 0.0
            for point in result.timeline]


def _plot_tiers(axis: Any, result: ReplayResult) -> None:
    xs = [point.requests_done for point in result.timeline]
    # The ideal goes underneath, wide and pale; "all tiers" on top, so both stay visible
    # where the cache reaches the ideal.
    axis.plot(xs, _ratios(result, lambda p: p.ideal_hits), label="ideal (infinite cache)",
              color="#bbbbbb", linewidth=6, solid_capstyle="round", zorder=1)
    axis.plot(xs, _ratios(result, lambda p: sum(p.tier_hits.values())), label="all tiers",
              color="black", linewidth=1.6, zorder=3)
    for tier in result.tiers:
        axis.plot(xs, _ratios(result, lambda p, name=tier.name: p.tier_hits.get(name, 0)),
                  label=tier.name, linewidth=1.2, zorder=2)
    axis.set_ylabel("block hit ratio in the window")
    axis.set_ylim(0, 1)
    axis.set_xlabel(_window_label(result))
    axis.set_title(f"{result.trace_name}: block hit ratio per window, strategy "
                   f"{result.strategy} (overall {result.block_hit_ratio:.4f}, ideal "
                   f"{result.ideal_block_hit_ratio:.4f})")
    axis.grid(True, alpha=0.3)
    axis.legend(**_OUTSIDE_RIGHT)


def _plot_compare(plt: Any, results: Sequence[ReplayResult]) -> Any:
    figure = plt.figure(figsize=(11, 8))
    grid = figure.add_gridspec(2, 3, height_ratios=(1.2, 1))
    hits = figure.add_subplot(grid[0, :])
    first = results[0]
    xs = [point.requests_done for point in first.timeline]
    hits.plot(xs, _ratios(first, lambda p: p.ideal_hits), label="ideal (infinite cache)",
              color="#bbbbbb", linewidth=6, zorder=1)
    styles = ("-", "--", ":", "-.")
    for index, result in enumerate(results):  # dashed styles keep overlapping lines visible
        hits.plot([point.requests_done for point in result.timeline],
                  _ratios(result, lambda p: sum(p.tier_hits.values())),
                  label=f"{result.strategy}: all tiers", linewidth=1.6,
                  linestyle=styles[index % len(styles)], zorder=2)
    hits.set_ylim(0, 1)
    hits.set_ylabel("block hit ratio in the window")
    hits.set_xlabel(_window_label(first))
    hits.set_title(f"{first.trace_name}: the strategies reach the same hits; what differs is "
                   f"below")
    hits.grid(True, alpha=0.3)
    hits.legend(**_OUTSIDE_RIGHT)
    names = [result.strategy for result in results]
    panels: list[tuple[str, list[float], str]] = [
        ("backend calls (secondary tiers)",
         [float(r.secondary_total("backend_calls")) for r in results], "{:,.0f}"),
        ("steps waited on lookups (request-steps)",
         [float(r.steps_waited) for r in results], "{:,.0f}"),
        ("scheduler time per step, p50 (ms)",
         [r.step_time_p50_s * 1e3 for r in results], "{:.3f}"),
    ]
    for column, (title, values, fmt) in enumerate(panels):
        axis = figure.add_subplot(grid[1, column])
        bars = axis.bar(names, values, color=[f"C{i}" for i in range(len(names))])
        axis.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize="small")
        axis.set_title(title, fontsize="medium")
        axis.margins(y=0.15)
        axis.tick_params(axis="x", labelsize="small")
    return figure
