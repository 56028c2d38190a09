"""EngineMetadata: what an engine rank is (its model, its rank in the world, its KV geometry).

It promises a validated value (`ValueError` at construction for a dtype that is not a
`torch.dtype`, a size below 1, a worker id outside the world) and derives from it the
chunk layout (`layout`: MLA holds one latent plane of one head, others K and V of every KV
head) and the key fields (`namespace`). `key_namespace(metadata, shared)` is the namespace a
rank-shared engine (MLA with `save_only_first_rank`) names its chunks under: that of a
single-rank engine, whatever the rank.
"""

from __future__ import annotations

import dataclasses

import torch

from lmcache_remote.naming.hashing import KeyNamespace
from lmcache_remote.storage.local.memory import ChunkLayout
from lmcache_remote.values.serde import dtype_name


@dataclasses.dataclass(frozen=True)
class EngineMetadata:
    """What the engine is: its model, its rank, and its KV geometry."""

    model_name: str
    world_size: int
    worker_id: int
    kv_dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_size: int
    use_mla: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kv_dtype, torch.dtype):
            raise ValueError(f"kv_dtype must be a torch.dtype, got {self.kv_dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_size", "world_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.worker_id < self.world_size:
            raise ValueError("need 0 <= worker_id < world_size")

    @property
    def layout(self) -> ChunkLayout:
        planes = 1 if self.use_mla else 2
        heads = 1 if self.use_mla else self.num_kv_heads
        return ChunkLayout(self.num_layers, heads, self.head_size, self.kv_dtype, planes)

    @property
    def namespace(self) -> KeyNamespace:
        return KeyNamespace(
            self.model_name, self.world_size, self.worker_id, dtype_name(self.kv_dtype)
        )


def key_namespace(metadata: EngineMetadata, shared: bool) -> KeyNamespace:
    """The engine's key fields; a rank-shared (MLA, save_only_first_rank) namespace is that of
    a single-rank engine."""
    if not shared:
        return metadata.namespace
    return KeyNamespace(metadata.model_name, 1, 0, dtype_name(metadata.kv_dtype))
