"""A long-lived vLLM process driven by the integration tests over stdin/stdout.

Started as ``python vllm_runner.py MODEL_DIR KV_CONFIG_JSON`` (``null`` for no offloading). It
builds one ``vllm.LLM`` (real multiprocess engine core, prefix caching off, greedy sampling)
and answers one JSON command per stdin line with one JSON line on stdout prefixed by
``KVTIER-RUNNER`` (vLLM's own logging goes to stderr):

- ``{"op": "generate", "prompts": [...], "max_tokens": N}`` ->
  ``{"results": [{"prompt_len", "prompt_token_ids", "token_ids", "logprobs",
  "num_cached_tokens"}]}``
- ``{"op": "reset"}`` -> drops vLLM's CPU primary tier (``reset_prefix_cache(reset_connector=
  True)``); secondary tiers keep their blocks.
- ``{"op": "metrics"}`` -> ``{"metrics": {name: value}}`` for every ``kvtier_*`` counter vLLM
  exported.
- ``{"op": "quit"}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

MARKER = "KVTIER-RUNNER "


def _reply(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARKER + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _build_llm(model_dir: str, kv_config: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if kv_config is not None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=kv_config,
        )
    return LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        block_size=32,
        max_model_len=512,
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=transfer,
    )


def _generate(llm: Any, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        chosen_logprobs = [
            float(step[token].logprob)
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        results.append(
            {
                "prompt_len": len(output.prompt_token_ids),
                "prompt_token_ids": list(output.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "logprobs": chosen_logprobs,
                "num_cached_tokens": output.num_cached_tokens,
            }
        )
    return results


def _kvtier_metrics(llm: Any) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kvtier_") and hasattr(metric, "value"):
            totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
    return totals


def main() -> None:
    model_dir, raw_config = sys.argv[1], sys.argv[2]
    kv_config = json.loads(raw_config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    llm = _build_llm(model_dir, kv_config)
    _reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "generate":
                _reply({"results": _generate(llm, command["prompts"], command["max_tokens"])})
            elif op == "reset":
                _reply({"ok": bool(llm.reset_prefix_cache(reset_connector=True))})
            elif op == "metrics":
                _reply({"metrics": _kvtier_metrics(llm)})
            elif op == "quit":
                _reply({"ok": True})
                break
            else:
                _reply({"error": f"unknown op {op!r}"})
        except Exception:
            _reply({"error": traceback.format_exc()})
    del llm


if __name__ == "__main__":
    main()
