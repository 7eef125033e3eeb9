"""``benchmarks/namespace_check.py``: what it writes, and that its Python arm leaves the file
tier as it found it. Runs one tiny round only to check the shape; nothing is timed or compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_module import load_benchmark
from kvtier.backends.file import dirs

pytestmark = pytest.mark.timeout(120)

bench = load_benchmark("namespace_check")


def test_both_arms_are_measured_and_the_native_check_is_restored(tmp_path: Path) -> None:
    guarded = dirs.TierDirs.acquire_guarded
    out = tmp_path / "check.json"
    assert bench.main(["--rounds", "2", "--blocks", "128", "--idle", "--json", str(out)]) == 0
    assert dirs.TierDirs.acquire_guarded is guarded
    report = json.loads(out.read_text())
    assert report["scheduler"] == "idle" and report["rounds"] == 2
    for arm in ("native", "python"):
        assert set(report["medians"][arm]) == {"put", "probe", "load"}
        assert all(len(rates) == 2 and min(rates) > 0
                   for rates in report["samples"][arm].values())


def test_a_bad_count_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--blocks", "10"])
    assert exit_info.value.code == 2
    assert "--blocks 10: expected at least 1 round and 64 blocks" in capsys.readouterr().err
