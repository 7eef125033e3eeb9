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
``TierStats`` snapshot: its counters, lookup stats and backend stats). A tier metric's spec names
the ``TierStats`` field it reads, so a new metric is one declaration here and one increment
where it is counted; :func:`manager_samples` and :func:`tier_samples` read them into
:data:`Samples` (cumulative values, by metric and label
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
    "Reading",
    "Samples",
    "TierSnapshot",
    "exposed_names",
    "manager_samples",
    "metrics_markdown",
    "tier_label",
    "tier_samples",
    "vllm_metric_definitions",
]


class MetricsRegistry(enum.Enum):
    """Where a manager registers its metrics; the value is the config spelling."""

    PRIVATE = "private"    # a CollectorRegistry per manager (several managers never collide)
    GLOBAL = "global"      # prometheus_client.REGISTRY (one manager per process)
    DISABLED = "disabled"  # no metrics

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


class Reading(enum.Enum):
    """How a tier metric's value is read from the field its spec names."""

    AS_IS = "as_is"              # the number (absent when the tier does not report it)
    TOKENS = "tokens"            # keys times the namespace's tokens per block
    BREAKER = "breaker"          # the breaker state as 0 closed, 1 half-open, 2 open
    POSITIVE = "positive"        # absent unless a positive int (a limit that may be unset)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: ``name`` without prefix and without the ``_total`` counters get.

    ``tier``: the secondary tier's stats field it reads (a ``TierStats`` path such as
    ``"counters.loaded_keys"`` or ``"backend.errors"``, see :mod:`kvtier.tiering.tier_stats`);
    empty for metrics that only the primary pool or the probe histogram has."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ("tier",)
    standalone_only: bool = False  # about kvtier's own primary pool and its cascades (vLLM
    # owns the pool there)
    tier: str = ""
    reading: Reading = Reading.AS_IS

    def exposed(self, prefix: str = STANDALONE_PREFIX) -> str:
        """The name a scrape shows (counters end in ``_total``)."""
        return prefix + self.name + ("_total" if self.kind is MetricKind.COUNTER else "")


def _counter(name: str, help_text: str, tier: str = "", *, standalone_only: bool = False,
             reading: Reading = Reading.AS_IS) -> MetricSpec:
    return MetricSpec(name, MetricKind.COUNTER, help_text, standalone_only=standalone_only,
                      tier=tier, reading=reading)


def _gauge(name: str, help_text: str, tier: str = "",
           reading: Reading = Reading.AS_IS) -> MetricSpec:
    return MetricSpec(name, MetricKind.GAUGE, help_text, tier=tier, reading=reading)


