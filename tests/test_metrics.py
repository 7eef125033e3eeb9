"""Prometheus metrics: private registries per manager, optional global registry."""

from __future__ import annotations

import prometheus_client
import pytest

from kvtier.config import ConfigError
from kvtier.keys import RequestContext
from kvtier.lookup import BreakerState, LookupStats
from kvtier.manager import open_manager
from kvtier.metrics import KvtierMetrics

CONFIG = {"block_bytes": 64, "primary_bytes": 256, "namespace": {"model": "m"},
          "secondary_tiers": ["memory://"]}


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
        assert first.metrics.value("kvtier_lookups_total", tier="primary") == 1
        assert second.metrics.value("kvtier_lookups_total", tier="primary") == 0
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
            "kvtier_lookups_total", {"tier": "primary"}) == 1
    finally:
        manager.shutdown()
    again = open_manager({**CONFIG, "metrics_registry": "global"})
    again.shutdown()
    assert prometheus_client.REGISTRY.get_sample_value(
        "kvtier_lookups_total", {"tier": "primary"}) is None


def test_disabled_metrics() -> None:
    manager = open_manager({**CONFIG, "metrics_registry": "disabled"})
    try:
        assert manager.metrics is None
        manager.lookup(b"k" * 16, RequestContext("a"))
        manager.on_schedule_end()
    finally:
        manager.shutdown()


def test_lookup_stats_are_published_as_deltas() -> None:
    metrics = KvtierMetrics()
    metrics.publish_lookup_stats("t", LookupStats(lookups=5, backend_calls=2, inflight_reuses=1,
                                                  verdict_cache_hits=3, quarantined_keys=4,
                                                  breaker_state=BreakerState.OPEN))
    metrics.publish_lookup_stats("t", LookupStats(lookups=7, backend_calls=2, inflight_reuses=1,
                                                  verdict_cache_hits=3, quarantined_keys=1,
                                                  breaker_state=BreakerState.HALF_OPEN))
    assert metrics.value("kvtier_lookups_total", tier="t") == 7
    assert metrics.value("kvtier_backend_calls_total", tier="t", op="exists") == 2
    assert metrics.value("kvtier_inflight_reuses_total", tier="t") == 1
    assert metrics.value("kvtier_verdict_cache_hits_total", tier="t") == 3
    assert metrics.value("kvtier_quarantined_keys", tier="t") == 1
    assert metrics.value("kvtier_breaker_state", tier="t") == 1
    text = metrics.render().decode()
    assert 'kvtier_lookups_total{tier="t"} 7.0' in text
