"""The trace readers: Mooncake JSONL (both hash conventions), per-session JSON documents and
directories, builtin:agentic; validation messages, --skip-bad-lines, compression."""

from __future__ import annotations

import gzip
import itertools
import json
import lzma
from pathlib import Path

import pytest

from kvtier.replay.reader import read_trace
from kvtier.replay.trace import TraceFormatError, TraceRequest

from ._traces import TraceWriter, full, record


def test_bundled_traces_are_the_published_files() -> None:
    conversation = read_trace("builtin:conversation")
    synthetic = read_trace("builtin:synthetic")
    assert (len(conversation.requests), conversation.total_blocks) == (12_031, 288_500)
    assert conversation.total_tokens == 144_793_823
    assert conversation.sha256.startswith("b8cbb061a85206d7")
    assert (len(synthetic.requests), synthetic.total_blocks) == (3_993, 121_877)
    assert synthetic.sha256.startswith("bd070915a98fc0ed")
    assert conversation.complete and synthetic.complete
    first = conversation.requests[0]
    assert (first.line, first.timestamp_ms, first.input_length, first.output_length) == (
        1, 0, 6758, 500)
    assert first.hash_ids == tuple(range(14))


def test_reads_records_and_block_tokens(write_trace: TraceWriter) -> None:
    path = write_trace([record(0, 1000, [7, 8]), "", record(5, 512, [7], output_length=0)])
    trace = read_trace(path)
    assert [r.line for r in trace.requests] == [1, 3]
    assert trace.requests[0].block_token_counts(512) == [512, 488]
    assert trace.requests[1].block_token_counts(512) == [512]
    first = trace.requests[0]  # 1000 tokens: a full block, then 488
    assert [first.tokens_in_blocks(0, 1, 512), first.tokens_in_blocks(1, 2, 512)] == [512, 488]
    assert first.tokens_in_blocks(0, 2, 512) == 1000
    assert first.tokens_in_blocks(1, 1, 512) == 0
    assert (trace.total_blocks, trace.total_tokens, trace.skipped_lines) == (3, 1512, 0)
    assert trace.name == path.name


def test_extra_fields_are_ignored(write_trace: TraceWriter) -> None:
    line = {**full([1]), "chat_id": 3, "type": "text"}
    assert read_trace(write_trace([line])).requests[0].hash_ids == (1,)


def test_other_block_sizes(write_trace: TraceWriter) -> None:
    path = write_trace([record(0, 40, [1, 2, 3])])
    assert read_trace(path, block_tokens=16).total_blocks == 3
    with pytest.raises(TraceFormatError, match="--trace-block-tokens 512"):
        read_trace(path)


BAD_LINES = [
    ("{not json", None, "not valid JSON"),
    ("[1, 2]", None, "expected a JSON object, got list"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1}', "hash_ids", "missing"),
    ('{"input_length": 512, "output_length": 1, "hash_ids": [1]}', "timestamp", "missing"),
    ('{"timestamp": true, "input_length": 512, "output_length": 1, "hash_ids": [1]}',
     "timestamp", "expected a number"),
    ('{"timestamp": "0", "input_length": 512, "output_length": 1, "hash_ids": [1]}',
     "timestamp", "expected a number"),
    ('{"timestamp": -1, "input_length": 512, "output_length": 1, "hash_ids": [1]}',
     "timestamp", ">= 0"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}',
     "input_length", "in [1, 16,777,216], got 0"),
    ('{"timestamp": 0, "input_length": 51.2, "output_length": 1, "hash_ids": [1]}',
     "input_length", "got 51.2"),
    ('{"timestamp": 0, "input_length": 512, "output_length": -3, "hash_ids": [1]}',
     "output_length", "got -3"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": []}',
     "hash_ids", "has 0 ids but input_length 512 needs 512/512 = 1 blocks"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": "1"}',
     "hash_ids", "expected a list of integers"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1.5]}',
     "hash_ids", "found 1.5"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [-4]}',
     "hash_ids", "found -4"),
    ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1]}',
     "hash_ids", "has 1 ids but input_length 1024 needs 1024/512 = 2 blocks"),
    ('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1]}',
     "hash_ids", "needs ceil(1100/512) = 3 blocks (partial last block hashed) or "
     "floor(1100/512) = 2 blocks (only full blocks hashed)"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 100000000000000000000, '
     '"hash_ids": [1]}', "output_length", "in [0, 1,048,576], got 100000000000000000000"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1e20, "hash_ids": [1]}',
     "output_length", "got 1e+20"),
    ('{"timestamp": 946080000000, "input_length": 512, "output_length": 1, "hash_ids": [1]}',
     "timestamp", "366 days from the trace start"),
    ('{"timestamp": 0, "input_length": 512, "output_length": 1, '
     '"hash_ids": [18446744073709551616]}', "hash_ids", "[0, 2**64), found 18446744073709551616"),
    ('{"timestamp": 0, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", None, "nested too deeply"),
    ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [3, 3]}',
     "hash_ids", "repeats an id"),
]


