"""The pure parts of ``kvtier bench serve``: round order, medians over rounds, the output
check across rounds and the metrics parsing (no vLLM needed; the servers are covered by the
smoke test in ``test_vllm_serve.py``)."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import pytest

from kvtier.bench import serve as sb


def _result(name: str, p50: float, *, texts: tuple[str, ...] = ("a",), cached: int = 10,
            throughput: float = 1.0) -> sb.ConfigResult:
    return sb.ConfigResult(
        name=name, ttft_mean_s=p50, ttft_p50_s=p50, ttft_p99_s=2 * p50, itl_p50_s=0.01,
        throughput_req_s=throughput, requests=4, failed=0, cached_prompt_tokens=cached,
        prompt_tokens=100, cached_by_source={"host": cached}, kvtier_counters={},
        startup_s=1.0, ttfts_s=[p50], generated_texts=list(texts), result_files=[name])


def _settings(tmp_path: Path, rounds: int = 3) -> sb.BenchSettings:
    parser = argparse.ArgumentParser()
    sb.add_arguments(parser)
    return sb.settings_from_args(parser.parse_args(
        ["--workdir", str(tmp_path), "--rounds", str(rounds)]))


def test_each_round_rotates_the_order_and_keeps_the_restart_after_its_server(
        tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    specs = sb.server_specs(settings)
    orders = [[spec.name for spec in sb.round_order(specs, index)] for index in range(3)]
    assert orders[0][0] == sb.CONFIG_NAMES[0]
    assert orders[1][0] != orders[0][0] and orders[2][0] != orders[1][0]
    for order in orders:
        assert sorted(order) == sorted(sb.CONFIG_NAMES)
        assert order.index("kvtier-file-restart") == order.index("kvtier-file") + 1


def test_every_round_gets_its_own_empty_tiers(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    first = {s.name: s.tier_dir for s in sb.server_specs(settings, tmp_path / "round-1")}
    second = {s.name: s.tier_dir for s in sb.server_specs(settings, tmp_path / "round-2")}
    for name, directory in first.items():
        if directory is not None:
            assert directory != second[name]
    assert first["kvtier-file"] == first["kvtier-file-restart"]  # the restart's warm tier


def test_rounds_combine_as_medians_and_keep_every_sample() -> None:
    rounds = [_result("kvtier-file", p50, throughput=t, cached=c)
              for p50, t, c in ((0.3, 2.0, 10), (0.1, 4.0, 30), (0.2, 3.0, 20))]
    combined = sb.combine_rounds(rounds)
    assert combined.ttft_p50_s == 0.2 and combined.ttft_p99_s == 0.4
    assert combined.throughput_req_s == 3.0 and combined.cached_prompt_tokens == 20
    assert combined.cached_by_source == {"host": 20}
    assert sorted(combined.ttfts_s) == [0.1, 0.2, 0.3]
    assert combined.result_files == ["kvtier-file"] * 3
    with pytest.raises(sb.ServeBenchError, match="at least one round"):
        sb.combine_rounds([])


def test_a_nan_round_does_not_poison_the_median() -> None:
    combined = sb.combine_rounds([_result("x", math.nan), _result("x", 0.5)])
    assert combined.ttft_p50_s == 0.5


def test_outputs_must_match_in_every_round() -> None:
    same = {"kvtier-file": _result("kvtier-file", 0.1), "prefix-cache-only":
            _result("prefix-cache-only", 1.0)}
    different = {"kvtier-file": _result("kvtier-file", 0.1, texts=("b",)),
                 "prefix-cache-only": _result("prefix-cache-only", 1.0)}
    assert sb.outputs_match(same, "kvtier-file", "prefix-cache-only", [same, same]) is True
    assert sb.outputs_match(same, "kvtier-file", "prefix-cache-only",
                            [same, different]) is False
    assert sb.outputs_match(same, "kvtier-redis", "prefix-cache-only", [same]) is None


def test_cached_tokens_by_source_come_from_the_counter_not_its_created_stamp() -> None:
    """vLLM exports ``..._total`` and ``..._created`` samples with the same source label; the
    report must read the counter (an earlier version showed the stamps' delta: zeros)."""
    delta = {"vllm:prompt_tokens_cached_by_source_total[host]": 96.0,
             "vllm:prompt_tokens_cached_by_source_created[host]": 0.0,
             "vllm:prompt_tokens_cached_by_source_total[device]": 32.0,
             "vllm:prompt_tokens_cached_total": 128.0}
    raw = {"ttfts": [0.1], "itls": [[0.01]], "request_throughput": 1.0, "completed": 1}
    result = sb.summarize("kvtier-file", sb.PassResult(raw, delta, "f.json"), 1.0, [])
    assert result.cached_by_source == {"host": 96, "device": 32}
    assert result.cached_prompt_tokens == 128


@pytest.mark.parametrize("rounds", ["0", "-2"])
def test_bad_rounds_are_named(tmp_path: Path, rounds: str) -> None:
    parser = argparse.ArgumentParser()
    sb.add_arguments(parser)
    with pytest.raises(sb.ServeBenchError, match=f"--rounds must be >= 1, got {rounds}"):
        sb.settings_from_args(parser.parse_args(["--workdir", str(tmp_path),
                                                 "--rounds", rounds]))


def test_the_agentic_trace_feeds_the_client_with_distinct_sessions(tmp_path: Path) -> None:
    rows = sb.trace_rows("agentic", 40)
    assert len(rows) == 40 and all(row["hash_ids"] for row in rows)
    firsts = {row["hash_ids"][0] for row in rows}
    assert len(firsts) > 1  # several sessions, and ...
    shared = [row for row in rows[1:] if row["hash_ids"][0] in
              {earlier["hash_ids"][0] for earlier in rows[: rows.index(row)]}]
    assert shared  # ... later turns of a session repeat its prefix
    info = sb.write_trace(rows, tmp_path / "t.jsonl", kind=sb.TraceKind.REUSE, block_size=32,
                          max_prompt_tokens=2040, output_len=4)
    assert info["prompt_tokens"] == sum(min(len(r["hash_ids"]), 63) * 32 for r in rows)
    with pytest.raises(sb.ServeBenchError, match="unknown --trace 'nope'"):
        sb.trace_rows("nope", 1)


def test_agentic_sessions_are_scaled_to_the_context_and_keep_growing_prefixes() -> None:
    rows = sb.trace_rows("agentic", 30, sessions=3, speed=4.0, max_blocks=63)
    assert all(0 < len(row["hash_ids"]) <= 63 for row in rows)
    by_session: dict[object, list[list[int]]] = {}
    for row in rows:
        by_session.setdefault(row["session"], []).append(row["hash_ids"])
    assert len(by_session) == 3
    grew = False
    for turns in by_session.values():
        for earlier, later in itertools.pairwise(turns):
            common = len(earlier) if len(later) >= len(earlier) else 0
            if common and later[:common] == earlier:
                grew = grew or len(later) > len(earlier)
    assert grew  # a later turn extends the previous one's prefix
    unscaled = sb.trace_rows("agentic", 30, sessions=3)
    assert rows[-1]["timestamp"] == unscaled[-1]["timestamp"] / 4.0  # think time at 1/speed


def test_later_turns_exclude_each_sessions_first_in_the_window() -> None:
    rows = [{"session": 0}, {"session": 1}, {"session": 0}, {"session": 1}, {"session": 2}]
    assert sb.later_turns(rows) == [False, False, True, True, False]
    assert sb.later_turns([{"timestamp": 0}]) == [False]
    raw = {"ttfts": [1.0, 2.0, 0.1, 0.3, 3.0], "itls": [[0.01]], "request_throughput": 1.0,
           "completed": 5}
    result = sb.summarize("kvtier-file-prefetch", sb.PassResult(raw, {}, "f.json"), 1.0, [],
                          sb.later_turns(rows))
    assert result.ttft_p50_later_turns_s == pytest.approx(0.2)
    assert result.ttft_p50_s == 1.0
    combined = sb.combine_rounds([result, result])
    assert combined.ttft_p50_later_turns_s == pytest.approx(0.2)


def test_prefetch_configs_give_the_kvtier_tier_a_staging_memory(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    sb.add_arguments(parser)
    settings = sb.settings_from_args(parser.parse_args(
        ["--workdir", str(tmp_path), "--trace", "agentic", "--prefetch-mib", "32"]))
    specs = {spec.name: spec for spec in sb.server_specs(settings)}
    for name in ("kvtier-file-prefetch", "kvtier-redis-prefetch"):
        spec = specs[name]
        assert spec.passes == (sb.Pass.MEASURED,)  # sessions: one pass
        config = sb.kv_transfer_config(settings, spec.tier, spec.tier_dir, "redis://x:1/0",
                                       spec.prefetch_bytes)
        assert config is not None
        tier = config["kv_connector_extra_config"]["secondary_tiers"][0]
        assert tier["prefetch_bytes"] == 32 * sb.MIB
    plain = sb.kv_transfer_config(settings, specs["kvtier-file"].tier,
                                  specs["kvtier-file"].tier_dir, None)
    assert plain is not None
    assert "prefetch_bytes" not in plain["kv_connector_extra_config"]["secondary_tiers"][0]
    with pytest.raises(sb.ServeBenchError, match=r"--speed must be > 0, got 0\.0"):
        sb.settings_from_args(parser.parse_args(["--workdir", str(tmp_path), "--speed", "0"]))


def test_the_memory_floor_runs_only_when_named(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    sb.add_arguments(parser)
    default = {spec.name for spec in sb.server_specs(_settings(tmp_path))}
    assert "kvtier-memory" not in default  # a diagnostic, not part of the default run
    settings = sb.settings_from_args(parser.parse_args(
        ["--workdir", str(tmp_path), "--configs", "vllm-fs,kvtier-memory"]))
    specs = {spec.name: spec for spec in sb.server_specs(settings)}
    assert list(specs) == ["vllm-fs", "kvtier-memory"]
    spec = specs["kvtier-memory"]
    assert spec.passes == (sb.Pass.WARM, sb.Pass.MEASURED)  # the warm pass fills it
    config = sb.kv_transfer_config(settings, spec.tier, spec.tier_dir, None)
    assert config is not None
    tier = config["kv_connector_extra_config"]["secondary_tiers"][0]
    assert tier == {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                    "url": "memory://"}
    with pytest.raises(sb.ServeBenchError, match=r"unknown --configs \['kvtier-ram'\]"):
        sb.settings_from_args(parser.parse_args(
            ["--workdir", str(tmp_path), "--configs", "kvtier-ram"]))
