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
#: 1024 tokens of an 8B model's KV are 128 MiB: a transfer of several steps' time.
DEFAULT_ASYNC_LOAD_MIN_TOKENS = 1024
#: `--kv-cache-dtype` values whose cache holds plain per-token K/V (or latent) values, and the
#: torch dtype that names them in the keys. vLLM keeps fp8 caches as uint8 tensors; the bytes
#: are e4m3 ("fp8" is e4m3 in vLLM) or e5m2, and the two must never read each other's chunks.
CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "half": torch.float16,
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2, "fp8_inc": torch.float8_e4m3fn,
}

#: How `mm_items` may name multimodal items in the keys (`ConnectorSettings.mm_items`).
MM_ITEM_MODES = ("content", "identifier")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` configures. `config_file` names a YAML file of
    `CacheConfig` fields (as `load_config`), every other key except `layerwise`,
    `model_name`, `model_fingerprint`, `async_load_min_tokens`, `async_save`,
    `lookup_wait_ms` and `mm_items` overrides one field; an unknown key is a
    `ConfigError` naming it."""

    config: CacheConfig
    layerwise: bool = True
    """Load in `wait_for_layer_load` and store in `save_kv_layer`, one layer at a time."""
    model_name: str | None = None
    """The model name in the keys; default: the model folder's name (a hub id as is)."""
    async_load_min_tokens: int | None = DEFAULT_ASYNC_LOAD_MIN_TOKENS
    """Hits of at least this many tokens load in the background (the request waits in
    `WAITING_FOR_REMOTE_KVS` while the others run); smaller ones within the step, where the
    transfer costs less than a step. None: every load within the step."""
    async_save: bool = False
    """Stores run on a background thread after the step (copy out of the cache included);
    vLLM keeps a finished request's blocks until every worker reports its stores done, and a
    preempted request's stores finish before its blocks are reused. Off: stores copy within
    the step (layer by layer with `layerwise`) and only the Redis write is in the
    background."""
    model_fingerprint: str = "auto"
    """"auto": the keys' model field is `{model_name}@{fingerprint of the weights}`
    (`lmcache_remote.naming.fingerprint`, docs/key-schema.md); "off": the name alone; any other
    string: used as the fingerprint."""
    lookup_wait_ms: float | None = None
    """The scheduler's lookups run on a thread of their own, and vLLM's scheduler waits at
    most this long for one; a request whose lookup takes longer is asked about again on a
    later step. None: lookups run in the scheduler's thread (one round trip, bounded by
    `remote_timeout`)."""

    mm_items: str = "content"
    """How multimodal items are named in the keys (`integrations.vllm.requests`):
    "content", a digest of the processed inputs the encoder runs on (safe whatever ids clients
    send); "identifier", vLLM's item identifier, which is a client's `multi_modal_uuids` entry
    verbatim when one is given: every engine sharing the Redis then trusts every client's
    ids."""

    @property
    def lookup_wait_s(self) -> float | None:
        return None if self.lookup_wait_ms is None else self.lookup_wait_ms / 1000


def load_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    values = dict(extra or {})
    path = values.pop("config_file", None)
    layerwise = values.pop("layerwise", True)
    model_name = values.pop("model_name", None)
    async_min = values.pop("async_load_min_tokens", DEFAULT_ASYNC_LOAD_MIN_TOKENS)
    if async_min is not None and (isinstance(async_min, bool) or not isinstance(async_min, int)
                                  or async_min < 1):
        raise ConfigError("async_load_min_tokens",
                          f"must be a positive integer or null, got {async_min!r}")
    if not isinstance(layerwise, bool):
        raise ConfigError("layerwise", f"must be true or false, got {layerwise!r}")
    if model_name is not None and (not isinstance(model_name, str) or not model_name):
        raise ConfigError("model_name", f"must be a non-empty string, got {model_name!r}")
    async_save = values.pop("async_save", False)
    if not isinstance(async_save, bool):
        raise ConfigError("async_save", f"must be true or false, got {async_save!r}")
    wait_ms = values.pop("lookup_wait_ms", None)
    if wait_ms is not None and (isinstance(wait_ms, bool) or not isinstance(wait_ms, int | float)
                                or wait_ms < 0):
        raise ConfigError("lookup_wait_ms", f"must be a number >= 0 or null, got {wait_ms!r}")
    fingerprint = values.pop("model_fingerprint", "auto")
    if not isinstance(fingerprint, str) or not fingerprint or any(c.isspace() for c in fingerprint):
        raise ConfigError("model_fingerprint", f"must be 'auto', 'off' or a string without "
                          f"spaces, got {fingerprint!r}")
    mm_items = values.pop("mm_items", "content")
    if mm_items not in MM_ITEM_MODES:
        raise ConfigError("mm_items", f"must be {' or '.join(map(repr, MM_ITEM_MODES))}, "
                          f"got {mm_items!r}")
    return ConnectorSettings(load_config(path, **values), layerwise, model_name, async_min,
                             async_save, fingerprint, wait_ms, mm_items)


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
    """The dtype of the KV values for `--kv-cache-dtype` (the model's for `auto`), as the keys
    and value headers name it: `float8_e4m3fn` / `float8_e5m2` for the fp8 variants, never the
    `uint8` of vLLM's tensors. Formats that pack scales or several values per byte
    (`fp8_ds_mla`, `nvfp4*`, `turboquant_*`, `*_per_token_head`, ...) are refused with a
    `ConfigError`: their bytes are not per-token values a chunk can be cut from."""
    if cache_dtype == "auto":
        return model_dtype
    dtype = CACHE_DTYPES.get(cache_dtype)
    if dtype is None:
        raise ConfigError("cache_dtype", f"KV cache dtype {cache_dtype!r} is not supported by "
                          f"the connector; use one of auto, {', '.join(CACHE_DTYPES)}")
    return dtype


def layer_view(tensor: torch.Tensor, *, use_mla: bool,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, str]:
    """One registered layer as PagedKV addresses it, and its layout name; views only, no copy.

    vLLM 0.33 and 0.34 hand every layer as a logical `[blocks, heads, block_size, C]` view of
    its allocation, whatever the physical layout (`KVCacheLayout`: LBNHC, LBHNC, LHBNC, BLNHC,
    BLHNC, BHLNC permute the strides, not the shape): `C` is K then V (`packed`), or, for MLA,
    `heads == 1` and `C` the latent (`mla`, seen as `[blocks, block_size, C]`). Whether a layer
    is MLA comes from the KV cache spec (`use_mla`): the shapes alone cannot tell. Older
    releases' shapes are still read: `[2, blocks, block_size, heads, head]` (`kv_split`),
    FlashInfer's `[blocks, 2, block_size, heads, head]` (seen as kv_split) and MLA's
    `[blocks, block_size, C]`. `dtype`, when given and of the tensor's element size (fp8 held
    as uint8), is how the bytes are viewed."""
    if dtype is not None and tensor.dtype != dtype:
        if tensor.element_size() != torch.empty(0, dtype=dtype).element_size():
            raise ValueError(f"KV cache of {tensor.dtype} cannot be viewed as {dtype}")
        tensor = tensor.view(dtype)
    shape = tuple(tensor.shape)
    if use_mla:
        if len(shape) == 4 and shape[1] == 1:
            return tensor[:, 0], "mla"
        if len(shape) == 3:
            return tensor, "mla"
        raise ValueError(f"MLA KV cache layer of shape {shape} matches no supported layout")
    if len(shape) == 5 and shape[0] != 2 and shape[1] == 2:
        return tensor.transpose(0, 1), "kv_split"
    if len(shape) == 5 and shape[0] == 2:
        return tensor, "kv_split"
    if len(shape) == 4:
        return tensor, "packed"
    raise ValueError(f"KV cache layer of shape {shape} matches no supported layout")