@pytest.mark.parametrize(("bad", "field", "problem"), BAD_LINES)
def test_bad_line_names_line_and_field(write_trace: TraceWriter, bad: str, field: str | None,
                                       problem: str) -> None:
    path = write_trace([full([1]), full([1, 2]), bad, full([1, 2, 3])])
    with pytest.raises(TraceFormatError) as caught:
        read_trace(path)
    error = caught.value
    assert (error.line, error.field) == (3, field)
    assert problem in str(error)
    assert f"{path}, line 3" in str(error)
    if field is not None:
        assert f"field {field!r}" in str(error)


def test_timestamps_must_not_go_back(write_trace: TraceWriter) -> None:
    path = write_trace([full([1], timestamp=10), full([1], timestamp=10), full([2], timestamp=9)])
    with pytest.raises(TraceFormatError, match="line 3: field 'timestamp': 9 is earlier than "
                                               "10 on line 2"):
        read_trace(path)


def test_skip_bad_lines_counts_and_keeps_the_rest(write_trace: TraceWriter) -> None:
    path = write_trace([full([1]), "{oops", full([1, 2]), '{"timestamp": 0}', full([1, 2, 3])])
    trace = read_trace(path, skip_bad_lines=True)
    assert [r.line for r in trace.requests] == [1, 3, 5]
    assert trace.skipped_lines == 2
    assert "line 2" in trace.skip_reasons[0] and "line 4" in trace.skip_reasons[1]
    assert not trace.complete


def test_a_trace_with_no_good_line_is_an_error(write_trace: TraceWriter, tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"contains no requests \(2 bad line"):
        read_trace(write_trace(["{", "[]"]), skip_bad_lines=True)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceFormatError, match="contains no requests"):
        read_trace(empty)


def test_max_requests_cuts_the_trace(write_trace: TraceWriter) -> None:
    path = write_trace([full([1]), full([1, 2]), full([1, 2, 3])])
    trace = read_trace(path, max_requests=2)
    assert len(trace.requests) == 2 and not trace.complete
    assert read_trace(path).sha256 == trace.sha256  # identifies the file, not the cut


def test_compressed_traces(tmp_path: Path, write_trace: TraceWriter) -> None:
    plain = write_trace([full([1]), full([1, 2])])
    data = plain.read_bytes()
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "t.jsonl.xz").write_bytes(lzma.compress(data))
    for name in ("t.jsonl.gz", "t.jsonl.xz"):
        trace = read_trace(tmp_path / name)
        assert trace.total_blocks == 3 and trace.sha256 == read_trace(plain).sha256
    (tmp_path / "broken.jsonl.xz").write_bytes(b"not xz at all")
    with pytest.raises(TraceFormatError, match="could not decompress"):
        read_trace(tmp_path / "broken.jsonl.xz")


def test_bad_sources_and_arguments(tmp_path: Path, write_trace: TraceWriter) -> None:
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceFormatError, match="is a directory without session files"):
        read_trace(tmp_path)
    with pytest.raises(TraceFormatError, match="unknown built-in trace 'nope'; expected one of "
                                               "builtin:agentic, builtin:conversation, "
                                               "builtin:synthetic"):
        read_trace("builtin:nope")
    latin = tmp_path / "latin.jsonl"
    # Streamed: lines are checked in order, so line 1 must be a good one.
    latin.write_bytes(json.dumps(full([1])).encode() + b'\n\xff\xfe\n')
    with pytest.raises(TraceFormatError, match="line 2: not valid UTF-8"):
        read_trace(latin)
    path = write_trace([full([1])])
    with pytest.raises(ValueError, match="block_tokens must be an integer >= 1, got 0"):
        read_trace(path, block_tokens=0)
    with pytest.raises(ValueError, match="max_requests must be an integer >= 1 or None"):
        read_trace(path, max_requests=0)


# ---- hash conventions -----------------------------------------------------------------------


def test_floor_and_ceil_conventions_are_detected_per_line(write_trace: TraceWriter) -> None:
    ceil_line = record(0, 1100, [1, 2, 3])    # ceil(1100/512) = 3: partial last block hashed
    floor_line = record(1, 1100, [1, 2])      # floor(1100/512) = 2: only full blocks
    whole = record(2, 1024, [1, 2])           # both conventions agree
    assert read_trace(write_trace([ceil_line, whole])).hash_convention == "ceil"
    floor_trace = read_trace(write_trace([floor_line, whole]))
    assert floor_trace.hash_convention == "floor"
    first = floor_trace.requests[0]
    assert first.tokens_in_blocks(0, 2, 512) == 1024  # the partial block's 76 tokens: uncached
    assert first.block_token_counts(512) == [512, 512]
    mixed = read_trace(write_trace([ceil_line, floor_line]))
    assert mixed.hash_convention == "mixed (1 lines ceil, 1 lines floor)"
    assert read_trace(write_trace([whole])).hash_convention == "whole blocks (ceil = floor)"
    short = read_trace(write_trace([record(0, 100, [])]))  # shorter than a block: no ids
    assert short.requests[0].hash_ids == () and short.hash_convention == "floor"


