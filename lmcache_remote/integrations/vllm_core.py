"""The vLLM connector's logic, free of vLLM: settings, the scheduler side, the worker side.

`lmcache_remote.integrations.vllm` is a thin adapter that turns vLLM's objects into the plain
values used here; everything that decides something lives in this module and is tested on real
tensors and real Redis without vLLM.

Scheduler side (`SchedulerSide`, one per vLLM engine, in the scheduler process):

- `num_new_matched_tokens(req_id, prompt, num_computed, cache_salt)`: the prompt tokens past
  `num_computed` (vLLM's own prefix cache) that the cache can load now: `lookup` on every
  rank's key namespace (the smallest answer wins), never the whole prompt (vLLM must compute
  at least one token to sample from: a hit on the whole prompt is cut to the last chunk
  boundary before its last token). May be called several times for one request.
- `after_alloc(req_id, num_external, cache_salt)`: vLLM allocated blocks for the hit; the load
  is now promised to the worker.
- `build(new, cached, num_scheduled, finished)`: the step's `RequestPlan`s: per request the
  tokens, their slots, what to load (whole chunks from the last chunk boundary at or before
  `num_computed`) and what to store (the prompt's chunks completed by this step and not yet
  stored or known to be stored). Only prompt tokens are stored, never decode tokens.
- `finish(req_id)`: forget the request. Transfers never outlive a step, so vLLM may free its
  blocks at once.

Worker side (`WorkerSide`, one per rank, in the worker process):

- `register(kv_caches)`: the per-layer paged caches, in layer order; the layout (`kv_split`
  `[2, blocks, block_size, heads, head]`, FlashInfer's `[blocks, 2, block_size, heads, head]`
  (seen as kv_split), `packed` `[blocks, heads, block_size, 2 * head]`, or MLA
  `[blocks, block_size, head]`) and the geometry come from the tensors; opens the rank's
  `CacheEngine`.
- `start_load(plans)`: loads every planned hit: whole (`retrieve`) or, layer-wise, fetches
  the chunks now and leaves one `retrieve_layer` generator per request.
- `wait_for_layer(name)`: layer-wise: writes that layer (and any earlier one not yet written)
  of every pending load; when it returns, the layer's loaded KV is in the cache.
- `save_layer(name)`: layer-wise: copies that layer of every planned store (`store_layer`).
- `wait_for_save()`: finishes every store of the step (whole: `store` here) and any load left.
- `take_load_errors()`: the block ids whose planned KV did not arrive (a miss, a corrupt chunk,
  Redis down, any exception), so vLLM recomputes from the first of them. Nothing here raises
  into vLLM: a failure is logged, counted and reported as data.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

import torch

from lmcache_remote.config import CacheConfig, load_config
from lmcache_remote.connectors import PagedKV
from lmcache_remote.engine import CacheEngine, EngineMetadata
from lmcache_remote.errors import ConfigError
from lmcache_remote.metrics import RateLimitedLogger

logger = logging.getLogger(__name__)

ROLES = ("kv_producer", "kv_consumer", "kv_both")
_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


# -- settings ---------------------------------------------------------------------------------


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


# -- plans: what the scheduler tells the workers ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Span:
    """Tokens `[start, end)` of a transfer; `skip` (a chunk boundary, <= start) is where the
    chunk-aligned mask begins: tokens `[skip, start)` are moved again though vLLM has them."""

    skip: int
    start: int
    end: int


@dataclasses.dataclass
class RequestPlan:
    """One request's transfers in one step (picklable: vLLM sends it to every worker)."""

    req_id: str
    token_ids: list[int]
    slot_mapping: torch.Tensor
    cache_salt: str | None = None
    load: Span | None = None
    save: Span | None = None


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (vLLM's NewRequestData, what is used of it)."""

    req_id: str
    prompt_token_ids: Sequence[int]
    block_ids: Sequence[int]
    num_computed_tokens: int


@dataclasses.dataclass(frozen=True)
class CachedRequest:
    """A request scheduled again (one entry of vLLM's CachedRequestData)."""

    req_id: str
    new_block_ids: Sequence[int] | None
    resumed: bool
    num_computed_tokens: int


@dataclasses.dataclass
class _Tracker:
    prompt: list[int]
    block_ids: list[int]
    salt: str | None
    stored_end: int = 0


def slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """slot[i] = block_ids[i // block_size] * block_size + i % block_size, for i < num_tokens."""
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    if num_tokens > len(blocks) * block_size:
        raise ValueError(f"{num_tokens} tokens need more than the {len(blocks)} blocks given")
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks[:, None] * block_size + offsets).reshape(-1)[:num_tokens]


