"""Prometheus metrics for one tiering manager (prefix ``kvtier_``, label ``tier``).

Thread ownership: the metric objects are prometheus-client collectors, which are thread-safe.
I/O threads observe transfer bytes, times and call counts directly; the probe worker observes
probe latency directly. Counters that the lookup managers keep on the scheduler thread are
published by :meth:`KvtierMetrics.publish_lookup_stats` on the scheduler thread, as deltas against
the last published snapshot (``_published``, owned by the scheduler thread).

By default every manager gets its own :class:`prometheus_client.CollectorRegistry`, so several
managers in one process never collide; serve it with :meth:`KvtierMetrics.render` or
``prometheus_client.start_http_server(port, registry=manager.metrics.registry)``. Pass
``registry=prometheus_client.REGISTRY`` (config ``metrics_registry: global``) to use the
process-wide registry instead (then only one manager per process may exist at a time).

Metrics (``tier`` is ``primary`` or a secondary tier's name):

==============================================  ==========================================
``kvtier_lookups_total``                        keys looked up (manager: ``tier=primary``)
``kvtier_hits_total``                           primary: HIT answers; tier: promotions started
``kvtier_probe_latency_seconds``                histogram of one ``exists`` backend call
``kvtier_backend_calls_total{op}``              backend calls by op: exists, get, put
``kvtier_inflight_reuses_total``                lookups that joined a probe already in flight
``kvtier_verdict_cache_hits_total``             lookups answered from the verdict cache
``kvtier_quarantine_hits_total``                lookups answered False by quarantine
``kvtier_bytes_read_total`` / ``_written_``     payload bytes moved by transfer jobs
``kvtier_read_seconds_total`` / ``_write_``     time spent in get_many / put_many
``kvtier_failed_loads_total``                   promoted keys whose load failed (or corrupt)
``kvtier_quarantined_keys``                     gauge: keys quarantined now
``kvtier_breaker_state``                        gauge: 0 closed, 1 half-open, 2 open
``kvtier_shed_stores_total``                    cascaded blocks dropped by backpressure
``kvtier_stores_total``                         blocks stored (primary: engine stores)
``kvtier_evictions_total``                      primary evictions
``kvtier_primary_slots{state}``                 gauge: free / filling / resident / pinned
==============================================  ==========================================
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.lookup import BreakerState, LookupStats

BREAKER_STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}

_PROBE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  0.5, 1.0, 2.5, 5.0, 10.0)

# LookupStats fields published as the counter attribute of the same name.
_LOOKUP_COUNTERS = ("lookups", "inflight_reuses", "verdict_cache_hits", "quarantine_hits")


class KvtierMetrics:
    """The ``kvtier_*`` metrics of one manager, in ``registry`` (a private one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        reg = self.registry
        self.lookups = Counter("kvtier_lookups", "Keys looked up", ["tier"], registry=reg)
        self.hits = Counter("kvtier_hits",
                            "Primary HIT answers; for a secondary tier, promotions started",
                            ["tier"], registry=reg)
        self.probe_latency = Histogram("kvtier_probe_latency_seconds",
                                       "Latency of one exists() backend call", ["tier"],
                                       buckets=_PROBE_BUCKETS, registry=reg)
        self.backend_calls = Counter("kvtier_backend_calls", "Backend calls", ["tier", "op"],
                                     registry=reg)
        self.inflight_reuses = Counter("kvtier_inflight_reuses",
                                       "Lookups that joined a probe already in flight", ["tier"],
                                       registry=reg)
        self.verdict_cache_hits = Counter("kvtier_verdict_cache_hits",
                                          "Lookups answered from the verdict cache", ["tier"],
                                          registry=reg)
        self.quarantine_hits = Counter("kvtier_quarantine_hits",
                                       "Lookups answered False because the key is quarantined",
                                       ["tier"], registry=reg)
        self.bytes_read = Counter("kvtier_bytes_read", "Payload bytes loaded", ["tier"],
                                  registry=reg)
        self.bytes_written = Counter("kvtier_bytes_written", "Payload bytes stored", ["tier"],
                                     registry=reg)
        self.read_seconds = Counter("kvtier_read_seconds", "Time spent loading", ["tier"],
                                    registry=reg)
        self.write_seconds = Counter("kvtier_write_seconds", "Time spent storing", ["tier"],
                                     registry=reg)
        self.failed_loads = Counter("kvtier_failed_loads",
                                    "Promoted keys whose load failed or was corrupt", ["tier"],
                                    registry=reg)
        self.quarantined_keys = Gauge("kvtier_quarantined_keys", "Keys quarantined now",
                                      ["tier"], registry=reg)
        self.breaker_state = Gauge("kvtier_breaker_state",
                                   "Circuit breaker: 0 closed, 1 half-open, 2 open", ["tier"],
                                   registry=reg)
        self.shed_stores = Counter("kvtier_shed_stores",
                                   "Cascaded blocks dropped by backpressure", ["tier"],
                                   registry=reg)
        self.stores = Counter("kvtier_stores", "Blocks stored", ["tier"], registry=reg)
        self.evictions = Counter("kvtier_evictions", "Blocks evicted", ["tier"], registry=reg)
        self.primary_slots = Gauge("kvtier_primary_slots", "Primary pool slots by state",
                                   ["state"], registry=reg)
        self._published: dict[str, LookupStats] = {}

    def publish_lookup_stats(self, tier: str, stats: LookupStats) -> None:
        """Publish a lookup manager's counters (scheduler thread), as deltas since last time."""
        previous = self._published.get(tier)
        for field_name in _LOOKUP_COUNTERS:
            now_value: int = getattr(stats, field_name)
            delta = now_value - (getattr(previous, field_name) if previous is not None else 0)
            if delta > 0:
                counter: Counter = getattr(self, field_name)
                counter.labels(tier=tier).inc(delta)
        calls = stats.backend_calls - (previous.backend_calls if previous is not None else 0)
        if calls > 0:
            self.backend_calls.labels(tier=tier, op="exists").inc(calls)
        self.quarantined_keys.labels(tier=tier).set(stats.quarantined_keys)
        self.breaker_state.labels(tier=tier).set(BREAKER_STATE_VALUES[stats.breaker_state])
        self._published[tier] = stats

    def publish_primary(self, *, free: int, filling: int, resident: int, pinned: int) -> None:
        gauge = self.primary_slots
        gauge.labels(state="free").set(free)
        gauge.labels(state="filling").set(filling)
        gauge.labels(state="resident").set(resident)
        gauge.labels(state="pinned").set(pinned)

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (e.g. ``value("kvtier_hits_total", tier="s3")``)."""
        result = self.registry.get_sample_value(name, labels)
        return 0.0 if result is None else result

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def unregister(self) -> None:
        """Remove every metric from the registry (used at shutdown for the global registry)."""
        for collector in list(self._collectors()):
            try:
                self.registry.unregister(collector)
            except KeyError:
                continue

    def _collectors(self) -> list[Any]:
        return [self.lookups, self.hits, self.probe_latency, self.backend_calls,
                self.inflight_reuses, self.verdict_cache_hits, self.quarantine_hits,
                self.bytes_read, self.bytes_written, self.read_seconds, self.write_seconds,
                self.failed_loads, self.quarantined_keys, self.breaker_state, self.shed_stores,
                self.stores, self.evictions, self.primary_slots]
