"""``--format table|plain|json`` on every command (issue 20), against a real file tier: plain
parses as tab-separated tables with one header line each, json as one document, and a table in
a pipe has no padding. Subprocesses get a real pipe as stdout (never a terminal)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier import cli, codec
from kvtier.backends import open_backend
from kvtier.keys import Namespace, chain_keys

FAST = ["--step-ms", "0", "--block-bytes", "4KiB", "--no-progress", "--max-requests", "40"]
BENCH = ["--requests", "40", "--rounds", "1", "--block-bytes", "4KiB"]
WALL_S = 120


def _store(root: Path, model: str = "org/model", blocks: int = 3) -> Namespace:
    namespace = Namespace(model=model, block_size=16)
    backend = open_backend(f"file://{root}", namespace)
    keys = chain_keys(list(range(16 * blocks)), 16, namespace)
    backend.put_many(keys, [bytes(range(256)) * 16] * len(keys))
    backend.close()
    return namespace


def _kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True,
                          text=True, timeout=WALL_S, stdin=subprocess.DEVNULL,
                          env={**base, **(env or {})})


def _tables(text: str) -> list[list[dict[str, str]]]:
    """Plain output as tables of rows (by header), checking the shape of every line."""
    assert text.endswith("\n") and "\x1b" not in text and "│" not in text
    tables = []
    for block in text.split("\n\n"):
        rows = list(csv.reader(io.StringIO(block), delimiter="\t", quoting=csv.QUOTE_NONE))
        header, body = rows[0], rows[1:]
        assert len(set(header)) == len(header) and all(re.fullmatch(r"[a-z][a-z0-9_]*", h)
                                                       for h in header), header
        assert all(len(row) == len(header) for row in body), block
        assert all(cell == cell.strip() for row in rows for cell in row)  # no padding
        tables.append([dict(zip(header, row, strict=True)) for row in body])
    return tables


def _commands(root: Path, digest: str) -> dict[str, list[str]]:
    url = f"file://{root}"
    return {
        "replay": ["replay", "--scratch-dir", str(root.parent), *FAST],
        "inspect": ["inspect", url, "--digest", digest[:8], "--key", "00" * 16],
        "usage": ["usage", url],
        "purge": ["purge", url, "--digest", digest[:8], "--dry-run"],
        "bench": ["bench", *BENCH],
    }


@pytest.fixture
def tier(tmp_path: Path) -> tuple[Path, Namespace]:
    root = tmp_path / "tier"
    return root, _store(root)


@pytest.mark.parametrize("command", ["replay", "inspect", "usage", "purge", "bench"])
def test_plain_is_tab_separated_tables_for_every_command(
        command: str, tier: tuple[Path, Namespace]) -> None:
    """Before: no command but usage had another format; usage's was JSON only."""
    root, namespace = tier
    done = _kvtier(*_commands(root, namespace.digest_hex)[command], "--format", "plain")
    assert done.returncode == 0, done.stderr
    tables = _tables(done.stdout)
    if command == "usage":
        (row,) = tables[0]
        assert row["digest"] == namespace.digest_hex and row["model"] == "org/model"
        assert int(row["disk_bytes"]) >= int(row["bytes"]) == 3 * (codec.HEADER_BYTES + 4096)
        assert int(row["blocks"]) == 3
    if command == "inspect":
        counters = {row["counter"]: row["value"] for row in tables[0]}
        assert counters["blocks"] == "3"
        assert tables[-1] == [{"key": "00" * 16, "present": "absent"}]
    if command == "purge":
        assert tables[-1][0]["action"] == "would_remove" and tables[-1][0]["blocks"] == "3"
    if command == "replay":
        tiers, lookups, run, sources = tables
        hits = sum(int(row["blocks"]) for row in sources if row["outcome"] == "hit")
        assert hits == int(run[0]["block_hits"])  # the hit sources add up to the hits
        total = next(row for row in tiers if row["kind"] == "total")
        ideal = next(row for row in tiers if row["kind"] == "ideal")
        assert float(total["block_hit_ratio"]) == float(run[0]["block_hit_ratio"])
        assert float(ideal["block_hit_ratio"]) == float(run[0]["ideal_block_hit_ratio"])
        assert lookups[0]["tier"] == "file" and run[0]["validation"] == "PASSED"
    if command == "bench":
        assert [row["strategy"] for row in tables[0]] == ["kvtier", "per-request"]
        assert int(tables[0][0]["backend_calls"]) < int(tables[0][1]["backend_calls"])


