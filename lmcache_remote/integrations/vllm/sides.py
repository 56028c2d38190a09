"""The connector's two sides, as vLLM sees them: what each hook promises, and who keeps it.

`LmcrConnector` (`connector`) is the class vLLM loads; it picks its sides once, when vLLM
builds it, and every hook hands its call to one of them:

- `SchedulerHooks`, in the scheduler process: `ServedScheduler` turns vLLM's requests and
  scheduler outputs into plain values for `vllm_core.SchedulerSide` (with its
  `PrefixLookup` and `RequestNames`);
- `WorkerHooks`, in each worker process: `ServedWorker` turns vLLM's caches, metadata and
  forward context into calls on a `vllm_core.KVWorker` (one `WorkerSide`, or a
  `GroupedWorker` for a model of several KV cache groups: the same interface);
- `PassThrough` is both sides for a model the connector cannot serve right
  (`config.unserved_model`): every hook does nothing and answers as if no connector were
  there (no lookup, no load, no store, no Redis connection);
- `WrongRole` is the side a connector does not hold (a worker hook on the scheduler's
  connector): every hook raises, a bug in the caller.

Each protocol method states its hook's contract, as vLLM's `KVConnectorBase_V1` does for
the hook itself; the hook order and what happens to a preempted, a failed or an unnamed
request are in `connector`'s module docstring. No hook raises for a cache or Redis failure.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any, NamedTuple, NoReturn, Protocol

import torch

from lmcache_remote.integrations.vllm.caches import cache_writer, caches_from_forward_context
from lmcache_remote.integrations.vllm.messages import (
    KVConnectorWorkerMetadata,
    LmcrConnectorMetadata,
    LmcrWorkerMetadata,
)
from lmcache_remote.integrations.vllm.requests import (
    BadRetention,
    RequestNames,
    UnnamedRequest,
    retention,
)
from lmcache_remote.integrations.vllm_core import (
    CachedRequest,
    KVGeometry,
    NewRequest,
    PrefixLookup,
    SchedulerSide,
)
from lmcache_remote.integrations.vllm_core.fleet import SchedulerPublisher
from lmcache_remote.integrations.vllm_core.worker_api import KVWorker
from lmcache_remote.telemetry.metrics import Metrics

logger = logging.getLogger(__name__)

__all__ = ["PassThrough", "SchedulerHooks", "ServedScheduler", "ServedWorker", "Transfers",
           "WorkerHooks", "WrongRole"]


class Transfers(NamedTuple):
    """What the background transfers finished since the last step (vLLM's
    `get_finished` / `get_transfer_results`): requests whose stores are done (vLLM may free
    their blocks), whose loads are over, and those of them vLLM must recompute whole."""

    stored: set[str]
    loaded: set[str]
    failed: set[str]


class SchedulerHooks(Protocol):
    """The scheduler's hooks, called by vLLM's scheduler in the scheduler process."""

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens past `num_computed_tokens` (vLLM's own prefix-cache hit) the
        cache will load for `request`, and whether that load runs in the background (vLLM
        then keeps the request waiting while others run). `(None, False)`: the lookup is
        still running, vLLM asks again in a later step. `(0, False)` for a request that is
        not named (`UnnamedRequest`), that reads no external KV, or a hit not worth loading.
        Whole chunks only, never the prompt's last token."""

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34, with `--max-num-inflight-kv-loads`: whether a hit of this request may
        load in the background, asked without a lookup when it enters the waiting queues."""

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks, `num_external_tokens` of them to be loaded
        (0: the hit was declined or none): the plan for the next step is fixed here."""

    def build_connector_meta(self, scheduler_output: Any) -> LmcrConnectorMetadata:
        """Every step: the plans of the scheduled requests (what each rank loads and stores,
        into which blocks), the preempted requests, the model namespace and the step's work,
        sent to every worker. Never None."""

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report of the last step (`LmcrWorkerMetadata`, aggregated over the
        ranks, and vLLM's `failed_recving`): failed loads are promised no hit again after
        repeated failures, a down link makes lookups probe only, an off rank turns lookups
        off, and the forward's speed feeds the load decision."""

    def request_finished(self, request: Any) -> bool:
        """The request is done: whether vLLM must keep its blocks until `get_finished`
        reports its background stores done (`async_save`); False frees them now."""

    def reset_cache(self) -> bool | None:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: nothing cached before is served
        by this engine again (a fresh model namespace). True when done, None when this side
        has nothing to reset."""

    def stats_sources(self) -> list[Metrics] | None:
        """The metrics whose change each step is vLLM's connector stats; None: none yet."""

    def close(self) -> None:
        """vLLM shuts down: the lookups, publishers and connections close."""


class WorkerHooks(Protocol):
    """The workers' hooks, called by vLLM's model runner (or 0.34's `ActiveKVConnector`) in
    each worker process."""

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """The rank's per-layer paged caches, once allocated: their layout is proven with the
        attention backend's own write op, or the connector turns itself off on this rank."""

    def bind_connector_metadata(self, metadata: Any) -> None:
        """The step's plans, before the forward: the model namespace is followed and the
        last step's transfers end."""

    def unregister_kv_caches(self) -> None:
        """The caches' memory is about to go (vLLM's sleep, `release_kv_cache_memory`,
        discarding the KV cache): every transfer finishes, nothing touches the caches until
        `restore_kv_caches`. Idempotent."""

    def restore_kv_caches(self) -> None:
        """The registered caches are back (the same tensors): transfers run again from the
        next step."""

    def build_connector_worker_meta(self) -> Any:
        """This rank's report to the scheduler (`LmcrWorkerMetadata`), or None when it has
        nothing to say (nothing failed or measured, the link up and reported up)."""

    def start_load_kv(self, forward_context: Any) -> None:
        """Start the step's loads (before the forward with a synchronous load, after it
        otherwise); registers the caches from the forward context if vLLM did not."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before the layer's attention: its loaded KV is in the cache when this returns."""

    def save_kv_layer(self, layer_name: str) -> None:
        """After the layer's attention: copy its KV of the step's planned stores."""

    def wait_for_save(self) -> None:
        """After the forward: the step's stores are copied out (or handed to the background
        with `async_save`); the blocks may be reused once this returns."""

    def transfers(self, finished_req_ids: set[str]) -> Transfers:
        """Forget the requests vLLM finished, and say which background transfers are over
        (each request once)."""

    def handle_preemptions(self, preempted: set[str]) -> None:
        """vLLM preempted these requests: their background stores finish before the blocks
        are reused."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks whose planned KV did not arrive, so that vLLM recomputes them."""

    def stats_sources(self) -> list[Metrics] | None:
        """The metrics whose change each step is vLLM's connector stats; None: none yet
        (the caches are not registered)."""

    def close(self) -> None:
        """vLLM shuts down: every transfer finishes, the engines close."""


class PassThrough(SchedulerHooks, WorkerHooks):
    """Both sides for a model the connector cannot serve right: every hook answers as if
    there were no connector. `namespace`: the (empty) one the metadata names."""

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def may_load_async(self, request: Any) -> bool:
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> LmcrConnectorMetadata:
        return LmcrConnectorMetadata([], set(), "")

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def request_finished(self, request: Any) -> bool:
        return False

    def reset_cache(self) -> bool | None:
        return None

    def stats_sources(self) -> list[Metrics] | None:
        return None

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        return None

    def bind_connector_metadata(self, metadata: Any) -> None:
        return None

    def unregister_kv_caches(self) -> None:
        return None

    def restore_kv_caches(self) -> None:
        return None

    def build_connector_worker_meta(self) -> Any:
        return None

    def start_load_kv(self, forward_context: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def transfers(self, finished_req_ids: set[str]) -> Transfers:
        return Transfers(set(), set(), set())

    def handle_preemptions(self, preempted: set[str]) -> None:
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def close(self) -> None:
        return None


class WrongRole(SchedulerHooks, WorkerHooks):
    """The side a connector does not hold: any hook of it is a caller's bug (a worker hook
    called on the scheduler's connector, or the other way round) and raises RuntimeError."""

    def __init__(self, side: str, role: str) -> None:
        self._said = f"{side} hook called on the {role}-side connector"

    def _refuse(self, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(self._said)

    get_num_new_matched_tokens = may_load_async = update_state_after_alloc = _refuse
    build_connector_meta = update_connector_output = request_finished = _refuse
    register_kv_caches = bind_connector_metadata = unregister_kv_caches = _refuse
    restore_kv_caches = build_connector_worker_meta = start_load_kv = _refuse
    wait_for_layer_load = save_kv_layer = wait_for_save = transfers = _refuse
    handle_preemptions = get_block_ids_with_load_errors = _refuse

    def reset_cache(self) -> bool | None:
        return None  # vLLM asks every connector; the worker side has nothing to reset

    def stats_sources(self) -> list[Metrics] | None:
        return None

    def close(self) -> None:
        return None


class ServedScheduler(SchedulerHooks):
    """The scheduler side of a served model: vLLM's objects to `SchedulerSide`'s values.
    `namespace` is the model namespace the workers follow (`reset_cache` moves it);
    `geometry`, the KV geometry the keys are hashed with (None: several KV cache groups,
    each its own)."""

    def __init__(self, side: SchedulerSide, lookup: PrefixLookup, names: RequestNames,
                 namespace: str, geometry: KVGeometry | None = None,
                 fleet: SchedulerPublisher | None = None) -> None:
        self.side = side
        self.geometry = geometry
        self.lookup = lookup
        self.names = names
        self.namespace = self.base_namespace = namespace
        self.fleet = fleet

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        side = self.side
        try:
            prompt, identity = self.names.name(request)
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
                                        identity, read=not skips_external_kv(request))
        if n is None:
            return None, False  # the lookup is still running: vLLM asks again later
        return n, side.loads_async(n, request.request_id)

    def may_load_async(self, request: Any) -> bool:
        """True when the longest hit the prompt could have (whole chunks short of its last
        token) would load in the background (`SchedulerSide.may_load_async`: every load of a
        model of several KV cache groups, a hit of at least `async_load_min_tokens`
        otherwise). A probe of a declined link also loads in the background but is not
        foreseen here (vLLM still counts it against the cap)."""
        if skips_external_kv(request):
            return False
        return self.side.may_load_async(
            request.request_id, int(getattr(request, "num_prompt_tokens", 0) or 0))

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        get_ids = getattr(blocks, "get_block_ids", None)
        self.side.after_alloc(request.request_id, num_external_tokens,
                              get_ids() if get_ids else None,
                              int(getattr(request, "num_prompt_tokens", 0) or 0))

    def build_connector_meta(self, scheduler_output: Any) -> LmcrConnectorMetadata:
        new = []
        for r in scheduler_output.scheduled_new_reqs:
            named = self.names.known(r.req_id)
            if named is not None and self.side.knows(r.req_id):  # never a request not named
                new.append(NewRequest(r.req_id, named[0], r.block_ids or [],
                                      r.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        again = [
            CachedRequest(req_id, cached.new_block_ids[i], req_id in resumed,
                          cached.num_computed_tokens[i])
            for i, req_id in enumerate(cached.req_ids)
        ]
        step_tokens, step_work = step_work_of(scheduler_output)
        if self.fleet is not None:
            self.fleet.tick()
        plans = self.side.build(
            new, again, scheduler_output.num_scheduled_tokens,
            getattr(scheduler_output, "finished_req_ids", ()) or (),
        )
        return LmcrConnectorMetadata(
            plans, set(getattr(scheduler_output, "preempted_req_ids", None) or ()),
            self.namespace, step_tokens, step_work)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        if isinstance(meta, LmcrWorkerMetadata):
            if meta.disabled:
                self.side.turn_off(meta.disabled)
            self.side.worker_report(failed | meta.failed_loads, meta.link_down,
                                    meta.throughput, meta.step)
        elif failed:
            self.side.load_failed(failed)

    def request_finished(self, request: Any) -> bool:
        self.names.forget(request.request_id)
        return self.side.finish(request.request_id)

    def reset_cache(self) -> bool | None:
        """The engine moves to a namespace of its own, `{namespace}+{8 random hex digits}`:
        the lookups at once, the workers with the next step's metadata. Nothing is deleted
        or unpinned in Redis (it is the fleet's), nor the workers' local tiers emptied
        (their keys carry the old namespace), nor vLLM's own prefix cache touched. Logged
        at INFO."""
        self.namespace = f"{self.base_namespace}+{secrets.token_hex(4)}"
        self.lookup.rename_model(self.namespace)
        logger.info("lmcache-remote: connector cache reset: model namespace %s from now on "
                    "(nothing stored before is served by this engine)", self.namespace)
        return True

    def stats_sources(self) -> list[Metrics] | None:
        return [self.side.metrics, self.lookup.metrics]

    def close(self) -> None:
        self.side.close()
        if self.fleet is not None:
            self.fleet.close()
        self.lookup.close()


class ServedWorker(WorkerHooks):
    """A worker of a served model: vLLM's objects to a `KVWorker`'s values. `vllm_config`
    gives the attention backend's write op of a layer (`caches.cache_writer`)."""

    def __init__(self, side: KVWorker, vllm_config: Any) -> None:
        self.side = side
        self._vllm_config = vllm_config
        self._reported_down = False  # the link state this worker last told the scheduler

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.side.register_caches(kv_caches, self._writer_for)

    def _writer_for(self, name: str, tensor: torch.Tensor, use_mla: bool) -> Any:
        return cache_writer(self._vllm_config, name, tensor, use_mla)

    def bind_connector_metadata(self, metadata: Any) -> None:
        namespace = getattr(metadata, "namespace", None)
        if namespace:
            self.side.rename_model(namespace)
        self.side.begin_step(list(getattr(metadata, "requests", [])),
                             (int(getattr(metadata, "step_tokens", 0)),
                              float(getattr(metadata, "step_work", 0.0))))

    def unregister_kv_caches(self) -> None:
        self.side.suspend()

    def restore_kv_caches(self) -> None:
        self.side.resume()

    def build_connector_worker_meta(self) -> Any:
        """A link that is down is reported every step, so that over several ranks the
        scheduler sees any rank's. Where vLLM has no worker metadata, None always."""
        if KVConnectorWorkerMetadata is object:
            return None
        report = self.side.report()
        quiet = (self.side.disabled is None and not report["failed_loads"]
                 and report["throughput"] is None and report["step"] is None
                 and not report["link_down"] and not self._reported_down)
        self._reported_down = bool(report["link_down"])
        return None if quiet else LmcrWorkerMetadata(self.side.disabled,
                                                     **report)  # type: ignore[arg-type]

    def start_load_kv(self, forward_context: Any) -> None:
        if not self.side.registered and self.side.disabled is None:
            caches = caches_from_forward_context(forward_context)
            if not caches:
                return
            self.register_kv_caches(caches)
        self.side.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.side.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        self.side.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self.side.wait_for_save()

    def transfers(self, finished_req_ids: set[str]) -> Transfers:
        self.side.forget(finished_req_ids)
        loaded, failed = self.side.finished_loads()
        return Transfers(self.side.finished_stores(), loaded, failed)

    def handle_preemptions(self, preempted: set[str]) -> None:
        self.side.wait_for_stores(preempted)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.side.take_load_errors()

    def stats_sources(self) -> list[Metrics] | None:
        if not self.side.registered or not self.side.engines:
            return None
        return [engine.metrics for engine in self.side.engines]

    def close(self) -> None:
        self.side.close()


def skips_external_kv(request: Any) -> bool:
    """Whether vLLM discards a connector hit for this request (prompt logprobs, prompt
    scoring, `skip_reading_prefix_cache`): 0.34's `skip_reading_external_kv`, the request's
    `skip_reading_prefix_cache` before."""
    skips = getattr(request, "skip_reading_external_kv", None)
    if skips is None:
        skips = getattr(request, "skip_reading_prefix_cache", False)
    return bool(skips)


def step_work_of(scheduler_output: Any) -> tuple[int, float]:
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