def test_a_chosen_convention_rejects_the_other_with_a_hint(write_trace: TraceWriter) -> None:
    path = write_trace([record(0, 1100, [1, 2])])
    assert read_trace(path, hash_convention="floor").total_blocks == 2
    with pytest.raises(TraceFormatError, match=r"needs ceil\(1100/512\) = 3 blocks \(partial "
                                               r"last block hashed\) \(the line follows the "
                                               r"other convention; try --hash-convention auto"):
        read_trace(path, hash_convention="ceil")
    with pytest.raises(ValueError, match="hash_convention must be one of"):
        read_trace(path, hash_convention="round")


def test_a_wrong_block_size_hint_points_at_the_right_size(write_trace: TraceWriter) -> None:
    path = write_trace([record(0, 64 * 1700 + 10, list(range(1700)))])  # 64-token blocks
    with pytest.raises(TraceFormatError, match=r"is --trace-block-tokens 512 right.* fit about "
                                               r"64 tokens per block"):
        read_trace(path)
    assert read_trace(path, block_tokens=64).total_blocks == 1700


def test_session_ids_on_jsonl_lines_link_each_thread(write_trace: TraceWriter) -> None:
    lines = [
        {**record(0, 512, [1]), "session_id": "a"},
        {**record(5, 512, [9]), "session_id": "b"},
        {**record(10, 1024, [1, 2]), "session_id": "a"},
        {**record(12, 1024, [1, 3]), "session_id": "a", "subagent": "s1"},
        {**record(20, 1536, [1, 3, 4]), "session_id": "a", "subagent": "s1"},
        {**record(30, 1536, [1, 2, 5]), "session_id": "a"},
    ]
    trace = read_trace(write_trace(lines))
    assert trace.sessions == 2 and trace.causal
    assert [(r.session, r.after) for r in trace.requests] == [
        (0, None), (1, None), (0, 0), (0, 2), (0, 3), (0, 2)]
    assert [r.gap_ms for r in trace.requests] == [0.0, 0.0, 10.0, 2.0, 8.0, 20.0]
    plain = read_trace(write_trace([record(0, 512, [1]), record(1, 512, [1])]))
    assert not plain.causal and plain.sessions == 0


# ---- per-session JSON -----------------------------------------------------------------------


def _session(requests: list[dict[str, object]], **extra: object) -> dict[str, object]:
    return {"block_size": 64, "hash_id_scope": "local", "requests": requests, **extra}


def _turn(t: float, hash_ids: list[int], extra_tokens: int = 10,
          out: int = 100) -> dict[str, object]:
    return {"t": t, "in": 64 * len(hash_ids) + extra_tokens, "out": out, "hash_ids": hash_ids}


def test_a_session_document_with_a_subagent(tmp_path: Path) -> None:
    document = _session([
        _turn(0.0, [7, 8]),
        _turn(4.0, [7, 8, 9]),
        {"type": "subagent", "t": 5.0, "requests": [_turn(0.0, [7, 20]), _turn(2.5, [7, 20, 21])]},
        _turn(9.0, [7, 8, 9, 10]),
    ])
    path = tmp_path / "one.json"
    path.write_text(json.dumps(document, indent=2))  # pretty-printed: not JSON Lines
    trace = read_trace(path)
    assert (trace.block_tokens, trace.hash_convention, trace.sessions) == (64, "floor", 1)
    times = [r.timestamp_ms for r in trace.requests]
    assert times == [0.0, 4000.0, 5000.0, 7500.0, 9000.0]
    # local ids renumbered densely; the sub-agent shares the parent's scope (7 is 0 everywhere)
    assert [r.hash_ids for r in trace.requests] == [
        (0, 1), (0, 1, 2), (0, 3), (0, 3, 4), (0, 1, 2, 5)]
    # each thread waits for its previous turn; the sub-agent starts from the parent's turn 2
    assert [r.after for r in trace.requests] == [None, 0, 1, 2, 1]
    assert [r.gap_ms for r in trace.requests] == [0.0, 4000.0, 1000.0, 2500.0, 5000.0]


