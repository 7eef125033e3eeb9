"""A replay in a line and in plain tables: the verdict that opens the report, the terms the
report uses (explained once, below its tables), and the ``--format plain`` tables.

Pure presentation of :class:`~kvtier.replay.results.ReplayReport`; this module owns no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.replay.results import ReplayReport, ReplayResult, TierKind, TierResult
from kvtier.text import Sheet

SAME_DIGITS = 4
"""Hit ratios are shown with this many decimals; equal at this precision reads as "=" ideal."""

TERMS: tuple[tuple[str, str], ...] = (
    ("GPU", "the simulated engine's own prefix cache (vLLM's KV cache on the GPU), looked up "
            "before kvtier; a GPU hit never reaches kvtier"),
    ("CPU", "kvtier's primary pool in host memory"),
    ("ideal", "an infinite cache: every block seen before is a hit (no cache can do better)"),
    ("block hit ratio", "blocks served by a tier / block references of all requests"),
    ("requests that waited", "requests held back at least one engine step because a "
                             "secondary tier had not yet answered whether it holds their "
                             "blocks, or was still loading one (steps waited on lookups counts "
                             "those request-steps)"),
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The run in one line: the first strategy's block hit ratio against the ideal, the
    validation of the reference simulation, and the wall time of every replay of the run."""

    strategy: str
    block_hit_ratio: float
    ideal_block_hit_ratio: float
    validation: str
    """``PASSED`` / ``FAILED`` against published numbers, ``n/a`` when none apply."""
    wall_s: float

    @property
    def of_ideal(self) -> float | None:
        """The hit ratio as a fraction of the ideal (None when the trace repeats no block)."""
        if self.ideal_block_hit_ratio <= 0:
            return None
        return self.block_hit_ratio / self.ideal_block_hit_ratio

    def line(self) -> str:
        hits = f"{self.block_hit_ratio:.{SAME_DIGITS}f}"
        ideal = f"{self.ideal_block_hit_ratio:.{SAME_DIGITS}f}"
        sign = "=" if hits == ideal else "<" if self.block_hit_ratio < self.ideal_block_hit_ratio \
            else ">"
        share = self.of_ideal
        of_ideal = ("no block repeats: nothing to hit" if share is None
                    else f"{share:.3f} of ideal")
        return (f"block hit {hits} {sign} ideal {ideal} ({of_ideal}) · validation "
                f"{self.validation} · {self.wall_s:.1f} s")

    def to_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "block_hit_ratio": self.block_hit_ratio,
                "ideal_block_hit_ratio": self.ideal_block_hit_ratio, "of_ideal": self.of_ideal,
                "validation": self.validation, "wall_s": self.wall_s, "line": self.line()}


def verdict(report: ReplayReport) -> Verdict:
    first = report.results[0]
    validation = ("n/a" if report.validation is None
                  else "PASSED" if report.validation.passed else "FAILED")
    return Verdict(strategy=first.strategy, block_hit_ratio=first.block_hit_ratio,
                   ideal_block_hit_ratio=first.ideal_block_hit_ratio, validation=validation,
                   wall_s=sum(result.wall_s for result in report.results))


def terms_text() -> str:
    """The report's terms, explained once (printed below its tables)."""
    return "terms: " + "; ".join(f"{term} = {meaning}" for term, meaning in TERMS) + "."


# --------------------------------------------------------------------------- plain tables

_TIER_COLUMNS = ("strategy", "tier", "kind", "block_hits", "block_hit_ratio", "token_hits",
                 "token_hit_ratio", "bytes_read", "bytes_written", "mb_per_s_wall")
_LOOKUP_FIELDS = ("lookups", "backend_calls", "probes", "inflight_reuses", "verdict_cache_hits",
                  "failed_loads", "failed_stores", "shed_stores", "probe_errors",
                  "backend_errors", "corrupt_objects")
