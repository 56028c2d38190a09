"""The connector's messages between vLLM's processes.

`LmcrConnectorMetadata` goes from the scheduler to every worker each step: the step's
`RequestPlan`s, the requests vLLM preempted in this step (their blocks are about to be reused)
and the scheduler's model namespace, which the workers follow. `LmcrWorkerMetadata` goes back
from a worker while its connector is off, saying why; vLLM aggregates it over the ranks (the
first rank's reason wins). Where vLLM has no worker metadata (older releases) the connector
sends none and the scheduler is not told.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:  # vLLM 0.32 and 0.33 have it; the connector works without it (no scheduler notice)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older releases
    KVConnectorWorkerMetadata = object

from lmcache_remote.integrations.vllm_core import RequestPlan

__all__ = ["KVConnectorWorkerMetadata", "LmcrConnectorMetadata", "LmcrWorkerMetadata"]


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
