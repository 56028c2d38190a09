"""Test helpers: engines on a test server, random KV caches in every layout, and an
independent (slow, obvious) way to read a token's KV out of a cache for comparisons."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from lmcache_remote import CacheConfig, CacheEngine, DenseKV, EngineMetadata, PagedKV

LAYERS, HEADS, HEAD = 2, 2, 8
BLOCK, BLOCKS = 16, 160
SENTINEL = 7.0


def metadata(dtype: torch.dtype = torch.bfloat16, model: str = "test/model", worker: int = 0,
             world: int = 1) -> EngineMetadata:
    return EngineMetadata(model, world, worker, dtype, LAYERS, HEADS, HEAD)


def engine(url: str | None, prefix: str, meta: EngineMetadata | None = None,
           **overrides: Any) -> CacheEngine:
    """An engine on a test server. `load_policy` is `always` unless overridden: these
    engines test what is stored and read, and the load decision, which weighs measured
    times, would make a hit depend on how loaded the machine is (its own tests:
    tests/test_load_decision.py)."""
    cfg: dict[str, Any] = {"remote_url": url, "key_prefix": prefix, "chunk_size": 256,
                           "remote_timeout": 1.0, "max_local_cpu_size": 0.25,
                           "load_policy": "always"}
    cfg.update(overrides)
    return CacheEngine(CacheConfig(**cfg), meta or metadata())


def paged_cache(layout: str, dtype: torch.dtype, seed: int | None, fill: float = 7.0
                ) -> list[torch.Tensor]:
    shape = ((2, BLOCKS, BLOCK, HEADS, HEAD) if layout == "kv_split"
             else (BLOCKS, HEADS, BLOCK, 2 * HEAD))
    if seed is None:
        return [torch.full(shape, fill, dtype=dtype) for _ in range(LAYERS)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS)]


def slots(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(BLOCKS * BLOCK, generator=gen)[:n].to(torch.int64)


def dense_cache(num_tokens: int, dtype: torch.dtype, seed: int | None, batch_dim: bool = True
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (1, HEADS, num_tokens, HEAD) if batch_dim else (HEADS, num_tokens, HEAD)
    if seed is None:
        make = lambda: torch.full(shape, SENTINEL, dtype=dtype)  # noqa: E731
    else:
        gen = torch.Generator().manual_seed(seed)
        make = lambda: torch.randn(shape, generator=gen).to(dtype)  # noqa: E731
    return [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]


def token_kv_paged(caches: list[torch.Tensor], layout: str, slot_ids: torch.Tensor
                   ) -> torch.Tensor:
    """[layers, 2, T, heads, head] read slot by slot, independent of the connectors."""
    out = []
    for cache in caches:
        per_token = []
        for s in slot_ids.tolist():
            b, o = divmod(s, BLOCK)
            if layout == "kv_split":
                per_token.append(torch.stack([cache[0, b, o], cache[1, b, o]]))
            else:
                row = cache[b, :, o, :]
                per_token.append(torch.stack([row[:, :HEAD], row[:, HEAD:]]))
        out.append(torch.stack(per_token, dim=1))
    return torch.stack(out)


def token_kv_dense(keys: list[torch.Tensor], values: list[torch.Tensor], start: int, end: int
                   ) -> torch.Tensor:
    out = []
    for k, v in zip(keys, values, strict=True):
        k3, v3 = k.reshape(HEADS, -1, HEAD), v.reshape(HEADS, -1, HEAD)
        k_t, v_t = k3[:, start:end].transpose(0, 1), v3[:, start:end].transpose(0, 1)
        out.append(torch.stack([k_t, v_t]))
    return torch.stack(out)


def view(kind: str, dtype: torch.dtype, n: int, seed: int | None, slot_seed: int = 0):
    """A KV view of `kind` (kv_split, packed, dense) over `n` tokens, and a reader
    `read(start, end) -> [layers, 2, T, heads, head]` for comparisons."""
    if kind == "dense":
        keys, values = dense_cache(n, dtype, seed)
        return DenseKV(keys, values), lambda s, e: token_kv_dense(keys, values, s, e)
    caches = paged_cache(kind, dtype, seed)
    sm = slots(n, slot_seed)
    return PagedKV(caches, sm), lambda s, e: token_kv_paged(caches, kind, sm[s:e])


def tokens(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=gen).tolist()


def reference_hashes(tokens: list[int], chunk: int, salt: str | None = None) -> list[str]:
    """DESIGN.md's chunk hash, written the slow obvious way with hashlib alone (every chunk,
    the last partial one included), as 32-hex-digit strings."""
    prev = bytes(16) if salt is None else hashlib.blake2b(salt.encode(), digest_size=16).digest()
    out = []
    for i in range(0, len(tokens), chunk):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[i:i + chunk])
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        out.append(prev.hex())
    return out


def reference_keys(toks: list[int], prefix: str, model: str = "test/model",
                   dtype: str = "bfloat16", salt: str | None = None, chunk: int = 256
                   ) -> list[str]:
    """The Redis keys of DESIGN.md for the full chunks of `toks` (world size 1, worker 0)."""
    full = toks[: len(toks) - len(toks) % chunk]
    return [f"{prefix}:v1:{model}:1:0:{dtype}:{{{h}}}"
            for h in reference_hashes(full, chunk, salt)]


def chunk_heads(keys: Any) -> set[Any]:
    """The chunk keys among Redis keys (str or bytes): a chunk is its key plus, when it was cut
    into several values, part keys ``<key>#1``, ``<key>#2``, ... (left out here)."""
    return {k for k in keys if ("}#" if isinstance(k, str) else b"}#") not in k}


