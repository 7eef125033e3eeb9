"""kvtier's one metric vocabulary, published standalone (Prometheus) and under vLLM.

Every metric is declared once in :data:`VOCABULARY` (name, kind, help, labels), following the
Prometheus conventions: the unit is the last word (``_bytes``, ``_seconds``, ``_blocks``,
``_tokens``), counters are exposed with ``_total``. The names are the same everywhere, prefix
aside: ``kvtier_read_bytes_total`` standalone, ``vllm:kvtier_read_bytes_total`` under vLLM.

The ``tier`` label has vLLM's tiering shape, ``"<position>:<name>"``: ``"0:primary"`` for the
CPU pool and ``"1:<tier name>"``, ``"2:..."`` for the secondary tiers in lookup order. Under vLLM
the name is the tier type (``tier="1:KvtierTier"``), the label vLLM's own
``vllm:kv_offload_tiering_*`` metrics carry, so the two join on ``tier``.

Counters live in one place per component (the manager's counters, each tier's
``TierCounters`` and lookup stats, the backend's stats); :func:`manager_samples` and
:func:`tier_samples` read them into :data:`Samples` (cumulative values, by metric and label
values). Standalone, the manager hands a fresh snapshot to :meth:`KvtierMetrics.publish` and a
scrape reads it; under vLLM, whose stats carry increments, :class:`DeltaTracker` turns the same
snapshots into increments. That is the only delta bookkeeping.

Thread ownership:

- :meth:`KvtierMetrics.publish` is called on the scheduler thread; it replaces ``_samples``
  with a new dict (one reference assignment), which the scrape thread only reads.
- The probe-duration histogram is observed on the probe worker thread (prometheus-client
  histograms are thread-safe); :class:`ProbeDurations` (vLLM) takes observations on the probe
  thread into a ``collections.deque`` (thread-safe append/popleft) that the scheduler thread
  drains.
- :class:`DeltaTracker` is owned by the scheduler thread.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = [
    "PRIMARY_LABEL",
    "STANDALONE_PREFIX",
    "VLLM_PREFIX",
    "VOCABULARY",
    "DeltaTracker",
    "KvtierMetrics",
    "MetricKind",
    "MetricSpec",
    "ProbeDurations",
    "ProbeMetrics",
    "Samples",
    "exposed_names",
    "manager_samples",
    "metrics_markdown",
    "tier_label",
    "tier_samples",
    "vllm_metric_definitions",
]

STANDALONE_PREFIX = "kvtier_"
VLLM_PREFIX = "vllm:kvtier_"  # vLLM exports (and LLM.get_metrics reads) vllm:* only
PRIMARY_LABEL = "0:primary"

Samples = dict[str, dict[tuple[str, ...], float]]
"""Cumulative values: metric name (no prefix, no ``_total``) -> label values -> value."""


class ProbeMetrics(Protocol):
    """Where a tier's lookup manager reports probe-call durations (any thread)."""

    def probe_observer(self, tier_name: str) -> Callable[[float], None]: ...


class MetricKind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: ``name`` without prefix and without the ``_total`` counters get."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ("tier",)
    standalone_only: bool = False  # about kvtier's own primary pool (vLLM owns it there)

    def exposed(self, prefix: str = STANDALONE_PREFIX) -> str:
        """The name a scrape shows (counters end in ``_total``)."""
        return prefix + self.name + ("_total" if self.kind is MetricKind.COUNTER else "")


def _counter(name: str, help_text: str, *, standalone_only: bool = False) -> MetricSpec:
    return MetricSpec(name, MetricKind.COUNTER, help_text, standalone_only=standalone_only)


def _gauge(name: str, help_text: str) -> MetricSpec:
    return MetricSpec(name, MetricKind.GAUGE, help_text)


