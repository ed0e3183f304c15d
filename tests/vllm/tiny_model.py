"""A tiny random Llama and its tokenizer, built locally (no download).

``build_tiny_llama(path, seed)`` writes a 2-layer Llama with random weights (the seed decides
them) and a word-level tokenizer to ``path``; vLLM loads it from there. Two seeds give two
models with the same architecture and different weights.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32  # vLLM block size of the tests (CPU attention needs a multiple of 32)
VOCAB = 512
WORDS = [f"w{i}" for i in range(VOCAB - 4)]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write the model and tokenizer to ``path`` (idempotent per path) and return ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(path))
    config = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def prompt_words(n: int, offset: int = 0) -> str:
    """A prompt of exactly ``n`` tokens (one word each, no BOS added by this tokenizer)."""
    return " ".join(WORDS[(offset + 7 * i) % len(WORDS)] for i in range(n))


# Two prompts of 200 tokens: 6 full blocks and 8 more tokens each.
PROMPTS = [prompt_words(200), prompt_words(200, offset=3)]
