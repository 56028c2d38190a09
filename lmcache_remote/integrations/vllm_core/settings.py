"""Connector settings (from `kv_connector_extra_config`) and the KV cache's geometry and
layout as vLLM hands it over."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from lmcache_remote.config import CacheConfig, load_config
from lmcache_remote.engine import EngineMetadata
from lmcache_remote.errors import ConfigError

ROLES = ("kv_producer", "kv_consumer", "kv_both")
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` configures. `config_file` names a YAML file of
    `CacheConfig` fields (as `load_config`), every other key except `layerwise` and
    `model_name` overrides one field; an unknown key is a `ConfigError` naming it."""

    config: CacheConfig
    layerwise: bool = True
    """Load in `wait_for_layer_load` and store in `save_kv_layer`, one layer at a time."""
    model_name: str | None = None
    """The model name in the keys; default: vLLM's `model_config.model`."""


def load_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    values = dict(extra or {})
    path = values.pop("config_file", None)
    layerwise = values.pop("layerwise", True)
    model_name = values.pop("model_name", None)
    if not isinstance(layerwise, bool):
        raise ConfigError("layerwise", f"must be true or false, got {layerwise!r}")
    if model_name is not None and (not isinstance(model_name, str) or not model_name):
        raise ConfigError("model_name", f"must be a non-empty string, got {model_name!r}")
    return ConnectorSettings(load_config(path, **values), layerwise, model_name)


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """One rank's KV cache as the keys and the canonical chunk need it."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    use_mla: bool

    def metadata(self, model_name: str, world_size: int, rank: int) -> EngineMetadata:
        return EngineMetadata(model_name, world_size, rank, self.dtype, self.num_layers,
                              self.num_kv_heads, self.head_size, use_mla=self.use_mla)


def cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """vLLM's KV cache tensor dtype for `--kv-cache-dtype`: the model's for `auto`, uint8 for
    the fp8 variants (vLLM keeps fp8 caches as raw bytes), else the torch dtype of that name."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in _FP8_CACHE_DTYPES:
        return torch.uint8
    dtype = getattr(torch, {"half": "float16", "float": "float32"}.get(cache_dtype, cache_dtype),
                    None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("cache_dtype", f"unknown KV cache dtype {cache_dtype!r}")
    return dtype


def layer_view(tensor: torch.Tensor) -> tuple[torch.Tensor, str]:
    """One registered layer as PagedKV addresses it, and its layout name. FlashInfer's
    `[blocks, 2, block_size, heads, head]` becomes a kv_split view (no copy)."""
    shape = tuple(tensor.shape)
    if len(shape) == 5 and shape[0] != 2 and shape[1] == 2:
        return tensor.transpose(0, 1), "kv_split"
    if len(shape) == 5 and shape[0] == 2:
        return tensor, "kv_split"
    if len(shape) == 4:
        return tensor, "packed"
    if len(shape) == 3:
        return tensor, "mla"
    raise ValueError(f"KV cache layer of shape {shape} matches no supported layout")