VOCABULARY: tuple[MetricSpec, ...] = (
    # lookups (tier 0:primary: the manager's answers; other tiers: that tier's answers)
    _counter("lookups", "Lookup calls, 'ask again' answers included"),
    _counter("lookup_hits", "Lookups answered present"),
    _counter("lookup_tokens", "Tokens of the keys answered present or absent "
             "(on 0:primary: every answered key; 0 while namespace.block_size is 0)"),
    _counter("lookup_hit_tokens", "Tokens of the keys answered present"),
    _counter("lookup_inflight_reuses", "Lookups that joined a probe already in flight"),
    _counter("lookup_verdict_cache_hits", "Lookups answered from the verdict cache"),
    _counter("lookup_quarantine_hits", "Lookups answered absent because the key is quarantined"),
    _counter("probe_calls", "Backend existence-probe calls"),
    _counter("probe_error_keys", "Keys resolved absent because a probe call failed"),
    _counter("probe_timeout_keys", "Keys resolved absent because a probe timed out"),
    _counter("breaker_opens", "Times the tier's circuit breaker opened"),
    # transfers
    _counter("load_jobs", "Load (promotion) jobs submitted"),
    _counter("store_jobs", "Store (cascade) jobs submitted"),
    _counter("loaded_blocks", "Blocks loaded and verified"),
    _counter("load_failed_blocks", "Blocks whose load failed, was missing or corrupt"),
    _counter("stored_blocks", "Blocks stored (on 0:primary: engine stores completed)"),
    _counter("store_failed_blocks", "Blocks whose store failed"),
    _counter("store_shed_blocks", "Blocks not stored because the tier was backlogged"),
    _counter("evicted_blocks", "Blocks evicted from the primary pool", standalone_only=True),
    _counter("read_bytes", "Payload bytes loaded from the tier"),
    _counter("write_bytes", "Payload bytes stored to the tier"),
    _counter("read_seconds", "Busy time of load jobs (summed over I/O threads)"),
    _counter("write_seconds", "Busy time of store jobs (summed over I/O threads)"),
    _counter("job_errors", "Transfer jobs whose backend call raised"),
    _counter("backend_errors", "Backend operations that failed"),
    _counter("backend_corrupt_objects", "Stored objects that failed verification"),
    # state
    _gauge("resident_blocks", "Blocks held by the tier now (where the tier can tell)"),
    _gauge("resident_bytes", "Bytes held by the tier now (where the tier can tell)"),
    _gauge("capacity_bytes", "The tier's byte limit (where it has one)"),
    _gauge("quarantined_keys", "Keys quarantined now"),
    _gauge("breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open"),
    _gauge("jobs_in_flight", "Transfer jobs submitted and not yet collected"),
    MetricSpec("primary_slots", MetricKind.GAUGE, "Primary pool slots by state",
               labels=("state",), standalone_only=True),
    MetricSpec("probe_duration_seconds", MetricKind.HISTOGRAM,
               "Duration of one backend existence-probe call"),
)
_BY_NAME = {spec.name: spec for spec in VOCABULARY}
_PROBE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  0.5, 1.0, 2.5, 5.0, 10.0)
_BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}

# metric -> the tier-stats field it reads (see SecondaryTier.stats()).
_TIER_FIELDS: Mapping[str, str] = {
    "lookups": "lookups",
    "lookup_hits": "lookup_hits",
    "lookup_inflight_reuses": "inflight_reuses",
    "lookup_verdict_cache_hits": "verdict_cache_hits",
    "lookup_quarantine_hits": "quarantine_hits",
    "probe_calls": "backend_calls",
    "probe_error_keys": "probe_errors",
    "probe_timeout_keys": "probe_timeouts",
    "breaker_opens": "breaker_opens",
    "load_jobs": "loads_submitted",
    "store_jobs": "stores_submitted",
    "loaded_blocks": "loaded_keys",
    "load_failed_blocks": "load_keys_failed",
    "stored_blocks": "stored_keys",
    "store_failed_blocks": "store_keys_failed",
    "store_shed_blocks": "store_keys_shed",
    "read_bytes": "read_bytes",
    "write_bytes": "write_bytes",
    "read_seconds": "read_seconds",
    "write_seconds": "write_seconds",
    "job_errors": "job_errors",
    "backend_errors": "backend_errors",
    "backend_corrupt_objects": "backend_corrupt_objects",
    "quarantined_keys": "quarantined_keys",
    "jobs_in_flight": "outstanding_jobs",
    "resident_blocks": "backend_blocks",
    "resident_bytes": "backend_used_bytes",
}


def exposed_names(prefix: str = STANDALONE_PREFIX, *, vllm: bool = False) -> list[str]:
    """Every metric name a scrape can show (histograms with their ``_bucket``/``_count``/
    ``_sum`` series); ``vllm=True``: the ones a KvtierTier publishes."""
    names: list[str] = []
    for spec in VOCABULARY:
        if vllm and spec.standalone_only:
            continue
        base = spec.exposed(prefix)
        if spec.kind is MetricKind.HISTOGRAM:
            names += [base + "_bucket", base + "_count", base + "_sum"]
        else:
            names.append(base)
    return names


