"""Small text helpers for messages. Owns no state."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of an error: some clients put a multi-line debug dump in their messages."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
