"""`LmcrConnector`: lmcache-remote as a vLLM v1 KV connector, the hooks vLLM calls on it.

It turns vLLM's objects into plain values for `vllm_core` and follows the hook order of vLLM
0.32, 0.33 and 0.34:

- scheduler: `get_num_new_matched_tokens` (repeated while a request waits: one Redis round
  trip each) -> `update_state_after_alloc` -> `build_connector_meta` every step;
  `request_finished` once per request; `may_load_async` (vLLM 0.34, with
  `--max-num-inflight-kv-loads`) when a request enters the waiting queues.
- worker, every step (0.32 and 0.33: the model runner's `KVConnectorModelRunnerMixin`, or
  Model Runner V2's `ActiveKVConnector`; 0.34: `ActiveKVConnector` always, Model Runner V1 is
  gone): `handle_preemptions` -> `bind_connector_metadata` (the plans are taken here) ->
  `start_load_kv` before the forward when the step has a synchronous load, after it
  otherwise -> per attention layer (`maybe_transfer_kv_layer`) `wait_for_layer_load` before
  it and `save_kv_layer` after it -> `wait_for_save` -> `get_finished` /
  `get_transfer_results` -> `get_block_ids_with_load_errors` -> `clear_connector_metadata`.
  A step with no forward runs the same hooks without the per-layer ones.

A preempted request comes back either as a cached request flagged resumed (vLLM 0.32 and
0.33's Model Runner V1: `resumed_req_ids`) or, in vLLM 0.34 (and Model Runner V2 before it),
as a new request with its whole block table and its computed tokens: the scheduler side
knows it by its id and plans it from that table either way. Requests vLLM reads no external
KV for (`Request.skip_reading_external_kv` in 0.34, `skip_reading_prefix_cache` before:
prompt logprobs, prompt scoring) are not looked up and are promised nothing; their prompt is
still stored.

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
worker metadata of the next step, which then stops claiming hits. `unregister_kv_caches`
(vLLM 0.33's sleep; 0.34's sleep, `release_kv_cache_memory`, `discard` of the KV cache and
layer-wise weight updates) finishes every transfer and nothing touches the caches until
`restore_kv_caches` (the same tensors, at the same addresses, zeroed in 0.34); loads planned
meanwhile are reported failed (vLLM recomputes). On CUDA, vLLM 0.34's extensible KV cache
builds the worker-side connector after warm-up and registers views of the committed blocks
only: what is registered is what is proven and served.

While layer-wise transfer is on (the default), `requires_piecewise_for_cudagraph` asks vLLM
for piecewise CUDA graphs: under full graphs the per-layer hooks would be skipped.

Hybrid models: the connector is `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on.
A model that is not one full-attention group (several groups, or one sliding-window group) is
served per group (`vllm_core.groups`, `lookup.GroupLookup`, `worker_groups.GroupedWorker`):
keys per group, vLLM's hit rule over all groups, every load in the background into the blocks
vLLM allocated (never its null block; a recurrent state must be in place before vLLM's
`preprocess_mamba` copies it, which a load within the step would miss), a failed load reported
as a failed request (`get_transfer_results`' `failed_recving`: vLLM cannot take a failed block
of such a model), stores within the step. `request_finished_all_groups` is
`request_finished`.

Requests whose token ids do not name their KV (images and other multimodal items, a LoRA
adapter, prompt embeddings) are named by a `RequestIdentity` as well, built once per request in
`get_num_new_matched_tokens` (`requests.RequestNames`) and sent to the workers in each plan:
scheduler and workers hash the same keys. A request whose KV depends on something the keys
cannot bind (`requests.UnnamedRequest`) is passed through: no lookup, no plan, no store.

A model whose KV cache the connector cannot serve right (`config.unserved_model`: a Mamba2
mixer's state, `mamba_cache_mode` none, any spec but full attention, MLA, sliding window and
Gated DeltaNet) is passed through: a WARNING at start-up on each side, then every hook does
nothing (no lookup, no load, no store, no Redis connection), and vLLM runs as it would without
the connector. Never a refusal to start, never wrong KV.

The hooks' bodies live in `sides`: the class below picks its scheduler and worker sides when
vLLM builds it (`ServedScheduler` and `ServedWorker`, `PassThrough` for a model it cannot
serve, `WrongRole` for the side a connector does not hold) and each hook hands its call on.
`sides.SchedulerHooks` and `sides.WorkerHooks` state each hook's contract.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmcache_remote.engine.decision import LoadDecision
from lmcache_remote.integrations.vllm.config import (
    check_version,
    group_lookup,
    kv_groups,
    model_namespace,
    prefix_lookup,
    spec_geometry,
    unserved_model,
    warn_on_fail_policy,
)
from lmcache_remote.integrations.vllm.metrics import LmcrConnectorStats, LmcrPromMetrics
from lmcache_remote.integrations.vllm.requests import RequestNames
from lmcache_remote.integrations.vllm.sides import (
    PassThrough,
    SchedulerHooks,
    ServedScheduler,
    ServedWorker,
    WorkerHooks,
    WrongRole,
)
from lmcache_remote.integrations.vllm_core import (
    ROLES,
    ConnectorSettings,
    SchedulerSide,
    WorkerSide,
    load_settings,
)
from lmcache_remote.integrations.vllm_core import stats as connector_stats
from lmcache_remote.integrations.vllm_core.fleet import SchedulerPublisher
from lmcache_remote.integrations.vllm_core.groups import KVGroup, model_chunk_size, plain
from lmcache_remote.integrations.vllm_core.worker_api import KVWorker
from lmcache_remote.integrations.vllm_core.worker_groups import GroupedWorker

logger = logging.getLogger(__name__)

__all__ = ["LmcrConnector"]


class LmcrConnector(KVConnectorBase_V1, SupportsHMA):
    """lmcache-remote as a vLLM v1 KV connector; see the module docstring. `_scheduler` and
    `_worker` are its two sides (`sides`), one of them `WrongRole` (or both `PassThrough`)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        check_version(str(getattr(vllm, "__version__", "")))
        self._settings = load_settings(transfer.kv_connector_extra_config)
        kv_role = transfer.kv_role or "kv_both"
        if kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {ROLES}, got {kv_role!r}")
        self._stats: connector_stats.StatsDelta | None = None
        is_scheduler = role == KVConnectorRole.SCHEDULER
        self._scheduler: SchedulerHooks = WrongRole("scheduler", "worker")
        self._worker: WorkerHooks = WrongRole("worker", "scheduler")
        self._own: SchedulerHooks | WorkerHooks  # the side of this connector's role
        unserved = unserved_model(kv_cache_config, self._settings.config.chunk_size)
        if unserved is not None:
            logger.warning(
                "lmcache-remote: LmcrConnector passes this model through: %s. The cache is off "
                "for this engine (no lookups, loads or stores); vLLM runs as without the "
                "connector. Served: full-attention, MLA and sliding-window layers, and Gated "
                "DeltaNet states in vLLM's 'align' mode (prefix caching on); not served: "
                "Mamba2 mixers, other kinds. See docs/integrations.md.", unserved)
            self._scheduler = self._worker = self._own = PassThrough()
            return
        model = model_namespace(self._settings, vllm_config)
        parallel = vllm_config.parallel_config
        world_size = int(getattr(parallel, "world_size", 1) or 1)
        groups = kv_groups(vllm_config, kv_cache_config)
        grouped = groups if groups is not None and not plain(groups) else None
        settings = self._settings if grouped is None else self._grouped_settings(grouped)
        geometry = None if grouped else spec_geometry(vllm_config, kv_cache_config)
        if is_scheduler:
            self._scheduler = self._own = self._served_scheduler(
                settings, grouped, geometry, model, world_size, can_load=kv_role != "kv_producer",
                can_save=kv_role != "kv_consumer")
            return
        rank = int(getattr(parallel, "rank", 0) or 0)
        side: KVWorker = (
            GroupedWorker(settings, model, world_size, rank, grouped, settings.config.chunk_size,
                          can_save=kv_role != "kv_consumer") if grouped
            else WorkerSide(settings, model, world_size, rank, can_save=kv_role != "kv_consumer",
                            spec=geometry,
                            block_size=int(vllm_config.cache_config.block_size)))
        self._worker = self._own = ServedWorker(side, vllm_config)

    def _served_scheduler(self, settings: ConnectorSettings, grouped: list[KVGroup] | None,
                          geometry: Any, model: str, world_size: int, *, can_load: bool,
                          can_save: bool) -> ServedScheduler:
        config = settings.config
        warn_on_fail_policy(self._vllm_config.kv_transfer_config)
        lookup = (group_lookup(config, grouped, model, world_size) if grouped
                  else prefix_lookup(settings, geometry, model, world_size))
        side = SchedulerSide(
            lookup, config.chunk_size, int(self._vllm_config.cache_config.block_size),
            save_unfull_chunk=config.save_unfull_chunk, can_load=can_load, can_save=can_save,
            async_load_min_tokens=settings.async_load_min_tokens,
            async_save=settings.async_save, lookup_wait_s=settings.lookup_wait_s,
            groups=grouped, decision=LoadDecision.from_config(config, link=lookup.link),
            bytes_per_token=lookup.bytes_per_token)
        served = ServedScheduler(side, lookup, RequestNames(config.chunk_size, settings.mm_items),
                                 model, geometry)
        if config.stats_publish_interval is not None and lookup.remote is not None:
            served.fleet = SchedulerPublisher(config, lookup.remote, [side.metrics, lookup.metrics],
                                              lambda: served.namespace, world_size)
        return served

    def _grouped_settings(self, groups: list[KVGroup]) -> ConnectorSettings:
        """The settings of a model that is not plain (`vllm_core.groups`): one chunk size for
        all groups, whole chunks only, no `async_save` (vLLM frees sliding-window blocks while
        a request runs: stores copy within the step); every load runs in the background
        (`SchedulerSide` with groups). Logged at INFO with the groups."""
        settings = self._settings
        chunk = model_chunk_size(groups, settings.config.chunk_size)
        described = ", ".join(
            f"{g.kind}{g.window if g.window else ''} x{len(g.layer_names)} layers "
            f"(block {g.block_size}, {g.tag})" for g in groups)
        logger.info("lmcache-remote: %d KV cache groups: %s; chunk size %d%s; every load in "
                    "the background, stores within the step", len(groups), described, chunk,
                    "" if chunk == settings.config.chunk_size
                    else f" (chunk_size {settings.config.chunk_size} cut to fit the windows)")
        if settings.async_save:
            logger.warning("lmcache-remote: async_save is ignored for this model: vLLM frees "
                           "sliding-window blocks while a request runs, so stores copy within "
                           "the step")
        return dataclasses.replace(settings, async_save=False, config=dataclasses.replace(
            settings.config, chunk_size=chunk, save_unfull_chunk=False))

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

    # -- worker side: `sides.WorkerHooks` states each hook's contract ----------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.bind_connector_metadata(connector_metadata)

    def unregister_kv_caches(self) -> None:
        self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._worker.restore_kv_caches()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.build_connector_worker_meta()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                   set[str] | None]:
        done = self._worker.transfers(finished_req_ids)
        return done.stored or None, done.loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and the requests whose background load failed (a model of several
        KV cache groups reports failed requests, not blocks; vLLM recomputes them)."""
        done = self._worker.transfers(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=done.stored,
                                          finished_recving=done.loaded,
                                          failed_recving=done.failed)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted:
            self._worker.handle_preemptions(set(preempted))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # -- vLLM's metrics ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What changed since the last step: a worker's loads and stores, or the scheduler's
        lookups and promises; vLLM sums them over every rank and the scheduler."""
        if self._stats is None:
            sources = self._own.stats_sources()
            if sources is None:
                return None
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

    def shutdown(self) -> None:
        self._own.close()

    # -- scheduler side: `sides.SchedulerHooks` states each hook's contract -------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Any) -> bool:
        return self._scheduler.may_load_async(request)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def reset_cache(self) -> bool | None:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (and `pause_generation` with
        `clear_cache`, the weight-update path of RLHF frameworks): nothing cached before may be
        served by this engine again (`ServedScheduler.reset_cache`: a namespace of its own).
        The worker side is never asked (None). vLLM 0.34's `sleep`, `pause_generation` and
        `release_kv_cache_memory` with `reset_connector=False` do not call it: the engine
        keeps its namespace (the caller says the weights did not change)."""
        return self._scheduler.reset_cache()

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool,
                                                                           dict[str, Any] | None]:
        return self._scheduler.request_finished(request), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid manager's `request_finished` (`SupportsHMA`): the same, every group's
        blocks given."""
        return self._scheduler.request_finished(request), None
