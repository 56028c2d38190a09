"""One tensor-parallel rank of an MLA engine, for the two-process save_only_first_rank test:
`store|retrieve URL PREFIX RANK WORLD N`. Prints one JSON line.

Every rank holds the same latent KV (a deterministic paged MLA cache, the same on every rank),
as vLLM's MLA backends do; `retrieve` loads into a differently permuted cache and checks the
hit bytes against the source itself."""

from __future__ import annotations

import json
import sys

import torch
from kvutil import tokens

from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata, PagedKV

LAYERS, HEAD, BLOCK, BLOCKS = 3, 64, 16, 96
SENTINEL = 5.0


def mla_cache(seed: int | None) -> list[torch.Tensor]:
    shape = (BLOCKS, BLOCK, HEAD)
    if seed is None:
        return [torch.full(shape, SENTINEL, dtype=torch.bfloat16) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def slot_ids(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(BLOCKS * BLOCK, generator=gen)[:n]


def read(caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """[layers, tokens, head] slot by slot, independent of the connectors."""
    return torch.stack([c.reshape(BLOCKS * BLOCK, HEAD)[slots] for c in caches])


def main() -> None:
    mode, url, prefix, rank, world, n = sys.argv[1:7]
    n_tokens, toks = int(n), tokens(int(n), seed=11)
    meta = EngineMetadata("deepseek/tiny-mla", int(world), int(rank), torch.bfloat16, LAYERS,
                          1, HEAD, use_mla=True)
    config = CacheConfig(remote_url=url, key_prefix=prefix, chunk_size=256, store_async=False,
                         local_cpu=(mode == "store"), save_only_first_rank=True,
                         max_local_cpu_size=0.1, load_policy="always")
    src, src_slots = mla_cache(seed=3), slot_ids(n_tokens, seed=1)
    out: dict = {"rank": int(rank)}
    with CacheEngine(config, meta) as engine:
        out["keys"] = [s.key.redis_key(prefix) for s in engine.token_db.chunks(toks)]
        if mode == "store":
            out["stored"] = engine.store(toks, PagedKV(src, src_slots))
        else:
            out["lookup"] = engine.lookup(toks)
            dst, dst_slots = mla_cache(seed=None), slot_ids(n_tokens, seed=2 + int(rank))
            gen = engine.retrieve_layer(toks, PagedKV(dst, dst_slots))
            for _ in range(LAYERS + 1):
                mask = next(gen)
            hits = int(mask.sum())
            out["hits"] = hits
            out["exact"] = bool(torch.equal(read(dst, dst_slots[:hits]),
                                            read(src, src_slots[:hits])))
            rest = read(dst, dst_slots[hits:])
            out["rest_untouched"] = bool(torch.equal(rest, torch.full_like(rest, SENTINEL)))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
