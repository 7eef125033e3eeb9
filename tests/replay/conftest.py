"""Fixtures for the replay tests: small traces written to real files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ._traces import TraceWriter


@pytest.fixture
def write_trace(tmp_path: Path) -> TraceWriter:
    """Write records (dicts, or raw strings written verbatim) as a JSONL file."""
    counter = iter(range(10_000))

    def write(lines: Sequence[dict[str, Any] | str], name: str | None = None) -> Path:
        path = tmp_path / (name or f"trace-{next(counter)}.jsonl")
        text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
        path.write_text(text + "\n")
        return path

    return write
