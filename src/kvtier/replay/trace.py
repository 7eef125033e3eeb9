"""Mooncake-format request traces: reading and validation.

This module owns no mutable state after :func:`read_trace` returns: a :class:`Trace` and its
:class:`TraceRequest` records are frozen and may be shared between threads.

Format (JSON Lines, one request per line, sorted by arrival)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is the arrival time in milliseconds, ``hash_ids`` lists one chained prefix-block hash
per ``block_tokens`` tokens of the prompt (the last block is usually partial). Extra fields are
ignored, so traces with more columns (session ids, types) read fine.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
BUILTIN_TRACES: dict[str, str] = {
    "conversation": "conversation_trace.jsonl.xz",
    "synthetic": "synthetic_trace.jsonl.xz",
}
"""Bundled Mooncake FAST'25 traces (Apache-2.0, see ``kvtier/data/NOTICE.md``)."""

DEFAULT_BLOCK_TOKENS = 512
_MAX_REASONS_KEPT = 20
_REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(ValueError):
    """A trace line is malformed; the message names the source, line number and field."""

    def __init__(self, source: str, line: int | None, field: str | None, problem: str) -> None:
        self.source = source
        self.line = line
        self.field = field
        self.problem = problem
        where = source if line is None else f"{source}, line {line}"
        what = problem if field is None else f"field {field!r}: {problem}"
        super().__init__(f"{where}: {what}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``line`` is its 1-based line number in the source."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def tokens_in_blocks(self, start: int, stop: int, block_tokens: int) -> int:
        """Tokens held by blocks [start, stop) (only the last block may be partial)."""
        if stop <= start:
            return 0
        return min(stop * block_tokens, self.input_length) - start * block_tokens

    def block_token_counts(self, block_tokens: int) -> list[int]:
        """Tokens held by each block: ``block_tokens`` each, fewer in a partial last block."""
        blocks = len(self.hash_ids)
        counts = [block_tokens] * blocks
        counts[-1] = self.input_length - block_tokens * (blocks - 1)
        return counts


@dataclass(frozen=True, slots=True)
class Trace:
    """A validated trace. ``complete`` is False when ``max_requests`` cut it short."""

    source: str
    sha256: str
    block_tokens: int
    requests: tuple[TraceRequest, ...]
    skipped_lines: int
    skip_reasons: tuple[str, ...]
    complete: bool

    @property
    def total_blocks(self) -> int:
        return sum(len(request.hash_ids) for request in self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(request.input_length for request in self.requests)

    @property
    def name(self) -> str:
        if self.source.startswith(BUILTIN_PREFIX):
            return self.source
        return Path(self.source).name


def _read_source_bytes(source: str) -> bytes:
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX):]
        filename = BUILTIN_TRACES.get(name)
        if filename is None:
            raise TraceFormatError(
                source, None, None,
                f"unknown built-in trace {name!r}; expected one of "
                + ", ".join(BUILTIN_PREFIX + known for known in sorted(BUILTIN_TRACES)),
            )
        return lzma.decompress(resources.files("kvtier").joinpath("data", filename).read_bytes())
    path = Path(source)
    if not path.exists():
        raise TraceFormatError(source, None, None, "no such file")
    if not path.is_file():
        raise TraceFormatError(source, None, None, "not a regular file")
    raw = path.read_bytes()
    try:
        if path.suffix == ".xz":
            return lzma.decompress(raw)
        if path.suffix == ".gz":
            return gzip.decompress(raw)
    except (lzma.LZMAError, OSError, EOFError) as exc:
        raise TraceFormatError(source, None, None, f"could not decompress: {exc}") from exc
    return raw


def _is_int(value: object) -> bool:
    return type(value) is int


