"""The KV the benchmark moves: shapes, synthetic normal data, and KV a tiny model produced.

Every row of one run uses the same tensors (built once, from fixed seeds).
"""

from __future__ import annotations

import dataclasses

import torch

from lmcache_remote import DenseKV, EngineMetadata, PagedKV
from lmcache_remote.connectors import KVView
from lmcache_remote.storage.local.memory import ChunkLayout

CHUNK = 256
BLOCK = 16  # vLLM's default block size


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's KV geometry."""

    name: str
    layers: int
    kv_heads: int
    head: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def layout(self) -> ChunkLayout:
        return ChunkLayout(self.layers, self.kv_heads, self.head, self.dtype)

    @property
    def chunk_bytes(self) -> int:
        return self.layout.nbytes(CHUNK)

    def metadata(self, model: str | None = None) -> EngineMetadata:
        return EngineMetadata(model or self.name, 1, 0, self.dtype, self.layers,
                              self.kv_heads, self.head)


#: Llama-3-8B-like: 32 MiB per 256-token chunk in bfloat16.
LLAMA8B = Shape("llama-3-8b-like", 32, 8, 128)
#: 1 MiB per 256-token chunk in bfloat16 (4 layers, 2 KV heads, head 128).
MIB1 = Shape("1-mib-chunks", 4, 2, 128)
#: The tiny transformers model of the TTFT rows (2 layers, 2 KV heads, head 16).
TINY = Shape("tiny-llama", 2, 2, 16)


def normal_dense(shape: Shape, num_tokens: int, scale: float = 1.0, seed: int = 0) -> DenseKV:
    """Per layer K and V `[heads, T, head]`, normal with std ``scale``, in the shape's dtype."""
    gen = torch.Generator().manual_seed(seed)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for _ in range(shape.layers):
        for out in (keys, values):
            t = torch.randn(shape.kv_heads, num_tokens, shape.head, generator=gen) * scale
            out.append(t.to(shape.dtype))
    return DenseKV(keys, values)


def empty_dense(shape: Shape, num_tokens: int) -> DenseKV:
    def make() -> torch.Tensor:
        return torch.zeros(shape.kv_heads, num_tokens, shape.head, dtype=shape.dtype)

    return DenseKV([make() for _ in range(shape.layers)], [make() for _ in range(shape.layers)])


def paged_like(dense: DenseKV, shape: Shape, num_tokens: int, seed: int) -> PagedKV:
    """The same KV as ``dense`` in vLLM's paged layout (`kv_split`, one
    `[2, num_blocks, 16, heads, head]` tensor per layer), its blocks in a random order among a
    few spare ones, as vLLM's free-block queue hands them out."""
    blocks = -(-num_tokens // BLOCK)
    num_blocks = blocks + max(4, blocks // 8)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:blocks]
    slots = (order[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:num_tokens]
    caches = [torch.zeros(2, num_blocks, BLOCK, shape.kv_heads, shape.head, dtype=shape.dtype)
              for _ in range(shape.layers)]
    view = PagedKV(caches, slots)
    ranges = [(i, min(i + CHUNK, num_tokens)) for i in range(0, num_tokens, CHUNK)]
    chunks = [torch.empty(shape.layout.shape(e - s), dtype=shape.dtype) for s, e in ranges]
    dense.gather(ranges, chunks)
    view.scatter(ranges, chunks)
    return view


def chunk_tensor(kv: DenseKV, shape: Shape, index: int) -> torch.Tensor:
    """Chunk ``index`` of a dense KV in the canonical layout `[layers, 2, T, heads, head]`."""
    out = torch.empty(shape.layout.shape(CHUNK), dtype=shape.dtype)
    kv.gather([(index * CHUNK, (index + 1) * CHUNK)], [out])
    return out


def same_kv(a: KVView, b: KVView, shape: Shape, num_tokens: int) -> bool:
    """Whether two dense KVs hold the same bytes for tokens [0, num_tokens)."""
    chunks = [(i, min(i + CHUNK, num_tokens)) for i in range(0, num_tokens, CHUNK)]

    def canon(kv: KVView) -> list[torch.Tensor]:
        outs = [torch.empty(shape.layout.shape(e - s), dtype=shape.dtype) for s, e in chunks]
        kv.gather(chunks, outs)
        return outs

    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(canon(a), canon(b), strict=True))


def tiny_model(num_layers: int = 2):
    """The tiny Llama of the issue, random weights, fixed seed, eval mode, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=8192)
    return LlamaForCausalLM(config).eval()


def model_kv(num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """KV the tiny model computed for ``num_tokens`` random tokens, as canonical chunk data
    `[layers, 2, T, heads, head]` in ``dtype``."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (1, num_tokens), generator=gen)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    planes = []
    for layer in cache.layers:
        k = layer.keys[0].permute(1, 0, 2)  # [T, heads, head]
        v = layer.values[0].permute(1, 0, 2)
        planes.append(torch.stack([k, v]))
    return torch.stack(planes).to(dtype).contiguous()