VOCABULARY: tuple[MetricSpec, ...] = (
    # lookups (tier 0:primary: the manager's answers; other tiers: that tier's answers)
    _counter("lookups", "Lookup calls, 'ask again' answers included", "lookup.lookups"),
    _counter("lookup_hits", "Lookups answered present", "counters.lookup_hits"),
    _counter("lookup_tokens", "Tokens of the keys answered present or absent "
             "(on 0:primary: every answered key; 0 while namespace.block_size is 0)",
             "counters.lookup_answers", reading=Reading.TOKENS),
    _counter("lookup_hit_tokens", "Tokens of the keys answered present",
             "counters.lookup_hits", reading=Reading.TOKENS),
    _counter("lookup_inflight_reuses", "Lookups that joined a probe already in flight",
             "lookup.inflight_reuses"),
    _counter("lookup_verdict_cache_hits", "Lookups answered from the verdict cache",
             "lookup.verdict_cache_hits"),
    _counter("lookup_quarantine_hits", "Lookups answered absent because the key is quarantined",
             "lookup.quarantine_hits"),
    _counter("probe_calls", "Backend existence-probe calls", "lookup.backend_calls"),
    _counter("probe_error_keys", "Keys resolved absent because a probe call failed",
             "lookup.probe_errors"),
    _counter("probe_timeout_keys", "Keys resolved absent because a probe timed out",
             "lookup.probe_timeouts"),
    _counter("probe_delays", "Checks that found probes past their deadline queued behind a "
             "probe call still in progress (back-pressure, not a fault)",
             "lookup.probes_delayed"),
    _counter("breaker_opens", "Times the tier's circuit breaker opened", "lookup.breaker_opens"),
    # transfers
    _counter("load_jobs", "Load (promotion) jobs submitted", "counters.loads_submitted"),
    _counter("store_jobs", "Store (cascade) jobs submitted", "counters.stores_submitted"),
    _counter("loaded_blocks", "Blocks loaded and verified", "counters.loaded_keys"),
    _counter("load_failed_blocks", "Blocks whose load failed, was missing or corrupt",
             "counters.load_keys_failed"),
    _counter("stored_blocks", "Blocks stored (on 0:primary: engine stores completed)",
             "counters.stored_keys"),
    _counter("store_failed_blocks", "Blocks whose store failed", "counters.store_keys_failed"),
    _counter("store_shed_blocks", "Blocks not stored because the tier was backlogged",
             "counters.store_keys_shed"),
    _counter("store_waits", "Steps that waited for the tier's store backlog (back-pressure: "
             "a slow tier costs time, not hits)", "counters.store_waits", standalone_only=True),
    _counter("store_wait_seconds", "Scheduler time spent waiting for the tier's store backlog",
             "counters.store_wait_seconds", standalone_only=True),
    _counter("store_stalls", "Store waits ended because the tier finished no job within "
             "store_stall_s (its excess was shed)", "counters.store_stalls",
             standalone_only=True),
    _counter("evicted_blocks", "Blocks evicted from the primary pool", standalone_only=True),
    _counter("read_bytes", "Payload bytes loaded from the tier", "counters.read_bytes"),
    _counter("write_bytes", "Payload bytes stored to the tier", "counters.write_bytes"),
    _counter("read_seconds", "Busy time of load jobs (summed over I/O threads)",
             "counters.read_seconds"),
    _counter("write_seconds", "Busy time of store jobs (summed over I/O threads)",
             "counters.write_seconds"),
    _counter("loads_declined", "Tier hits answered absent because loading them would take "
             "longer than recomputing them (prefill_tokens_per_s against the tier's measured "
             "load rate)", "counters.loads_declined"),
    _counter("job_errors", "Transfer jobs whose backend call raised", "counters.job_errors"),
    _counter("backend_errors", "Backend operations that failed", "backend.errors"),
    _counter("backend_corrupt_objects", "Stored objects that failed verification",
             "backend.corrupt_objects"),
    _counter("backend_auth_failures", "Stored objects refused: no valid MAC under the tier's "
             "auth keys (another key's, unkeyed or forged)", "backend.auth_failures"),
    _counter("backend_auth_old_key", "Blocks served that an older key of the tier's key list "
             "signed (key rotation; the next store rewrites them)", "backend.auth_old_key"),
    _counter("backend_old_format", "Blocks served in an older kvtier frame format (the next "
             "store rewrites them)", "backend.old_format"),
    # prefetch (under vLLM: a KvtierTier's staging memory, filled when a request finishes)
    _counter("prefetched_blocks", "Blocks read ahead into the staging memory after their "
             "request finished"),
    _counter("prefetch_used_blocks", "Staged blocks a load used (a memory copy, no backend "
             "read)"),
    _counter("prefetch_wasted_blocks", "Staged blocks dropped unused (evicted, expired, or "
             "their backend copy changed)"),
    _counter("prefetch_cancelled_blocks", "Prefetch reads dropped before staging (a demand "
             "load took the block, or the room was needed)"),
    # state
    _gauge("prefetch_staged_bytes", "Bytes held in the staging memory now"),
    _gauge("resident_blocks", "Blocks held by the tier now (where the tier can tell)",
           "backend.blocks"),
    _gauge("resident_bytes", "Bytes held by the tier now (where the tier can tell)",
           "backend.used_bytes"),
    _gauge("capacity_bytes", "The tier's byte limit (where it has one)", "backend.max_bytes",
           Reading.POSITIVE),
    _gauge("quarantined_keys", "Keys quarantined now", "lookup.quarantined_keys"),
    _gauge("breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open",
           "lookup.breaker_state", Reading.BREAKER),
    _gauge("jobs_in_flight", "Transfer jobs submitted and not yet collected", "outstanding_jobs"),
    MetricSpec("primary_slots", MetricKind.GAUGE, "Primary pool slots by state",
               labels=("state",), standalone_only=True),
    MetricSpec("probe_duration_seconds", MetricKind.HISTOGRAM,
               "Duration of one backend existence-probe call"),
)
_BY_NAME = {spec.name: spec for spec in VOCABULARY}
_TIER_SPECS = tuple(spec for spec in VOCABULARY if spec.tier)
_PROBE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                  0.5, 1.0, 2.5, 5.0, 10.0)
_BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


class TierSnapshot(Protocol):
    """A secondary tier's stats snapshot (``kvtier.tiering.tier_stats.TierStats``)."""

    def value(self, path: str) -> Any: ...


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


def _read(spec: MetricSpec, stats: TierSnapshot, tokens_per_block: int) -> float | None:
    value = stats.value(spec.tier)
    if spec.reading is Reading.BREAKER:
        return float(_BREAKER_VALUES.get(str(getattr(value, "value", value)), 0))
    if value is None:
        return None
    if spec.reading is Reading.TOKENS:
        return float(value) * tokens_per_block
    if spec.reading is Reading.POSITIVE:
        is_count = isinstance(value, int) and not isinstance(value, bool)
        return float(value) if is_count and value > 0 else None
    return float(value)


def tier_samples(stats: TierSnapshot, label: str, tokens_per_block: int) -> Samples:
    """One secondary tier's samples from its ``SecondaryTier.stats()``: every metric whose
    spec names a tier field."""
    samples: Samples = {}
    for spec in _TIER_SPECS:
        value = _read(spec, stats, tokens_per_block)
        if value is not None:
            samples[spec.name] = {(label,): value}
    return samples


PREFETCH_COUNTS = {"prefetched_blocks": "prefetched_blocks",
                   "prefetch_used_blocks": "used_blocks",
                   "prefetch_wasted_blocks": "wasted_blocks",
                   "prefetch_cancelled_blocks": "cancelled_blocks"}
"""Prefetch metric -> the count it reads (``PrefetchCounts`` of the vLLM tier's staging)."""


def prefetch_samples(counts: Mapping[str, int], staged_bytes: int, label: str) -> Samples:
    """One tier's prefetch samples from its staging memory's counts."""
    samples: Samples = {name: {(label,): float(counts[field])}
                        for name, field in PREFETCH_COUNTS.items()}
    samples["prefetch_staged_bytes"] = {(label,): float(staged_bytes)}
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
