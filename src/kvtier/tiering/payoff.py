"""Whether loading a prefix from a tier beats recomputing it: one pure function.

This module owns no state. :func:`blocks_worth_loading` is the one place of the rule "a hit is
taken only when it pays" (DESIGN.md, liveness); the tier's measured cost
(:class:`~kvtier.tiering.load_rate.LoadRate`) and the engine's prefill rate are its inputs.
Both the :class:`~kvtier.tiering.TieringManager`'s prefix scan and the vLLM tier's lookups
ask it through :meth:`~kvtier.tiering.tier.SecondaryTier.blocks_worth_loading`.

The model: one load job of ``n`` blocks takes ``seconds_per_job + n * block_bytes *
seconds_per_byte`` (the job's round trips, then its payload); recomputing them takes ``n *
tokens_per_block / prefill_tokens_per_s``. A job that would outlast the tier's load deadline
fails anyway (its keys are recomputed after the wait), so the blocks that fit before it are
the most that can pay; they are loaded only when that is strictly faster than recomputing
them, and a tie is recomputed (no gain, and the estimate has noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.settings import ConfigError

__all__ = ["LoadCost", "blocks_worth_loading"]


@dataclass(slots=True, frozen=True)
class LoadCost:
    """What one load job from a tier costs: ``seconds_per_job`` (round trips, scheduling) plus
    ``seconds_per_byte`` of payload. Both are finite and >= 0."""

    seconds_per_job: float
    seconds_per_byte: float

    def __post_init__(self) -> None:
        for name in ("seconds_per_job", "seconds_per_byte"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ConfigError(f"LoadCost.{name}: expected a finite number >= 0 (seconds), "
                                  f"got {value!r}")

    def seconds(self, nbytes: int) -> float:
        """How long one job moving ``nbytes`` takes."""
        return self.seconds_per_job + nbytes * self.seconds_per_byte


FREE = LoadCost(0.0, 0.0)
"""A load that costs nothing: every hit pays (the optimistic prior, see ``LoadRate``)."""


def _count(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def _positive_or_none(name: str, value: object, unit: str) -> float | None:
    if value is None:
        return None
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ConfigError(f"{name}: expected a finite number > 0 ({unit}) or None, "
                          f"got {value!r}")
    return float(value)


def blocks_worth_loading(blocks: int, *, block_bytes: int, tokens_per_block: int,
                         cost: LoadCost, prefill_tokens_per_s: float | None,
                         deadline_s: float | None = None) -> int:
    """How many of ``blocks`` leading blocks to load (the rest is recomputed).

    ``prefill_tokens_per_s`` None (no prefill rate known) or ``tokens_per_block`` 0 (the
    namespace does not say) never declines: ``blocks``. ``deadline_s``: the tier's load
    deadline (None: none). Bad values raise :class:`~kvtier.settings.ConfigError` naming them.
    """
    blocks = _count("blocks", blocks, 0)
    block_bytes = _count("block_bytes", block_bytes, 1)
    tokens_per_block = _count("tokens_per_block", tokens_per_block, 0)
    if not isinstance(cost, LoadCost):
        raise ConfigError(f"cost: expected a LoadCost, got {type(cost).__name__}")
    prefill = _positive_or_none("prefill_tokens_per_s", prefill_tokens_per_s, "tokens/s")
    deadline = _positive_or_none("deadline_s", deadline_s, "seconds")
    if prefill is None or tokens_per_block == 0 or blocks == 0:
        return blocks
    load_per_block = block_bytes * cost.seconds_per_byte
    count = blocks
    if deadline is not None:
        count = min(count, _blocks_before(deadline, cost.seconds_per_job, load_per_block))
    if count == 0:
        return 0
    load_s = cost.seconds_per_job + count * load_per_block
    recompute_s = count * tokens_per_block / prefill
    return count if load_s < recompute_s else 0


def _blocks_before(deadline_s: float, per_job_s: float, per_block_s: float) -> int:
    """The most blocks one job moves before ``deadline_s`` (a huge number when bytes are free)."""
    if per_job_s >= deadline_s:
        return 0
    if per_block_s <= 0:
        return 2**62
    return int(min(2**62, (deadline_s - per_job_s) // per_block_s))
