"""Counters behind `CacheEngine.stats()`.

`Metrics` is a thread-safe bag of monotonically increasing counters named `scope.name`
(`engine.stored_tokens`, `remote.errors`, `local.evicted_bytes`, ...). `snapshot()` nests them
by scope into plain dicts of ints and floats, safe to serialise; it never contains a URL or a
password. Gauges (bytes in use, health) are added to the snapshot by their owners.

`observe(name, seconds)` records a latency: it adds to the counter `name` (the total, so
`stats()["engine"]["lookup_seconds"]` keeps its meaning) and to a histogram over
`LATENCY_BUCKETS`, read with `histograms()`. The Prometheus exporter
(`lmcache_remote.telemetry.prometheus`) and the fleet publisher read these same numbers; nothing is
counted twice.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

#: Upper bounds (seconds) of the latency histogram buckets; +Inf is implied.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclasses.dataclass
class Histogram:
    """Counts per bucket (non-cumulative, the last one is +Inf), the sum and the count."""

    counts: list[int]
    total: float = 0.0
    count: int = 0


def summed_counters(sources: Iterable[Metrics]) -> dict[str, float]:
    """Every counter of `sources`, added up by name."""
    out: dict[str, float] = defaultdict(float)
    for metrics in sources:
        for name, value in metrics.counters().items():
            out[name] += value
    return dict(out)


class Metrics:
    """Monotonic counters and latency histograms, safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, float] = defaultdict(float)
        self._histograms: dict[str, Histogram] = {}
        self._gauges: dict[str, float] = {}

    def observe(self, name: str, seconds: float) -> None:
        """Record one latency: counter `name` += seconds, and the histogram `name`."""
        index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            self._counters[name] += seconds
            hist = self._histograms.get(name)
            if hist is None:
                hist = self._histograms[name] = Histogram([0] * (len(LATENCY_BUCKETS) + 1))
            hist.counts[index] += 1
            hist.total += seconds
            hist.count += 1

    def histograms(self) -> dict[str, Histogram]:
        """A copy of every histogram, by name."""
        with self._lock:
            return {
                k: Histogram(list(h.counts), h.total, h.count) for k, h in self._histograms.items()
            }

    def counters(self) -> dict[str, float]:
        """A flat copy of every counter, by full name (`scope.name`)."""
        with self._lock:
            return dict(self._counters)

    def inc(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counters[name] += value

    def set_gauge(self, name: str, value: float) -> None:
        """A figure that goes up and down (a link's measured throughput), by full name."""
        with self._lock:
            self._gauges[name] = value

    def gauges(self) -> dict[str, float]:
        """A flat copy of every gauge, by full name."""
        with self._lock:
            return dict(self._gauges)

    def get(self, name: str) -> float:
        with self._lock:
            return self._counters.get(name, 0)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            items = list(self._counters.items())
        out: dict[str, Any] = {}
        for name, value in sorted(items):
            scope, _, leaf = name.rpartition(".")
            target = out.setdefault(scope, {}) if scope else out
            target[leaf] = int(value) if float(value).is_integer() else value
        return out


class RateLimitedLogger:
    """Logs a repeated warning at most once per `interval` seconds per message key."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: object) -> None:
        self._log(logging.WARNING, key, msg, args)

    def error(self, key: str, msg: str, *args: object) -> None:
        """For a misconfiguration that needs a person (Redis refusing this client's rights)."""
        self._log(logging.ERROR, key, msg, args)

    def _log(self, level: int, key: str, msg: str, args: tuple[object, ...]) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._suppressed[key] += 1
                return
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.log(level, msg, *args)


@dataclasses.dataclass(eq=False)
class MetricsSource:
    """One engine's numbers as exporters see them: identity labels and its `Metrics`."""

    labels: dict[str, str]
    metrics: Metrics


_SOURCES: dict[int, MetricsSource] = {}
_SOURCES_LOCK = threading.Lock()


def register_source(source: MetricsSource) -> None:
    """Make an engine's metrics visible to exporters (`lmcache_remote.telemetry.prometheus`)."""
    with _SOURCES_LOCK:
        _SOURCES[id(source)] = source


def unregister_source(source: MetricsSource) -> None:
    with _SOURCES_LOCK:
        _SOURCES.pop(id(source), None)


def sources() -> list[MetricsSource]:
    """The live engines' metrics (closed engines unregister themselves)."""
    with _SOURCES_LOCK:
        return list(_SOURCES.values())
