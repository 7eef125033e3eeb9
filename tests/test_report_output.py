"""The replay report reads right at 80 columns: no cut numbers, throughput over wall time with
the busy-time rate labelled as such; the plot is written; the CLI has a version and help for
every option."""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

import kvtier
from kvtier import cli
from kvtier.replay.report import (
    compare_table,
    lookup_table,
    summary_table,
    tier_table,
    write_plot,
)
from kvtier.replay.results import ReplayReport, ReplayResult, TierKind, TierResult, TimelinePoint

_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def _secondary(name: str, scale: int) -> TierResult:
    return TierResult(
        name=name, kind=TierKind.SECONDARY, block_hits=1_030_525 * scale, token_hits=9_000_000,
        bytes_read=483_393_536 * scale, bytes_written=905_969_664, io_seconds=12.5,
        lookups=1_108_976 * scale, backend_calls=844, probes=210_413 * scale,
        inflight_reuses=34, verdict_cache_hits=1_882, failed_loads=0, failed_stores=12,
        shed_stores=0, probe_errors=0, backend_errors=3, corrupt_objects=0,
    )


def _result(strategy: str, tiers: int = 3) -> ReplayResult:
    secondaries = [_secondary(name, index + 1)
                   for index, name in enumerate(("file", "redis", "s3", "redis-2")[:tiers])]
    return ReplayResult(
        strategy=strategy, trace_name="conversation_trace.jsonl", requests=12_031,
        skipped_lines=0, instances=2, block_bytes=16_384, block_refs=288_500,
        total_tokens=144_793_823, ideal_block_hits=105_710, ideal_token_hits=54_098_411,
        tiers=[
            TierResult(name="GPU", kind=TierKind.GPU, block_hits=15_785, token_hits=8_000_000),
            TierResult(name="CPU", kind=TierKind.PRIMARY, block_hits=59_400,
                       token_hits=30_000_000, bytes_read=1_503_238_553,
                       bytes_written=3_006_477_107),
            *secondaries,
        ],
        steps=3_240, steps_waited=58_658, requests_waited=11_945, verified_blocks=89_925,
        store_plans_refused=0, step_time_p50_s=0.001910, step_time_p99_s=0.009526,
        wall_s=34.1, tier_urls=["file:///dev/shm/kvtier-replay-cv_hrwwb/file-tier"],
        timeline=[TimelinePoint(requests_done=120 * (i + 1), sim_time_s=float(i),
                                block_refs=2_885, tier_hits={"GPU": 150, "CPU": 600,
                                                             "file": 300},
                                ideal_hits=1_057) for i in range(100)],
    )


def _report(*strategies: str) -> ReplayReport:
    return ReplayReport(
        trace_source="builtin:conversation", trace_sha256="b8cbb061a852" + "0" * 52,
        results=[_result(strategy) for strategy in strategies or ("kvtier",)],
        validation=None,
        validation_note="PASSED: Mooncake FAST'25 conversation_trace.jsonl: ideal 0.3664 vs "
                        "0.3664 (computed vs published, tolerance 0.01)",
    )


def _render(table: Table, width: int = 80) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(table)
    text: str = console.file.getvalue()  # type: ignore[attr-defined]
    return text


def _cells(table: Table) -> list[str]:
    return [str(cell) for column in table.columns for cell in column.cells]


def _tables() -> list[Table]:
    report = _report("kvtier", "per-request", "no-reuse")
    result = report.results[0]
    return [tier_table(result, 80), lookup_table(result), summary_table(report, result),
            compare_table(report.results, 80)]


@pytest.mark.parametrize("index", range(4))
def test_tables_fit_80_columns_and_never_cut_a_number(index: int) -> None:
    table = _tables()[index]
    text = _render(table)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    rendered_numbers = set(_NUMBER.findall(text))
    for cell in _cells(table):
        for number in _NUMBER.findall(cell):
            assert number in rendered_numbers, (number, cell, text)


def test_a_narrow_console_drops_a_column_rather_than_cut_numbers() -> None:
    result = _result("kvtier")
    wide, narrow = _render(tier_table(result, 80)), _render(tier_table(result, 66), 66)
    assert "token" in wide and "token" not in narrow
    assert "…" not in narrow and "864 MiB" in narrow  # 905,969,664 bytes: 3 digits, unit
    assert max(len(line) for line in narrow.splitlines()) <= 66
    assert "3,091,575" in narrow and "69.1" in narrow  # the last column is whole


def test_throughput_is_over_wall_time_and_the_busy_rate_says_so() -> None:
    result = _result("kvtier", tiers=1)
    tier_text = _render(tier_table(result))
    assert "(wall)" in tier_text
    file_tier = result.tiers[2]
    wall_rate = (file_tier.bytes_read + file_tier.bytes_written) / result.wall_s / 1e6
    assert f"{wall_rate:,.1f}" in tier_text  # 102.3: bytes over the run's wall time
    lookup_text = _render(lookup_table(result))
    assert "busy-time GB/s" in lookup_text
    busy = (file_tier.bytes_read + file_tier.bytes_written) / 12.5 / 1e9
    assert f"{busy:.3g}" in lookup_text