def test_a_directory_of_sessions_merges_with_a_seeded_interleaving(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.json").write_text(json.dumps(_session(
            [_turn(0.0, [1, 2]), _turn(3.0, [1, 2, 3])])))
    (tmp_path / "notes.txt").write_text("not a session")
    trace = read_trace(tmp_path)
    again = read_trace(tmp_path)
    assert trace == again  # seeded: the same every time
    assert trace.sessions == 3 and len(trace.requests) == 6
    starts = sorted({r.timestamp_ms for r in trace.requests if r.after is None})
    assert starts == [0.0, 10_000.0, 20_000.0]  # sessions start SESSION_STAGGER_S apart
    ids = [set(r.hash_ids) for r in trace.requests if r.after is None]
    assert not (ids[0] & ids[1] or ids[1] & ids[2] or ids[0] & ids[2])  # an id space each
    orders = {tuple(r.session for r in read_trace(tmp_path, seed=seed).requests)
              for seed in range(6)}
    assert len(orders) >= 1
    firsts = {read_trace(tmp_path, seed=seed).requests[0].hash_ids for seed in range(6)}
    assert firsts == {(0, 1)}  # renumbered in session order: the first session gets 0, 1


def test_session_documents_reject_impossible_values(tmp_path: Path) -> None:
    cases: list[tuple[object, str]] = [
        (_session([_turn(0.0, [1]), {"t": 1.0, "in": 100, "out": 10**20, "hash_ids": [1]}]),
         r"one.json: field 'requests\[1\].out': expected an integer number of tokens in "
         r"\[0, 1,048,576\], got 100000000000000000000"),
        (_session([{**_turn(0.0, [1]), "t": 30 * 365 * 86400.0}]),
         r"field 'requests\[0\].t': .*366 days"),
        (_session([{**_turn(0.0, [1]), "hash_ids": [2**64]}]),
         r"field 'requests\[0\].hash_ids': expected integers in \[0, 2\*\*64\)"),
        (_session([_turn(5.0, [1]), _turn(1.0, [1, 2])]),
         r"field 'requests\[1\].t': starts at 1.000 s, before the turn it follows"),
        (_session([_turn(0.0, [1])], hash_id_scope="galaxy"), "expected 'local' or 'global'"),
        ({"hash_id_scope": "local", "requests": []}, "field 'block_size'"),
    ]
    nested: dict[str, object] = {"type": "subagent", "t": 0.0, "requests": [_turn(0.0, [1])]}
    for _ in range(12):
        nested = {"type": "subagent", "t": 0.0, "requests": [nested]}
    cases.append((_session([nested]), "sub-agents nested deeper than 8"))
    for document, problem in cases:
        path = tmp_path / "one.json"
        path.write_text(json.dumps(document))
        with pytest.raises(TraceFormatError, match=problem):
            read_trace(path)
    deep = tmp_path / "deep.json"
    deep.write_text('{"block_size": 64, "requests": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(TraceFormatError, match=r"deep\.json: JSON nested too deeply"):
        read_trace(deep)


# ---- builtin:agentic ------------------------------------------------------------------------


def test_builtin_agentic_matches_the_published_shape() -> None:
    from kvtier.replay import reference
    from kvtier.replay.agentic import generate_trace

    for trace in (read_trace("builtin:agentic"), generate_trace(seed=1, sessions=64)):
        inputs = sorted(r.input_length for r in trace.requests)
        p10, p50, p90 = (inputs[int(q * len(inputs))] for q in (0.10, 0.50, 0.90))
        assert 34_000 <= p10 <= 52_000, p10
        assert 90_000 <= p50 <= 130_000, p50
        assert 240_000 <= p90 <= 360_000, p90
        assert 850_000 <= inputs[-1] <= 900_000
        assert (trace.block_tokens, trace.hash_convention) == (64, "floor")
        per_session: dict[int | None, list[TraceRequest]] = {}
        for request in trace.requests:
            per_session.setdefault(request.session, []).append(request)
        assert len(per_session) == trace.sessions
        gaps: list[float] = []
        for turns in per_session.values():
            assert 45 <= len(turns) <= 80
            for before, after in itertools.pairwise(turns):
                assert after.input_length >= before.input_length  # the context only grows
                assert trace.requests[after.after or 0] is before
                gaps.append(after.gap_ms / 1000)
        ids = [set().union(*(r.hash_ids for r in turns)) for turns in per_session.values()]
        assert sum(map(len, ids)) == len(set().union(*ids))  # no block shared by two sessions
        gaps.sort()
        assert 8.0 <= gaps[len(gaps) // 2] <= 20.0  # think time + answer time, median
        assert gaps[int(0.99 * len(gaps))] >= 5 * gaps[len(gaps) // 2]  # a long tail
        ideal = reference.ideal(trace).block_hit_ratio
        assert 0.95 <= ideal <= 0.97, ideal
    assert read_trace("builtin:agentic", seed=3) != read_trace("builtin:agentic")
    assert read_trace("builtin:agentic") == read_trace("builtin:agentic")
