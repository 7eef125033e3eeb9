"""What ``kvtier bench serve`` runs: configuration names, passes, tiers, model shapes, presets,
the settings of one benchmark and the result records.

No state: immutable presets and plain records, built and read on the calling thread.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError

CONFIG_NAMES = (
    "prefix-cache-only", "vllm-fs", "kvtier-file", "kvtier-redis", "kvtier-file-prefetch",
    "kvtier-redis-prefetch", "kvtier-file-restart", "no-reuse-baseline", "no-reuse-kvtier",
)
DIAGNOSTIC_CONFIG_NAMES = ("kvtier-memory",)
"""Run only when named in ``--configs``: ``kvtier-memory`` keeps the blocks in the engine
worker's own memory (kvtier's memory tier), so its TTFT is what any tier can reach under
vLLM's offloading steps with a load that costs next to nothing: the floor for the others."""
ALL_CONFIG_NAMES = CONFIG_NAMES + DIAGNOSTIC_CONFIG_NAMES
SERVED_MODEL = "kvtier-bench-llama"
HEALTH_DEADLINE_S = 600.0
STOP_DEADLINE_S = 30.0
SHM_GLOB = "vllm_offload_*.mmap"


class ServeBenchError(KvtierError, RuntimeError):
    """The benchmark could not run (a server did not start, the client failed)."""


class Pass(enum.Enum):
    WARM = "warm"
    MEASURED = "measured"


class TraceKind(enum.Enum):
    REUSE = "reuse"
    NO_REUSE = "no-reuse"


class ServeTier(enum.Enum):
    NONE = "none"
    VLLM_FS = "vllm-fs"
    KVTIER_FILE = "kvtier-file"
    KVTIER_REDIS = "kvtier-redis"
    KVTIER_MEMORY = "kvtier-memory"


@dataclass(slots=True, frozen=True)
class ModelShape:
    """A Llama's shape; the weights are random (seeded), the tokenizer word level."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def parameters(self) -> int:
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp) + 2 * self.vocab_size * self.hidden_size


@dataclass(slots=True, frozen=True)
class Preset:
    model: ModelShape
    block_size: int
    max_model_len: int
    kv_cache_bytes: int
    cpu_tier_bytes: int
    requests: int
    output_len: int


MIB = 1 << 20
PRESETS: dict[str, Preset] = {
    # Prefill of a ~900-token prompt takes ~0.4 s on one core; the engine cache holds ~4k tokens.
    "cpu": Preset(ModelShape(512, 8, 8, 2, 1536, 1024, "float32"), block_size=32,
                  max_model_len=2048, kv_cache_bytes=32 * MIB, cpu_tier_bytes=96 * MIB,
                  requests=40, output_len=8),
    # Llama-3-8B-shaped (random weights): for a lent GPU.
    "gpu": Preset(ModelShape(4096, 32, 32, 8, 14336, 32000, "bfloat16"), block_size=64,
                  max_model_len=16384, kv_cache_bytes=2048 * MIB, cpu_tier_bytes=8192 * MIB,
                  requests=400, output_len=32),
}


@dataclass(slots=True)
class ServerSpec:
    name: str
    tier: ServeTier
    trace: TraceKind
    passes: tuple[Pass, ...]
    tier_dir: Path | None = None
    prefetch_bytes: int = 0  # the KvtierTier's staging memory (0: no prefetch)


@dataclass(slots=True)
class PassResult:
    raw: dict[str, Any]
    metrics_delta: dict[str, float]
    result_file: str


@dataclass(slots=True)
class ConfigResult:
    name: str
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    throughput_req_s: float
    requests: int
    failed: int
    cached_prompt_tokens: int
    prompt_tokens: int
    cached_by_source: dict[str, int]
    kvtier_counters: dict[str, int]
    startup_s: float
    ttfts_s: list[float] = field(default_factory=list)
    generated_texts: list[str] = field(default_factory=list)
    result_files: list[str] = field(default_factory=list)
    ttft_p50_later_turns_s: float = math.nan  # turns after each session's first (sessions)


@dataclass(slots=True)
class BenchSettings:
    preset: str
    model: ModelShape
    block_size: int
    max_model_len: int
    kv_cache_bytes: int
    cpu_tier_bytes: int
    requests: int
    window_start: int
    output_len: int
    max_concurrency: int
    request_rate: str
    reserved_cpus: int
    hash_seed: int
    o_direct: bool
    configs: tuple[str, ...]
    workdir: Path
    model_dir: Path | None
    keep_workdir: bool
    rounds: int = 1
    trace: str = "conversation"
    sessions: int = 4          # builtin:agentic sessions
    speed: float = 5.0         # builtin:agentic think times at 1/speed
    prefetch_bytes: int = 64 * MIB  # staging memory of the *-prefetch configurations


