"""The connector's figures in vLLM's metrics: `LmcrConnectorStats`, one step's payload of a
worker or the scheduler as vLLM sums it over the ranks and logs it, and `LmcrPromMetrics`, the
same figures on vLLM's `/metrics`. The payload, its aggregation, its log line and the
Prometheus names are `vllm_core.stats`'; this module only fits them to vLLM's classes.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from lmcache_remote.integrations.vllm_core import stats as connector_stats

__all__ = ["LmcrConnectorStats", "LmcrPromMetrics"]


class LmcrConnectorStats(KVConnectorStats):
    """One step's figures of a worker or the scheduler, as vLLM sums and reports them
    (`vllm_core.stats`: the payload, its aggregation and its log line)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {"counters": {}, "latency": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return LmcrConnectorStats(data=connector_stats.aggregate(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return connector_stats.reduce(self.data)

    def is_empty(self) -> bool:
        return connector_stats.is_empty(self.data)


class LmcrPromMetrics(KVConnectorPromMetrics):
    """The figures on vLLM's `/metrics` (the API server's registry, vLLM's labels): a counter
    `vllm:lmcache_remote_<name>_total` per payload counter, a histogram per latency (the
    cache's own buckets, replayed: `vllm_core.stats.bucket_values`), a gauge per decision
    figure (`vllm:lmcache_remote_link_bytes_per_s`, ...)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = connector_stats.prometheus_names()
        self._counters = {
            field: {idx: self._counter_cls(name=names[field], documentation=doc,
                                           labelnames=labelnames).labels(*values)
                    for idx, values in per_engine_labelvalues.items()}
            for field, (_, doc) in connector_stats.COUNTERS.items()}
        buckets = list(connector_stats.LATENCY_BUCKETS)
        self._latency = {
            field: {idx: self._histogram_cls(name=names[field], documentation=doc,
                                             buckets=buckets, labelnames=labelnames
                                             ).labels(*values)
                    for idx, values in per_engine_labelvalues.items()}
            for field, (_, doc) in connector_stats.LATENCIES.items()}
        self._gauges = {
            field: {idx: self._gauge_cls(name=names[field], documentation=doc,
                                         labelnames=labelnames,
                                         multiprocess_mode="mostrecent").labels(*values)
                    for idx, values in per_engine_labelvalues.items()}
            for field, (_, doc) in connector_stats.GAUGES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for field, value in transfer_stats_data.get("gauges", {}).items():
            gauge = self._gauges.get(field, {}).get(engine_idx)
            if gauge is not None:
                gauge.set(value)
        for field, value in transfer_stats_data.get("counters", {}).items():
            counter = self._counters.get(field, {}).get(engine_idx)
            if counter is not None and value > 0:
                counter.inc(value)
        for field, counts in transfer_stats_data.get("latency", {}).items():
            hist = self._latency.get(field, {}).get(engine_idx)
            if hist is None:
                continue
            for value, n in connector_stats.bucket_values(counts):
                for _ in range(n):
                    hist.observe(value)
