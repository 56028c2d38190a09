"""The worker side: one rank's loads and stores.

Worker side (`WorkerSide`, one per rank, in the worker process; `worker_api.KVWorker` is its
interface, shared with `worker_groups.GroupedWorker`, and states each method's contract):

- `register_caches(kv_caches, writer_for)`, or `register(kv_caches, use_mla=, dtype=,
  block_size=)` with every value given: the per-layer paged caches, in layer order, with
  what the KV cache spec says (MLA or not, the values' dtype, the scheduler's block size);
  the layout (`layer_view`: the `[blocks, heads, block_size, K|V]` views of
  vLLM 0.33 and 0.34 in any physical layout, MLA's `[blocks, 1, block_size, latent]`, and
  older shapes) and the geometry come from them; opens the rank's `CacheEngine`.
- `begin_step(plans)`: the step's plans, taken when vLLM binds the metadata, before the
  forward: vLLM 0.33 and 0.34 call `start_load_kv` after the forward in steps without a
  synchronous load, and the stores of those steps must still run layer by layer inside the
  forward.
- `start_load()`: loads every planned hit (once per step): whole (`retrieve`) or, layer-wise,
  fetches the chunks now and leaves one `retrieve_layer` generator per request.
- `wait_for_layer(name)`: layer-wise: writes that layer (and any earlier one not yet written)
  of every pending load; when it returns, the layer's loaded KV is in the cache.
- `save_layer(name)`: layer-wise: copies that layer of every planned store (`store_layer`).
- `wait_for_save()`: finishes every store of the step (whole: `store` here) and any load left.
  A request whose load came back short stores nothing past the gap (that KV was computed
  over the missing tokens) until a plan made after vLLM's rollback arrives (`begin_step`).
- `take_load_errors()`: the block ids whose planned KV did not arrive (a miss, a corrupt chunk,
  Redis down, any exception), so vLLM recomputes from the first of them. Nothing here raises
  into vLLM: a failure is logged, counted and reported as data.
- `report()`: what the scheduler must learn from this rank, once per step (vLLM's worker
  metadata): the requests whose load failed since the last report (a miss, a timeout, a
  corrupt chunk: the scheduler promises such a request no hit again after
  `MAX_LOAD_FAILURES`), whether the link to Redis is down (the engine's health gate is open:
  the scheduler then promises nothing but probes), the link's throughput when a load measured
  it anew, and the step's forward time with the step's tokens (`begin_step(..., step=)`,
  `forward_timer.ForwardTimer`): the engine's prefill speed.
- Loads run under the scheduler's verdict (`load_policy="always"` to the engine: it decided)
  and within its `load_budget` (a deadline on the fetch): a load slower than computing is
  abandoned, reported failed, and its time measures the link.
- background transfers (`background.BackgroundTransfers`): asynchronous loads on a loader
  thread, reported by
  `finished_loads()` (with their missing blocks); with `async_save` the step's stores on a
  saver thread, `finished_stores()` reporting finished requests whose stores are done and
  `wait_for_stores(ids)` finishing a preempted request's stores before its blocks are reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence

import torch

from lmcache_remote.connectors import PagedKV
from lmcache_remote.connectors.layout_proof import CacheWriter, LayoutUnproven
from lmcache_remote.engine import CacheEngine, startup
from lmcache_remote.integrations.vllm_core.background import (
    BackgroundTransfers,
    step_event,
    transfer_stream,
)
from lmcache_remote.integrations.vllm_core.forward_timer import ForwardTimer
from lmcache_remote.integrations.vllm_core.plans import RequestPlan, Span
from lmcache_remote.integrations.vllm_core.proof import ProvenLayout, proven_layout
from lmcache_remote.integrations.vllm_core.settings import (
    ConnectorSettings,
    KVGeometry,
    layer_view,
)
from lmcache_remote.integrations.vllm_core.worker_api import KVWorker, WriterFor
from lmcache_remote.storage.session.connection_count import (
    VLLM_WORKER_CALLERS,
    ConnectionCount,
    engine_connections,
)
from lmcache_remote.storage.wire.deadline import call_deadline
from lmcache_remote.storage.wire.lanes import background_reads
from lmcache_remote.telemetry.metrics import RateLimitedLogger

logger = logging.getLogger(__name__)


class WorkerSide(KVWorker):
    """One rank's loads and stores (`KVWorker`, whose methods state their contracts); see
    the module docstring. `spec` and `block_size`: what the KV cache spec says (the geometry,
    the scheduler's block size), for `register_caches`."""

    def __init__(self, settings: ConnectorSettings, model_name: str, world_size: int,
                 rank: int, *, can_save: bool = True, spec: KVGeometry | None = None,
                 block_size: int | None = None) -> None:
        self.settings = settings
        self.spec = spec
        self.spec_block_size = block_size
        self.model_name = model_name
        self.world_size = world_size
        self.rank = rank
        self.can_save = can_save
        self.engine: CacheEngine | None = None
        self.geometry: KVGeometry | None = None
        self._names: dict[str, int] = {}
        self._layers: list[torch.Tensor] = []
        self._reading: ProvenLayout | None = None
        self._disabled: str | None = None  # why the connector is off on this rank
        self._asleep = False  # vLLM's sleep mode: the caches are away
        self._block_size = 0
        self._plans: list[RequestPlan] = []
        self._loads: list[_PendingLoad] = []
        self._stores: list[_PendingStore] = []
        self._loads_started = False
        self._stores_started = False
        self._gaps: dict[str, int] = {}  # request -> first planned token that did not load
        self._async_plans: list[RequestPlan] = []
        self._background = BackgroundTransfers()
        self._errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests whose load failed, not yet reported
        self._timer = ForwardTimer()  # the forward's time, less this side's hooks
        self._sent_samples = 0  # link throughput samples already reported
        self._log = RateLimitedLogger(logger)

    @property
    def registered(self) -> bool:
        return self.engine is not None

    @property
    def disabled(self) -> str | None:
        return self._disabled

    def register_caches(self, kv_caches: Mapping[str, torch.Tensor],
                        writer_for: WriterFor) -> None:
        """`register` with what the KV cache spec said (`spec`, `block_size`) and the first
        layer's write op; caches of another geometry than the spec's are served but logged
        (WARNING: the scheduler, which keys by the spec, will miss)."""
        use_mla = bool(self.spec and self.spec.use_mla)
        first = next(iter(kv_caches), None)
        self.register(kv_caches, use_mla=use_mla,
                      dtype=self.spec.dtype if self.spec else None,
                      block_size=self.spec_block_size,
                      writer=None if first is None else writer_for(first, kv_caches[first],
                                                                   use_mla))
        if self.spec is not None and self.geometry is not None and self.spec != self.geometry:
            logger.warning("KV caches are %s but the KV cache spec says %s: the scheduler's "
                           "lookups will miss", self.geometry, self.spec)

    def register(self, kv_caches: Mapping[str, torch.Tensor], *, use_mla: bool,
                 dtype: torch.dtype | None = None, block_size: int | None = None,
                 writer: CacheWriter | None = None, opaque: bool = False) -> None:
        """Take the per-layer caches (in layer order): `register_caches` with every value
        given. `use_mla` and `dtype` come from the KV
        cache spec (see `layer_view`); `block_size` is the scheduler's block size, in which
        block ids are reported (default: the tensors' own). `writer` is the attention
        backend's own cache-write op on the first layer: the reading of the caches is proven
        with it (`proof.proven_layout`), or the connector turns itself off on this rank
        (`disabled` says why: ERROR logged once, nothing stored or loaded, every planned load
        reported failed so that vLLM recomputes it). `opaque`: the layers are bytes copied
        as they are (a recurrent state's page, `worker_groups`): nothing to prove."""
        if not kv_caches:
            raise ValueError("no KV cache layers to register")
        if self.engine is not None:  # registered again (new caches): start over
            self.close()
            self.engine = None
        views = [layer_view(t, use_mla=use_mla, dtype=dtype) for t in kv_caches.values()]
        layouts = {layout for _, layout in views}
        if len(layouts) != 1:
            raise ValueError(f"KV cache layers mix layouts {sorted(layouts)}")
        self._names = {name: i for i, name in enumerate(kv_caches)}
        self._layers = [v for v, _ in views]
        layout = layouts.pop()
        probe = PagedKV(self._layers, [], layout=layout)
        self._block_size = block_size or probe.block_size
        self.geometry = KVGeometry(probe.num_layers, probe.num_kv_heads, probe.head_size,
                                   probe.dtype, layout == "mla")
        try:
            self._reading = (ProvenLayout(self._layers, layout, None, tiled=False) if opaque
                             else proven_layout(self._layers, layout, writer))
        except (LayoutUnproven, ValueError, RuntimeError, TypeError, NotImplementedError) as exc:
            self._disabled = f"the KV cache layout could not be proven: {exc}"
            logger.error("lmcache-remote connector OFF on rank %d: %s (shape %s, %s). Nothing "
                         "is stored or loaded; inference goes on without the cache.",
                         self.rank, self.disabled, tuple(self._layers[0].shape), probe.dtype)
            startup.announce(self.settings.config, role=f"vllm worker (rank {self.rank})",
                             namespace=self.model_name, connections=ConnectionCount(),
                             kv_layout=f"not proven ({layout} shape): connector off")
            return
        self._disabled = None
        logger.info("rank %d: KV cache layout proven with the backend's write op: %s%s",
                    self.rank, self._reading.layout,
                    f" (tiled blocks, read through the op's map, {layout} shape)"
                    if self._reading.tiled else "")
        meta = self.geometry.metadata(self.model_name, self.world_size, self.rank)
        with startup.quiet():  # this side's line says more than the engine's
            self.engine = CacheEngine(self.settings.config, meta)
        reading = self._reading.layout + (" (tiled blocks)" if self._reading.tiled else "")
        startup.announce(self.settings.config, role=f"vllm worker (rank {self.rank})",
                         namespace=self.model_name, kv_layout=f"{reading}, proven",
                         connections=engine_connections(self.settings.config,
                                                        VLLM_WORKER_CALLERS))

    def turn_off(self, reason: str, block_size: int) -> None:
        """The caches cannot be read (before any `register`): this rank's connector is off
        (ERROR once), every planned load is reported failed, nothing is stored."""
        self._disabled = reason
        self._block_size = block_size
        logger.error("lmcache-remote connector OFF on rank %d: %s. Nothing is stored or "
                     "loaded; inference goes on without the cache.", self.rank, reason)

    def rename_model(self, model_name: str) -> None:
        """Keys name `model_name` from now on (the scheduler moved to it: `reset_cache`)."""
        if model_name == self.model_name:
            return
        logger.info("lmcache-remote rank %d: model namespace %s (was %s)", self.rank,
                    model_name, self.model_name)
        self.model_name = model_name
        if self.engine is not None:
            self.engine.rename_model(model_name)

    def begin_step(self, plans: Sequence[RequestPlan],
                   step: tuple[int, float] | None = None) -> None:
        """The step's plans, as vLLM binds them before the forward. Everything of the last
        step ends here (its loads finished, unstarted stores dropped): nothing may outlive it.

        A request whose load came back short has a gap: its KV after the gap is computed over
        missing tokens until vLLM has rolled it back and recomputes. Its stores that start
        past the gap are dropped (with asynchronous scheduling a step planned before vLLM saw
        the failure still runs); a plan whose store starts at or before the gap was made after
        the rollback and ends it, as does a new load (a resumed request) or its end.

        `step`: the step's computed tokens and their summed context, which the forward that
        follows is timed against (`report`)."""
        self._finish_loads()
        self._abort_stores()
        self._timer.begin(step)
        if self.disabled is not None or self._asleep:
            self._refuse(plans)
            plans = []
        self._plans = [p for p in plans if not p.async_load]
        self._async_plans = [p for p in plans if p.async_load]
        self._loads_started = False
        self._stores_started = False
        for plan in self._plans:
            if plan.save is not None and self.settings.async_save:
                self._background.expect_stores(plan.req_id)
            gap = self._gaps.get(plan.req_id)
            if gap is not None and (plan.load is not None
                                    or (plan.save is not None and plan.save.start <= gap)):
                del self._gaps[plan.req_id]

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests vLLM finished: nothing is kept for them (their background stores are
        reported by `finished_stores` once done)."""
        for req_id in req_ids:
            self._gaps.pop(req_id, None)
            self._background.forget(req_id)

    def finished_stores(self) -> set[str]:
        """Finished requests whose background stores are all done: vLLM may free their
        blocks now (a failed store counts as done: it is dropped, the blocks are freed)."""
        return self._background.finished_stores()

    def wait_for_stores(self, req_ids: Iterable[str]) -> None:
        """Block until these requests' background stores are done (vLLM preempted them: their
        blocks are about to be reused)."""
        self._background.wait_for_stores(req_ids)

    def start_load(self) -> None:
        """Start this step's loads (once; later calls do nothing). vLLM calls it before the
        forward in steps with a synchronous load, after it otherwise: a step whose plans
        load anything is always one of the former, and `wait_for_layer` starts them too."""
        if self._loads_started or not self.registered:
            return
        with self._timer.own():
            self._start_loads()

    def _start_loads(self) -> None:
        self._loads_started = True
        for plan in self._async_plans:
            self._background.submit_load(plan.req_id,
                                         functools.partial(self._load_in_background, plan))
        self._async_plans = []
        for plan in self._plans:
            if plan.load is not None and plan.load.end > plan.load.start:
                self._guard(plan, "load", self._start_one_load)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose background load is over (loaded, short or failed: vLLM must learn
        of each once), and no request to recompute whole: their missing blocks join
        `take_load_errors` in the same step."""
        done = self.finished_load_misses()
        for missed in done.values():
            self._errors |= missed
        return set(done), set()

    def finished_load_misses(self) -> dict[str, set[int]]:
        """Requests whose background load is over, each with its missing blocks (empty: all
        loaded), for a caller that reports failed requests rather than blocks."""
        done = self._background.finished_loads()
        self._failed_loads |= {req_id for req_id, missed in done.items() if missed}
        return done

    @property
    def engines(self) -> list[CacheEngine]:
        return [] if self.engine is None else [self.engine]

    def wait_for_layer(self, layer_name: str) -> None:
        layer = self._names.get(layer_name)
        if layer is None:
            return
        with self._timer.own():
            self.start_load()
            for pending in list(self._loads):
                self._step_load(pending, layer + 1)

    def save_layer(self, layer_name: str) -> None:
        layer = self._names.get(layer_name)
        if (layer is None or not self.settings.layerwise or not self.can_save
                or self.settings.async_save):
            return
        with self._timer.own():
            self._start_stores()
            for pending in list(self._stores):
                if self._over_gap(pending.plan):
                    self._drop_store(pending)
                else:
                    self._step_store(pending, layer + 1)

    def report(self) -> dict[str, object]:
        """What the scheduler must learn from this rank this step (see the module
        docstring): `failed_loads`, `link_down`, `throughput` (None: nothing new), `step`
        (None: not measured). Each failure and each figure is reported once."""
        failed, self._failed_loads = self._failed_loads, set()
        step = self._timer.take()
        link_down, throughput = False, None
        if self.engine is not None:
            storage = self.engine.storage
            link_down = storage.remote is not None and not storage.remote.gate.healthy
            snap = storage.link.snapshot()
            if snap.throughput is not None and snap.throughput_samples != self._sent_samples:
                self._sent_samples = snap.throughput_samples
                throughput = snap.throughput
        return {"failed_loads": failed, "link_down": link_down, "throughput": throughput,
                "step": step}

    def wait_for_save(self) -> None:
        self._timer.end()  # vLLM calls it after the forward
        self.start_load()
        self._finish_loads()
        if not self.can_save:
            return
        if self.settings.async_save:
            event = step_event(self._layers)
            for plan in self._plans:
                if plan.save is not None and not self._over_gap(plan):
                    self._background.submit_store(
                        plan.req_id, functools.partial(self._store_in_background, plan, event),
                        self._count_save_wait)
            return
        if self.settings.layerwise:
            self._start_stores()
            for pending in list(self._stores):
                if self._over_gap(pending.plan):
                    self._drop_store(pending)
                else:
                    self._step_store(pending, pending.total_steps)
            self._stores = []
            return
        for plan in self._plans:
            if plan.save is not None and not self._over_gap(plan):
                self._guard(plan, "store", self._store_whole)

    def take_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._errors = self._errors, set()
        return errors

    def suspend(self) -> None:
        """The caches go away (vLLM's sleep): every transfer is finished now, background ones
        included, and until `resume` no hook touches the caches (planned loads are reported
        failed, nothing is stored)."""
        self._finish_loads()
        self._abort_stores()
        self._background.wait_all()
        self._plans, self._async_plans = [], []
        self._asleep = True

    def resume(self) -> None:
        self._asleep = False

    def close(self) -> None:
        self._finish_loads()
        self._abort_stores()
        self._background.close()  # no access to the cache after this returns
        if self.engine is not None:
            self.engine.close()

    def _refuse(self, plans: Sequence[RequestPlan]) -> None:
        """The connector is off: every planned load is reported failed (an asynchronous one
        as finished, so that the request does not wait), and vLLM recomputes it."""
        for plan in plans:
            if plan.load is None or plan.load.end <= plan.load.start:
                continue
            missed = self._missed_blocks(plan, 0)
            self._failed_loads.add(plan.req_id)
            if plan.async_load:
                self._background.refuse_load(plan.req_id, missed)
            else:
                self._errors |= missed

    # -- background transfers (`background.BackgroundTransfers` runs them) -----------------

    def _load_in_background(self, plan: RequestPlan) -> set[int]:
        """A whole load on the loader thread; its missing blocks (touches no shared state but
        the engine, which is thread-safe, and blocks vLLM holds until the load is reported)."""
        span = _span(plan.load)
        hit_end = 0
        try:  # a background load yields the read lanes to the step's loads
            with transfer_stream(self._layers), background_reads(), _budget(plan):
                hit = self._engine().retrieve(plan.token_ids[: span.end], self._kv(plan, span.end),
                                              self._mask(span.skip, span.end),
                                              identity=plan.identity, load_policy="always")
            hit_end = _hit_end(hit, span.skip)
            self._pin_hit(plan, hit_end)
        except Exception as exc:
            self._log.warning("load", "load of request %s failed: %s", plan.req_id, exc)
        return self._missed_blocks(plan, hit_end)

    def _pin_hit(self, plan: RequestPlan, hit_end: int) -> None:
        """A request that asked for retention keeps the prefix it loaded pinned (its stores
        pin what they add: `CacheEngine.store(retain=)`)."""
        if plan.retain and hit_end > 0:
            engine = self._engine()
            engine.pin(plan.token_ids[:hit_end], identity=plan.identity,
                       seconds=min(plan.retain, engine.config.max_retain_seconds))

    def _store_in_background(self, plan: RequestPlan, event: object | None) -> None:
        """A whole store on the saver thread, after the step's forward (on CUDA its stream
        first waits for `event`, recorded when the step's KV was written; untested)."""
        try:
            with transfer_stream(self._layers, event):
                self._store_whole(plan)
        except Exception as exc:
            self._log.warning("store", "store of request %s failed: %s", plan.req_id, exc)

    def _count_save_wait(self) -> None:
        self._engine().metrics.inc("vllm.save_backpressure_waits")

    # -- loads --------------------------------------------------------------------------------

    def _kv(self, plan: RequestPlan, end: int) -> PagedKV:
        assert self._reading is not None
        return self._reading.view(plan.slot_mapping[:end])

    def _engine(self) -> CacheEngine:
        if self.engine is None:
            raise RuntimeError("no KV caches registered")
        return self.engine

    def _mask(self, skip: int, end: int) -> torch.Tensor:
        mask = torch.ones(end, dtype=torch.bool)
        mask[:skip] = False
        return mask

    def _start_one_load(self, plan: RequestPlan) -> None:
        span = _span(plan.load)
        args = (plan.token_ids[: span.end], self._kv(plan, span.end), self._mask(span.skip,
                                                                                 span.end))
        if not self.settings.layerwise:
            with _budget(plan):
                hit = self._engine().retrieve(*args, identity=plan.identity,
                                              load_policy="always")
            self._report_misses(plan, _hit_end(hit, span.skip))
            self._pin_hit(plan, _hit_end(hit, span.skip))
            return
        gen = self._engine().retrieve_layer(*args, identity=plan.identity, load_policy="always")
        with _budget(plan):
            hit_end = _hit_end(next(gen), span.skip)  # fetched now; the layers follow
        self._report_misses(plan, hit_end)  # known already: vLLM may learn it this step
        self._pin_hit(plan, hit_end)
        if hit_end > span.skip:
            self._loads.append(_PendingLoad(plan, gen, self._engine().layout.num_layers))
        else:
            gen.close()

    def _step_load(self, pending: _PendingLoad, upto: int) -> None:
        """Advance a load until `upto` layers are written; a failure voids the whole load."""
        done = False
        try:
            while pending.layers_done < min(upto, pending.num_layers):
                next(pending.gen)
                pending.layers_done += 1
            done = pending.layers_done >= pending.num_layers
        except Exception as exc:
            self._log.warning("load", "load of %s failed: %s", pending.plan.req_id, exc)
            self._report_misses(pending.plan, 0)
            done = True
        if done:
            self._loads.remove(pending)
            pending.gen.close()

    def _finish_loads(self) -> None:
        for pending in list(self._loads):
            self._step_load(pending, pending.num_layers)

    def _report_misses(self, plan: RequestPlan, hit_end: int) -> None:
        """Blocks of the planned tokens that were not loaded: vLLM recomputes from there. The
        request's stores past the gap wait for the rollback (`begin_step`)."""
        missed = self._missed_blocks(plan, hit_end)
        if missed:
            self._failed_loads.add(plan.req_id)
            first = max(hit_end, _span(plan.load).start)
            self._gaps[plan.req_id] = min(first, self._gaps.get(plan.req_id, first))
            self._errors |= missed

    def _missed_blocks(self, plan: RequestPlan, hit_end: int) -> set[int]:
        span = _span(plan.load)
        first = max(hit_end, span.start)
        if first >= span.end:
            return set()
        if self.engine is not None:
            self.engine.metrics.inc("vllm.load_error_tokens", span.end - first)
        slots = plan.slot_mapping[first: span.end]
        return {int(b) for b in torch.unique(slots // self._block_size)}

    # -- stores -------------------------------------------------------------------------------

    def _start_stores(self) -> None:
        """Open this step's layer-wise stores, once per step."""
        if self._stores_started:
            return
        self._stores_started = True
        for plan in self._plans:
            if plan.save is not None:
                self._guard(plan, "store", self._start_one_store)

    def _start_one_store(self, plan: RequestPlan) -> None:
        span = _span(plan.save)
        gen = self._engine().store_layer(plan.token_ids[: span.end], self._kv(plan, span.end),
                                         self._mask(span.skip, span.end),
                                         identity=plan.identity, retain=plan.retain)
        self._stores.append(_PendingStore(plan, gen, self._engine().layout.num_layers + 1))

    def _step_store(self, pending: _PendingStore, upto: int) -> None:
        try:
            while pending.steps_done < min(upto, pending.total_steps):
                next(pending.gen)
                pending.steps_done += 1
        except Exception as exc:
            self._log.warning("store", "store of %s dropped: %s", pending.plan.req_id, exc)
            pending.steps_done = pending.total_steps
        if pending.steps_done >= pending.total_steps:
            self._stores.remove(pending)
            pending.gen.close()

    def _abort_stores(self) -> None:
        for pending in self._stores:
            pending.gen.close()
        self._stores = []

    def _over_gap(self, plan: RequestPlan) -> bool:
        """Whether the plan's store covers KV computed over a gap not yet recomputed."""
        gap = self._gaps.get(plan.req_id)
        return gap is not None and plan.save is not None and plan.save.start > gap

    def _drop_store(self, pending: _PendingStore) -> None:
        pending.gen.close()
        if pending in self._stores:
            self._stores.remove(pending)
        if self.engine is not None:
            self.engine.metrics.inc("vllm.dropped_store_requests")

    def _store_whole(self, plan: RequestPlan) -> None:
        span = _span(plan.save)
        self._engine().store(plan.token_ids[: span.end], self._kv(plan, span.end),
                             self._mask(span.skip, span.end), identity=plan.identity,
                             retain=plan.retain)

    def _guard(self, plan: RequestPlan, what: str, action: Callable[[RequestPlan], None]) -> None:
        """Run one request's transfer; a failure is logged and, for a load, reported."""
        try:
            action(plan)
        except Exception as exc:
            self._log.warning(what, "%s of request %s failed: %s", what, plan.req_id, exc)
            if what == "load":
                self._report_misses(plan, 0)


@dataclasses.dataclass(eq=False)
class _PendingLoad:
    plan: RequestPlan
    gen: Generator[torch.Tensor, None, None]
    num_layers: int
    layers_done: int = 0


@dataclasses.dataclass(eq=False)
class _PendingStore:
    plan: RequestPlan
    gen: Generator[int | None, None, None]
    total_steps: int
    steps_done: int = 0


def _budget(plan: RequestPlan) -> contextlib.AbstractContextManager[None]:
    """The plan's load budget as a deadline on the fetch (none without a budget)."""
    if plan.load_budget is None:
        return contextlib.nullcontext()
    return call_deadline(plan.load_budget)


def _span(span: Span | None) -> Span:
    assert span is not None
    return span


def _hit_end(mask: torch.Tensor, skip: int) -> int:
    """End of the loaded run: the mask is True on a prefix of [skip, len)."""
    return skip + int(mask[skip:].sum())
