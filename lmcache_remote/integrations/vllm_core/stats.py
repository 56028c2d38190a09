"""The connector's figures in vLLM's own metrics (no vLLM import here:
`integrations.vllm.metrics` wires it).

vLLM collects connector figures through its connector stats interface: each worker's and the
scheduler's `get_kv_connector_stats()` every step, summed (`aggregate`) and sent to the API
server, which logs them (`reduce`) and records them on its `/metrics` through the connector's
`build_prom_metrics`. So a vLLM engine's lookups (scheduler process), loads and stores (every
worker) appear on the one endpoint operators already scrape, with vLLM's labels (`model_name`,
`engine`), however many ranks there are.

The payload (`take()`, a plain dict, safe for vLLM's serialisation) holds what changed since the
last step: `{"counters": {name: delta}, "latency": {name: [bucket count deltas]}}`, and from the
scheduler `"gauges": {name: value}` when a figure changed; names in `COUNTERS` / `LATENCIES` /
`GAUGES` (docs/metrics.md, "In vLLM's /metrics"). `prometheus_names()` gives the
names they appear under.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from lmcache_remote.telemetry.metrics import LATENCY_BUCKETS, Metrics, summed_counters

__all__ = ["COUNTERS", "GAUGES", "LATENCIES", "PREFIX", "StatsDelta", "aggregate", "is_empty",
           "prometheus_names", "reduce"]

#: Prometheus name prefix (vLLM's connectors name theirs `vllm:<connector>_...`).
PREFIX = "vllm:lmcache_remote_"

#: Payload counter -> (the `Metrics` counter it copies, help text). The scheduler's figures
#: come from its lookup and its plans, the others from each worker's engine.
COUNTERS: dict[str, tuple[str, str]] = {
    "prompt_tokens": ("vllm.prompt_tokens", "Prompt tokens of the requests vLLM scheduled"),
    "device_cached_tokens": ("vllm.device_cached_tokens",
                             "Prompt tokens vLLM's own prefix cache held when they were "
                             "scheduled"),
    "promised_tokens": ("vllm.promised_tokens",
                        "Prompt tokens the connector claimed as hits and vLLM allocated"),
    "unnamed_requests": ("vllm.unnamed_requests",
                         "Requests passed through: their KV depends on something the keys "
                         "cannot bind (an adapter changed under the engine, an item in "
                         "shared memory)"),
    "lookup_requests": ("lookup.requests", "Prefix lookups (scheduler)"),
    "lookup_errors": ("lookup.remote_errors", "Prefix lookups that failed on Redis (misses)"),
    "retrieved_tokens": ("engine.retrieved_tokens", "Tokens of KV loaded into vLLM's cache"),
    "local_hit_tokens": ("local.hit_tokens", "Tokens loaded from the local CPU tier"),
    "remote_hit_tokens": ("remote.hit_tokens", "Tokens loaded from Redis"),
    "local_hit_bytes": ("local.hit_bytes", "Bytes loaded from the local CPU tier"),
    "remote_read_bytes": ("remote.read_bytes", "Bytes read from Redis"),
    "remote_written_bytes": ("remote.written_bytes", "Bytes written to Redis"),
    "stored_tokens": ("engine.stored_tokens", "Tokens of KV stored (or queued) by the cache"),
    "promise_broken_tokens": ("engine.promise_broken_tokens",
                              "Promised tokens a load could not deliver (recomputed)"),
    "remote_errors": ("remote.errors", "Redis calls that failed"),
    "remote_corrupt_chunks": ("remote.corrupt_chunks", "Damaged values found (deleted)"),
    "declined_tokens": ("vllm.declined_tokens",
                        "Prompt tokens held by the cache but computed: loading them was "
                        "expected to take longer (the load decision)"),
    "probe_loads": ("vllm.probe_loads", "One-chunk loads that probe a declined link"),
    "failed_load_requests": ("vllm.failed_load_requests",
                             "Loads that failed (vLLM recomputed), counted per request"),
}
#: Payload gauge -> (the scheduler's `Metrics` gauge, help text): the load decision's
#: figures now (`engine.decision`).
GAUGES: dict[str, tuple[str, str]] = {
    "link_bytes_per_s": ("decision.link_bytes_per_s",
                         "The link's throughput to Redis the load decision uses (bytes/s)"),
    "link_rtt_seconds": ("decision.link_rtt_seconds",
                         "The link's round trip to Redis the load decision uses (seconds)"),
    "prefill_tokens_per_s": ("decision.prefill_tokens_per_s",
                             "This engine's prefill speed the load decision uses (tokens/s)"),
}
#: Payload latency -> (the `Metrics` histogram, help text).
LATENCIES: dict[str, tuple[str, str]] = {
    "lookup_seconds": ("lookup.seconds", "Prefix lookup latency (scheduler)"),
    "retrieve_seconds": ("engine.retrieve_seconds", "Load latency (worker, per request)"),
    "store_seconds": ("engine.store_seconds", "Store latency (worker, per request)"),
}


class StatsDelta:
    """What changed in some `Metrics` since the last `take()`."""

    def __init__(self, sources: Sequence[Metrics]) -> None:
        self._sources = list(sources)
        self._gauges: dict[str, float] = {}
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}
        self._buckets: dict[str, list[int]] = {}

    def take(self) -> dict[str, Any]:
        counters = summed_counters(self._sources)
        hists: dict[str, list[int]] = {}
        for metrics in self._sources:
            for name, hist in metrics.histograms().items():
                have = hists.setdefault(name, [0] * len(hist.counts))
                hists[name] = [a + b for a, b in zip(have, hist.counts, strict=True)]
        out_counters: dict[str, float] = {}
        out_latency: dict[str, list[int]] = {}
        with self._lock:
            for field, (name, _) in COUNTERS.items():
                now = counters.get(name, 0)
                delta = now - self._counters.get(name, 0)
                self._counters[name] = now
                if delta:
                    out_counters[field] = int(delta) if float(delta).is_integer() else delta
            for field, (name, _) in LATENCIES.items():
                counts = hists.get(name)
                if counts is None:
                    continue
                before = self._buckets.get(name, [0] * len(counts))
                self._buckets[name] = counts
                delta_counts = [a - b for a, b in zip(counts, before, strict=True)]
                if any(delta_counts):
                    out_latency[field] = delta_counts
            gauges = {name: value for metrics in self._sources
                      for name, value in metrics.gauges().items()}
            out_gauges = {}
            for field, (name, _) in GAUGES.items():
                if name in gauges and gauges[name] != self._gauges.get(name):
                    self._gauges[name] = out_gauges[field] = gauges[name]
        out: dict[str, Any] = {"counters": out_counters, "latency": out_latency}
        if out_gauges:
            out["gauges"] = out_gauges
        return out


def aggregate(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two payloads summed (ranks, the scheduler, successive steps)."""
    counters = dict(a.get("counters", {}))
    for name, value in b.get("counters", {}).items():
        counters[name] = counters.get(name, 0) + value
    latency = {k: list(v) for k, v in a.get("latency", {}).items()}
    for name, counts in b.get("latency", {}).items():
        have = latency.get(name)
        latency[name] = list(counts) if have is None else [
            x + y for x, y in zip(have, counts, strict=True)]
    out: dict[str, Any] = {"counters": counters, "latency": latency}
    gauges = {**a.get("gauges", {}), **b.get("gauges", {})}  # the later figure wins
    if gauges:
        out["gauges"] = gauges
    return out


