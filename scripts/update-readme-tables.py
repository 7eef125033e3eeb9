"""Regenerate the docs' settings and metrics tables from the declarations.

    .venv/bin/python scripts/update-readme-tables.py

The settings tables live in docs/configuration.md, the metric table in docs/operations.md;
tests/test_config.py and tests/ops/test_metrics.py fail when a page and the declarations differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import kvtier.integrations.vllm._settings  # noqa: F401  (registers the vLLM tier's table)
from kvtier.config import settings_markdown
from kvtier.ops.metrics import metrics_markdown

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCKS = {"settings": (DOCS / "configuration.md", settings_markdown),
          "metrics": (DOCS / "operations.md", metrics_markdown)}


def replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name}:begin (generated) -->\n", f"<!-- {name}:end -->"
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise SystemExit(f"the page has no {begin.strip()} ... {end} block")
    return head + begin + body + rest[rest.index(end):]


def main() -> int:
    for name, (page, generate) in BLOCKS.items():
        text = page.read_text(encoding="utf-8")
        page.write_text(replace_block(text, name, generate()), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
