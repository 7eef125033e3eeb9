"""Reading a trace source in bounded pieces: decompressed as it is read, never whole.

A ``.jsonl.gz`` of a gigabyte of zeros is a few megabytes on disk; read whole, it took 3.2 GB
of memory before the first line was looked at. :func:`open_source` gives a
:class:`TraceStream` instead: gzip and xz are decompressed incrementally, a line is at most
:data:`MAX_LINE_BYTES` (longer: a :class:`~kvtier.replay.trace.TraceFormatError` naming the
line and the bound, or with ``--skip-bad-lines`` a skipped line, read past in bounded pieces),
and a whole document (a per-session JSON file) at most :data:`MAX_DOCUMENT_BYTES`. Every byte
read is hashed, and :meth:`TraceStream.drain` hashes the rest of a trace cut short by
``max_requests`` in :data:`_CHUNK_BYTES` pieces, so the sha256 names the whole trace (a cut copy
of a published trace is still recognised) while memory stays bounded.

State: a :class:`TraceStream` belongs to the one thread reading it (the command's).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import lzma
import zlib
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Protocol

from kvtier.replay.trace import (
    BUILTIN_GENERATED,
    BUILTIN_PREFIX,
    BUILTIN_TRACES,
    TraceFormatError,
)

__all__ = ["MAX_DOCUMENT_BYTES", "MAX_LINE_BYTES", "TraceStream", "open_source",
           "read_source_bytes"]

MAX_LINE_BYTES = 32 << 20
"""The longest trace line: a prompt of 2**24 tokens (the most a trace may hold) in 16-token
blocks has 2**20 hash ids, 23 MB written as 20-digit numbers."""
MAX_DOCUMENT_BYTES = 512 << 20
"""The largest per-session JSON document (parsed whole, as JSON must be)."""
_CHUNK_BYTES = 1 << 20
_DECOMPRESS_ERRORS = (lzma.LZMAError, zlib.error, EOFError, OSError)


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...

    def readline(self, size: int | None = -1, /) -> bytes: ...


class TraceStream:
    """The decompressed bytes of one trace source, read in bounded pieces and hashed."""

    def __init__(self, stream: _Readable, source: str) -> None:
        self._stream = stream
        self.source = source
        self._digest = hashlib.sha256()
        self._head: tuple[int, bytes | None] | None = None
        self._line = 0
        self._in_long_line = False

    @property
    def sha256(self) -> str:
        """The sha256 of every byte read so far (all of them after :meth:`drain`)."""
        return self._digest.hexdigest()

    def _read(self, reader: Callable[[int], bytes], size: int) -> bytes:
        try:
            data = reader(size)
        except _DECOMPRESS_ERRORS as exc:
            raise TraceFormatError(self.source, None, None,
                                   f"could not decompress: {exc}") from exc
        self._digest.update(data)
        return data

    def _next_line(self) -> tuple[int, bytes | None] | None:
        """(number, the line without its newline, or None when it is over-long), or None at
        the end. The rest of an over-long line is read past, in bounded pieces, when the next
        line is asked for."""
        while self._in_long_line:  # only when asked for the next line: a skip
            rest = self._read(self._stream.readline, _CHUNK_BYTES)
            self._in_long_line = bool(rest) and not rest.endswith(b"\n")
        data = self._read(self._stream.readline, MAX_LINE_BYTES + 1)
        if not data:
            return None
        self._line += 1
        if data.endswith(b"\n") or len(data) <= MAX_LINE_BYTES:
            return self._line, data.rstrip(b"\n")
        self._in_long_line = True
        return self._line, None

    def head(self) -> bytes | None:
        """The first non-blank line (b"" when there is none, None when it is over-long);
        :meth:`lines` starts with it."""
        while (item := self._next_line()) is not None:
            if item[1] is None or item[1].strip():
                self._head = item
                return item[1]
        return b""

    def lines(self) -> Iterator[tuple[int, str | TraceFormatError]]:
        """(number, text) of every non-blank line; an over-long or undecodable line comes as
        the error it is (the caller raises it or skips it)."""
        if self._head is not None:
            number, data = self._head
            self._head = None
            yield number, self._text(number, data)
        while (item := self._next_line()) is not None:
            number, data = item
            if data is None or data.strip():
                yield number, self._text(number, data)

    def _text(self, number: int, data: bytes | None) -> str | TraceFormatError:
        if data is None:
            return self._too_long(number)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return TraceFormatError(self.source, number, None, "not valid UTF-8")

    def _too_long(self, number: int) -> TraceFormatError:
        return TraceFormatError(self.source, number, None,
                                f"longer than {MAX_LINE_BYTES:,} bytes, the most a trace line "
                                f"may hold")

    def document(self) -> bytes:
        """The lines read so far and the rest, whole: at most :data:`MAX_DOCUMENT_BYTES`."""
        parts: list[bytes] = []
        if self._head is not None:
            number, data = self._head
            if data is None:
                raise self._too_long(number)
            # Blank lines before the head keep their numbers; their spaces do not matter.
            parts.append(b"\n" * (number - 1) + data + b"\n")
            self._head = None
        size = sum(map(len, parts))
        while chunk := self._read(self._stream.read, _CHUNK_BYTES):
            size += len(chunk)
            if size > MAX_DOCUMENT_BYTES:
                raise TraceFormatError(self.source, None, None,
                                       f"larger than {MAX_DOCUMENT_BYTES:,} bytes, the most a "
                                       f"JSON trace document may hold")
            parts.append(chunk)
        return b"".join(parts)

    def drain(self) -> bool:
        """Hash the rest without keeping it; whether it held anything but blank space."""
        more = False
        while chunk := self._read(self._stream.read, _CHUNK_BYTES):
            more = more or bool(chunk.strip())
        return more


@contextlib.contextmanager
def open_source(source: str) -> Iterator[TraceStream]:
    """The decompressed bytes of a trace file (``.gz``, ``.xz`` or plain) or of a bundled
    ``builtin:NAME`` trace, as a :class:`TraceStream`."""
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX):]
        filename = BUILTIN_TRACES.get(name)
        if filename is None:
            raise TraceFormatError(
                source, None, None,
                f"unknown built-in trace {name!r}; expected one of "
                + ", ".join(BUILTIN_PREFIX + known
                            for known in sorted((*BUILTIN_TRACES, *BUILTIN_GENERATED))),
            )
        data = resources.files("kvtier").joinpath("data", filename).read_bytes()
        with lzma.LZMAFile(io.BytesIO(data)) as stream:
            yield TraceStream(stream, source)
        return
    path = Path(source)
    if not path.exists():
        raise TraceFormatError(source, None, None, "no such file")
    if not path.is_file():
        raise TraceFormatError(source, None, None, "not a regular file")
    with path.open("rb") as raw:
        if path.suffix == ".xz":
            with lzma.LZMAFile(raw) as stream:
                yield TraceStream(stream, source)
        elif path.suffix == ".gz":
            with gzip.GzipFile(fileobj=raw) as zipped:
                yield TraceStream(zipped, source)
        else:
            yield TraceStream(raw, source)


def read_source_bytes(source: str) -> bytes:
    """The decompressed bytes of a trace document, whole (at most :data:`MAX_DOCUMENT_BYTES`)."""
    with open_source(source) as stream:
        return stream.document()
