"""The KV caches as vLLM holds them, for the worker side's registration.

- `cache_writer(vllm_config, name, kv_cache, use_mla)`: the attention backend's own write of
  per-token K/V (or MLA's latent) into a layer's cache, with which the worker proves how it
  reads the caches (`vllm_core.proof`); None where vLLM does not show the op.
- `caches_from_forward_context(forward_context)`: the per-layer caches from the attention
  layers, for vLLM releases that never call `register_kv_caches`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lmcache_remote.connectors.layout_proof import CacheWriter

__all__ = ["cache_writer", "caches_from_forward_context"]


def cache_writer(vllm_config: Any, name: str, kv_cache: torch.Tensor,
                  use_mla: bool) -> CacheWriter | None:
    """The attention backend's own write of per-token K/V into layer `name`'s cache, as the
    layer's forward does it (`impl.do_kv_cache_update`, the same in vLLM 0.32 to 0.34), fed
    values in the model's dtype; None where the layer or its op is not found (the layout then stays
    unproven and the connector off)."""
    context = getattr(getattr(vllm_config, "compilation_config", None),
                      "static_forward_context", None) or {}
    layer = context.get(name)
    update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
    if update is None:
        return None
    model_dtype = getattr(vllm_config.model_config, "dtype", None)

    def fed(x: torch.Tensor) -> torch.Tensor:
        x = x.to(model_dtype) if isinstance(model_dtype, torch.dtype) else x
        return x.to(kv_cache.device).contiguous()

    if use_mla:
        rank = int(getattr(layer, "kv_lora_rank", 0))

        def write_latent(kv: torch.Tensor, slots: torch.Tensor) -> None:
            latent = fed(kv[0, :, 0])
            update(latent[:, :rank].contiguous(), latent[:, rank:].unsqueeze(1).contiguous(),
                   kv_cache, slots.to(kv_cache.device), getattr(layer, "kv_cache_dtype", "auto"),
                   getattr(layer, "_k_scale", None))
        return write_latent if rank > 0 else None

    def write(kv: torch.Tensor, slots: torch.Tensor) -> None:
        update(layer, fed(kv[0]), fed(kv[1]), kv_cache, slots.to(kv_cache.device))
    return write


def caches_from_forward_context(forward_context: Any) -> Mapping[str, torch.Tensor]:
    """The per-layer caches from the attention layers, when vLLM never called
    `register_kv_caches` (older versions)."""
    layers = getattr(forward_context, "no_compile_layers", None) or {}
    engine = getattr(forward_context, "virtual_engine", 0)
    caches = {}
    for name, layer in layers.items():
        kv = getattr(layer, "kv_cache", None)
        if kv is not None:
            caches[name] = kv[engine] if isinstance(kv, (list, tuple)) else kv
    return caches
