"""A second transformers process: `MODEL_DIR URL PREFIX TOKENS_JSON`.

Loads the saved tiny model, prefills the prompt through a CachedLM whose engine has no local
tier (so every hit comes from Redis), and prints one JSON line: hit tokens, remote hit chunks,
and the largest logit difference against a full recompute in this process."""

from __future__ import annotations

import json
import sys

import torch
from hfutil import CHUNK, full_logits

from lmcache_remote import CacheConfig
from lmcache_remote.integrations.huggingface import CachedLM


def main() -> None:
    from transformers import AutoModelForCausalLM

    model_dir, url, prefix, tokens_json = sys.argv[1:5]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([json.loads(tokens_json)])
    config = CacheConfig(remote_url=url, key_prefix=prefix, chunk_size=CHUNK, local_cpu=False,
                         load_policy="always")  # a hit must not hang on the machine's load
    with CachedLM.open(model, config, store=False) as lm:
        out = lm.prefill(ids)
        diff = (out.logits - full_logits(model, ids)[:, out.hit_tokens:]).abs().max().item()
        print(json.dumps({"model_name": lm.engine.metadata.model_name,
                          "hit_tokens": out.hit_tokens, "max_diff": diff,
                          "remote_hit_chunks": lm.engine.stats()["remote"]["hit_chunks"]}))


if __name__ == "__main__":
    main()
