"""The pure parts of ``benchmarks/engine_load.py``: argument checks, medians, ratios, the table.

No engine runs here (the benchmark itself needs vLLM and minutes); nothing is timed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_module import load_benchmark

pytestmark = pytest.mark.timeout(60)

bench = load_benchmark("engine_load")


def test_defaults_cover_the_issue_rows() -> None:
    settings = bench.parse_args([])
    assert settings.rounds == 3
    assert settings.fresh_tokens == (2048, 8192)
    assert settings.same_tokens == (512, 2048)
    assert settings.modes == ("direct", "buffered")
    assert settings.io_threads == 4
    assert settings.engine_core == "mp"  # as vllm serve runs the engine
    assert settings.max_model_len >= 8192 + 1


def test_loads_time_distinct_prompts_per_length_and_size_the_cpu_tier() -> None:
    one = bench.parse_args(["--fresh-tokens", "2048", "--same-tokens", "512"])
    four = bench.parse_args(["--fresh-tokens", "2048", "--same-tokens", "512", "--loads", "4"])
    assert one.loads == 1
    prompts = bench._prompts(four, 0, four.fresh_tokens + four.same_tokens)
    assert len(prompts) == 8 and len({seed for _, seed in prompts}) == 8
    assert [n for n, _ in prompts] == [2048] * 4 + [512] * 4
    assert bench._prompts(one, 0, (2048,)) == [(2048, bench._seed(0, 2048))]  # as before
    assert four.cpu_tier_bytes > one.cpu_tier_bytes


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--loads", "0"], "--loads: 0: expected 1..64"),
    (["--fresh-tokens", "2048,abc"], "'abc' is not a token count"),
    (["--fresh-tokens", "2000"], "2000 tokens: expected a multiple of 32"),
    (["--same-tokens", "512,512"], "512 is given twice"),
    (["--modes", "direct,mmap"], "--modes: 'direct,mmap'"),
    (["--rounds", "0"], "--rounds: 0: expected at least 1"),
    (["--io-threads", "0"], "--io-threads: 0: expected 1..64"),
    (["--switch-interval-ms", "0"], "--switch-interval-ms: 0.0"),
    (["--kvtier-io-yield-ms", "101"], "--kvtier-io-yield-ms: expected a finite number >= 0.0 "
                                      "and <= 100.0 (milliseconds), got 101.0"),
])
def test_bad_arguments_name_the_value(argv: list[str], fragment: str) -> None:
    with pytest.raises(bench.BenchArgumentError, match=None) as caught:
        bench.parse_args(argv)
    assert fragment in str(caught.value)


def test_main_reports_bad_arguments_without_a_traceback(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--modes", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine_load: --modes: 'nope'")
    assert "Traceback" not in err


def test_none_skips_a_phase() -> None:
    assert bench.parse_args(["--fresh-tokens", "none"]).fresh_tokens == ()


def _sample(phase: str, tier: str, mode: str, tokens: int, seconds: float,
            cached: int | None = None, round_index: int = 0) -> object:
    full = bench.expected_cached(tokens) if cached is None else cached
    return bench.Sample(phase, tier, mode, tokens, seconds, full, round_index)


def test_summarize_takes_medians_ratios_and_flags_misses() -> None:
    samples = [
        _sample("fresh", "kvtier", "direct", 2048, 0.30),
        _sample("fresh", "kvtier", "direct", 2048, 0.10),
        _sample("fresh", "kvtier", "direct", 2048, 0.20),
        _sample("fresh", "fs", "direct", 2048, 0.10),
        _sample("fresh", "fs", "direct", 2048, 0.40, cached=0),
        _sample("fresh", "recompute", "-", 2048, 3.0),
        _sample("fresh", "recompute", "-", 2048, 5.0),
        _sample("same", "kvtier", "direct", 512, 0.05),
        _sample("same", "fs", "direct", 512, 0.025),
    ]
    rows = bench.summarize(samples)
    assert [(row.phase, row.tokens, row.mode) for row in rows] == [
        ("fresh", 2048, "direct"), ("same", 512, "direct")]
    fresh, same = rows
    assert fresh.medians == {"kvtier": 0.20, "fs": 0.25, "recompute": 4.0}
    assert fresh.ratio == pytest.approx(0.8)
    assert fresh.missed == {"fs": 1}
    assert same.ratio == pytest.approx(2.0)
    assert "recompute" not in same.medians


def test_ratio_is_absent_without_both_tiers() -> None:
    (row,) = bench.summarize([_sample("same", "kvtier", "buffered", 512, 0.05)])
    assert row.ratio is None
    table = bench.format_table([row])
    assert "same      512 buffered     0.0500" in table


def test_table_lists_every_row_with_its_ratio_and_notes() -> None:
    rows = bench.summarize([
        _sample("fresh", "kvtier", "direct", 8192, 0.5),
        _sample("fresh", "fs", "direct", 8192, 0.25, cached=64),
    ])
    lines = bench.format_table(rows).splitlines()
    assert lines[0].split()[:4] == ["phase", "tokens", "mode", "kvtier"]
    assert lines[2].split()[:5] == ["fresh", "8192", "direct", "0.5000", "0.2500"]
    assert lines[2].split()[6] == "2.00"
    assert lines[2].endswith("fs missed 1x")


def test_expected_cached_leaves_the_block_of_the_last_token() -> None:
    assert bench.expected_cached(2048) == 2016
    assert bench.expected_cached(2049) == 2048


def test_rotate_interleaves_round_by_round() -> None:
    items = ["a", "b", "c"]
    assert [bench.rotate(items, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert bench.rotate([], 2) == []


def test_prompts_are_deterministic_and_distinct() -> None:
    first = bench.prompt_ids(64, 7, 1024)
    assert first == bench.prompt_ids(64, 7, 1024)
    assert first != bench.prompt_ids(64, 8, 1024)
    assert len(first) == 64 and min(first) >= bench.VOCAB_FIRST and max(first) < 1024


def test_tier_waits_have_their_own_medians_and_ratio() -> None:
    samples = [
        bench.Sample("same", "kvtier", "direct", 512, 0.05, 512, 0, 0.030),
        bench.Sample("same", "kvtier", "direct", 512, 0.06, 512, 1, 0.010),
        bench.Sample("same", "fs", "direct", 512, 0.04, 512, 0, 0.020),
        bench.Sample("same", "fs", "direct", 512, 0.04, 512, 1, None),  # not measured
    ]
    (row,) = bench.summarize(samples)
    assert row.wait_medians == {"kvtier": pytest.approx(0.020), "fs": pytest.approx(0.020)}
    assert row.wait_ratio == pytest.approx(1.0)
    assert row.best_ratio == pytest.approx(0.5)  # fs 40 ms, 20 of them its tier wait
    line = bench.format_table([row]).splitlines()[2]
    assert "20.0ms   20.0ms     1.00     0.50" in line


@pytest.mark.parametrize(("fs_seconds", "fs_wait", "best"), [
    (0.050, 0.008, 0.84),  # the engine's own 42 ms bound the ratio from below
    (0.050, None, None),  # no tier wait measured: no bound claimed
    (None, 0.008, None),
    (0.0, 0.0, None),
    (0.010, 0.012, 0.0),  # a wait longer than the run (clock skew) never goes negative
])
def test_the_best_ratio_is_fs_time_without_its_tier_wait(
        fs_seconds: float | None, fs_wait: float | None, best: float | None) -> None:
    result = bench.best_ratio(fs_seconds, fs_wait)
    assert result == (None if best is None else pytest.approx(best))


def test_the_diagnostics_reach_the_engine_core_process_under_mp(tmp_path: Path) -> None:
    """The switch interval travels as environment for the engine processes' sitecustomize;
    ``--kvtier-io-yield-ms`` is the tier's own ``io_yield_ms`` setting, in its config entry."""
    settings = bench.parse_args(["--engine-core", "mp", "--kvtier-io-yield-ms", "0",
                                 "--switch-interval-ms", "0.5"])
    assert settings.kvtier_io_yield_ms == 0
    (entry,) = bench.kv_config(settings, "kvtier", "buffered", tmp_path)[
        "kv_connector_extra_config"]["secondary_tiers"]
    assert entry["io_yield_ms"] == 0
    default = bench.parse_args([])
    (entry,) = bench.kv_config(default, "kvtier", "buffered", tmp_path)[
        "kv_connector_extra_config"]["secondary_tiers"]
    assert "io_yield_ms" not in entry  # the tier decides
    spec = {"engine_core": "mp", "kv_config": {"kv_connector": "OffloadingConnector"},
            "fs_buffered": True, "switch_interval_s": 0.0005}
    assert bench.engine_env_overrides(spec) == {
        "KVTIER_BENCH_FS_BUFFERED": "1", "KVTIER_BENCH_SWITCH_INTERVAL_S": "0.0005"}
    # No tier (the recompute process): nothing of the tier's to set; no diagnostics: no site.
    assert bench.engine_env_overrides({**spec, "kv_config": None, "fs_buffered": False}) == {
        "KVTIER_BENCH_SWITCH_INTERVAL_S": "0.0005"}
    assert bench.engine_env_overrides({"engine_core": "mp", "kv_config": None}) == {}