@pytest.mark.parametrize("strategies", [("kvtier",), ("kvtier", "per-request", "no-reuse")])
def test_the_plot_is_a_png(tmp_path: Path, strategies: tuple[str, ...]) -> None:
    path = tmp_path / "plot.png"
    write_plot(_report(*strategies), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtier {kvtier.__version__}"


def _actions(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    found: list[tuple[str, argparse.Action]] = []
    for action in parser._actions:
        found.append((path, action))
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(_actions(sub, f"{path} {name}"))
    return found


def test_every_option_has_help() -> None:
    actions = _actions(cli._build_parser(), "kvtier")
    assert len(actions) > 40
    missing = [f"{path}: {action.option_strings or action.dest}" for path, action in actions
               if not action.help or action.help == argparse.SUPPRESS]
    assert missing == []


def _small_result() -> ReplayResult:
    """A short run: short numbers, so the headers are what must wrap."""
    return ReplayResult(
        strategy="kvtier", trace_name="builtin:conversation", requests=200, skipped_lines=0,
        instances=1, block_bytes=16_384, block_refs=5_537, total_tokens=2_782_179,
        ideal_block_hits=322, ideal_token_hits=164_864,
        tiers=[TierResult("GPU", TierKind.GPU, 199, 101_888),
               TierResult("CPU", TierKind.PRIMARY, 123, 62_976, 2_015_232, 85_442_560),
               TierResult("file", TierKind.SECONDARY, 0, 0, 0, 85_442_560, io_seconds=1.0)],
        steps=76, steps_waited=1_348, requests_waited=200, verified_blocks=123,
        store_plans_refused=0, step_time_p50_s=0.0028, step_time_p99_s=0.0106, wall_s=0.9,
    )


@pytest.mark.parametrize("width", [80, 72])
def test_a_short_runs_tier_table_is_never_cropped(width: int) -> None:
    """Before: rich shrank every column evenly, below their minimum widths, and cut the
    table's right edge (the MB/s column lost its last digit and its border) at 80 columns."""
    text = _render(tier_table(_small_result(), width), width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    boxed = [line for line in lines if line[:1] in "┏┃┡│├└"]
    assert boxed and all(line[-1] in "┓┃┩│┤┘" for line in boxed), text
    assert "99.9" in text or "97.2" in text or "95.0" in text  # the MB/s column is whole


def test_the_report_opens_with_the_verdict_and_ends_with_its_terms() -> None:
    from kvtier.replay.report import report_tables

    report = _report("kvtier", "per-request", "no-reuse")
    shown = report_tables(report, 80)
    first, last = str(shown[0]), str(shown[-1])
    result = report.results[0]
    assert first.startswith(f"block hit {result.block_hit_ratio:.4f} > ideal ")  # made-up hits
    assert "validation n/a" in first
    assert first.endswith(f"· {sum(r.wall_s for r in report.results):.1f} s")
    assert last.startswith("terms: GPU = the simulated engine's own prefix cache")
    assert sum("terms:" in str(item) for item in shown) == 1  # once, however many strategies


def test_the_verdict_line_compares_with_the_ideal_and_names_the_validation() -> None:
    from kvtier.replay.summary import Verdict

    below = Verdict("kvtier", 0.31416, 0.36640, "PASSED", 8.94)
    assert below.line() == ("block hit 0.3142 < ideal 0.3664 (0.857 of ideal) · validation "
                            "PASSED · 8.9 s")
    same = Verdict("kvtier", 0.314159, 0.314161, "FAILED", 1.0)
    assert same.line().startswith("block hit 0.3142 = ideal 0.3142 (1.000 of ideal) · "
                                  "validation FAILED")
    nothing = Verdict("kvtier", 0.0, 0.0, "n/a", 0.25)
    assert "(no block repeats: nothing to hit)" in nothing.line() and nothing.of_ideal is None
    assert below.to_json()["of_ideal"] == pytest.approx(0.31416 / 0.36640)


def test_the_json_report_keeps_every_key_and_adds_the_verdict() -> None:
    import dataclasses

    from kvtier.replay.report import report_json

    data = report_json(_report("kvtier", "per-request"))
    assert set(data) == {"schema_version", "trace", "settings", "validation", "validation_note",
                         "results", "verdict"}
    fields = {field.name for field in dataclasses.fields(ReplayResult)}
    assert set(data["results"][0]) >= fields | {"block_hit_ratio", "ideal_block_hit_ratio",
                                                "backend_calls", "prefill_tokens_saved"}
    assert data["verdict"]["strategy"] == "kvtier"
    assert data["verdict"]["block_hit_ratio"] == data["results"][0]["block_hit_ratio"]
    assert data["verdict"]["validation"] == "n/a"


def test_plain_tables_of_a_report_have_one_row_per_tier_and_strategy() -> None:
    from kvtier.replay.summary import report_sheets

    tiers, lookups, run, sources = report_sheets(_report("kvtier", "per-request"))
    assert sources.columns == ("strategy", "outcome", "source", "blocks")
    assert len(tiers.rows) == 2 * (5 + 2)  # GPU, CPU, 3 secondaries, total, ideal
    assert len(lookups.rows) == 2 * 3 and len(run.rows) == 2
    row = dict(zip(run.columns, run.rows[1], strict=True))
    assert row["strategy"] == "per-request" and row["requests_waited"] == 11_945
