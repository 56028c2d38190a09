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
"""

from __future__ import annotations

import dataclasses
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
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmcache_remote.engine.decision import LoadDecision
from lmcache_remote.integrations.vllm.caches import cache_writer, caches_from_forward_context
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
from lmcache_remote.integrations.vllm.messages import (
    KVConnectorWorkerMetadata,
    LmcrConnectorMetadata,
    LmcrWorkerMetadata,
)
from lmcache_remote.integrations.vllm.metrics import LmcrConnectorStats, LmcrPromMetrics
from lmcache_remote.integrations.vllm.requests import (
    BadRetention,
    RequestNames,
    UnnamedRequest,
    retention,
)
from lmcache_remote.integrations.vllm_core import (
    ROLES,
    CachedRequest,
    ConnectorSettings,
    NewRequest,
    PrefixLookup,
    SchedulerSide,
    WorkerSide,
    load_settings,
)
from lmcache_remote.integrations.vllm_core import stats as connector_stats
from lmcache_remote.integrations.vllm_core.fleet import SchedulerPublisher
from lmcache_remote.integrations.vllm_core.groups import KVGroup, model_chunk_size, plain
from lmcache_remote.integrations.vllm_core.worker_groups import GroupedWorker

logger = logging.getLogger(__name__)

__all__ = ["LmcrConnector"]


class LmcrConnector(KVConnectorBase_V1, SupportsHMA):
    """lmcache-remote as a vLLM v1 KV connector; see the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        check_version(str(getattr(vllm, "__version__", "")))
        self._settings = load_settings(transfer.kv_connector_extra_config)
        kv_role = transfer.kv_role or "kv_both"
        if kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {ROLES}, got {kv_role!r}")
        can_save = kv_role != "kv_consumer"
        can_load = kv_role != "kv_producer"
        self._lookup: PrefixLookup | None = None
        self._stats: connector_stats.StatsDelta | None = None
        self._fleet: SchedulerPublisher | None = None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | GroupedWorker | None = None
        self._names: RequestNames | None = None
        self._reported_down = False  # the link state this worker last told the scheduler
        self._passthrough = unserved_model(kv_cache_config, self._settings.config.chunk_size)
        if self._passthrough is not None:
            logger.warning(
                "lmcache-remote: LmcrConnector passes this model through: %s. The cache is off "
                "for this engine (no lookups, loads or stores); vLLM runs as without the "
                "connector. Served: full-attention, MLA and sliding-window layers, and Gated "
                "DeltaNet states in vLLM's 'align' mode (prefix caching on); not served: "
                "Mamba2 mixers, other kinds. See docs/integrations.md.",
                self._passthrough)
            self._namespace = self._base_namespace = ""
            self._geometry = None
            return
        model = model_namespace(self._settings, vllm_config)
        self._namespace = self._base_namespace = model
        parallel = vllm_config.parallel_config
        world_size = int(getattr(parallel, "world_size", 1) or 1)
        groups = kv_groups(vllm_config, kv_cache_config)
        grouped = groups if groups is not None and not plain(groups) else None
        settings = self._settings if grouped is None else self._grouped_settings(grouped)
        config = settings.config
        self._geometry = None if grouped else spec_geometry(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            warn_on_fail_policy(transfer)
            self._names = RequestNames(config.chunk_size, settings.mm_items)
            self._lookup = (group_lookup(config, grouped, model, world_size) if grouped
                            else prefix_lookup(settings, self._geometry, model, world_size))
            self._scheduler = SchedulerSide(
                self._lookup, config.chunk_size, int(vllm_config.cache_config.block_size),
                save_unfull_chunk=config.save_unfull_chunk,
                can_load=can_load, can_save=can_save,
                async_load_min_tokens=settings.async_load_min_tokens,
                async_save=settings.async_save, lookup_wait_s=settings.lookup_wait_s,
                groups=grouped,
                decision=LoadDecision.from_config(config, link=self._lookup.link),
                bytes_per_token=self._lookup.bytes_per_token)
            if config.stats_publish_interval is not None and self._lookup.remote is not None:
                self._fleet = SchedulerPublisher(
                    config, self._lookup.remote, [self._scheduler.metrics, self._lookup.metrics],
                    lambda: self._namespace, world_size)
        else:
            rank = int(getattr(parallel, "rank", 0) or 0)
            self._worker = (
                GroupedWorker(settings, model, world_size, rank, grouped, config.chunk_size,
                              can_save=can_save) if grouped
                else WorkerSide(settings, model, world_size, rank, can_save=can_save))

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

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._passthrough is not None:
            return
        worker = self._worker_side()
        self._register(worker, kv_caches)
        if (isinstance(worker, WorkerSide) and self._geometry is not None
                and self._geometry != worker.geometry):
            logger.warning("KV caches are %s but the KV cache spec says %s: the scheduler's "
                           "lookups will miss", worker.geometry, self._geometry)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._passthrough is not None:
            return
        worker = self._worker_side()
        namespace = getattr(connector_metadata, "namespace", None)
        if namespace:
            worker.rename_model(namespace)
        worker.begin_step(list(getattr(connector_metadata, "requests", [])),
                          (int(getattr(connector_metadata, "step_tokens", 0)),
                           float(getattr(connector_metadata, "step_work", 0.0))))

    def unregister_kv_caches(self) -> None:
        """The KV cache's memory is about to go (vLLM 0.33 and 0.34's sleep; in 0.34 also
        `release_kv_cache_memory`, `Worker.discard(("kv_cache",))` and layer-wise weight
        updates): every transfer is finished and nothing touches the caches until
        `restore_kv_caches`. Idempotent."""
        if self._passthrough is None:
            self._worker_side().suspend()

    def restore_kv_caches(self) -> None:
        """The registered caches are back (the same tensors; vLLM 0.34 hands them back
        zeroed): loads and stores run again from the next step."""
        if self._passthrough is None:
            self._worker_side().resume()

    def build_connector_worker_meta(self) -> Any:
        """This rank's report to the scheduler (`LmcrWorkerMetadata`), in every step with
        something to say: None when nothing failed, nothing was measured and the link is up
        and was reported up (vLLM then has nothing of ours to carry). A link that is down is
        reported every step, so that over several ranks the scheduler sees any rank's."""
        if self._passthrough is not None or KVConnectorWorkerMetadata is object:
            return None
        worker = self._worker_side()
        report = worker.report()
        quiet = (worker.disabled is None and not report["failed_loads"]
                 and report["throughput"] is None and report["step"] is None
                 and not report["link_down"] and not self._reported_down)
        self._reported_down = bool(report["link_down"])
        return None if quiet else LmcrWorkerMetadata(worker.disabled,
                                                     **report)  # type: ignore[arg-type]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._passthrough is not None:
            return
        worker = self._worker_side()
        if not worker.registered and worker.disabled is None:
            caches = caches_from_forward_context(forward_context)
            if not caches:
                return
            self._register(worker, caches)
        worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._passthrough is None:
            self._worker_side().wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if self._passthrough is None:
            self._worker_side().save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._passthrough is None:
            self._worker_side().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                   set[str] | None]:
        stored, loaded, _ = self._transfers(finished_req_ids)
        return stored or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`, and the requests whose background load failed (a model of several
        KV cache groups reports failed requests, not blocks; vLLM recomputes them)."""
        stored, loaded, failed = self._transfers(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=stored, finished_recving=loaded,
                                          failed_recving=failed)

    def _transfers(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        if self._passthrough is not None:
            return set(), set(), set()
        worker = self._worker_side()
        worker.forget(finished_req_ids)
        if isinstance(worker, GroupedWorker):
            loaded, failed = worker.finished_loads()
            return worker.finished_stores(), loaded, failed
        return worker.finished_stores(), worker.finished_loads(), set()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted and self._passthrough is None:
            self._worker_side().wait_for_stores(preempted)

    # -- vLLM's metrics ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What changed since the last step: a worker's loads and stores, or the scheduler's
        lookups and promises; vLLM sums them over every rank and the scheduler."""
        if self._passthrough is not None:
            return None
        if self._stats is None:
            if self._worker is not None:  # a worker: its engines', once the caches are in
                if not self._worker.registered or not self._worker.engines:
                    return None
                sources = [engine.metrics for engine in self._worker.engines]
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
        if self._passthrough is not None:
            return set()
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
        if self._passthrough is not None:
            return 0, False
        side = self._scheduler_side()
        assert self._names is not None
        try:
            prompt, identity = self._names.name(request)
        except UnnamedRequest as exc:
            side.unnamed(request.request_id, str(exc))
            return 0, False
        try:
            side.retain(request.request_id,
                        retention(getattr(request, "kv_transfer_params", None)))
        except BadRetention as exc:
            logger.warning("lmcache-remote: request %s: %s; served without retention",
                           request.request_id, exc)
        n = side.num_new_matched_tokens(request.request_id, prompt, num_computed_tokens,
                                        identity, read=not _skips_external_kv(request))
        if n is None:
            return None, False  # the lookup is still running: vLLM asks again later
        return n, side.loads_async(n, request.request_id)

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34, with `--max-num-inflight-kv-loads`: whether `get_num_new_matched_tokens`
        may answer `load_kv_async=True` for this request, so that vLLM queues it where its
        load can start while the running batch is full. Asked when the request enters the
        waiting queues, so no lookup: true when the longest hit its prompt could have (whole
        chunks short of its last token) would load in the background (`SchedulerSide.
        may_load_async`: every load of a model of several KV cache groups, a hit of at least
        `async_load_min_tokens` otherwise). A probe of a declined link also loads in the
        background but is not foreseen here (vLLM still counts it against the cap)."""
        if self._passthrough is not None or self._scheduler is None:
            return False
        if _skips_external_kv(request):
            return False
        return self._scheduler.may_load_async(
            request.request_id, int(getattr(request, "num_prompt_tokens", 0) or 0))

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if self._passthrough is not None:
            return
        get_ids = getattr(blocks, "get_block_ids", None)
        self._scheduler_side().after_alloc(request.request_id, num_external_tokens,
                                           get_ids() if get_ids else None,
                                           int(getattr(request, "num_prompt_tokens", 0) or 0))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._passthrough is not None:
            return LmcrConnectorMetadata([], set(), self._namespace)
        side = self._scheduler_side()
        assert self._names is not None
        new = []
        for r in scheduler_output.scheduled_new_reqs:
            named = self._names.known(r.req_id)
            if named is not None and side.knows(r.req_id):  # never a request not named
                new.append(NewRequest(r.req_id, named[0], r.block_ids or [],
                                      r.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        again = [
            CachedRequest(req_id, cached.new_block_ids[i], req_id in resumed,
                          cached.num_computed_tokens[i])
            for i, req_id in enumerate(cached.req_ids)
        ]
        step_tokens, step_work = _step_work(scheduler_output)
        if self._fleet is not None:
            self._fleet.tick()
        plans = side.build(
            new, again, scheduler_output.num_scheduled_tokens,
            getattr(scheduler_output, "finished_req_ids", ()) or (),
        )
        return LmcrConnectorMetadata(
            plans, set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            self._namespace, step_tokens, step_work)

    def reset_cache(self) -> bool | None:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (and `pause_generation` with
        `clear_cache`, the weight-update path of RLHF frameworks): nothing cached before may be
        served by this engine again, the weights may have changed. Redis is the fleet's, so
        nothing is deleted: the engine moves to a namespace of its own, `{namespace}+{8 random
        hex digits}`, the scheduler's lookups at once, the workers with the next step's
        metadata. Logged at INFO. The worker side is never asked (None). It does not delete
        or unpin anything in Redis, nor empty the workers' local tiers (their keys carry the
        old namespace, so nothing there is read again), nor touch vLLM's own prefix cache.
        vLLM 0.34's `sleep`, `pause_generation` and `release_kv_cache_memory` with
        `reset_connector=False` do not call it: the engine keeps its namespace (the caller
        says the weights did not change)."""
        if self._lookup is None:
            return None
        self._namespace = f"{self._base_namespace}+{secrets.token_hex(4)}"
        self._lookup.rename_model(self._namespace)
        logger.info("lmcache-remote: connector cache reset: model namespace %s from now on "
                    "(nothing stored before is served by this engine)", self._namespace)
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        if self._passthrough is not None:
            return
        side = self._scheduler_side()
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        if isinstance(meta, LmcrWorkerMetadata):
            if meta.disabled:
                side.turn_off(meta.disabled)
            side.worker_report(failed | meta.failed_loads, meta.link_down, meta.throughput,
                               meta.step)
        elif failed:
            side.load_failed(failed)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool,
                                                                           dict[str, Any] | None]:
        if self._passthrough is not None:
            return False, None
        if self._names is not None:
            self._names.forget(request.request_id)
        return self._scheduler_side().finish(request.request_id), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid manager's `request_finished` (`SupportsHMA`): the same, every group's
        blocks given."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # -- helpers ------------------------------------------------------------------------------

    def _register(self, worker: WorkerSide | GroupedWorker,
                  caches: Mapping[str, torch.Tensor]) -> None:
        if isinstance(worker, GroupedWorker):
            worker.register(caches, lambda name, tensor: cache_writer(
                self._vllm_config, name, tensor,
                next(g.geometry.use_mla for g in worker.groups if name in g.layer_names)))
            return
        geometry = self._geometry
        use_mla = bool(geometry and geometry.use_mla)
        first = next(iter(caches), None)
        writer = None if first is None else cache_writer(self._vllm_config, first,
                                                         caches[first], use_mla)
        worker.register(caches, use_mla=use_mla,
                        dtype=geometry.dtype if geometry else None,
                        block_size=int(self._vllm_config.cache_config.block_size),
                        writer=writer)

    def _worker_side(self) -> WorkerSide | GroupedWorker:
        if self._worker is None:
            raise RuntimeError("worker hook called on the scheduler-side connector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler hook called on the worker-side connector")
        return self._scheduler


def _skips_external_kv(request: Any) -> bool:
    """Whether vLLM discards a connector hit for this request (prompt logprobs, prompt
    scoring, `skip_reading_prefix_cache`): 0.34's `skip_reading_external_kv`, the request's
    `skip_reading_prefix_cache` before."""
    skips = getattr(request, "skip_reading_external_kv", None)
    if skips is None:
        skips = getattr(request, "skip_reading_prefix_cache", False)
    return bool(skips)


def _step_work(scheduler_output: Any) -> tuple[int, float]:
    """The step's computed tokens (every request's) and their summed context (the sum of
    their positions), which the workers time the forward against."""
    computed: dict[str, int] = {}
    for r in scheduler_output.scheduled_new_reqs:
        computed[r.req_id] = int(r.num_computed_tokens)
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        computed[req_id] = int(cached.num_computed_tokens[i])
    tokens, work = 0, 0.0
    for req_id, n in scheduler_output.num_scheduled_tokens.items():
        tokens += int(n)
        work += n * (computed.get(req_id, 0) + n / 2)
    return tokens, work
