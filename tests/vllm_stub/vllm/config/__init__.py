"""Test stand-in of vllm.config: the fields of VllmConfig and its parts that connectors read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.config.kv_transfer import KVTransferConfig


@dataclass
class ModelConfig:
    model: str = "test/model"
    dtype: torch.dtype = torch.bfloat16
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 8
    use_mla: bool = False

    def get_num_layers(self, parallel_config: Any) -> int:
        return self.num_layers

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        return self.num_kv_heads

    def get_head_size(self) -> int:
        return self.head_size


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    world_size: int = 1
    rank: int = 0


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None


__all__ = ["CacheConfig", "KVTransferConfig", "ModelConfig", "ParallelConfig", "VllmConfig"]