def _parse_line(text: str, line: int, source: str, block_tokens: int) -> TraceRequest:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(source, line, None, f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TraceFormatError(
            source, line, None, f"expected a JSON object, got {type(record).__name__}"
        )
    for name in _REQUIRED_FIELDS:
        if name not in record:
            raise TraceFormatError(source, line, name, "missing")
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
        raise TraceFormatError(
            source, line, "timestamp", f"expected a number of milliseconds, got {timestamp!r}"
        )
    if not math.isfinite(timestamp) or timestamp < 0:
        raise TraceFormatError(
            source, line, "timestamp", f"expected a finite number >= 0, got {timestamp!r}"
        )
    input_length = record["input_length"]
    if not _is_int(input_length) or input_length < 1:
        raise TraceFormatError(
            source, line, "input_length", f"expected an integer >= 1, got {input_length!r}"
        )
    output_length = record["output_length"]
    if not _is_int(output_length) or output_length < 0:
        raise TraceFormatError(
            source, line, "output_length", f"expected an integer >= 0, got {output_length!r}"
        )
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not hash_ids:
        raise TraceFormatError(
            source, line, "hash_ids", f"expected a non-empty list of integers, got {hash_ids!r}"
        )
    if not all(type(block_id) is int and block_id >= 0 for block_id in hash_ids):
        bad = next(b for b in hash_ids if not (type(b) is int and b >= 0))
        raise TraceFormatError(
            source, line, "hash_ids", f"expected integers >= 0, found {bad!r}"
        )
    expected_blocks = -(-input_length // block_tokens)
    if len(hash_ids) != expected_blocks:
        raise TraceFormatError(
            source, line, "hash_ids",
            f"has {len(hash_ids)} ids but input_length {input_length} needs "
            f"ceil({input_length}/{block_tokens}) = {expected_blocks} blocks "
            f"(is --trace-block-tokens {block_tokens} right?)",
        )
    if len(set(hash_ids)) != len(hash_ids):
        raise TraceFormatError(
            source, line, "hash_ids",
            "repeats an id; chained prefix hashes are distinct within a request",
        )
    return TraceRequest(
        line=line,
        timestamp_ms=timestamp,
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(hash_ids),
    )


def _lines(data: bytes, source: str) -> Iterator[tuple[int, str]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TraceFormatError(source, line, None, "not valid UTF-8") from None
    for number, line_text in enumerate(text.split("\n"), start=1):
        if line_text.strip():
            yield number, line_text


def read_trace(
    source: str | Path,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    skip_bad_lines: bool = False,
    max_requests: int | None = None,
) -> Trace:
    """Read and validate a Mooncake JSONL trace (plain, ``.gz`` or ``.xz``, or ``builtin:NAME``).

    A malformed line raises :class:`TraceFormatError` naming its line and field, or with
    ``skip_bad_lines`` is skipped and counted in ``Trace.skipped_lines``. Requests must be sorted
    by ``timestamp`` (ties keep file order); a line that goes back in time is malformed.
    """
    source_name = str(source)
    if not _is_int(block_tokens) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 1):
        raise ValueError(f"max_requests must be an integer >= 1 or None, got {max_requests!r}")
    data = _read_source_bytes(source_name)
    digest = hashlib.sha256(data).hexdigest()
    requests: list[TraceRequest] = []
    skipped = 0
    reasons: list[str] = []
    last_timestamp = 0.0
    last_line = 0
    complete = True
    for number, text in _lines(data, source_name):
        if max_requests is not None and len(requests) >= max_requests:
            complete = False
            break
        try:
            request = _parse_line(text, number, source_name, block_tokens)
            if request.timestamp_ms < last_timestamp:
                raise TraceFormatError(
                    source_name, number, "timestamp",
                    f"{request.timestamp_ms!r} is earlier than {last_timestamp!r} on line "
                    f"{last_line}; requests must be sorted by arrival time",
                )
        except TraceFormatError as exc:
            if not skip_bad_lines:
                raise
            skipped += 1
            if len(reasons) < _MAX_REASONS_KEPT:
                reasons.append(str(exc))
            continue
        last_timestamp = request.timestamp_ms
        last_line = number
        requests.append(request)
    if not requests:
        problem = "contains no requests"
        if skipped:
            problem += f" ({skipped} bad line(s) skipped; first: {reasons[0]})"
        raise TraceFormatError(source_name, None, None, problem)
    return Trace(
        source=source_name,
        sha256=digest,
        block_tokens=block_tokens,
        requests=tuple(requests),
        skipped_lines=skipped,
        skip_reasons=tuple(reasons),
        complete=complete and skipped == 0,
    )
