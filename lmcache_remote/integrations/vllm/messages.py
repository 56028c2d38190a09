"""The connector's messages between vLLM's processes.

`LmcrConnectorMetadata` goes from the scheduler to every worker each step: the step's
`RequestPlan`s, the requests vLLM preempted in this step (their blocks are about to be reused),
the scheduler's model namespace, which the workers follow, and the step's computed tokens
(`step_tokens`, and `step_work`, their summed context), which a worker times.
`LmcrWorkerMetadata` goes back from a worker every step: why its connector is off (if it is),
the requests whose load failed this step (however vLLM will learn of it: failed blocks or a
failed request), whether its link to Redis is down (its health gate open), its measured link
throughput, and how long the step's forward took. vLLM aggregates it over the ranks
(`aggregate`): the first reason, every failed request, down if any rank's link is, the
slowest link and the slowest forward. Where vLLM has no worker metadata (older releases) the
connector sends none and the scheduler is not told.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:  # vLLM 0.32 to 0.34 have it; the connector works without it (no scheduler notice)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older releases
    KVConnectorWorkerMetadata = object

from lmcache_remote.integrations.vllm_core import RequestPlan

__all__ = ["KVConnectorWorkerMetadata", "LmcrConnectorMetadata", "LmcrWorkerMetadata"]


class LmcrConnectorMetadata(KVConnectorMetadata):
    """One step's plans, sent by the scheduler to every worker; see the module docstring."""

    def __init__(self, requests: list[RequestPlan], preempted: set[str] | None = None,
                 namespace: str | None = None, step_tokens: int = 0,
                 step_work: float = 0.0) -> None:
        self.requests = requests
        self.preempted = preempted or set()
        self.namespace = namespace  # the scheduler's model namespace: the workers follow it
        self.step_tokens = step_tokens  # tokens the step computes, all requests
        self.step_work = step_work  # their summed context (sum of positions)


class LmcrWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step; see the module docstring. `step`: (tokens, work,
    seconds) of the step's forward, None when not measured."""

    def __init__(self, disabled: str | None = None, failed_loads: set[str] | None = None,
                 link_down: bool = False, throughput: float | None = None,
                 step: tuple[int, float, float] | None = None) -> None:
        self.disabled = disabled
        self.failed_loads = set(failed_loads or ())
        self.link_down = link_down
        self.throughput = throughput
        self.step = step

    def aggregate(self, other: Any) -> LmcrWorkerMetadata:
        if not isinstance(other, LmcrWorkerMetadata):
            return self
        throughputs = [t for t in (self.throughput, other.throughput) if t is not None]
        steps = [s for s in (self.step, other.step) if s is not None]
        return LmcrWorkerMetadata(
            self.disabled or other.disabled, self.failed_loads | other.failed_loads,
            self.link_down or other.link_down, min(throughputs) if throughputs else None,
            max(steps, key=lambda s: s[2]) if steps else None)