class SchedulerSide:
    """Hit counting and per-step plans; see the module docstring. Not thread-safe (vLLM's
    scheduler calls it from one thread)."""

    def __init__(self, lookup: Callable[[Sequence[int], str | None], int], chunk_size: int,
                 block_size: int, *, save_unfull_chunk: bool = False, can_load: bool = True,
                 can_save: bool = True) -> None:
        self._lookup = lookup
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.save_unfull_chunk = save_unfull_chunk
        self.can_load = can_load
        self.can_save = can_save
        self._hits: dict[str, tuple[int, int]] = {}  # req -> (num_computed, loadable end)
        self._loads: dict[str, Span] = {}
        self._salts: dict[str, str | None] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._log = RateLimitedLogger(logger)

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int,
                               cache_salt: str | None = None) -> int:
        self._salts[req_id] = cache_salt
        if not self.can_load or len(prompt) < 2:
            return 0
        try:
            hits = self._lookup(prompt, cache_salt)
        except Exception as exc:  # a lookup must never fail a request
            self._log.warning("lookup", "lookup failed, counted as a miss: %s", exc)
            return 0
        n = len(prompt)
        end = hits if hits < n else (n - 1) // self.chunk_size * self.chunk_size
        self._hits[req_id] = (num_computed, end)
        return max(0, end - num_computed)

    def after_alloc(self, req_id: str, num_external: int, cache_salt: str | None = None) -> None:
        self._salts[req_id] = cache_salt
        known = self._hits.get(req_id)
        if num_external <= 0 or known is None:
            return
        num_computed = known[0]
        skip = num_computed // self.chunk_size * self.chunk_size
        self._loads[req_id] = Span(skip, num_computed, num_computed + num_external)

    def build(self, new: Iterable[NewRequest], cached: Iterable[CachedRequest],
              num_scheduled: Mapping[str, int], finished: Iterable[str] = ()) -> list[RequestPlan]:
        for req_id in finished:
            self.finish(req_id)
        plans = []
        for req in new:
            tracker = _Tracker(list(req.prompt_token_ids), list(req.block_ids),
                               self._salts.get(req.req_id))
            tracker.stored_end = self._hits.get(req.req_id, (0, 0))[1]
            self._trackers[req.req_id] = tracker
            end = req.num_computed_tokens + num_scheduled.get(req.req_id, 0)
            plans.append(self._plan(req.req_id, tracker, end))
        for creq in cached:
            known = self._trackers.get(creq.req_id)
            if known is None:
                continue
            if creq.resumed:
                known.block_ids = list(creq.new_block_ids or [])
            elif creq.new_block_ids:
                known.block_ids.extend(creq.new_block_ids)
            end = creq.num_computed_tokens + num_scheduled.get(creq.req_id, 0)
            plans.append(self._plan(creq.req_id, known, end))
        return [p for p in plans if p is not None]

    def finish(self, req_id: str) -> None:
        self._hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._salts.pop(req_id, None)
        self._trackers.pop(req_id, None)

    def _plan(self, req_id: str, tracker: _Tracker, computed_end: int) -> RequestPlan | None:
        load = self._loads.pop(req_id, None)
        self._hits.pop(req_id, None)
        save = self._save_span(tracker, computed_end) if self.can_save else None
        if load is None and save is None:
            return None
        n = max(load.end if load else 0, save.end if save else 0)
        try:
            slots = slot_mapping(tracker.block_ids, self.block_size, n)
        except ValueError as exc:
            self._log.warning("plan", "request %s skipped: %s", req_id, exc)
            return None
        if save is not None:
            tracker.stored_end = save.end
        return RequestPlan(req_id, tracker.prompt[:n], slots, tracker.salt, load, save)

    def _save_span(self, tracker: _Tracker, computed_end: int) -> Span | None:
        prompt_done = min(computed_end, len(tracker.prompt))
        end = prompt_done // self.chunk_size * self.chunk_size
        if self.save_unfull_chunk and prompt_done == len(tracker.prompt):
            end = prompt_done
        if end <= tracker.stored_end:
            return None
        start = tracker.stored_end // self.chunk_size * self.chunk_size
        return Span(start, tracker.stored_end, end)


def lookup_over_ranks(engines: Sequence[CacheEngine]) -> Callable[[Sequence[int], str | None],
                                                                    int]:
    """A lookup that counts a token only when every rank's namespace holds it."""

    def lookup(tokens: Sequence[int], salt: str | None) -> int:
        return min(engine.lookup(tokens, cache_salt=salt) for engine in engines)

    return lookup


# -- worker side ------------------------------------------------------------------------------


