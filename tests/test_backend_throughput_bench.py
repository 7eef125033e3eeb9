"""``benchmarks/backend_throughput.py --json``: the rows it writes and the targets it judges.

Runs the benchmark on tiny sizes (memory and file, one round) only to check the shape of what it
writes; nothing is timed or compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_module import load_benchmark

pytestmark = pytest.mark.timeout(120)

bench = load_benchmark("backend_throughput")


def test_json_has_a_raw_and_a_floor_for_every_transfer_row(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    assert bench.main(["--backends", "memory,file+auth", "--sizes", "4KiB", "--total", "64KiB",
                       "--rounds", "1", "--exists-batches", "4", "--exists-keys", "8",
                       "--dir", str(tmp_path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    transfers = [row for row in rows if row["op"] in ("put", "get")]
    assert {(row["backend"], row["op"]) for row in transfers} == {
        (kind, op) for kind in ("memory", "file+auth") for op in ("put", "get")}
    for row in transfers:
        assert row["block_bytes"] == 4096
        assert {"gbps", "raw_gbps", "floor_gbps"} <= row.keys()
        assert all(row[name] > 0 for name in ("gbps", "raw_gbps", "floor_gbps"))
    by_kind = {(row["backend"], row["op"]): row for row in transfers}
    assert by_kind["file+auth", "get"]["floor"] == "raw write/read + keyed BLAKE3"
    assert by_kind["memory", "put"]["floor"] == "copy in/out + xxh3"
    assert by_kind["memory", "get"]["floor"] == "copy in/out (nothing to verify)"
    assert "unkeyed_gbps" in by_kind["file+auth", "get"]
    exists = [row for row in rows if row["op"] == "exists"]
    assert [(row["backend"], row["batch"]) for row in exists] == [("memory", 4), ("file+auth", 4)]


def test_a_row_names_the_targets_it_misses() -> None:
    row = bench.Row("file", "get", "256 KiB", "GB/s", 1.0, "raw", 1.4, None, 0.7,
                    block_bytes=256 << 10, floor=1.2, floor_ratio=0.85,
                    targets=bench.TARGETS["file", "get"])
    assert row.misses() == ["90% of floor", "80% of raw"]
    row.ratio, row.floor_ratio = 0.81, 0.95
    assert row.misses() == []


@pytest.mark.parametrize(("argv", "named"), [
    (["--dir", "/nonexistent/kvtier"], "--dir '/nonexistent/kvtier': no such directory"),
    (["--exists-batches", "1,many"], "--exists-batches '1,many': expected comma-separated whole"),
    (["--exists-batches", "0"], "--exists-batches '0': expected comma-separated whole"),
])
def test_a_bad_option_is_a_usage_error_that_names_it(argv: list[str], named: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert named in error and "Traceback" not in error
