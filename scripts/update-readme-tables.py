"""Regenerate the README's settings and metrics tables from the declarations.

    .venv/bin/python scripts/update-readme-tables.py

tests/test_config.py and tests/ops/test_metrics.py fail when the README and the declarations differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

import kvtier.integrations.vllm._settings  # noqa: F401  (registers the vLLM tier's table)
from kvtier.config import settings_markdown
from kvtier.ops.metrics import metrics_markdown

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = {"settings": settings_markdown, "metrics": metrics_markdown}


def replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name}:begin (generated) -->\n", f"<!-- {name}:end -->"
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise SystemExit(f"README.md has no {begin.strip()} ... {end} block")
    return head + begin + body + rest[rest.index(end):]


def main() -> int:
    text = README.read_text(encoding="utf-8")
    for name, generate in BLOCKS.items():
        text = replace_block(text, name, generate())
    README.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
