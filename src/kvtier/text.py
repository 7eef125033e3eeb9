"""Small text helpers for messages, and the plain table (:class:`Sheet`) the commands print
for scripts. Owns no state."""

from __future__ import annotations

import json
from dataclasses import dataclass


def first_line(exc: BaseException) -> str:
    """The first line of an error: some clients put a multi-line debug dump in their messages."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def printable(value: object) -> str:
    """``value`` as text that is safe to put on a terminal: every control character (ANSI
    escapes, OSC titles, carriage returns, NUL...) shown as its ``\\xNN`` / ``\\uNNNN`` escape,
    so a value read from a shared tier can never move the cursor, clear the screen or retitle
    the window. Rich markup is not interpreted by callers that wrap this in ``rich.text.Text``."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


@dataclass(frozen=True, slots=True)
class Sheet:
    """A table of plain values for scripts: column names (the JSON field names) and rows of
    ints, floats, strings, booleans or None, in column order. The ``kvtier`` commands write it
    tab-separated (:mod:`kvtier.cli.output` holds the escaping rule)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...] = ()

    def __post_init__(self) -> None:
        for index, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"sheet row {index} has {len(row)} values for "
                                 f"{len(self.columns)} columns {self.columns}")


def json_document(document: object) -> str:
    """``document`` as every kvtier JSON output is written: indented, unknown types as text."""
    return json.dumps(document, indent=2, default=str) + "\n"
