"""Tiny transformers models and tokenizers built offline (random weights, fixed seed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lmcache_remote import CacheConfig, CacheEngine  # noqa: E402
from lmcache_remote.integrations.huggingface import engine_metadata  # noqa: E402

CHUNK = 16
VOCAB = 1000


def tiny_model(kind: str = "llama", seed: int = 0) -> Any:
    """A 2-layer float32 causal LM with grouped KV heads: `llama` or `qwen2`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    else:
        raise ValueError(kind)
    return model.eval()


def cache_engine(model: Any, url: str | None, prefix: str, name: str = "tiny",
                 **overrides: Any) -> CacheEngine:
    """An engine for `model` on a test server; `load_policy` `always` unless overridden (as
    `kvutil.engine`: a hit must not depend on how loaded the machine is)."""
    cfg: dict[str, Any] = {"remote_url": url, "key_prefix": prefix, "chunk_size": CHUNK,
                           "remote_timeout": 2.0, "max_local_cpu_size": 0.05,
                           "load_policy": "always"}
    cfg.update(overrides)
    return CacheEngine(CacheConfig(**cfg), engine_metadata(model, model_name=name))


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, n), generator=gen)


def full_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def save_tokenizer(folder: Path) -> Any:
    """A word-level tokenizer trained on a few strings, saved with `save_pretrained`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the cache keeps the prefix of every prompt",
              "a system prompt and some documents come first",
              "then the question of the user follows the documents"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(folder)
    return fast