def tier_chunks(db: Any, layout: Any, pool: Any, n_tokens: int, seed: int) -> tuple[list, list]:
    """The chunk specs of ``n_tokens`` tokens (ids from ``seed``) and a random `MemoryObj`
    from ``pool`` for each, as a storage tier's put takes them."""
    specs = db.chunks(list(range(seed, seed + n_tokens)))
    gen = torch.Generator().manual_seed(seed)
    objs = []
    for s in specs:
        obj = pool.allocate(layout.shape(s.num_tokens), layout.dtype)
        assert obj is not None
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(layout.dtype))
        objs.append(obj)
    return specs, objs


# Reference cache-write ops for the layout proof's own tests (`test_layout_proof.py`) and the
# vLLM-free worker tests. They stand in for vLLM's `do_kv_cache_update`, which needs vLLM; the
# real ops are proven in tests/vllm_cpu (vLLM's CPU kernels) and tests/vllm_real. Each takes
# `kv` [planes, tokens, heads, head_size] and the tokens' slots.

def packed_writer(cache: torch.Tensor) -> Any:
    """What vLLM's GPU backends leave in a `[blocks, heads, block_size, 2 * head]` view: row
    t = K then V of token t."""
    size = cache.shape[2]

    def write(kv: torch.Tensor, slots: torch.Tensor) -> None:
        cache[slots // size, :, slots % size, :] = torch.cat([kv[0], kv[1]], -1).to(cache.dtype)
    return write


def tiled_writer(cache: torch.Tensor, pairs: bool = False) -> Any:
    """A tiled block like vLLM's CPU backend under ISA "vec" (`[blocks, heads, 2 * size,
    head]`: a K area stored transposed, `[head, size]`, then V row-major); with `pairs`, K in
    pairs of dims per token (VNNI-like: dims 2i and 2i+1 of token t side by side)."""
    blocks, heads, size, width = cache.shape
    head = width // 2
    areas = cache.view(blocks, heads, 2 * size, head)

    def write(kv: torch.Tensor, slots: torch.Tensor) -> None:
        b, o = slots // size, slots % size
        k, v = kv[0].to(cache.dtype), kv[1].to(cache.dtype)
        for i in range(len(slots)):
            k_area = areas[b[i], :, :size].reshape(heads, -1)
            if pairs:  # [head // 2, size, 2]
                k_area.view(heads, head // 2, size, 2)[:, :, o[i], :] = k[i].view(heads, -1, 2)
            else:  # [head, size]
                k_area.view(heads, head, size)[:, :, o[i]] = k[i]
            areas[b[i], :, size + o[i], :] = v[i]
    return write


def vnni_writer(cache: torch.Tensor, tile: int = 16) -> Any:
    """A tiled block like vLLM's CPU backend under ISA "amx" (as its research note describes
    it; `[blocks, heads, 2 * size, head]`): K in tiles of `tile` tokens, each token's dims in
    pairs (VNNI pairs of dims), then V with tokens in pairs per dim (VNNI pairs of tokens)."""
    blocks, heads, size, width = cache.shape
    head = width // 2
    areas = cache.view(blocks, heads, 2 * size * head)
    t = torch.arange(size).view(-1, 1)
    d = torch.arange(head).view(1, -1)
    k_at = (t // tile) * (tile * head) + (d // 2) * (2 * tile) + (t % tile) * 2 + d % 2
    v_at = size * head + (t // 2) * (2 * head) + d * 2 + t % 2

    def write(kv: torch.Tensor, slots: torch.Tensor) -> None:
        b, o = slots // size, slots % size
        k, v = kv[0].to(cache.dtype), kv[1].to(cache.dtype)
        for i in range(len(slots)):
            areas[b[i], :, k_at[o[i]]] = k[i]
            areas[b[i], :, v_at[o[i]]] = v[i]
    return write


def mla_writer(cache: torch.Tensor) -> Any:
    """MLA's `[blocks, block_size, latent]`: one latent per token."""
    size = cache.shape[1]

    def write(kv: torch.Tensor, slots: torch.Tensor) -> None:
        cache[slots // size, slots % size, :] = kv[0, :, 0].to(cache.dtype)
    return write
