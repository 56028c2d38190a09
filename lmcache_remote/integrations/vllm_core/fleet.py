"""The vLLM scheduler's figures in the fleet stats in Redis (`lmcache-remote stats`).

Workers are engines and publish their loads and stores (`reporting.EngineReporter`); what only
the scheduler knows, the prompt tokens vLLM was sent, what its own prefix cache held and what
this cache promised, what it declined (computing was cheaper), the figures its load decision
uses now (link throughput and round trip, prefill speed), is published here, into a hash of
its own (`{prefix}:engines:{id}`, `role` `scheduler`), so the fleet view can say, per model
namespace, how many of the prompt tokens came from each tier. The scheduler side starts no
thread: `tick()`, called every step, publishes when `stats_publish_interval` has passed (one
pipelined round trip, skipped while Redis is unhealthy), and `close()` once more.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from lmcache_remote.config import CacheConfig
from lmcache_remote.engine.reporting import counter_fields, new_engine_id
from lmcache_remote.naming.keys import engine_stats_key
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.session.publisher import FieldValue, StatsPublisher
from lmcache_remote.telemetry.metrics import Metrics, summed_counters

__all__ = ["SCHEDULER_COUNTERS", "SCHEDULER_FIGURES", "SchedulerPublisher"]

#: Published field -> the scheduler-side counter (`SchedulerSide.metrics`, the lookup's).
SCHEDULER_COUNTERS = {
    "prompt_tokens": "vllm.prompt_tokens",
    "device_cached_tokens": "vllm.device_cached_tokens",
    "promised_tokens": "vllm.promised_tokens",
    "unnamed_requests": "vllm.unnamed_requests",
    "scheduler_lookup_requests": "lookup.requests",
    "scheduler_lookup_errors": "lookup.remote_errors",
    "declined_tokens": "vllm.declined_tokens",
    "probe_loads": "vllm.probe_loads",
    "failed_load_requests": "vllm.failed_load_requests",
}
#: Published field -> the scheduler's gauge (`decision.publish_figures`): the figures its
#: load decision uses now.
SCHEDULER_FIGURES = {
    "link_bytes_per_s": "decision.link_bytes_per_s",
    "link_rtt_s": "decision.link_rtt_seconds",
    "prefill_tokens_per_s": "decision.prefill_tokens_per_s",
}


class SchedulerPublisher:
    def __init__(self, config: CacheConfig, remote: RemoteLookup, sources: list[Metrics],
                 namespace: Callable[[], str], world_size: int) -> None:
        assert config.stats_publish_interval is not None
        self.engine_id = f"{new_engine_id()}-scheduler"
        self._sources = sources
        self._namespace = namespace
        self._identity: dict[str, FieldValue] = {
            "engine_id": self.engine_id, "role": "scheduler", "world_size": world_size,
            "host": socket.gethostname(), "pid": os.getpid(),
            "started_at": round(time.time(), 3),
        }
        self.metrics = Metrics()  # publisher.* of this side
        self._publisher = StatsPublisher(
            remote, engine_stats_key(config.key_prefix, self.engine_id),
            config.stats_publish_interval, self.fields, self.metrics, threaded=False)

    def fields(self) -> dict[str, FieldValue]:
        out = dict(self._identity)
        out["model_name"] = self._namespace()
        out.update(counter_fields(summed_counters(self._sources), SCHEDULER_COUNTERS))
        gauges = {name: value for source in self._sources
                  for name, value in source.gauges().items()}
        out.update({field: round(gauges[name], 6) for field, name in SCHEDULER_FIGURES.items()
                    if name in gauges})
        out["updated_at"] = round(time.time(), 3)
        return out

    def tick(self) -> None:
        self._publisher.publish_if_due()

    def close(self) -> None:
        self._publisher.close()
