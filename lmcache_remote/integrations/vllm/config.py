"""What vLLM's configuration says, read into the plain values the connector's sides need, and
the checks the connector makes of it at start-up.

- `spec_geometry(vllm_config, kv_cache_config)`: the workers' KV geometry from vLLM's KV cache
  spec (or the model config), the same on both sides so that the scheduler's keys are the
  workers'; `ValueError` for what the connector does not support (several KV cache groups,
  K and V head sizes that differ).
- `unserved_model(kv_cache_config)`: why the connector must pass this model through (a KV
  cache group whose blocks do not hold every token of the prefix), or None.
- `model_namespace(settings, vllm_config)`: the model field of the keys (name and the weights'
  fingerprint).
- `prefix_lookup(settings, geometry, model, world_size)`: the scheduler's lookup over every
  rank's namespace.
- `check_version(version)`, `warn_on_fail_policy(transfer)`: WARNINGs for a vLLM outside
  `SUPPORTED_VLLM` and for vLLM's `fail` load-failure policy; neither stops the connector.
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache_remote.fingerprint import (
    FingerprintError,
    model_fingerprint,
    model_folder,
    model_name_of,
    namespace,
    resolve_fingerprint,
)
from lmcache_remote.integrations.vllm_core import (
    ConnectorSettings,
    KVGeometry,
    PrefixLookup,
    cache_torch_dtype,
)
from lmcache_remote.serde import dtype_name

logger = logging.getLogger(__name__)

__all__ = ["SERVED_SPECS", "SUPPORTED_VLLM", "check_version", "model_namespace",
           "prefix_lookup", "spec_geometry", "unserved_model", "warn_on_fail_policy"]

#: The vLLM releases (major.minor) the connector is tested inside.
SUPPORTED_VLLM = ("0.32", "0.33")

#: The KV cache specs whose groups the connector loads and stores: every block of a request's
#: prefix is a real block holding its tokens' K and V. A full-attention group with a
#: `sliding_window` (vLLM's own promotion of sliding-window layers beside full-attention ones
#: when the hybrid manager is off) is one of them: vLLM keeps every block of it.
SERVED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def unserved_model(kv_cache_config: Any | None) -> str | None:
    """Why this model's KV cache cannot be served by the connector, or None. Exact spec classes
    only: a sliding-window group (an all-SWA model such as Mistral v0.1: vLLM keeps it a
    `SlidingWindowSpec` even with the hybrid manager off and hands the connector its null
    block below the window, for loads and for stores), a recurrent state, a chunked-local or
    any other kind, including subclasses of the served ones that drop blocks, is not served."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    for group in groups:
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind in SERVED_SPECS:
            continue
        window = getattr(spec, "sliding_window", None)
        what = f"a {kind} KV cache group"
        if window:
            what += f" (sliding window of {window} tokens)"
        return (f"{what} over {len(group.layer_names)} layers: vLLM keeps only some of such a "
                "group's blocks and hands the connector its null block for the others, which "
                "the connector does not yet load or store right")
    return None


def spec_geometry(vllm_config: Any, kv_cache_config: Any | None) -> KVGeometry | None:
    """The workers' KV geometry as both sides know it from vLLM's KV cache spec (one group:
    the connector is not `SupportsHMA`, so vLLM runs without the hybrid allocator). MLA is an
    `MLAAttentionSpec` (one latent per token); the dtype is that of the values, fp8 named as
    such (`cache_torch_dtype`), never the uint8 of vLLM's tensors. From the model config when
    vLLM passes no KV cache config; None when neither says enough."""
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ValueError(f"LmcrConnector needs a single KV cache group, got {len(groups)}: "
                         "models with several attention types are not supported")
    if groups:
        spec = groups[0].kv_cache_spec
        use_mla = is_mla(spec)
        head_v = getattr(spec, "head_size_v", None)
        if not use_mla and head_v not in (None, spec.head_size):
            raise ValueError(f"K head size {spec.head_size} != V head size {head_v}: not "
                             "supported by LmcrConnector")
        heads = 1 if use_mla else int(spec.num_kv_heads)
        dtype = cache_torch_dtype(cache_dtype, spec.dtype)
        return KVGeometry(len(groups[0].layer_names), heads, int(spec.head_size), dtype,
                          use_mla)
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
    vLLM loads (`lmcache_remote.fingerprint`; the same as the transformers integration's for
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
                                 overrides=_plain_overrides(model_config))

    space = namespace(name, resolve_fingerprint(settings.model_fingerprint, compute))
    logger.info("lmcache-remote: model namespace %s (model %s, model_fingerprint %s)",
                space, source, settings.model_fingerprint)
    return space


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