def metrics_markdown() -> str:
    """The README's metric table, generated from :data:`VOCABULARY`."""
    rows = ["| metric (standalone; under vLLM: `vllm:` + the same) | type | labels | meaning |",
            "|---|---|---|---|"]
    for spec in VOCABULARY:
        where = " (standalone only)" if spec.standalone_only else ""
        rows.append(f"| `{spec.exposed()}` | {spec.kind.value} | "
                    f"{', '.join(spec.labels)} | {spec.help}{where} |")
    return "\n".join(rows) + "\n"


def tier_label(position: int, name: str) -> str:
    """vLLM's tier label shape: ``"1:KvtierTier"``; position 0 is the primary pool."""
    return f"{position}:{name}"


def tier_samples(stats: Mapping[str, Any], label: str, tokens_per_block: int) -> Samples:
    """One secondary tier's samples from its ``SecondaryTier.stats()``."""
    samples: Samples = {}
    key = (label,)
    for metric, field_name in _TIER_FIELDS.items():
        value = stats.get(field_name)
        if value is not None:
            samples[metric] = {key: float(value)}
    answered = float(stats.get("lookup_answers", 0))
    samples["lookup_tokens"] = {key: answered * tokens_per_block}
    samples["lookup_hit_tokens"] = {key: float(stats.get("lookup_hits", 0)) * tokens_per_block}
    samples["breaker_state"] = {key: float(_BREAKER_VALUES.get(str(stats.get("breaker_state")),
                                                               0))}
    max_bytes = stats.get("backend_max_bytes")
    if isinstance(max_bytes, int) and max_bytes > 0:
        samples["capacity_bytes"] = {key: float(max_bytes)}
    return samples


def manager_samples(stats: Mapping[str, Any], tokens_per_block: int) -> Samples:
    """Every sample of one manager from its ``TieringManager.get_stats()``."""
    primary, manager = stats["primary"], stats["manager"]
    key = (PRIMARY_LABEL,)
    answered = manager["hits"] + manager["hit_pending"] + manager["misses"]
    block_bytes = primary["block_bytes"]
    samples: Samples = {
        "lookups": {key: manager["lookups"]},
        "lookup_hits": {key: manager["hits"]},
        "lookup_tokens": {key: answered * tokens_per_block},
        "lookup_hit_tokens": {key: manager["hits"] * tokens_per_block},
        "stored_blocks": {key: manager["stores_completed"]},
        "evicted_blocks": {key: primary["evictions"]},
        "resident_blocks": {key: primary["resident_blocks"]},
        "resident_bytes": {key: primary["resident_blocks"] * block_bytes},
        "capacity_bytes": {key: primary["num_slots"] * block_bytes},
        "primary_slots": {
            ("free",): primary["free_slots"], ("filling",): primary["filling_slots"],
            ("resident",): primary["resident_blocks"], ("pinned",): primary["pinned_slots"],
        },
    }
    for position, (name, tier_stats) in enumerate(stats["tiers"].items(), start=1):
        label = tier_label(position, name)
        for metric, values in tier_samples(tier_stats, label, tokens_per_block).items():
            samples.setdefault(metric, {}).update(values)
    return samples