def test_the_engine_sitecustomize_sets_the_switch_interval_in_a_new_interpreter(
        tmp_path: Path) -> None:
    """A real child interpreter started with the benchmark's environment (as vLLM starts its
    engine-core process) runs with the asked switch interval and says so on stderr."""
    env = bench._child_env({"engine_core": "mp", "kv_config": None,
                            "switch_interval_s": 0.0005}, tmp_path)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    done = subprocess.run([sys.executable, "-c", "import sys; print(sys.getswitchinterval())"],
                          env=env, capture_output=True, text=True, timeout=30, check=True)
    assert float(done.stdout) == pytest.approx(0.0005)
    assert "engine_load: switch interval 0.0005 s in" in done.stderr


def test_no_sitecustomize_without_a_diagnostic_or_buffered_fs(tmp_path: Path) -> None:
    env = bench._child_env({"engine_core": "inproc", "kv_config": None}, tmp_path)
    assert not (tmp_path / "engine-site").exists()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_tier_wait_runs_from_the_first_lookup_to_the_report_of_the_last_own_load() -> None:
    events = [(1.0, "step_end", ""), (2.0, "lookup", "RETRY"), (3.0, "step_end", ""),
              (4.0, "lookup", "HIT"), (4.5, "submit_load", "job 7: 16 keys"),
              (5.0, "finished", "3:True"),  # an earlier store: not this request's load
              (6.5, "finished", "7:True"), (9.0, "finished", "4:True")]
    assert bench.tier_wait_of(events) == pytest.approx(4.5)
    assert bench.tier_wait_of(events[:6]) is None  # the load not reported yet
    assert bench.tier_wait_of([(1.0, "submit_load", "job 1: 1 keys")]) is None


