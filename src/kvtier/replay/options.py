"""What a replay is asked to do (:class:`ReplayOptions`, how requests are routed) and the
simulator's fixed rules. Immutable records; no state.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_GPU_BLOCKS = 2_000
STORE_PATIENCE_STEPS = 500
ARRIVAL_RULE = "arrival order (the trace names no sessions)"
CAUSAL_RULE = ("session causality: a session's next request waits until its previous one "
               "finished, plus the recorded gap / speed")

_PAYLOAD_SEED = 0x6B76_7469_6572  # "kvtier"
_KEY_PREFIX_BYTES = 16
_IDLE_SLEEP_S = 0.0005
_MAX_SPEED_SLEEP_S = 0.005


class Route(enum.Enum):
    """How requests are spread over instances."""

    ROUND_ROBIN = "round_robin"
    FIRST_BLOCK_HASH = "hash"


class Prefetch(enum.Enum):
    """Whether the replayed managers prefetch a session's chain between its turns."""

    ON = "on"
    OFF = "off"


DEFAULT_PREFETCH = Prefetch.OFF
"""The replay's default, the library's too: measured on ``builtin:agentic`` (speed 20,
``benchmarks/session_prefetch.py``, commit 3a4ca51), prefetch keeps every hit and at 16 sessions
waits fewer steps than off, but brings back only 0.017 of the tier-served blocks in time (target
0.80), costs scheduler time per step, and at 50 sessions requests waited 1.41x the steps of off
in one pair (0.96x in another); ``--prefetch on`` measures it."""


class PrefixLoading(enum.Enum):
    """How the simulated engine loads a request's prefix from the manager."""

    PIECES = "pieces"  # lookup_piece: any length, a piece at a time (the default)
    WHOLE = "whole"    # lookup_prefix: all at once, or up to where the pool's room ends


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """Settings of one replay; see ``kvtier replay --help`` for the meaning of each."""

    tier_urls: tuple[str, ...] = ()
    instances: int = 1
    route: Route = Route.ROUND_ROBIN
    speed: float | None = None
    max_running: int = 32
    gpu_blocks: int | None = None
    cpu_blocks: int = 16_000
    block_bytes: int = 16 * 1024
    decode_tokens_per_step: int = 64
    step_ms: float = 10.0
    eviction_policy: str = "lru"
    write_policy: str = "write_through"
    namespace_tag: str = ""
    scratch_dir: str | None = None
    max_wait_s: float = 120.0
    timeline_windows: int = 100
    store_patience_steps: int = STORE_PATIENCE_STEPS
    prefix_loading: PrefixLoading = PrefixLoading.PIECES
    prefetch: Prefetch = DEFAULT_PREFETCH

    def __post_init__(self) -> None:
        _require_int("instances", self.instances, 1)
        _require_int("max_running", self.max_running, 1)
        if self.gpu_blocks is not None:
            _require_int("gpu_blocks", self.gpu_blocks, 0)
        _require_int("store_patience_steps", self.store_patience_steps, 1)
        _require_int("cpu_blocks", self.cpu_blocks, 1)
        _require_int("block_bytes", self.block_bytes, 16)
        if self.block_bytes % 16:
            raise ValueError(
                f"block_bytes must be a multiple of 16, got {self.block_bytes}"
            )
        _require_int("decode_tokens_per_step", self.decode_tokens_per_step, 1)
        _require_int("timeline_windows", self.timeline_windows, 1)
        if self.speed is not None and not self.speed > 0:
            raise ValueError(
                f"speed must be > 0 (or None for as fast as possible), got {self.speed}"
            )
        if not (self.step_ms >= 0 and math.isfinite(self.step_ms)):
            raise ValueError(f"step_ms must be a finite number >= 0, got {self.step_ms}")
        if not isinstance(self.prefetch, Prefetch):
            raise ValueError(f"prefetch must be one of {[p.value for p in Prefetch]}, got "
                             f"{self.prefetch!r}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")


def _require_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


ProgressCallback = Callable[[int, int], None]
"""Called with (requests scheduled, total requests) as the replay advances."""
