"""The one entry point that reads a trace from any source: Mooncake JSONL, a per-session JSON
document or directory, or a built-in (stored or generated). Stateless.

It sits above the format readers (trace, sessions, agentic) so that none of them imports it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

from kvtier.replay.agentic import DEFAULT_SESSIONS, MAX_GENERATED_SESSIONS, generate_trace
from kvtier.replay.sessions import read_session_dir, session_document, sessions_to_trace
from kvtier.replay.source import TraceStream, open_source
from kvtier.replay.trace import (
    BUILTIN_GENERATED,
    BUILTIN_PREFIX,
    DEFAULT_BLOCK_TOKENS,
    HashConvention,
    Trace,
    TraceFormatError,
    _is_int,
    read_jsonl,
)

__all__ = ["read_trace"]


def read_trace(
    source: str | Path,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    skip_bad_lines: bool = False,
    max_requests: int | None = None,
    hash_convention: HashConvention | str = HashConvention.AUTO,
    seed: int = 0,
    sessions: int | None = None,
) -> Trace:
    """Read and validate a trace: Mooncake JSONL (plain, ``.gz`` or ``.xz``, or
    ``builtin:NAME``), a per-session JSON document, a directory of them, or ``builtin:agentic``
    (generated with ``seed`` and ``sessions``, default
    :data:`~kvtier.replay.agentic.DEFAULT_SESSIONS`; ``seed`` also orders the sessions of a
    directory; ``sessions`` applies to ``builtin:agentic`` only).

    A malformed line raises :class:`TraceFormatError` naming its line and field, or with
    ``skip_bad_lines`` is skipped and counted in ``Trace.skipped_lines``. Requests must be sorted
    by ``timestamp`` (ties keep file order); a line that goes back in time is malformed.
    """
    source_name = str(source)
    if not _is_int(block_tokens) or block_tokens < 1:
        raise ValueError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 1):
        raise ValueError(f"max_requests must be an integer >= 1 or None, got {max_requests!r}")
    try:
        convention = HashConvention(hash_convention)
    except ValueError:
        raise ValueError(
            f"hash_convention must be one of {[c.value for c in HashConvention]}, "
            f"got {hash_convention!r}"
        ) from None
    generated = source_name.startswith(BUILTIN_PREFIX) and source_name[
        len(BUILTIN_PREFIX):] in BUILTIN_GENERATED
    if sessions is not None:
        if not _is_int(sessions) or not 1 <= sessions <= MAX_GENERATED_SESSIONS:
            raise ValueError(f"sessions must be an integer from 1 to "
                             f"{MAX_GENERATED_SESSIONS:,}, got {sessions!r}")
        if not generated:
            raise ValueError(f"sessions applies to builtin:agentic only (a generated trace), "
                             f"not to {source_name!r}, whose sessions are its own")
    if generated:
        return _cut(generate_trace(seed=seed, sessions=sessions or DEFAULT_SESSIONS),
                    max_requests)
    if not source_name.startswith(BUILTIN_PREFIX) and Path(source_name).is_dir():
        return _cut(read_session_dir(Path(source_name), convention, seed), max_requests)
    with open_source(source_name) as stream:
        head = stream.head()
        if head is None or not _may_be_a_document(head):
            return read_jsonl(stream, source_name, block_tokens, skip_bad_lines, max_requests,
                              convention)
        data = stream.document()
    # A JSON document (parsed whole, as JSON must be), or JSON Lines after all.
    document = session_document(data, source_name)
    if document is not None:
        trace = sessions_to_trace([(source_name, document)], convention, seed, stream.sha256,
                                  source_name)
        return _cut(trace, max_requests)
    lines = _Lines(data, stream.sha256, source_name)
    return read_jsonl(lines, source_name, block_tokens, skip_bad_lines, max_requests, convention)


def _may_be_a_document(head: bytes) -> bool:
    """Whether a trace whose first line is ``head`` may be one per-session JSON document: it
    starts with ``{`` and is not a whole JSONL record on its own (a one-line document is one
    with a ``requests`` field)."""
    if head.lstrip()[:1] != b"{":
        return False
    try:
        record = json.loads(head)
    except (ValueError, RecursionError):
        return True  # the first line of a document written over several lines
    return not isinstance(record, dict) or "requests" in record


class _Lines:
    """The lines of a trace already read whole (a document that turned out to be JSONL)."""

    def __init__(self, data: bytes, sha256: str, source: str) -> None:
        self.sha256 = sha256
        self._stream = TraceStream(io.BytesIO(data), source)

    def lines(self) -> Iterator[tuple[int, str | TraceFormatError]]:
        return self._stream.lines()

    def drain(self) -> bool:
        return self._stream.drain()


def _cut(trace: Trace, max_requests: int | None) -> Trace:
    """The first ``max_requests`` requests of ``trace`` (their dependencies come earlier)."""
    if max_requests is None or len(trace.requests) <= max_requests:
        return trace
    requests = trace.requests[:max_requests]
    sessions = len({r.session for r in requests if r.session is not None})
    return Trace(trace.source, trace.sha256, trace.block_tokens, requests, trace.skipped_lines,
                 trace.skip_reasons, False, trace.hash_convention, sessions)