@pytest.mark.parametrize("command", ["replay", "inspect", "usage", "purge", "bench"])
def test_json_is_one_document_on_stdout_for_every_command(
        command: str, tier: tuple[Path, Namespace]) -> None:
    """Before: replay wrote JSON only to a file, inspect/purge/bench had none."""
    root, namespace = tier
    args = _commands(root, namespace.digest_hex)[command]
    if command == "replay":  # a given tier: the run removes its blocks, and says so on stderr
        args = [*args, "--tier", f"file://{root.parent / 'given'}"]
    done = _kvtier(*args, "--format", "json")
    assert done.returncode == 0, done.stderr
    data: Any = json.loads(done.stdout)
    if command == "usage":
        assert data[0]["digest"] == namespace.digest_hex and data[0]["disk_bytes"] >= \
            data[0]["bytes"] > 0
    elif command == "inspect":
        assert data["namespace"] == namespace.digest_hex and data["stored"]["blocks"] == 3
        assert data["keys"] == [{"key": "00" * 16, "present": False}]
    elif command == "purge":
        assert data["action"] == "would_remove" and data["blocks"] == 3
    elif command == "replay":
        assert "removed the" in done.stderr  # the note went to stderr, not into the document
        verdict = data["verdict"]
        result = data["results"][0]
        assert verdict["block_hit_ratio"] == result["block_hit_ratio"]
        assert verdict["ideal_block_hit_ratio"] == result["ideal_block_hit_ratio"]
        assert verdict["validation"] == "PASSED" and verdict["line"].startswith("block hit ")
    else:
        assert [r["strategy"] for r in data["results"]] == ["kvtier", "per-request"]