class KvtierMetrics:
    """The ``kvtier_*`` metrics of one manager, in ``registry`` (a private one by default).

    Scheduler-thread counters arrive as whole snapshots (:meth:`publish`); the probe-duration
    histogram is observed where probes run (:meth:`probe_observer`).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self._samples: Samples = {}
        self._tier_labels: dict[str, str] = {}
        self._collector = _SnapshotCollector(self)
        self.registry.register(self._collector)
        try:
            spec = _BY_NAME["probe_duration_seconds"]
            self.probe_duration = Histogram(spec.exposed(), spec.help, list(spec.labels),
                                            buckets=_PROBE_BUCKETS, registry=self.registry)
        except ValueError:
            self.registry.unregister(self._collector)
            raise

    def bind_tiers(self, names: list[str]) -> None:
        """Label the secondary tiers ``names`` by position (the manager does this once)."""
        self._tier_labels = {name: tier_label(position, name)
                             for position, name in enumerate(names, start=1)}

    def probe_observer(self, tier_name: str) -> Callable[[float], None]:
        """Records one probe call's duration for ``tier_name`` (any thread)."""
        def observe(seconds: float) -> None:
            label = self._tier_labels.get(tier_name, tier_name)
            self.probe_duration.labels(tier=label).observe(seconds)
        return observe

    def publish(self, samples: Samples) -> None:
        """Make ``samples`` what the next scrape shows (scheduler thread)."""
        self._samples = samples

    @property
    def samples(self) -> Samples:
        return self._samples

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (e.g. ``value("kvtier_lookups_total",
        tier="0:primary")``); 0.0 when absent."""
        result = self.registry.get_sample_value(name, labels)
        return 0.0 if result is None else result

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def unregister(self) -> None:
        """Remove every metric from the registry (used at shutdown for the global registry)."""
        for collector in (self._collector, self.probe_duration):
            try:
                self.registry.unregister(collector)
            except KeyError:
                continue


class _SnapshotCollector:
    """Serves the last published snapshot at scrape time (never touches scheduler state)."""

    def __init__(self, owner: KvtierMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterator[Metric]:
        for spec in VOCABULARY:
            if spec.kind is not MetricKind.HISTOGRAM:
                yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        samples = self._owner.samples  # one read of the reference: a consistent snapshot
        for spec in VOCABULARY:
            values = samples.get(spec.name)
            if spec.kind is MetricKind.HISTOGRAM or not values:
                continue
            family = _family(spec)
            for label_values, value in values.items():
                family.add_metric(list(label_values), value)
            yield family


def _family(spec: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily:
    name = STANDALONE_PREFIX + spec.name
    if spec.kind is MetricKind.COUNTER:
        return CounterMetricFamily(name, spec.help, labels=list(spec.labels))
    return GaugeMetricFamily(name, spec.help, labels=list(spec.labels))


class DeltaTracker:
    """Turns cumulative snapshots into increments since the previous one (vLLM's stats carry
    increments); owned by the scheduler thread."""

    __slots__ = ("_reported",)

    def __init__(self) -> None:
        self._reported: dict[tuple[str, tuple[str, ...]], float] = {}

    def changes(self, samples: Samples) -> tuple[list[tuple[str, tuple[str, ...], float]],
                                                 list[tuple[str, tuple[str, ...], float]]]:
        """(counter increments, gauge values) of ``samples``: only counters that grew."""
        increments: list[tuple[str, tuple[str, ...], float]] = []
        gauges: list[tuple[str, tuple[str, ...], float]] = []
        for name, values in samples.items():
            spec = _BY_NAME[name]
            for labels, value in values.items():
                if spec.kind is MetricKind.GAUGE:
                    gauges.append((name, labels, value))
                    continue
                delta = value - self._reported.get((name, labels), 0.0)
                if delta > 0:
                    increments.append((name, labels, delta))
                    self._reported[(name, labels)] = value
        return increments, gauges


class ProbeDurations:
    """Probe-call durations waiting to be reported (vLLM reports histograms as observations)."""

    __slots__ = ("_pending",)

    def __init__(self, limit: int = 4096) -> None:
        self._pending: deque[float] = deque(maxlen=limit)

    def observe(self, seconds: float) -> None:  # probe worker thread
        self._pending.append(seconds)

    def probe_observer(self, tier_name: str) -> Callable[[float], None]:
        return self.observe

    def drain(self) -> list[float]:  # scheduler thread
        drained: list[float] = []
        while True:
            try:
                drained.append(self._pending.popleft())
            except IndexError:
                return drained


def vllm_metric_definitions(counter: Callable[..., Any], gauge: Callable[..., Any],
                            histogram: Callable[..., Any]) -> dict[str, Any]:
    """vLLM metric metadata for every metric a KvtierTier publishes, built with vLLM's
    ``Offloading{Counter,Gauge,Histogram}Metadata`` classes (passed in: vLLM is optional)."""
    definitions: dict[str, Any] = {}
    for spec in VOCABULARY:
        if spec.standalone_only:
            continue
        name = VLLM_PREFIX + spec.name
        if spec.kind is MetricKind.COUNTER:
            definitions[name] = counter(documentation=spec.help, labelnames=spec.labels)
        elif spec.kind is MetricKind.GAUGE:
            definitions[name] = gauge(documentation=spec.help, labelnames=spec.labels)
        else:
            definitions[name] = histogram(documentation=spec.help, labelnames=spec.labels,
                                          buckets=_PROBE_BUCKETS)
    return definitions
