"""Prometheus exporter: every live engine's counters and latency histograms, at scrape time.

Names (the full list with meanings is in `docs/metrics.md`):

- a counter `scope.name` of an engine's `Metrics` becomes `lmcr_<scope>_<name>_total`, except
  the per-tier scopes `local` and `remote`, which become `lmcr_tier_<name>_total` with a
  `tier` label (`lmcr_tier_hit_tokens_total{tier="remote"}`); latency totals (`*_seconds`)
  are exported as histograms only;
- a latency histogram `scope.name_seconds` becomes the histogram `lmcr_<scope>_<name>_seconds`
  (`lmcr_engine_lookup_seconds_bucket{le="0.005"}`, `_sum`, `_count`);
- a gauge `scope.name` (`Metrics.set_gauge`: the load decision's figures) becomes the gauge
  `lmcr_<scope>_<name>` (engines of one process with the same labels: the last one's);
- every sample carries the engine's labels `host`, `model` (its namespace) and `worker` (its
  rank): stable across restarts, so a restarted engine continues its series (a counter reset,
  which `rate()` handles) instead of starting new ones; engines of one process with the same
  labels are summed into one sample.

`collector()` is one `prometheus_client` collector for the whole process (register it in
your own registry when the inference server already serves `/metrics`); `serve(port, addr)`
registers it in the default registry and starts `prometheus_client`'s HTTP server on `addr`
(loopback unless the caller says otherwise), once per process, address and port. Importing
this module is what imports `prometheus_client`.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from lmcache_remote.telemetry.metrics import LATENCY_BUCKETS, Histogram, sources

TIER_SCOPES = ("local", "remote")
LABELS = ("host", "model", "worker")
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(counter: str) -> tuple[str, dict[str, str]]:
    """The Prometheus family name (without `_total`) and extra labels of a counter name."""
    scope, _, leaf = counter.rpartition(".")
    leaf = _NAME_RE.sub("_", leaf)
    if scope in TIER_SCOPES:
        return f"lmcr_tier_{leaf}", {"tier": scope}
    return f"lmcr_{_NAME_RE.sub('_', scope or 'engine')}_{leaf}", {}


class EngineCollector(Collector):
    """Reads every registered engine's `Metrics` at each scrape."""

    def collect(self) -> Iterator[Any]:
        counters: dict[str, CounterMetricFamily] = {}
        histograms: dict[str, HistogramMetricFamily] = {}
        latest: dict[tuple[str, tuple[str, ...]], float] = {}  # (name, labels) -> last value
        for src in sources():
            key = tuple(src.labels.get(k, "") for k in LABELS)
            for name, value in src.metrics.gauges().items():
                latest[name, key] = value
        gauges: dict[str, GaugeMetricFamily] = {}
        for (name, label_values), value in sorted(latest.items()):
            family, extra = metric_name(name)
            fam_g = gauges.get(family)
            if fam_g is None:
                fam_g = gauges[family] = GaugeMetricFamily(
                    family, f"lmcache-remote figure {name}", labels=[*LABELS, *extra])
            fam_g.add_metric([*label_values, *extra.values()], value)
        for labels, summed, hists in _merged():
            for name, value in sorted(summed.items()):
                if name.endswith("_seconds"):
                    continue
                family, extra = metric_name(name)
                fam = counters.get(family)
                if fam is None:
                    fam = counters[family] = CounterMetricFamily(
                        family, f"lmcache-remote counter {name}", labels=[*LABELS, *extra]
                    )
                fam.add_metric([*labels, *extra.values()], value)
            for name, hist in sorted(hists.items()):
                family, extra = metric_name(name)
                fam_h = histograms.get(family)
                if fam_h is None:
                    fam_h = histograms[family] = HistogramMetricFamily(
                        family, f"lmcache-remote latency {name}", labels=[*LABELS, *extra]
                    )
                cumulative, buckets = 0, []
                for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], hist.counts,
                                        strict=True):
                    cumulative += count
                    buckets.append((bound, cumulative))
                fam_h.add_metric([*labels, *extra.values()], buckets, hist.total)
        yield from counters.values()
        yield from histograms.values()
        yield from gauges.values()


def _merged() -> list[tuple[list[str], dict[str, float], dict[str, Histogram]]]:
    """Per label set (engines of this process with the same labels summed): the label
    values, the counters, the histograms."""
    groups: dict[tuple[str, ...], tuple[dict[str, float], dict[str, Histogram]]] = {}
    for src in sources():
        key = tuple(src.labels.get(k, "") for k in LABELS)
        summed, hists = groups.setdefault(key, ({}, {}))
        for name, value in src.metrics.counters().items():
            summed[name] = summed.get(name, 0) + value
        for name, hist in src.metrics.histograms().items():
            have = hists.get(name)
            hists[name] = hist if have is None else Histogram(
                [a + b for a, b in zip(have.counts, hist.counts, strict=True)],
                have.total + hist.total, have.count + hist.count)
    return [(list(key), summed, hists) for key, (summed, hists) in groups.items()]


_COLLECTOR = EngineCollector()
_REGISTERED = False
_SERVED: dict[tuple[str, int], Any] = defaultdict(lambda: None)
_LOCK = threading.Lock()


def collector() -> EngineCollector:
    """The process-wide collector (not registered anywhere until `serve` or you do it)."""
    return _COLLECTOR


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Register the collector in the default registry and serve it on `addr`:`port`
    (idempotent); the default address is loopback: only this host can scrape it."""
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            REGISTRY.register(_COLLECTOR)
            _REGISTERED = True
        if _SERVED[addr, port] is None:
            _SERVED[addr, port] = start_http_server(port, addr)
