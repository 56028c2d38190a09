"""The vLLM connector's logic, free of vLLM: settings, the scheduler side, the worker side.

`lmcache_remote.integrations.vllm` is a thin adapter that turns vLLM's objects into the plain
values used here; everything that decides something lives in this module and is tested on real
tensors and real Redis without vLLM.

Scheduler side (`SchedulerSide`, one per vLLM engine, in the scheduler process):

- `num_new_matched_tokens(req_id, prompt, num_computed, cache_salt)`: the prompt tokens past
  `num_computed` (vLLM's own prefix cache) that the cache can load now: one `PrefixLookup`
  over every rank's key namespace in one Redis round trip (a token counts when every rank
  holds it), never the whole prompt (vLLM must compute
  at least one token to sample from: a hit on the whole prompt is cut to the last chunk
  boundary before its last token). May be called several times for one request.
- `after_alloc(req_id, num_external, cache_salt)`: vLLM allocated blocks for the hit; the load
  is now promised to the worker.
- `build(new, cached, num_scheduled, finished)`: the step's `RequestPlan`s: per request the
  tokens, their slots, what to load (whole chunks from the last chunk boundary at or before
  `num_computed`) and what to store (the prompt's chunks completed by this step and not yet
  stored or known to be stored). Only prompt tokens are stored, never decode tokens. A
  request that vLLM rolled back (`num_computed` below what was counted as stored: a short
  load being recomputed) has its chunks from there on stored again.
- `loads_async(n)`: whether a hit of `n` tokens is offered as an asynchronous load
  (`async_load_min_tokens`); such a load is planned from the blocks given to `after_alloc`,
  in the next `build`, while vLLM keeps the request waiting. With `lookup_wait_s` lookups run
  on a thread (`BackgroundLookup`) and answer None while still running.
- `finish(req_id)`: forget the request; True (with `async_save`) when vLLM must keep its
  blocks until the workers report its background stores done.

Worker side (`WorkerSide`, one per rank, in the worker process):

- `register(kv_caches, use_mla=, dtype=, block_size=)`: the per-layer paged caches, in layer
  order, with what the KV cache spec says (MLA or not, the values' dtype, the scheduler's
  block size); the layout (`layer_view`: vLLM 0.33's `[blocks, heads, block_size, K|V]`
  views in any physical layout, MLA's `[blocks, 1, block_size, latent]`, and older shapes)
  and the geometry come from them; opens the rank's `CacheEngine`.
- `begin_step(plans)`: the step's plans, taken when vLLM binds the metadata, before the
  forward: vLLM 0.33 calls `start_load_kv` after the forward in steps without a synchronous
  load, and the stores of those steps must still run layer by layer inside the forward.
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
- background transfers: asynchronous loads on a loader thread, reported by
  `finished_loads()` (with their missing blocks); with `async_save` the step's stores on a
  saver thread, `finished_stores()` reporting finished requests whose stores are done and
  `wait_for_stores(ids)` finishing a preempted request's stores before its blocks are reused.
"""

from __future__ import annotations

from lmcache_remote.integrations.vllm_core.lookup import PrefixLookup
from lmcache_remote.integrations.vllm_core.plans import RequestPlan, Span, slot_mapping
from lmcache_remote.integrations.vllm_core.scheduler import (
    CachedRequest,
    NewRequest,
    SchedulerSide,
)
from lmcache_remote.integrations.vllm_core.settings import (
    ROLES,
    ConnectorSettings,
    KVGeometry,
    cache_torch_dtype,
    layer_view,
    load_settings,
)
from lmcache_remote.integrations.vllm_core.worker import WorkerSide

__all__ = [
    "ROLES",
    "CachedRequest",
    "ConnectorSettings",
    "KVGeometry",
    "NewRequest",
    "PrefixLookup",
    "RequestPlan",
    "SchedulerSide",
    "Span",
    "WorkerSide",
    "cache_torch_dtype",
    "layer_view",
    "load_settings",
    "slot_mapping",
]
