"""``benchmarks/namespace_check.py``: what it writes, and that its Python arm leaves the file
tier as it found it. Runs one tiny round only to check the shape; nothing is timed or compared.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvtier.backends.file import dirs

pytestmark = pytest.mark.timeout(120)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "namespace_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("namespace_check_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


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
