"""The inputs of ``kvtier bench serve``: a random-weight Llama built locally (no download) and
the ``timed_trace`` files the client replays.

No state: functions that write files under the directory they are given.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

from kvtier.bench.serve_config import (
    ModelShape,
    ServeBenchError,
    TraceKind,
)

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


def trace_rows(name: str, count: int, *, sessions: int | None = None,
               speed: float = 1.0, max_blocks: int | None = None) -> list[dict[str, Any]]:
    """The first ``count`` rows of a bundled trace as ``{timestamp, hash_ids}`` (hash ids are
    distinct between sessions; the client cuts each prompt to the engine's context).

    ``builtin:agentic`` rows also carry ``session`` and ``turn`` (0: the session's first turn
    in these rows); ``sessions`` is the generator's session count, ``speed`` divides the
    timestamps (think times at 1/speed), and ``max_blocks`` scales each session's prompts
    down to that many blocks at most by keeping every k-th block (k per session), so prompts
    still grow turn by turn and each turn still extends the previous one's prefix."""
    if name == "conversation":
        return bundled_trace_rows()[:count]
    if name == "agentic":
        from kvtier.replay.reader import read_trace

        trace = read_trace("builtin:agentic", max_requests=count, sessions=sessions)
        rows: list[dict[str, Any]] = []
        turns: dict[int | None, int] = {}
        for request in trace.requests:
            turn = turns.get(request.session, 0)
            turns[request.session] = turn + 1
            rows.append({"timestamp": request.timestamp_ms / speed,
                         "hash_ids": list(request.hash_ids), "session": request.session,
                         "turn": turn})
        return rows if max_blocks is None else _fit_sessions(rows, max_blocks)
    raise ServeBenchError(f"unknown --trace {name!r}; expected one of {sorted(TRACES)}")


def _fit_sessions(rows: list[dict[str, Any]], max_blocks: int) -> list[dict[str, Any]]:
    """Every k-th block of each session (k: its longest prompt over ``max_blocks``)."""
    longest: dict[Any, int] = {}
    for row in rows:
        longest[row["session"]] = max(longest.get(row["session"], 0), len(row["hash_ids"]))
    fitted = []
    for row in rows:
        stride = max(1, -(-longest[row["session"]] // max_blocks))
        fitted.append({**row, "hash_ids": row["hash_ids"][::stride][:max_blocks]})
    return fitted


def later_turns(rows: Sequence[Mapping[str, Any]]) -> list[bool]:
    """Per row: whether its session already had a turn in ``rows`` (rows without a session:
    False), so a window's first turn of each session counts as that session's first."""
    seen: set[Any] = set()
    later = []
    for row in rows:
        session = row.get("session")
        later.append(session is not None and session in seen)
        if session is not None:
            seen.add(session)
    return later


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


