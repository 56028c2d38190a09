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

from lmcache_remote.integrations.vllm_core.plans import RequestPlan, Span, slot_mapping
from lmcache_remote.integrations.vllm_core.scheduler import (
    CachedRequest,
    NewRequest,
    SchedulerSide,
    lookup_over_ranks,
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
    "RequestPlan",
    "SchedulerSide",
    "Span",
    "WorkerSide",
    "cache_torch_dtype",
    "layer_view",
    "load_settings",
    "lookup_over_ranks",
    "slot_mapping",
]