_RUN_FIELDS = ("requests", "skipped_lines", "instances", "block_refs", "block_hits",
               "block_hit_ratio", "ideal_block_hits", "ideal_block_hit_ratio", "token_hits",
               "total_tokens", "token_hit_ratio", "ideal_token_hit_ratio", "verified_blocks",
               "steps", "steps_waited", "requests_waited", "store_plans_refused",
               "requests_rejected", "rejected_blocks", "gpu_blocks", "admission_rule",
               "hash_convention", "sessions", "store_blocks_deferred", "store_blocks_shed",
               "cascades_shed", "store_waits", "store_wait_s", "promotions_lost",
               "step_time_p50_s", "step_time_p99_s", "wall_s")


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _tier_row(result: ReplayResult, tier: TierResult) -> tuple[object, ...]:
    moved = tier.kind is not TierKind.GPU
    rate = ((tier.bytes_read + tier.bytes_written) / result.wall_s / 1e6
            if moved and result.wall_s > 0 else None)
    return (result.strategy, tier.name, tier.kind.value, tier.block_hits,
            _share(tier.block_hits, result.block_refs), tier.token_hits,
            _share(tier.token_hits, result.total_tokens),
            tier.bytes_read if moved else None, tier.bytes_written if moved else None, rate)


def tier_sheet(report: ReplayReport) -> Sheet:
    """Every tier of every strategy, then the run's total and the ideal (kind ``total`` and
    ``ideal``) per strategy."""
    rows: list[tuple[object, ...]] = []
    for result in report.results:
        rows += [_tier_row(result, tier) for tier in result.tiers]
        rows.append((result.strategy, "all tiers", "total", result.block_hits,
                     result.block_hit_ratio, result.token_hits, result.token_hit_ratio,
                     None, None, None))
        rows.append((result.strategy, "ideal", "ideal", result.ideal_block_hits,
                     result.ideal_block_hit_ratio, result.ideal_token_hits,
                     result.ideal_token_hit_ratio, None, None, None))
    return Sheet(_TIER_COLUMNS, tuple(rows))


def lookup_sheet(report: ReplayReport) -> Sheet:
    """One row per secondary tier per strategy: the lookup and transfer counters."""
    rows = []
    for result in report.results:
        for tier in result.tiers:
            if tier.kind is not TierKind.SECONDARY:
                continue
            busy = ((tier.bytes_read + tier.bytes_written) / tier.io_seconds / 1e9
                    if tier.io_seconds else None)
            rows.append((result.strategy, tier.name,
                         *(getattr(tier, name) for name in _LOOKUP_FIELDS), busy))
    return Sheet(("strategy", "tier", *_LOOKUP_FIELDS, "busy_gb_per_s"), tuple(rows))


def run_sheet(report: ReplayReport) -> Sheet:
    """One row per strategy: what the run table shows, the validation and the trace."""
    state = verdict(report).validation
    rows = tuple(
        (result.strategy, *(getattr(result, name) for name in _RUN_FIELDS),
         ",".join(result.tier_urls), state, report.validation_note, report.trace_source,
         report.trace_sha256)
        for result in report.results
    )
    return Sheet(("strategy", *_RUN_FIELDS, "tier_urls", "validation", "validation_note",
                  "trace", "trace_sha256"), rows)


def sources_sheet(report: ReplayReport) -> Sheet:
    """Per strategy: block hits by where they came from (``hit``: gpu, cpu_resident, ...;
    they add up to ``block_hits``) and hits lost against the ideal by cause (``lost``)."""
    rows: list[tuple[object, ...]] = []
    for result in report.results:
        rows += [(result.strategy, "hit", name, count)
                 for name, count in result.hit_sources.items()]
        rows += [(result.strategy, "lost", name, count)
                 for name, count in result.lost_hits.items()]
    return Sheet(("strategy", "outcome", "source", "blocks"), tuple(rows))


def report_sheets(report: ReplayReport) -> list[Sheet]:
    """The ``--format plain`` tables of a replay: tiers, lookups, run, hit sources."""
    return [tier_sheet(report), lookup_sheet(report), run_sheet(report), sources_sheet(report)]
