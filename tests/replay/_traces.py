"""Helpers for the replay tests: trace records (the published traces are the bundled copies)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TraceWriter = Callable[..., Path]


def record(timestamp: float, input_length: int, hash_ids: Sequence[int],
           output_length: int = 64) -> dict[str, Any]:
    return {"timestamp": timestamp, "input_length": input_length,
            "output_length": output_length, "hash_ids": list(hash_ids)}


def full(hash_ids: Sequence[int], timestamp: float = 0, output_length: int = 64,
         block_tokens: int = 512) -> dict[str, Any]:
    """A record whose blocks are all full."""
    return record(timestamp, block_tokens * len(hash_ids), hash_ids, output_length)
