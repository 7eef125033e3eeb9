"""Reference hit ratios: the ideal (infinite) cache and a plain LRU cache of block ids.

These are the yardsticks a replay is compared with, and the check that our reading of a trace
agrees with the published statistics (the Mooncake FAST'25 paper; the numbers are recorded
in this module, and the traces ship in ``kvtier/data``).
Pure functions; this module owns no mutable state beyond the locals of one call.

Both simulations follow the published method exactly: for each request, hits are the leading run
of its ids that are cached now (stop at the first miss); then every id of the request is touched
in prompt order (LRU: move to most-recently-used or insert, evicting the least-recently-used id
while over capacity). Nothing is pinned and there is no admission filter.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.replay.trace import Trace

VALIDATION_TOLERANCE = 0.01
"""Largest allowed difference between a computed and a published hit ratio."""


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    """Hit counts of one reference cache over one trace."""

    policy: str
    capacity_blocks: int | None
    block_hits: int
    block_refs: int
    token_hits: int
    total_tokens: int
    inserts: int
    evictions: int

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_refs if self.block_refs else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.token_hits / self.total_tokens if self.total_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PublishedTrace:
    """Published statistics of a known trace, identified by the sha256 of its bytes."""

    name: str
    sha256: str
    ideal_block_hit_ratio: float
    lru_block_hit_ratio: dict[int, float]


PUBLISHED_TRACES: tuple[PublishedTrace, ...] = (
    PublishedTrace(
        name="Mooncake FAST'25 conversation_trace.jsonl",
        sha256="b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        ideal_block_hit_ratio=0.3664,
        lru_block_hit_ratio={1_000: 0.0445, 3_000: 0.0650, 10_000: 0.2112, 30_000: 0.3257,
                             50_000: 0.3546, 100_000: 0.3637},
    ),
    PublishedTrace(
        name="Mooncake FAST'25 synthetic_trace.jsonl",
        sha256="bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
        ideal_block_hit_ratio=0.6396,
        lru_block_hit_ratio={1_000: 0.0825, 3_000: 0.1878, 10_000: 0.4235, 30_000: 0.6242,
                             50_000: 0.6396, 100_000: 0.6396},
    ),
)
"""From ``shared/traces/README.md`` ("LRU hit ratio (block-weighted)" table)."""

VALIDATED_LRU_CAPACITIES = (10_000, 100_000)


@dataclass(frozen=True, slots=True)
class ValidationCheck:
    label: str
    computed: float
    published: float

    @property
    def passed(self) -> bool:
        return abs(self.computed - self.published) <= VALIDATION_TOLERANCE


@dataclass(frozen=True, slots=True)
class Validation:
    """The outcome of comparing our reference simulation with a trace's published numbers."""

    trace_name: str
    checks: tuple[ValidationCheck, ...]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        parts = ", ".join(
            f"{c.label} {c.computed:.4f} vs {c.published:.4f}" for c in self.checks
        )
        return (
            f"{verdict}: {self.trace_name}: {parts} "
            f"(computed vs published, tolerance {VALIDATION_TOLERANCE})"
        )


def published_for(trace: Trace) -> PublishedTrace | None:
    """The published statistics for this exact trace file, if it is a known one."""
    return next((known for known in PUBLISHED_TRACES if known.sha256 == trace.sha256), None)


def ideal(trace: Trace) -> ReferenceResult:
    """Hit ratio of an infinite cache (every block ever seen stays cached)."""
    return _simulate(trace, None)[0]


def ideal_hit_runs(trace: Trace) -> list[int]:
    """Per request, the leading blocks an infinite cache would hold when it arrives."""
    return _simulate(trace, None)[1]


def lru(trace: Trace, capacity_blocks: int) -> ReferenceResult:
    """Hit ratio of an LRU cache holding at most ``capacity_blocks`` block ids."""
    if type(capacity_blocks) is not int or capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be an integer >= 1, got {capacity_blocks!r}")
    return _simulate(trace, capacity_blocks)[0]


def _simulate(trace: Trace, capacity: int | None) -> tuple[ReferenceResult, list[int]]:
    """The cache's totals, and each request's hit run (leading blocks found cached)."""
    runs: list[int] = []
    cache: OrderedDict[int, None] = OrderedDict()
    move_to_end = cache.move_to_end
    block_tokens = trace.block_tokens
    block_hits = block_refs = token_hits = total_tokens = inserts = evictions = 0
    for request in trace.requests:
        ids = request.hash_ids
        hit_run = 0
        for block_id in ids:
            if block_id not in cache:
                break
            hit_run += 1
        runs.append(hit_run)
        block_hits += hit_run
        block_refs += len(ids)
        total_tokens += request.input_length
        token_hits += request.tokens_in_blocks(0, hit_run, block_tokens)
        for block_id in ids:
            if block_id in cache:
                move_to_end(block_id)
                continue
            cache[block_id] = None
            inserts += 1
            if capacity is not None and len(cache) > capacity:
                cache.popitem(last=False)
                evictions += 1
    totals = ReferenceResult(
        policy="ideal" if capacity is None else "lru",
        capacity_blocks=capacity,
        block_hits=block_hits,
        block_refs=block_refs,
        token_hits=token_hits,
        total_tokens=total_tokens,
        inserts=inserts,
        evictions=evictions,
    )
    return totals, runs


def validate(trace: Trace) -> Validation | None:
    """Compare ideal and LRU (10,000 and 100,000 blocks) with the published numbers.

    Returns None when ``trace`` is not a complete known trace (no published numbers apply).
    """
    known = published_for(trace)
    if known is None or not trace.complete:
        return None
    checks = [ValidationCheck("ideal", ideal(trace).block_hit_ratio, known.ideal_block_hit_ratio)]
    for capacity in VALIDATED_LRU_CAPACITIES:
        checks.append(
            ValidationCheck(
                f"LRU {capacity:,}",
                lru(trace, capacity).block_hit_ratio,
                known.lru_block_hit_ratio[capacity],
            )
        )
    return Validation(trace_name=known.name, checks=tuple(checks))
