"""The replay report: rich tables, JSON document and PNG plot."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvtier.replay import reference
from kvtier.replay.report import (
    ReportError,
    print_report,
    report_json,
    write_json,
    write_plot,
)
from kvtier.replay.results import (
    ReplayReport,
    ReplayResult,
    TierKind,
    TierResult,
    TimelinePoint,
)


def _result(strategy: str = "kvtier", backend_calls: int = 7) -> ReplayResult:
    return ReplayResult(
        strategy=strategy, trace_name="t.jsonl", requests=4, skipped_lines=1, instances=2,
        block_bytes=4096, block_refs=10, total_tokens=5000, ideal_block_hits=6,
        ideal_token_hits=3000,
        tiers=[
            TierResult("GPU", TierKind.GPU, block_hits=1, token_hits=512),
            TierResult("CPU", TierKind.PRIMARY, block_hits=2, token_hits=1024,
                       bytes_read=8192, bytes_written=40960),
            TierResult("redis", TierKind.SECONDARY, block_hits=3, token_hits=1400,
                       bytes_read=12288, bytes_written=40960, io_seconds=0.5, lookups=20,
                       backend_calls=backend_calls, probes=9, inflight_reuses=2,
                       verdict_cache_hits=1, failed_loads=0, shed_stores=0),
        ],
        steps=12, steps_waited=5, requests_waited=3, verified_blocks=5, store_plans_refused=0,
        step_time_p50_s=0.0012, step_time_p99_s=0.0034, wall_s=1.5,
        tier_urls=["redis://127.0.0.1:1/0"],
        timeline=[TimelinePoint(2, 0.5, 5, {"GPU": 1, "CPU": 1}, 2),
                  TimelinePoint(4, 1.0, 5, {"CPU": 1, "redis": 3}, 4)],
    )


def _report(*results: ReplayResult, validation: reference.Validation | None = None
            ) -> ReplayReport:
    return ReplayReport(
        trace_source="/data/t.jsonl", trace_sha256="ab" * 32, results=list(results),
        validation=validation, validation_note="n/a: no published numbers",
        settings={"instances": 2},
    )


def _render(report: ReplayReport) -> str:
    console = Console(record=True, width=220)
    print_report(report, console)
    return console.export_text()


def test_tables_show_every_tier_next_to_the_ideal() -> None:
    text = _render(_report(_result()))
    for expected in ("GPU", "CPU", "redis", "all tiers", "│ ideal ",
                     "0.6000",  # all tiers: 6 / 10
                     "0.3000",  # redis block hit ratio
                     "0.000106",  # redis GB/s over its I/O time: 53248 B / 0.5 s
                     "prefill tokens saved", "2,936 of 5,000",
                     "1.200 ms / 3.400 ms", "steps waited on lookups", "n/a: no published"):
        assert expected in text, expected
    assert "lookup strategies" not in text


def test_declined_loads_show_only_when_some_were_declined() -> None:
    assert "declined loads" not in _render(_report(_result()))
    result = _result()
    result.tiers[2].declined_loads = 4
    line = next(line for line in _render(_report(result)).splitlines()
                if "declined loads (slower than recompute)" in line)
    assert line.split("│")[2].strip() == "4"


def test_compare_table_lists_each_strategy() -> None:
    text = _render(_report(_result("kvtier", 7), _result("per-request", 70)))
    assert "lookup strategies on the same trace" in text
    assert "per-request: one call per request per step" in text
    lines = [line for line in text.splitlines() if line.startswith(("│ kvtier", "│ per-request"))]
    assert len(lines) == 2 and " 7 " in lines[0] and " 70 " in lines[1]


def test_json_has_every_number(tmp_path: Path) -> None:
    check = reference.ValidationCheck("LRU 10,000", 0.4235, 0.4235)
    report = _report(_result(), validation=reference.Validation("synthetic", (check,)))
    path = tmp_path / "out.json"
    write_json(report, path)
    data: dict[str, Any] = json.loads(path.read_text())
    assert data == report_json(report) | {"settings": {"instances": 2}}
    assert data["validation"]["passed"] is True
    result = data["results"][0]
    assert result["block_hit_ratio"] == pytest.approx(0.6)
    assert result["ideal_block_hit_ratio"] == pytest.approx(0.6)
    assert result["prefill_tokens_saved"] == 2936
    assert (result["backend_calls"], result["probes"], result["inflight_reuses"]) == (7, 9, 2)
    assert result["steps_waited"] == 5 and result["step_time_p99_s"] == 0.0034
    assert [tier["kind"] for tier in result["tiers"]] == ["gpu", "primary", "secondary"]
    assert result["tiers"][2]["gb_per_s"] == pytest.approx(53248 / 0.5 / 1e9)
    assert len(result["timeline"]) == 2


def test_unwritable_json_path_is_a_report_error(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="could not write JSON report to"):
        write_json(_report(_result()), tmp_path / "missing-dir" / "x.json")


def test_plot_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "hits.png"
    write_plot(_report(_result(), _result("no-reuse")), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection (a mock): matplotlib is installed here, so its absence is simulated."""
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ReportError, match=r"pip install 'kvtier\[plot\]'"):
        write_plot(_report(_result()), tmp_path / "x.png")
