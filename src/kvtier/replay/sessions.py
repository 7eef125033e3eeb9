"""Per-session JSON traces (agentic coding sessions) and directories of them.

Pure functions; this module owns no state beyond the locals of one call.

One JSON document per session::

    {"block_size": 64, "hash_id_scope": "local",
     "requests": [
        {"t": 0.0, "in": 41000, "out": 800, "hash_ids": [0, 1, ...]},
        {"type": "subagent", "t": 12.5, "requests": [{"t": 0.0, "in": ..., ...}, ...]},
        ...]}

``t`` is seconds since the session start (inside a sub-agent: since the sub-agent's start, its
entry's ``t``); ``hash_ids`` has one id per *full* block of ``block_size`` tokens (the ``floor``
convention; ``ceil`` is accepted under ``--hash-convention auto``). ``hash_id_scope`` ``"local"``
(the default) means ids are comparable only inside one document, sub-agents included;
``"global"`` keeps them as they are.

Causality: each request waits for the previous request of its thread (the session's main
thread, or one sub-agent's own thread); a sub-agent's first request waits for the parent request
before the sub-agent entry. ``gap_ms`` is the recorded time between the two arrivals.

Merging several sessions (``kvtier replay DIR/``): the documents are taken in file-name order,
shuffled with ``random.Random(seed)``, and the i-th one starts at ``i * SESSION_STAGGER_S``
seconds; every session gets its own id space (local ids are renumbered densely, session by
session), so no block is shared between sessions. Requests are merged by start time (ties: the
session order, then document order).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.replay.trace import (
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_TIMESTAMP_MS,
    HashConvention,
    Trace,
    TraceFormatError,
    TraceRequest,
    check_convention,
    check_count,
    check_hash_ids,
    check_time_ms,
    convention_label,
)

SESSION_STAGGER_S = 10.0
"""Start offset between consecutive sessions of a merged directory."""

MAX_SUBAGENT_DEPTH = 8
_SESSION_SUFFIXES = (".json", ".json.gz", ".json.xz")


@dataclass(frozen=True, slots=True)
class _Turn:
    t_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    after: int | None  # local index of the turn this one waits for


def session_document(data: bytes, source: str) -> dict[str, object] | None:
    """The per-session document in ``data``, or None when ``data`` is JSON Lines."""
    try:
        document = json.loads(data)
    except json.JSONDecodeError as exc:
        if exc.msg.startswith("Extra data"):
            return None  # several documents: JSON Lines
        return None  # a broken first line: the JSONL reader names it
    except RecursionError:
        raise TraceFormatError(source, None, None, "JSON nested too deeply") from None
    except UnicodeDecodeError:
        return None
    if isinstance(document, dict) and "requests" in document:
        return document
    return None


def _session_turns(document: dict[str, object], source: str,
                   convention: HashConvention) -> tuple[int, bool, list[_Turn],
                                                        dict[HashConvention | None, int]]:
    """(block_size, ids are local, turns in document order, conventions found)."""
    block_size = check_count(source, None, "block_size", document.get("block_size"), 1,
                             1 << 20, "tokens")
    scope = document.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise TraceFormatError(source, None, "hash_id_scope",
                               f"expected 'local' or 'global', got {scope!r}"[:200])
    turns: list[_Turn] = []
    found: dict[HashConvention | None, int] = {}
    # An explicit stack (no recursion): (entries, base ms, path, depth, thread's last turn).
    stack: list[tuple[Iterator[tuple[int, object]], float, str, int, list[int | None]]] = []
    top = document["requests"]
    if not isinstance(top, list):
        raise TraceFormatError(source, None, "requests", "expected a list")
    stack.append((enumerate(top), 0.0, "requests", 0, [None]))
    while stack:
        entries, base_ms, path, depth, last = stack[-1]
        item = next(entries, None)
        if item is None:
            stack.pop()
            continue
        position, entry = item
        where = f"{path}[{position}]"
        if not isinstance(entry, dict):
            raise TraceFormatError(source, None, where, "expected a JSON object")
        t_ms = base_ms + check_time_ms(source, None, f"{where}.t", entry.get("t"), 1000.0)
        if t_ms > MAX_TIMESTAMP_MS:
            raise TraceFormatError(source, None, f"{where}.t",
                                   "more than 366 days after the session start")
        if entry.get("type") == "subagent":
            inner = entry.get("requests")
            if not isinstance(inner, list):
                raise TraceFormatError(source, None, f"{where}.requests", "expected a list")
            if depth + 1 > MAX_SUBAGENT_DEPTH:
                raise TraceFormatError(source, None, where,
                                       f"sub-agents nested deeper than {MAX_SUBAGENT_DEPTH}")
            stack.append((enumerate(inner), t_ms, f"{where}.requests", depth + 1, [last[0]]))
            continue
        input_length = check_count(source, None, f"{where}.in", entry.get("in"), 1,
                                   MAX_INPUT_TOKENS, "tokens")
        output_length = check_count(source, None, f"{where}.out", entry.get("out", 0), 0,
                                    MAX_OUTPUT_TOKENS, "tokens")
        hash_ids = check_hash_ids(source, None, f"{where}.hash_ids", entry.get("hash_ids"))
        kind = check_convention(source, None, f"{where}.hash_ids", len(hash_ids), input_length,
                                block_size, convention)
        found[kind] = found.get(kind, 0) + 1
        after = last[0]
        if after is not None and t_ms < turns[after].t_ms:
            raise TraceFormatError(
                source, None, f"{where}.t",
                f"starts at {t_ms / 1000:.3f} s, before the turn it follows "
                f"({turns[after].t_ms / 1000:.3f} s)",
            )
        last[0] = len(turns)
        turns.append(_Turn(t_ms, input_length, output_length, hash_ids, after))
    return block_size, scope == "local", turns, found


def sessions_to_trace(documents: Sequence[tuple[str, dict[str, object]]],
                      convention: HashConvention, seed: int, digest: str,
                      source: str) -> Trace:
    """Merge session documents (name, document) into one trace (see the module docstring)."""
    order = sorted(documents, key=lambda named: named[0])
    random.Random(seed).shuffle(order)
    block_size: int | None = None
    found: dict[HashConvention | None, int] = {}
    # (start ms, session, local index, turn, global ids)
    merged: list[tuple[float, int, int, _Turn, tuple[int, ...]]] = []
    next_id = 0
    for number, (name, document) in enumerate(order):
        size, local, turns, kinds = _session_turns(document, name, convention)
        if block_size is None:
            block_size = size
        elif size != block_size:
            raise TraceFormatError(name, None, "block_size",
                                   f"{size} differs from {block_size} in the other sessions")
        for kind, count in kinds.items():
            found[kind] = found.get(kind, 0) + count
        offset_ms = number * SESSION_STAGGER_S * 1000.0
        renumbered: dict[int, int] = {}
        for index, turn in enumerate(turns):
            if local:
                ids = []
                for block_id in turn.hash_ids:
                    mapped = renumbered.get(block_id)
                    if mapped is None:
                        mapped = renumbered[block_id] = next_id
                        next_id += 1
                    ids.append(mapped)
                global_ids = tuple(ids)
            else:
                global_ids = tuple(turn.hash_ids)
            start = offset_ms + turn.t_ms
            if start > MAX_TIMESTAMP_MS:
                raise TraceFormatError(name, None, "t", "the merged stream spans over 366 days")
            merged.append((start, number, index, turn, global_ids))
    if not merged or block_size is None:
        raise TraceFormatError(source, None, None, "contains no requests")
    merged.sort(key=lambda item: (item[0], item[1], item[2]))
    position: dict[tuple[int, int], int] = {(s, i): p for p, (_, s, i, _, _) in
                                            enumerate(merged)}
    requests: list[TraceRequest] = []
    for place, (start, session, _index, turn, block_ids) in enumerate(merged):
        after = None if turn.after is None else position[(session, turn.after)]
        gap = 0.0 if after is None else start - requests[after].timestamp_ms
        requests.append(TraceRequest(place + 1, start, turn.input_length, turn.output_length,
                                     block_ids, session, after, gap))
    return Trace(source, digest, block_size, tuple(requests), 0, (), True,
                 convention_label(found), len(order))


def read_session_dir(path: Path, convention: HashConvention, seed: int) -> Trace:
    """Every ``*.json`` (``.json.gz``, ``.json.xz``) session document in ``path``, merged."""
    from kvtier.replay.source import read_source_bytes

    files = sorted(p for p in path.iterdir()
                   if p.is_file() and p.name.endswith(_SESSION_SUFFIXES))
    if not files:
        raise TraceFormatError(str(path), None, None,
                               "is a directory without session files (*.json, *.json.gz, "
                               "*.json.xz)")
    digest = hashlib.sha256()
    documents: list[tuple[str, dict[str, object]]] = []
    for file in files:
        data = read_source_bytes(str(file))
        digest.update(hashlib.sha256(data).digest())
        document = session_document(data, str(file))
        if document is None:
            raise TraceFormatError(str(file), None, None,
                                   "expected one JSON object with a 'requests' list")
        documents.append((str(file), document))
    return sessions_to_trace(documents, convention, seed, digest.hexdigest(), str(path))
