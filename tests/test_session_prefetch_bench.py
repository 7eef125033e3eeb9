"""``benchmarks/session_prefetch.py``: the think-time hazard it prints before the replays, on a
hand-made trace whose answer is known. Nothing is timed or compared."""

from __future__ import annotations

import pytest

from benchmark_module import load_benchmark
from kvtier.replay.trace import Trace, TraceRequest

pytestmark = pytest.mark.timeout(60)

bench = load_benchmark("session_prefetch")


def _trace(gaps_ms: list[float]) -> Trace:
    first = TraceRequest(line=1, timestamp_ms=0.0, input_length=64, output_length=1,
                         hash_ids=(1,), session=0)
    later = [TraceRequest(line=number + 2, timestamp_ms=0.0, input_length=64, output_length=1,
                          hash_ids=(1,), session=0, after=number, gap_ms=gap)
             for number, gap in enumerate(gaps_ms)]
    return Trace(source="hand-made", sha256="", block_tokens=64, requests=(first, *later),
                 skipped_lines=0, skip_reasons=(), complete=True, sessions=1)


def test_the_hazard_counts_the_sessions_still_paused_and_those_back_soon() -> None:
    # At speed 10: gaps of 0.1, 0.2, 0.6 and 4 s; the session's first turn has no gap.
    rows = {row["paused_s"]: row for row in bench.think_time_hazard(
        _trace([1000.0, 2000.0, 6000.0, 40000.0]), speed=10.0)}
    assert rows[0.0]["sessions_paused"] == 4
    assert rows[0.0]["back_within_window"] == pytest.approx(2 / 4)  # 0.1 and 0.2 s (< 0.25)
    assert rows[0.5]["sessions_paused"] == 2
    assert rows[0.5]["back_within_window"] == pytest.approx(1 / 2)  # 0.6 s
    assert rows[5.0] == {"paused_s": 5.0, "sessions_paused": 0, "back_within_window": 0.0}