class WorkerSide:
    """One rank's loads and stores; see the module docstring."""

    def __init__(self, settings: ConnectorSettings, model_name: str, world_size: int,
                 rank: int, *, can_save: bool = True) -> None:
        self.settings = settings
        self.model_name = model_name
        self.world_size = world_size
        self.rank = rank
        self.can_save = can_save
        self.engine: CacheEngine | None = None
        self.geometry: KVGeometry | None = None
        self._names: dict[str, int] = {}
        self._layers: list[torch.Tensor] = []
        self._layout = ""
        self._block_size = 0
        self._plans: list[RequestPlan] = []
        self._loads: list[_PendingLoad] = []
        self._stores: list[_PendingStore] = []
        self._stores_started = False
        self._errors: set[int] = set()
        self._log = RateLimitedLogger(logger)

    @property
    def registered(self) -> bool:
        return self.engine is not None

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("no KV cache layers to register")
        views = [layer_view(t) for t in kv_caches.values()]
        layouts = {layout for _, layout in views}
        if len(layouts) != 1:
            raise ValueError(f"KV cache layers mix layouts {sorted(layouts)}")
        self._names = {name: i for i, name in enumerate(kv_caches)}
        self._layers = [v for v, _ in views]
        self._layout = layouts.pop()
        probe = PagedKV(self._layers, [], layout=self._layout)
        self._block_size = probe.block_size
        self.geometry = KVGeometry(probe.num_layers, probe.num_kv_heads, probe.head_size,
                                   probe.dtype, self._layout == "mla")
        meta = self.geometry.metadata(self.model_name, self.world_size, self.rank)
        self.engine = CacheEngine(self.settings.config, meta)

    def start_load(self, plans: Sequence[RequestPlan]) -> None:
        self._finish_loads()  # nothing may survive from an earlier step
        self._abort_stores()
        self._plans = list(plans)
        self._stores_started = False
        for plan in self._plans:
            if plan.load is not None and plan.load.end > plan.load.start:
                self._guard(plan, "load", self._start_one_load)

    def wait_for_layer(self, layer_name: str) -> None:
        layer = self._names.get(layer_name)
        if layer is not None:
            for pending in list(self._loads):
                self._step_load(pending, layer + 1)

    def save_layer(self, layer_name: str) -> None:
        layer = self._names.get(layer_name)
        if layer is None or not self.settings.layerwise or not self.can_save:
            return
        self._start_stores()
        for pending in list(self._stores):
            self._step_store(pending, layer + 1)

    def wait_for_save(self) -> None:
        self._finish_loads()
        if not self.can_save:
            return
        if self.settings.layerwise:
            self._start_stores()
            for pending in list(self._stores):
                self._step_store(pending, pending.total_steps)
            self._stores = []
            return
        for plan in self._plans:
            if plan.save is not None:
                self._guard(plan, "store", self._store_whole)

    def take_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        self._finish_loads()
        self._abort_stores()
        if self.engine is not None:
            self.engine.close()

    # -- loads --------------------------------------------------------------------------------

    def _kv(self, plan: RequestPlan, end: int) -> PagedKV:
        return PagedKV(self._layers, plan.slot_mapping[:end], layout=self._layout)

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
            hit = self._engine().retrieve(*args, cache_salt=plan.cache_salt)
            self._report_misses(plan, _hit_end(hit, span.skip))
            return
        gen = self._engine().retrieve_layer(*args, cache_salt=plan.cache_salt)
        hit_end = _hit_end(next(gen), span.skip)  # fetched now; the layers follow
        self._report_misses(plan, hit_end)  # known already: vLLM may learn it this step
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
        """Blocks of the planned tokens that were not loaded: vLLM recomputes from there."""
        span = _span(plan.load)
        first = max(hit_end, span.start)
        if first < span.end:
            slots = plan.slot_mapping[first: span.end]
            self._errors.update(int(b) for b in torch.unique(slots // self._block_size))
            if self.engine is not None:
                self.engine.metrics.inc("vllm.load_error_tokens", span.end - first)

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
                                         cache_salt=plan.cache_salt)
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

    def _store_whole(self, plan: RequestPlan) -> None:
        span = _span(plan.save)
        self._engine().store(plan.token_ids[: span.end], self._kv(plan, span.end),
                             self._mask(span.skip, span.end), cache_salt=plan.cache_salt)

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


def _span(span: Span | None) -> Span:
    assert span is not None
    return span


def _hit_end(mask: torch.Tensor, skip: int) -> int:
    """End of the loaded run: the mask is True on a prefix of [skip, len)."""
    return skip + int(mask[skip:].sum())
