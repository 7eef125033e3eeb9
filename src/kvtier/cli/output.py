"""How every ``kvtier`` command prints what it found: ``--format table|plain|json``.

- ``table`` (the default): rich tables for people, as wide as the terminal (``COLUMNS``, else
  the terminal of a standard stream, else 80 columns). When stdout is not a terminal, the
  trailing spaces rich pads titles, captions and cells with are removed from every line, so a
  pipe or a log gets no padding.
- ``plain``: tab-separated, for ``cut``, ``awk`` and ``csv``: each table is one header line (the
  JSON field names) and one line per row, tables separated by one empty line; no padding, no box
  characters, numbers in full (no thousands separators, no units), an unknown value empty. A
  backslash, tab, newline or any other control character in a value is written as its escape
  (``\\\\``, ``\\t``, ``\\n``, ``\\x1b``): a value read from a shared tier can never break a row
  or reach the terminal raw.
- ``json``: one JSON document on stdout.

In every format errors go to stderr with the exit code; with ``plain`` and ``json`` the messages
meant for people (progress, "removed N blocks") go to stderr too, so stdout is only the data.

State: an :class:`Output` is built by a command for its run and used on the command's thread
only; :class:`_TrimmedLines` buffers the last unfinished line of the stream it wraps, for the
console that owns it.
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any, TextIO, cast

from kvtier.text import Sheet, json_document, printable

__all__ = ["Output", "OutputFormat", "add_format_option", "console", "plain_cell",
           "plain_text"]


class OutputFormat(enum.Enum):
    TABLE = "table"
    PLAIN = "plain"
    JSON = "json"


FORMAT_HELP = ("table: for people (the default); plain: tab-separated, one header line per "
               "table, for scripts; json: one JSON document on stdout")


def add_format_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--format table|plain|json`` (every command has it; ``dest`` is ``format``)."""
    parser.add_argument("--format", choices=[choice.value for choice in OutputFormat],
                        default=OutputFormat.TABLE.value, help=FORMAT_HELP)


def add_json_alias(parser: argparse.ArgumentParser) -> None:
    """Add ``--json``: the same as ``--format json`` (kept for scripts written before it)."""
    parser.add_argument("--json", dest="format", action="store_const",
                        const=OutputFormat.JSON.value, help="the same as --format json")


class _TrimmedLines:
    """A text stream that writes to ``stream`` every complete line without trailing spaces."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._pending = ""

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self._stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        # An unfinished line is kept as written: what follows may continue it.
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._stream.fileno()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream is not a terminal
        return False


def console(stream: TextIO | None = None) -> Any:
    """A rich console on ``stream`` (default stdout) by the rule of the module docstring."""
    from rich.console import Console

    target = sys.stdout if stream is None else stream
    if _is_terminal(target):
        return Console(file=target)
    return Console(file=cast(IO[str], _TrimmedLines(target)))


def plain_cell(value: object) -> str:
    """One value of a ``plain`` table: escaped so that it stays one field on one line."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return printable(str(value).replace("\\", "\\\\"))


def plain_text(sheets: Sequence[Sheet]) -> str:
    """``sheets`` tab-separated: a header line and the rows of each, an empty line between."""
    return "\n".join(
        "".join("\t".join(plain_cell(value) for value in line) + "\n"
                for line in (sheet.columns, *sheet.rows))
        for sheet in sheets
    )


@dataclass(slots=True)
class Output:
    """Where one command run prints: ``console`` for its tables (stdout), ``notes`` for messages
    meant for people and progress (stdout with ``table``, stderr otherwise)."""

    format: OutputFormat
    console: Any
    notes: Any

    @classmethod
    def for_args(cls, args: argparse.Namespace) -> Output:
        chosen = OutputFormat(getattr(args, "format", None) or OutputFormat.TABLE.value)
        tables = console()
        return cls(chosen, tables, tables if chosen is OutputFormat.TABLE else console(sys.stderr))

    @property
    def for_people(self) -> bool:
        return self.format is OutputFormat.TABLE

    def note(self, text: str) -> None:
        """A message for people, never parsed as markup."""
        self.notes.print(text, soft_wrap=True, markup=False, highlight=False)

    def emit(self, *, tables: Callable[[], Iterable[Any]], sheets: Callable[[], Sequence[Sheet]],
             document: Callable[[], object]) -> None:
        """Print the command's result in the chosen format (only that one is built). Of
        ``tables``, a ``str`` is a line for people, printed as written (never wrapped, never
        parsed as markup); anything else is a rich renderable (a table, a paragraph)."""
        if self.format is OutputFormat.JSON:
            sys.stdout.write(json_document(document()))
            sys.stdout.flush()
        elif self.format is OutputFormat.PLAIN:
            sys.stdout.write(plain_text(sheets()))
            sys.stdout.flush()
        else:
            for renderable in tables():
                self.console.print(renderable, soft_wrap=isinstance(renderable, str),
                                   markup=False, highlight=False)
