"""The Mooncake trace reader: parsing, validation messages, --skip-bad-lines, compression."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path

import pytest

from kvtier.replay.trace import TraceFormatError, read_trace

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
    latin.write_bytes(b'{"timestamp": 0}\n\xff\xfe\n')
    with pytest.raises(TraceFormatError, match="line 2: not valid UTF-8"):
        read_trace(latin)
    path = write_trace([full([1])])
    with pytest.raises(ValueError, match="block_tokens must be an integer >= 1, got 0"):
        read_trace(path, block_tokens=0)
    with pytest.raises(ValueError, match="max_requests must be an integer >= 1 or None"):
        read_trace(path, max_requests=0)
