"""What one replay measured: plain result records, filled by the engine, read by the report.

This module owns no shared state: the records are built by the replay loop on the thread that
runs it and are read-only afterwards.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvtier.replay.reference import Validation

PREFETCH_FIELDS = ("prefetched_blocks", "used_blocks", "wasted_blocks", "cancelled_blocks",
                   "started_blocks", "failed_blocks")
"""The prefetch counters a replay reports (blocks; see :mod:`kvtier.tiering.prefetch`)."""


class TierKind(enum.Enum):
    GPU = "gpu"
    PRIMARY = "primary"
    SECONDARY = "secondary"


@dataclass(slots=True)
class TierResult:
    """Hits served by one tier and the traffic it carried.

    A block counts as a hit of the tier it came from for that request: GPU if the simulated GPU
    prefix cache held it; CPU if the primary pool held it when the request first asked, or it
    came back from a write-back copy, or another request stored it meanwhile; else the
    secondary tier whose load promoted it (so a tier row never counts hits it did not read).
    """

    name: str
    kind: TierKind
    block_hits: int = 0
    token_hits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    io_seconds: float | None = None
    lookups: int | None = None
    backend_calls: int | None = None
    probes: int | None = None
    inflight_reuses: int | None = None
    verdict_cache_hits: int | None = None
    failed_loads: int | None = None
    failed_stores: int | None = None
    shed_stores: int | None = None
    probe_errors: int | None = None
    backend_errors: int | None = None
    corrupt_objects: int | None = None
    declined_loads: int | None = None  # hits not loaded: slower than recomputing them

    def gb_per_s(self, wall_s: float) -> float:
        """Bytes moved over the tier's own I/O time when known, else over the run's wall time."""
        seconds = self.io_seconds if self.io_seconds else wall_s
        return (self.bytes_read + self.bytes_written) / seconds / 1e9 if seconds > 0 else 0.0


@dataclass(slots=True)
class TimelinePoint:
    """Hits within one window of scheduled requests (for the plot)."""

    requests_done: int
    sim_time_s: float
    block_refs: int
    tier_hits: dict[str, int]
    ideal_hits: int


@dataclass(slots=True)
class ReplayResult:
    """Everything one replay (one lookup strategy) measured."""

    strategy: str
    trace_name: str
    requests: int
    skipped_lines: int
    instances: int
    block_bytes: int
    block_refs: int
    total_tokens: int
    ideal_block_hits: int
    ideal_token_hits: int
    tiers: list[TierResult]
    steps: int
    steps_waited: int
    requests_waited: int
    verified_blocks: int
    store_plans_refused: int
    step_time_p50_s: float
    step_time_p99_s: float
    wall_s: float
    tier_urls: list[str] = field(default_factory=list)
    timeline: list[TimelinePoint] = field(default_factory=list)
    manager_stats: list[dict[str, Any]] = field(default_factory=list)
    # Long contexts and sessions: every trace request is either replayed (``requests``) or
    # rejected (``requests_rejected``: more blocks than the modelled GPU of ``gpu_blocks``).
    requests_rejected: int = 0
    rejected_blocks: int = 0
    gpu_blocks: int = 0
    admission_rule: str = ""
    hash_convention: str = ""
    sessions: int = 0
    store_blocks_deferred: int = 0  # computed blocks that waited for pool slots (streamed)
    store_blocks_shed: int = 0      # computed blocks never stored (counted, never silent)
    promotions_lost: int = 0        # promoted blocks evicted before their request came back
    cascades_shed: int = 0          # cascades dropped for a backlogged tier
    store_waits: int = 0            # steps the scheduler waited for a backlogged tier
    store_wait_s: float = 0.0       # seconds of those waits (back-pressure: time, not hits)
    scheduler_s: float = 0.0        # scheduler-thread time of every step, summed
    # Block hits by where each block came from (adds up to block_hits): gpu, cpu_resident,
    # cpu_prefetched, copy_readmitted, stored_meanwhile, promoted.<tier>; see
    # kvtier.replay.instance.
    hit_sources: dict[str, int] = field(default_factory=dict)
    # Blocks the ideal hit but this run recomputed, by why the prefix ended early: store_shed,
    # cascade_shed, load_failed, no_room (a tier has it; whole-prefix loading ran out of pool
    # room), not_found (in no tier: evicted from a bounded tier, expired).
    lost_hits: dict[str, int] = field(default_factory=dict)
    # Session prefetch, summed over instances (PREFETCH_FIELDS; all 0 with prefetch off):
    # started = prefetched + cancelled + failed (+ in flight at the end, none after shutdown),
    # prefetched = used + wasted + still unused at the end.
    prefetch: dict[str, int] = field(default_factory=dict)

    @property
    def block_hits(self) -> int:
        return sum(tier.block_hits for tier in self.tiers)

    @property
    def token_hits(self) -> int:
        return sum(tier.token_hits for tier in self.tiers)

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.token_hits / self.total_tokens if self.total_tokens else 0.0

    @property
    def ideal_block_hit_ratio(self) -> float:
        return self.ideal_block_hits / self.block_refs if self.block_refs else 0.0

    @property
    def ideal_token_hit_ratio(self) -> float:
        return self.ideal_token_hits / self.total_tokens if self.total_tokens else 0.0

    def secondary_total(self, attribute: str) -> int:
        total = 0
        for tier in self.tiers:
            value = getattr(tier, attribute)
            if tier.kind is TierKind.SECONDARY and value is not None:
                total += int(value)
        return total


@dataclass(slots=True)
class ReplayReport:
    """One ``kvtier replay`` run: one result per strategy (several with ``--compare``)."""

    trace_source: str
    trace_sha256: str
    results: list[ReplayResult]
    validation: Validation | None
    validation_note: str
    settings: dict[str, Any] = field(default_factory=dict)
