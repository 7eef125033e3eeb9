"""The docs site builds in MkDocs' strict mode: every page in the navigation, no broken link.

Skipped only where mkdocs is not installed (``pip install -e '.[docs]'``); ``.ci/run`` installs
the docs extra, so CI always builds the site.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mkdocs() -> list[str]:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed")
    return [sys.executable, "-m", "mkdocs"]


@pytest.mark.timeout(300)
def test_docs_site_builds_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [*_mkdocs(), "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
        capture_output=True, text=True, timeout=280, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name if p.parent != site else "index" for p in site.rglob("index.html")}
    assert pages <= built | {"index"}, sorted(pages - built)


def test_readme_names_the_docs_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert ".venv/bin/pip install -e '.[docs]' && .venv/bin/mkdocs build --strict" in readme
