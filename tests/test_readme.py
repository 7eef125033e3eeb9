"""The README's runnable Python examples run as written (vLLM examples run in the vLLM lane's
own tests; they need a model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    return [block for block in blocks if "vllm" not in block]


EXAMPLES = _python_examples()


def test_the_readme_has_runnable_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", EXAMPLES[index]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"example {index} failed:\n{EXAMPLES[index]}\n{result.stderr}"
