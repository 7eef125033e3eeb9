"""Trace sources are streamed: decompressed as read, lines bounded, the rest of a cut trace only
hashed. Real gzip/xz files; the memory of a real ``kvtier replay`` subprocess is measured with
``wait4`` (its own ``ru_maxrss``, no other child's)."""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.replay import source
from kvtier.replay.reader import read_trace
from kvtier.replay.source import MAX_LINE_BYTES
from kvtier.replay.trace import TraceFormatError

from ._traces import full

ZERO_RUN_MIB = 256
RSS_BOUND_MIB = 192
"""A replay of one request takes about 50 MiB, 110 MiB with a line at the bound; before, the
zero run below took 811 MiB (after a good line) and 557 MiB (as the first line)."""


def _gzip_with_zeros(path: Path, first: bytes, mib: int) -> Path:
    with gzip.GzipFile(path, "wb", compresslevel=1) as out:
        out.write(first)
        chunk = bytes(1 << 20)
        for _ in range(mib):
            out.write(chunk)
    return path


_LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_pid, status, usage = os.wait4(child.pid, 0)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)
"""


def _replay_rss(trace: Path, tmp_path: Path) -> tuple[int, str, float]:
    """(exit code, stderr, peak RSS in MiB) of ``kvtier replay TRACE --max-requests 1``.

    Measured by a small launcher process: Linux carries a process's peak RSS across fork and
    exec, so a child of this (large) test process would report at least this one's size."""
    err = tmp_path / "stderr.txt"
    with err.open("w") as stderr:
        done = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, sys.executable, "-m", "kvtier.cli", "replay",
             str(trace), "--max-requests", "1", "--cpu-blocks", "64", "--block-bytes", "4KiB",
             "--step-ms", "0", "--no-progress", "--scratch-dir", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=60, check=True)
    code, rss_kib = done.stdout.split()
    return int(code), err.read_text(), int(rss_kib) / 1024


def test_a_zero_run_after_the_first_request_is_never_held(tmp_path: Path) -> None:
    """Before: the whole 256 MiB were decompressed, decoded and split (811 MiB RSS)."""
    line = (json.dumps(full([1, 2])) + "\n").encode()
    trace = _gzip_with_zeros(tmp_path / "zeros.jsonl.gz", line, ZERO_RUN_MIB)
    assert trace.stat().st_size < 2 << 20
    code, err, rss_mib = _replay_rss(trace, tmp_path)
    assert code == 0, err
    assert rss_mib < RSS_BOUND_MIB, f"{rss_mib:.0f} MiB"


def test_an_over_long_line_fails_by_number_and_bound(tmp_path: Path) -> None:
    """Before: the line was read whole (557 MiB) and failed as "not valid JSON"."""
    trace = _gzip_with_zeros(tmp_path / "one-line.jsonl.gz", b"", ZERO_RUN_MIB)
    code, err, rss_mib = _replay_rss(trace, tmp_path)
    assert code == 2, err
    assert f"line 1: longer than {MAX_LINE_BYTES:,} bytes, the most a trace line may hold" in err
    assert "Traceback" not in err
    assert rss_mib < RSS_BOUND_MIB, f"{rss_mib:.0f} MiB"


def test_an_over_long_line_can_be_skipped_and_the_hash_covers_every_byte(
        tmp_path: Path) -> None:
    good = [(json.dumps(full([i, i + 1], timestamp=i)) + "\n").encode() for i in range(3)]
    data = good[0] + b"[" * (MAX_LINE_BYTES + 10) + b"\n" + good[1] + b"\n" + good[2]
    path = tmp_path / "long.jsonl.xz"
    path.write_bytes(lzma.compress(data, preset=0))
    with pytest.raises(TraceFormatError, match=r"line 2: longer than"):
        read_trace(path)
    trace = read_trace(path, skip_bad_lines=True)
    assert [request.line for request in trace.requests] == [1, 3, 5]
    assert trace.skipped_lines == 1
    assert trace.sha256 == hashlib.sha256(data).hexdigest()
    cut = read_trace(path, skip_bad_lines=True, max_requests=1)
    assert len(cut.requests) == 1 and not cut.complete
    assert cut.sha256 == trace.sha256  # the rest was hashed, not kept


def test_a_document_larger_than_the_bound_is_refused(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is lowered to 1 MiB (the real one is 512 MiB: too much for a test)."""
    monkeypatch.setattr(source, "MAX_DOCUMENT_BYTES", 1 << 20)
    path = tmp_path / "sessions.json"
    path.write_text('{\n "block_size": 16,\n "requests": [' + " " * (2 << 20) + "]}\n")
    with pytest.raises(TraceFormatError, match="larger than 1,048,576 bytes"):
        read_trace(path)