def is_empty(data: Mapping[str, Any]) -> bool:
    return not data.get("counters") and not data.get("latency") and not data.get("gauges")


def reduce(data: Mapping[str, Any]) -> dict[str, int | float]:
    """vLLM's periodic log line: the interval's counters, and the share of the scheduled
    prompt tokens that came from this cache (`cache_hit_rate`)."""
    counters = dict(data.get("counters", {}))
    out: dict[str, int | float] = {k: counters[k] for k in COUNTERS if k in counters}
    prompt = counters.get("prompt_tokens", 0)
    if prompt:
        out["cache_hit_rate"] = round(counters.get("promised_tokens", 0) / prompt, 4)
    for name, counts in data.get("latency", {}).items():
        out[name.replace("_seconds", "_count")] = sum(counts)
    out.update(data.get("gauges", {}))
    return out


def prometheus_names() -> dict[str, str]:
    """Payload name -> the metric name on vLLM's `/metrics` (counters end in `_total` there,
    histograms give `_bucket`, `_sum`, `_count`)."""
    names = {field: f"{PREFIX}{field}" for field in COUNTERS}
    names.update({field: f"{PREFIX}{field}" for field in LATENCIES})
    names.update({field: f"{PREFIX}{field}" for field in GAUGES})
    return names


def bucket_values(counts: Sequence[int]) -> list[tuple[float, int]]:
    """(a value inside each bucket, how many) to replay bucket counts into a Prometheus
    histogram with the same bounds: the upper bound (inclusive), twice the last one for
    +Inf. The histogram's buckets and counts are exact; its `_sum` is an upper bound."""
    bounds = [*LATENCY_BUCKETS, LATENCY_BUCKETS[-1] * 2]
    return [(bounds[i], n) for i, n in enumerate(counts) if n]