def test_usage_json_flag_stays_an_alias_of_format_json(tier: tuple[Path, Namespace],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    root, _namespace = tier
    assert cli.main(["usage", f"file://{root}", "--json"]) == 0
    alias = capsys.readouterr().out
    assert cli.main(["usage", f"file://{root}", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(alias)


@pytest.mark.parametrize("command", ["usage", "replay", "inspect"])
def test_a_piped_table_is_never_padded(command: str, tier: tuple[Path, Namespace]) -> None:
    """Before: without COLUMNS a pipe got 170-column lines padded with spaces."""
    root, namespace = tier
    done = _kvtier(*_commands(root, namespace.digest_hex)[command])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines and all(line == line.rstrip() for line in lines), command
    # Tables are 80 columns wide (rich's width without a terminal) and never cropped:
    # every line of a box ends with its right border.
    boxed = [line for line in lines if line[:1] in "┏┃┡│├└┌"]
    assert boxed and max(len(line) for line in boxed) <= 80, command
    assert all(line[-1] in "┓┃┩│┤┘┐" for line in boxed), command


def test_a_table_follows_columns_when_given(tier: tuple[Path, Namespace]) -> None:
    root, _namespace = tier
    done = _kvtier("usage", f"file://{root}", env={"COLUMNS": "140"})
    assert max(len(line) for line in done.stdout.splitlines()) > 80


def test_plain_escapes_a_tab_or_newline_in_a_value_from_the_tier(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    """A neighbour's model name cannot add a row or a column, nor reach the terminal raw."""
    _store(tmp_path, model="evil\tcolumn\nrow\\x1b\x1b[2J")
    assert cli.main(["usage", f"file://{tmp_path}", "--format", "plain"]) == 0
    (row,) = _tables(capsys.readouterr().out)[0]
    assert row["model"] == "evil\\tcolumn\\nrow\\\\x1b\\x1b[2J"


def test_the_replay_report_opens_with_its_verdict_and_explains_its_terms(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    done = _kvtier("replay", "--scratch-dir", str(tmp_path), "--json", str(report), *FAST)
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    result = data["results"][0]
    first = done.stdout.splitlines()[0]
    match = re.fullmatch(r"block hit (\d\.\d{4}) ([=<]) ideal (\d\.\d{4}) \((\d\.\d{3}) of "
                         r"ideal\) · validation (PASSED) · (\d+\.\d) s", first)
    assert match, first
    assert float(match[1]) == round(result["block_hit_ratio"], 4)
    assert float(match[3]) == round(result["ideal_block_hit_ratio"], 4)
    assert (match[2] == "=") == (match[1] == match[3])
    assert float(match[4]) == round(result["block_hit_ratio"] / result["ideal_block_hit_ratio"], 3)
    assert float(match[6]) == round(result["wall_s"], 1)
    assert data["verdict"]["line"] == first
    text = " ".join(done.stdout.split())
    assert text.count("GPU = the simulated engine's own prefix cache") == 1
    assert "requests that waited = requests held back" in text


def test_format_is_refused_with_the_choices_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["usage", "memory://", "--format", "csv"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--format: invalid choice: 'csv'" in err and "plain" in err and "json" in err


# ---- the pieces -----------------------------------------------------------------------------

def test_trimmed_lines_drop_trailing_spaces_only_of_complete_lines() -> None:
    from kvtier.cli.output import _TrimmedLines

    sink = io.StringIO()
    stream = _TrimmedLines(sink)
    stream.write("title    \nrow │ 1 │   \npart ")
    assert sink.getvalue() == "title\nrow │ 1 │\n"
    stream.write("ial  \n")  # the unfinished line continues: its inner space stays
    assert sink.getvalue() == "title\nrow │ 1 │\npart ial\n"
    stream.write("prompt? ")
    stream.flush()
    assert sink.getvalue().endswith("prompt? ")


def test_plain_cells_are_raw_numbers_and_escaped_text() -> None:
    from kvtier.cli.output import plain_cell, plain_text
    from kvtier.text import Sheet

    assert [plain_cell(v) for v in (None, True, 1234567, 0.1, "a\tb\\n\x1b")] == \
        ["", "true", "1234567", "0.1", "a\\tb\\\\n\\x1b"]
    assert plain_text([Sheet(("a", "b"), ((1, None),)), Sheet(("c",))]) == "a\tb\n1\t\n\nc\n"
    with pytest.raises(ValueError, match="sheet row 0 has 1 values for 2 columns"):
        Sheet(("a", "b"), ((1,),))


def _serve_outcome() -> tuple[dict[str, Any], dict[str, Any]]:
    from kvtier.bench import serve as sb

    def result(name: str, p50: float) -> sb.ConfigResult:
        return sb.ConfigResult(
            name=name, ttft_mean_s=p50, ttft_p50_s=p50, ttft_p99_s=2 * p50, itl_p50_s=0.01,
            throughput_req_s=1.5, requests=4, failed=0, cached_prompt_tokens=10,
            prompt_tokens=100, cached_by_source={"host": 10},
            kvtier_counters={"loaded_blocks_total": 7}, startup_s=1.0, ttfts_s=[p50])

    results = {"prefix-cache-only": result("prefix-cache-only", 1.0),
               "kvtier-file": result("kvtier-file", 0.1)}
    report = {"configs": {name: {"ttft_p50_s": r.ttft_p50_s} for name, r in results.items()},
              "targets": sb.targets(results),
              "outputs_match": {"kvtier-file vs prefix-cache-only": True,
                                "kvtier-redis vs prefix-cache-only": None}}
    return report, results


@pytest.mark.parametrize("chosen", ["table", "plain", "json"])
def test_bench_serve_prints_its_outcome_in_every_format(
        chosen: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The printing half of ``kvtier bench serve`` (the run needs vLLM: the vLLM lane)."""
    from kvtier.bench import serve as sb

    report, results = _serve_outcome()
    sb.print_outcome(argparse.Namespace(format=chosen), report, results)
    out = capsys.readouterr().out
    if chosen == "json":
        assert json.loads(out)["outputs_match"]["kvtier-file vs prefix-cache-only"] is True
    elif chosen == "plain":
        configs, goals, outputs = _tables(out)
        assert configs[1]["config"] == "kvtier-file" and configs[1]["kvtier_loaded_blocks"] == "7"
        first = goals[0]
        assert first["target"] == "kvtier-file TTFT p50 / prefix-cache-only"
        assert float(first["measured"]) == pytest.approx(0.1) and first["met"] == "true"
        assert {row["pair"]: row["identical"] for row in outputs}[
            "kvtier-redis vs prefix-cache-only"] == ""
    else:
        assert "kvtier-file" in out and "target kvtier-file TTFT p50 / prefix-cache-only: 0.100" \
            in out and "outputs kvtier-file vs prefix-cache-only: identical" in out
