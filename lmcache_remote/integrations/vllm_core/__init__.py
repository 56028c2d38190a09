"""The vLLM connector's logic, free of vLLM: settings, the scheduler side, the worker side.

`lmcache_remote.integrations.vllm` is a thin adapter that turns vLLM's objects into the plain
values used here; everything that decides something lives in this module and is tested on real
tensors and real Redis without vLLM.

- `settings`: the connector's settings and the KV cache's geometry;
- `lookup`: the scheduler's prefix lookup over every rank's keys (`PrefixLookup`);
- `scheduler`: the scheduler side (`SchedulerSide`), one per vLLM engine;
- `plans`: what the scheduler tells the workers each step (`RequestPlan`);
- `worker_api`: `KVWorker`, the one interface of a rank's worker side, each method's
  contract stated;
- `worker`: the worker side (`WorkerSide`), one per rank, with `background` (the transfers
  that outlive their step) and `proof` (the proven reading of the caches); `worker_groups`:
  `GroupedWorker`, the same interface over several KV cache groups;
- `stats`, `fleet`: the connector's figures in vLLM's metrics and in the fleet stats.
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
from lmcache_remote.integrations.vllm_core.worker_api import KVWorker

__all__ = [
    "ROLES",
    "CachedRequest",
    "ConnectorSettings",
    "KVGeometry",
    "KVWorker",
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
