"""Helpers for the replay tests: trace records and the location of the shared traces."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

TraceWriter = Callable[..., Path]


def shared_traces_dir() -> Path:
    """``../shared/traces`` relative to the repository root (CI keeps a copy there).

    ``KVTIER_TRACES_DIR`` overrides it. Fails (never skips) with a message saying where it
    looked, because the published-number validation must run in CI.
    """
    candidates = []
    override = os.environ.get("KVTIER_TRACES_DIR")
    if override:
        candidates.append(Path(override))
    candidates.append(REPO_ROOT.parent / "shared" / "traces")
    for candidate in candidates:
        if (candidate / "mooncake-fast25" / "synthetic_trace.jsonl").is_file():
            return candidate
    pytest.fail(
        "the shared traces are missing: looked for mooncake-fast25/synthetic_trace.jsonl under "
        + ", ".join(str(c) for c in candidates)
        + " (CI copies shared/ next to the repository; or set KVTIER_TRACES_DIR)"
    )


def record(timestamp: float, input_length: int, hash_ids: Sequence[int],
           output_length: int = 64) -> dict[str, Any]:
    return {"timestamp": timestamp, "input_length": input_length,
            "output_length": output_length, "hash_ids": list(hash_ids)}


def full(hash_ids: Sequence[int], timestamp: float = 0, output_length: int = 64,
         block_tokens: int = 512) -> dict[str, Any]:
    """A record whose blocks are all full."""
    return record(timestamp, block_tokens * len(hash_ids), hash_ids, output_length)
