"""Build a tiny, deterministic, random-weight Llama checkpoint on local disk (no downloads).

The tokenizer is word level: prompt text made of ``w0 w1 ... wN`` maps one word to one token,
so tests can reason about exact token counts and block boundaries.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_WORDS = 384
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def build_tiny_llama(directory: Path, *, seed: int = 1234) -> Path:
    """Write config, safetensors weights and a word-level tokenizer to ``directory``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word_index in range(VOCAB_WORDS - len(SPECIAL_TOKENS)):
        vocab[f"w{word_index}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(directory)

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            # Larger than the default init so greedy decoding is sensitive to every KV byte.
            parameter.normal_(mean=0.0, std=0.2)
    model.save_pretrained(directory, safe_serialization=True)
    # Plain generation config: greedy decoding comes from SamplingParams in the tests.
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3})
    )
    return directory


def prompt_words(start: int, count: int) -> str:
    """``count`` distinct-ish words starting at word ``start`` (wrapping in the vocabulary)."""
    usable = VOCAB_WORDS - len(SPECIAL_TOKENS)
    return " ".join(f"w{(start + offset * 7) % usable}" for offset in range(count))