def test_an_engine_core_trace_file_is_cut_by_the_timed_window(tmp_path: Path) -> None:
    """The engine-core process's sink, read back and cut as the parent does under mp."""
    with (tmp_path / "trace-1.tsv").open("a") as sink:
        trace = bench._Trace(sink)
        assert trace.on  # an engine-core trace keeps every call
        for name, detail in (("lookup", "HIT"), ("submit_load", "job 2: 4 keys"),
                             ("finished", "2:True")):
            trace.add(name, detail)
    (tmp_path / "trace-2.tsv").write_text("")  # a process that made no tier call
    events = bench.read_trace_dir(tmp_path)
    assert [name for _, name, _ in events] == ["lookup", "submit_load", "finished"]
    assert [detail for *_, detail in events] == ["HIT", "job 2: 4 keys", "2:True"]
    first, last = events[0][0], events[-1][0]
    assert bench.tier_wait_of(bench.in_window(events, [first, last])) == last - first
    assert bench.in_window(events, [last + 1, last + 2]) == []
    assert trace.events == []  # written, not kept


def test_trace_is_accepted_with_the_engine_core_in_its_own_process() -> None:
    settings = bench.parse_args(["--engine-core", "mp", "--trace"])
    assert settings.trace and settings.engine_core == "mp"
