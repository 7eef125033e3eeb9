"""The metric vocabulary: names, conventions, publishing from the components' counters, the
Grafana dashboard, private and global registries."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import prometheus_client
import pytest

from kvtier.config import ConfigError
from kvtier.factory import open_manager
from kvtier.keys import RequestContext
from kvtier.ops.metrics import (
    STANDALONE_PREFIX,
    VLLM_PREFIX,
    VOCABULARY,
    DeltaTracker,
    KvtierMetrics,
    MetricKind,
    ProbeDurations,
    exposed_names,
    manager_samples,
    metrics_markdown,
)

CONFIG = {"block_bytes": 64, "primary_bytes": 256, "namespace": {"model": "m"},
          "secondary_tiers": ["memory://"]}

GOLDEN = [
    "kvtier_lookups_total", "kvtier_lookup_hits_total", "kvtier_lookup_tokens_total",
    "kvtier_lookup_hit_tokens_total", "kvtier_lookup_inflight_reuses_total",
    "kvtier_lookup_verdict_cache_hits_total", "kvtier_lookup_quarantine_hits_total",
    "kvtier_probe_calls_total", "kvtier_probe_error_keys_total",
    "kvtier_probe_timeout_keys_total", "kvtier_probe_delays_total",
    "kvtier_breaker_opens_total", "kvtier_load_jobs_total",
    "kvtier_store_jobs_total", "kvtier_loaded_blocks_total", "kvtier_load_failed_blocks_total",
    "kvtier_stored_blocks_total", "kvtier_store_failed_blocks_total",
    "kvtier_store_shed_blocks_total", "kvtier_store_waits_total",
    "kvtier_store_wait_seconds_total", "kvtier_store_stalls_total",
    "kvtier_evicted_blocks_total", "kvtier_read_bytes_total",
    "kvtier_write_bytes_total", "kvtier_read_seconds_total", "kvtier_write_seconds_total",
    "kvtier_loads_declined_total", "kvtier_job_errors_total", "kvtier_backend_errors_total",
    "kvtier_backend_corrupt_objects_total", "kvtier_backend_auth_failures_total",
    "kvtier_backend_auth_old_key_total", "kvtier_backend_old_format_total",
    "kvtier_prefetched_blocks_total", "kvtier_prefetch_used_blocks_total",
    "kvtier_prefetch_wasted_blocks_total", "kvtier_prefetch_cancelled_blocks_total",
    "kvtier_prefetch_staged_bytes", "kvtier_resident_blocks", "kvtier_resident_bytes",
    "kvtier_capacity_bytes", "kvtier_quarantined_keys", "kvtier_breaker_state",
    "kvtier_jobs_in_flight", "kvtier_primary_slots", "kvtier_probe_duration_seconds_bucket",
    "kvtier_probe_duration_seconds_count", "kvtier_probe_duration_seconds_sum",
]
_UNITS = ("bytes", "seconds")


def test_metric_names_match_the_golden_list() -> None:
    assert exposed_names() == GOLDEN


def test_names_follow_prometheus_conventions() -> None:
    for spec in VOCABULARY:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", spec.name), spec.name
        assert not spec.name.endswith("_total"), spec.name  # counters get it when exposed
        for unit in _UNITS:  # a unit is always the last word
            assert unit not in spec.name.split("_")[:-1], spec.name
        assert spec.help and spec.labels
        exposed = spec.exposed()
        assert exposed.endswith("_total") == (spec.kind is MetricKind.COUNTER), exposed
        assert spec.kind is not MetricKind.HISTOGRAM or exposed.endswith("_seconds")


def test_vllm_names_are_the_standalone_names_with_vllms_prefix() -> None:
    standalone = set(exposed_names())
    under_vllm = exposed_names(VLLM_PREFIX, vllm=True)
    assert under_vllm
    for name in under_vllm:
        assert name.startswith("vllm:kvtier_")
        assert STANDALONE_PREFIX + name.removeprefix(VLLM_PREFIX) in standalone
    only_standalone = {spec.name for spec in VOCABULARY if spec.standalone_only}
    # vLLM owns the primary pool, so its evictions and the waits for cascades out of it
    assert only_standalone == {"evicted_blocks", "primary_slots", "store_waits",
                               "store_wait_seconds", "store_stalls"}


def test_manager_publishes_token_hits_transfers_and_usage() -> None:
    config = {**CONFIG, "namespace": {"model": "m", "block_size": 16},
              "secondary_tiers": [{"url": "memory://", "name": "mem"}]}
    with open_manager(config) as manager:
        ctx = RequestContext("a")
        stored, remote, absent = b"s" * 16, b"r" * 16, b"a" * 16
        prepared = manager.prepare_store([stored], ctx)
        assert prepared is not None
        manager.complete_store([stored], ctx, True)
        manager.tiers[0].backend.put_many([remote], [b"x" * 64])
        for _ in range(3):
            for key in (stored, remote, absent):
                manager.lookup(key, ctx)
            manager.on_schedule_end()
            manager.wait_idle(10)
        manager.publish_metrics()
        metrics = manager.metrics
        assert metrics is not None
        stats = manager.get_stats()

        def value(name: str, tier: str) -> float:
            return metrics.value(name, tier=tier)

        answered = (stats["manager"]["hits"] + stats["manager"]["hit_pending"]
                    + stats["manager"]["misses"])
        assert value("kvtier_lookup_tokens_total", "0:primary") == answered * 16
        assert value("kvtier_lookup_hit_tokens_total", "0:primary") == (
            stats["manager"]["hits"] * 16)
        assert value("kvtier_lookup_hit_tokens_total", "1:mem") == 16  # remote, promoted once
        assert value("kvtier_lookup_hits_total", "1:mem") == 1
        assert value("kvtier_write_bytes_total", "1:mem") == 64  # the cascade of `stored`
        assert value("kvtier_read_bytes_total", "1:mem") == 64  # the promotion of `remote`
        assert value("kvtier_loaded_blocks_total", "1:mem") == 1
        assert value("kvtier_resident_blocks", "0:primary") == 2
        assert value("kvtier_resident_bytes", "0:primary") == 128
        assert value("kvtier_capacity_bytes", "0:primary") == 256
        assert value("kvtier_resident_blocks", "1:mem") == 2
        assert value("kvtier_probe_duration_seconds_count", "1:mem") >= 1
        assert metrics.value("kvtier_primary_slots", state="free") == 2
        text = metrics.render().decode()
        assert 'kvtier_lookup_hits_total{tier="1:mem"} 1.0' in text


def test_samples_are_snapshots_not_increments() -> None:
    """Publishing twice the same counters shows them once (no delta bookkeeping standalone)."""
    with open_manager(CONFIG) as manager:
        manager.lookup(b"k" * 16, RequestContext("a"))
        manager.publish_metrics()
        manager.publish_metrics()
        assert manager.metrics is not None
        assert manager.metrics.value("kvtier_lookups_total", tier="0:primary") == 1
        assert manager_samples(manager.get_stats(), 0)["lookups"][("0:primary",)] == 1


def test_delta_tracker_reports_growth_once_and_every_gauge() -> None:
    tracker = DeltaTracker()
    first = {"lookups": {("1:KvtierTier",): 5.0}, "jobs_in_flight": {("1:KvtierTier",): 2.0}}
    assert tracker.changes(first) == ([("lookups", ("1:KvtierTier",), 5.0)],
                                      [("jobs_in_flight", ("1:KvtierTier",), 2.0)])
    second = {"lookups": {("1:KvtierTier",): 7.0}, "jobs_in_flight": {("1:KvtierTier",): 0.0}}
    assert tracker.changes(second) == ([("lookups", ("1:KvtierTier",), 2.0)],
                                       [("jobs_in_flight", ("1:KvtierTier",), 0.0)])
    assert tracker.changes(second)[0] == []


def test_probe_durations_drain_in_order() -> None:
    durations = ProbeDurations(limit=2)
    observe = durations.probe_observer("t")
    for seconds in (0.1, 0.2, 0.3):
        observe(seconds)
    assert durations.drain() == [0.2, 0.3]  # bounded: the oldest goes first
    assert durations.drain() == []


def test_two_managers_in_one_process_have_separate_registries() -> None:
    first = open_manager(CONFIG)
    second = open_manager(CONFIG)
    try:
        ctx = RequestContext("a")
        first.lookup(b"k" * 16, ctx)
        first.publish_metrics()
        second.publish_metrics()
        assert first.metrics is not None and second.metrics is not None
        assert first.metrics.registry is not second.metrics.registry
        assert first.metrics.value("kvtier_lookups_total", tier="0:primary") == 1
        assert second.metrics.value("kvtier_lookups_total", tier="0:primary") == 0
    finally:
        first.shutdown()
        second.shutdown()


def test_global_registry_is_exclusive_and_released_at_shutdown() -> None:
    manager = open_manager({**CONFIG, "metrics_registry": "global"})
    try:
        assert manager.metrics is not None
        assert manager.metrics.registry is prometheus_client.REGISTRY
        with pytest.raises(ConfigError, match="metrics_registry: 'global' failed"):
            open_manager({**CONFIG, "metrics_registry": "global"})
        manager.lookup(b"k" * 16, RequestContext("a"))
        manager.publish_metrics()
        assert prometheus_client.REGISTRY.get_sample_value(
            "kvtier_lookups_total", {"tier": "0:primary"}) == 1
    finally:
        manager.shutdown()
    again = open_manager({**CONFIG, "metrics_registry": "global"})
    again.shutdown()
    assert prometheus_client.REGISTRY.get_sample_value(
        "kvtier_lookups_total", {"tier": "0:primary"}) is None


def test_disabled_metrics() -> None:
    manager = open_manager({**CONFIG, "metrics_registry": "disabled"})
    try:
        assert manager.metrics is None
        manager.lookup(b"k" * 16, RequestContext("a"))
        manager.on_schedule_end()
    finally:
        manager.shutdown()


def test_a_standalone_tier_label_has_vllms_shape() -> None:
    metrics = KvtierMetrics()
    metrics.bind_tiers(["redis", "s3"])
    metrics.probe_observer("s3")(0.01)
    assert metrics.value("kvtier_probe_duration_seconds_count", tier="2:s3") == 1


def _dashboard() -> dict[str, object]:
    text = resources.files("kvtier").joinpath("data/grafana-dashboard.json").read_text()
    loaded: dict[str, object] = json.loads(text)
    return loaded


def test_every_dashboard_expression_names_an_existing_metric() -> None:
    panels = _dashboard()["panels"]
    assert isinstance(panels, list) and len(panels) >= 8
    series = re.compile(r"\$\{prefix\}([a-z_]+)")
    used: set[str] = set()
    for panel in panels:
        for target in panel["targets"]:
            names = series.findall(target["expr"])
            assert names, target["expr"]  # every query reads kvtier metrics
            used.update(names)
            for prefix, vllm in ((STANDALONE_PREFIX, False), (VLLM_PREFIX, True)):
                known = set(exposed_names(prefix, vllm=vllm))
                missing = [prefix + name for name in names if prefix + name not in known]
                standalone_panel = "Standalone only" in panel["description"] or (
                    "(standalone)" in panel["title"])
                if vllm and standalone_panel:
                    continue
                if vllm:  # evicted blocks are reported by vLLM's own primary-tier metrics
                    missing = [name for name in missing if "evicted_blocks" not in name]
                assert not missing, (panel["title"], missing)
    assert {"lookup_hit_tokens_total", "read_bytes_total", "resident_bytes",
            "probe_duration_seconds_bucket"} <= used


def test_readme_metric_table_is_the_generated_one() -> None:
    readme = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
    text = readme.read_text(encoding="utf-8")
    block = text.split("<!-- metrics:begin (generated) -->\n", 1)[1].split(
        "<!-- metrics:end -->", 1)[0]
    assert block == metrics_markdown(), (
        "README metric table is stale: run .venv/bin/python scripts/update-readme-tables.py")


def test_every_tier_metric_names_a_field_of_the_typed_snapshot() -> None:
    from kvtier.lookup.manager import LookupStats
    from kvtier.ops.metrics import VOCABULARY, tier_samples
    from kvtier.tiering.tier_stats import TierCounters, TierStats

    full = {"errors": 1, "corrupt_objects": 2, "blocks": 3, "used_bytes": 4, "max_bytes": 5,
            "auth_failures": 6, "auth_old_key": 7, "old_format": 8}
    stats = TierStats(LookupStats(lookups=7), TierCounters(lookup_answers=2, lookup_hits=1),
                      backend=full)
    samples = tier_samples(stats, "1:t", 16)
    named = {spec.name for spec in VOCABULARY if spec.tier}
    assert set(samples) == named  # each declared path resolves to a value
    assert samples["lookups"] == {("1:t",): 7.0}
    assert samples["lookup_tokens"] == {("1:t",): 32.0}
    assert samples["breaker_state"] == {("1:t",): 0.0}
    assert samples["capacity_bytes"] == {("1:t",): 5.0}
    assert samples["backend_auth_old_key"] == {("1:t",): 7.0}
    assert samples["backend_old_format"] == {("1:t",): 8.0}
    bare = tier_samples(TierStats(LookupStats(), TierCounters()), "1:t", 16)
    assert not {"backend_errors", "resident_blocks", "capacity_bytes"} & set(bare)


def test_a_block_signed_by_an_older_key_is_counted_in_tier_stats_and_prometheus(
        tmp_path: Path) -> None:
    """Before: a block under another key was an auth failure (and removed); there was no key
    list and no auth metric."""
    old, new = "old-metrics-key-0123456789abcdef", "new-metrics-key-fedcba9876543210"
    url = f"file://{tmp_path}/tier"
    key = b"o" * 16
    config = {**CONFIG, "namespace": {"model": "m", "block_size": 16},
              "secondary_tiers": [{"url": url, "name": "disk", "auth_key": [new, old]}]}
    with open_manager(config) as manager:
        from kvtier.backends import open_backend

        writer = open_backend(url, manager.namespace, auth_key=old)
        assert writer.put_many([key], [b"x" * 64]) == [True]
        writer.close()
        ctx = RequestContext("a")
        for _ in range(3):
            manager.lookup(key, ctx)
            manager.on_schedule_end()
            manager.wait_idle(10)
        manager.publish_metrics()
        assert manager.get_stats()["tiers"]["disk"].backend["auth_old_key"] == 1
        assert manager.metrics is not None
        text = manager.metrics.render().decode()
        assert 'kvtier_backend_auth_old_key_total{tier="1:disk"} 1.0' in text
        assert 'kvtier_backend_auth_failures_total{tier="1:disk"} 0.0' in text
