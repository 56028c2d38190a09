"""StatsPublisher: an engine's counters, copied into Redis every few seconds for fleet stats.

Each engine owns one small hash, `keys.engine_stats_key(prefix, engine_id)`
(`{prefix}:engines:{engine_id}`), rewritten every `interval` seconds by a daemon thread
(`HSET` of every field, then `EXPIRE` to `ttl`, in one pipeline), and once more by
`publish_now()` (the engine calls it from `flush()` and `close()`). An engine that stops
publishing disappears when its hash expires. `lmcache-remote stats` sums the hashes it finds.

The same thread runs the owner's chore every `chore_interval` (an engine ends the pins whose
time has passed, `storage.pins.Pins.sweep`).

Publishing never touches inference: it runs on its own thread with its own bounded calls
(`remote_timeout`), is skipped while the remote tier's health gate reports Redis unhealthy,
never opens that gate itself, and counts what happens in `publisher.published`,
`publisher.skipped` and `publisher.errors` instead of raising.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from lmcache_remote.config import CacheConfig
from lmcache_remote.storage.session.client import translate
from lmcache_remote.storage.session.health import HealthGate
from lmcache_remote.storage.session.pins import SWEEP_INTERVAL
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

logger = logging.getLogger(__name__)
FieldValue = str | int | float
MIN_TTL = 30.0


def publish_ttl(interval: float) -> int:
    """Seconds a published hash lives: three intervals, at least `MIN_TTL`."""
    return int(max(MIN_TTL, 3 * interval) + 0.999)


class Remote(Protocol):
    """What a publisher needs of a remote store: a `RedisTier`, or the SGLang backend's
    `PageStore`."""

    config: CacheConfig
    gate: HealthGate

    @property
    def client(self) -> Any:
        """The redis-py client to publish with."""


class StatsPublisher:
    """Publishes `fields()` into the hash `key` every `interval` seconds, on a daemon thread."""

    def __init__(self, remote: Remote, key: str, interval: float,
                 fields: Callable[[], Mapping[str, FieldValue]], metrics: Metrics,
                 *, threaded: bool = True, chore: Callable[[], object] | None = None,
                 chore_interval: float = SWEEP_INTERVAL) -> None:
        self._remote = remote
        self._key = key
        self._interval = interval
        self._ttl = publish_ttl(interval)
        self._fields = fields
        self._metrics = metrics
        self._log = RateLimitedLogger(logger, 60.0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last = float("-inf")
        self._thread: threading.Thread | None = None
        self._chore = chore
        self._chore_interval = chore_interval
        self._chore_last = time.monotonic()
        if threaded:
            self._thread = threading.Thread(target=self._run, name="lmcr-stats-publisher",
                                            daemon=True)
            self._thread.start()

    def publish_if_due(self) -> bool:
        """Without a thread (`threaded=False`: vLLM's scheduler side, which starts none), the
        owner calls this often; it publishes when an interval has passed since the last time
        (one pipelined round trip, bounded by `remote_timeout`, skipped while Redis is
        unhealthy). True when it published."""
        if time.monotonic() - self._last < self._interval:
            return False
        return self.publish_now()

    @property
    def key(self) -> str:
        return self._key

    def publish_now(self) -> bool:
        """Write the counters now; False when skipped (Redis unhealthy) or failed (counted)."""
        self._last = time.monotonic()
        if not self._remote.gate.healthy:
            self._metrics.inc("publisher.skipped")
            return False
        try:
            mapping: dict[Any, Any] = {
                k: str(v) for k, v in self._fields().items()
            }
            with self._lock:
                pipe = self._remote.client.pipeline(transaction=False)
                pipe.hset(self._key, mapping=mapping)
                pipe.expire(self._key, self._ttl)
                pipe.execute()
        except Exception as exc:  # never let publishing fail anything else
            self._metrics.inc("publisher.errors")
            self._log.warning("publish", "could not publish engine stats: %s", translate(exc))
            return False
        self._metrics.inc("publisher.published")
        return True

    def close(self) -> None:
        """Stop the thread and publish a last time (bounded by `remote_timeout`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._remote.config.remote_timeout * 2 + 1)
        self.publish_now()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.publish_now()
            self._run_chore()

    def _run_chore(self) -> None:
        """The owner's periodic chore (an engine's: ending past pins, `storage.pins`), every
        `chore_interval` on this thread while Redis is healthy; it must not raise."""
        now = time.monotonic()
        if (self._chore is None or now - self._chore_last < self._chore_interval
                or not self._remote.gate.healthy):
            return
        self._chore_last = now
        try:
            self._chore()
        except Exception as exc:  # never let a chore end the thread
            self._metrics.inc("publisher.errors")
            self._log.warning("chore", "a periodic chore failed: %s", exc)
