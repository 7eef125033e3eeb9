"""Small text helpers for messages. Owns no state."""

from __future__ import annotations


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
