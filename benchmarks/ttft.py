"""Time to first token on the tiny model: recompute vs a local-tier hit vs a Redis hit."""

from __future__ import annotations

import torch

from benchmarks.data import CHUNK, tiny_model
from benchmarks.timing import median_seconds
from lmcache_remote import CacheConfig, CacheEngine
from lmcache_remote.integrations.huggingface import CachedLM, engine_metadata


def ttft_rows(url: str, prefix_tokens: int, reps: int, suffix: int = 16) -> dict[str, float]:
    """Median seconds from prompt to first-token logits for a ``prefix_tokens`` shared prefix
    plus ``suffix`` new tokens; checks that every path gives the same next token."""
    model = tiny_model()
    meta = engine_metadata(model, model_name="bench/tiny-llama")
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 1000, (prefix_tokens,), generator=gen)
    prompts = [torch.cat([prefix, torch.randint(0, 1000, (suffix,), generator=gen)])[None]
               for _ in range(reps + 1)]

    def config(remote: str | None, local: bool) -> CacheConfig:
        return CacheConfig(remote_url=remote, local_cpu=local, chunk_size=CHUNK,
                           key_prefix="bench-ttft", serde="raw", remote_timeout=30.0)

    first: dict[str, int] = {}

    def run(lm: CachedLM, name: str, expect_hit: int) -> float:
        rounds = iter(range(10**9))  # every path sees the prompts in the same order

        def once() -> None:
            ids = prompts[next(rounds) % len(prompts)]
            out = lm.prefill(ids)
            assert out.hit_tokens == expect_hit, (name, out.hit_tokens)
            first.setdefault(name, int(out.logits[0, -1].argmax()))

        return median_seconds(once, reps, warmup=2)

    out = {}
    with CacheEngine(config(None, False), meta) as e:
        out["recompute"] = run(CachedLM(model, e, store=False), "recompute", 0)
    hit = prefix_tokens // CHUNK * CHUNK
    with CacheEngine(config(url, True), meta) as e:
        CachedLM(model, e).prefill(prompts[0])
        assert e.flush()
        out["local_hit"] = run(CachedLM(model, e, store=False), "local_hit", hit)
    with CacheEngine(config(url, False), meta) as e:
        out["redis_hit"] = run(CachedLM(model, e, store=False), "redis_hit", hit)
    # the same prompt under each path gives the same next token (KV loaded == KV computed)
    assert len(set(first.values())) == 1, first
    return out
