"""What an engine reports beyond `stats()`: fleet counters in Redis, and Prometheus metrics.

`EngineReporter` is created by `CacheEngine` and owns, for that engine:

- its `engine_id` (`<host>-<pid>-<random>`, safe for a Redis key);
- a `StatsPublisher` (when there is a remote tier and `stats_publish_interval` is set) that
  writes `published_fields()` into `{prefix}:engines:{engine_id}` every interval, and at
  once on `publish()` (the engine's `flush()`) and `close()`;
- its entry in the process-wide metrics registry (`metrics.register_source`), which the
  Prometheus collector reads at scrape time; with `metrics_port` set, the HTTP exporter is
  started on `metrics_host` (loopback by default) once per process
  (`lmcache_remote.telemetry.prometheus.serve`).

None of this can fail or slow inference: publishing runs on its own thread, failures are
counted (`publisher.*`), and a port that cannot be bound is logged, not raised.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Mapping

from lmcache_remote.config import CacheConfig
from lmcache_remote.naming.keys import engine_stats_key
from lmcache_remote.storage.manager.storage_manager import StorageManager
from lmcache_remote.storage.session.publisher import FieldValue, StatsPublisher
from lmcache_remote.telemetry.metrics import (
    Metrics,
    MetricsSource,
    register_source,
    unregister_source,
)

logger = logging.getLogger(__name__)

#: Published field -> the engine counter it copies (`scope.name` in `Metrics`).
PUBLISHED_COUNTERS = {
    "lookup_requests": "engine.lookup_requests",
    "lookup_tokens": "engine.lookup_tokens",
    "hit_tokens": "engine.lookup_hit_tokens",
    "retrieve_tokens": "engine.retrieve_tokens",
    "retrieved_tokens": "engine.retrieved_tokens",
    "store_tokens": "engine.store_tokens",
    "stored_tokens": "engine.stored_tokens",
    "remote_errors": "remote.errors",
    "remote_hit_chunks": "remote.hit_chunks",
    "local_hit_tokens": "local.hit_tokens",
    "remote_hit_tokens": "remote.hit_tokens",
    "remote_read_bytes": "remote.read_bytes",
    "remote_written_bytes": "remote.written_bytes",
    "local_evicted_chunks": "local.evicted_chunks",
    "promise_broken_tokens": "engine.promise_broken_tokens",
    "no_room_chunks": "memory.no_room_chunks",
    "remote_incomplete_chunks": "remote.incomplete_chunks",
    "remote_corrupt_chunks": "remote.corrupt_chunks",
    "remote_foreign_chunks": "remote.foreign_chunks",
    "remote_unauthenticated_chunks": "remote.unauthenticated_chunks",
    "duplicate_writes_skipped": "remote.duplicate_writes_skipped",
    "declined_tokens": "engine.declined_tokens",
}


def counter_fields(counters: Mapping[str, float], names: Mapping[str, str]
                   ) -> dict[str, FieldValue]:
    """Published field -> the value of the counter `names[field]` (0 when it never counted;
    whole numbers as ints)."""
    out: dict[str, FieldValue] = {}
    for field, name in names.items():
        value = counters.get(name, 0)
        out[field] = int(value) if float(value).is_integer() else value
    return out


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", socket.gethostname())[:64] or "host"


def new_engine_id() -> str:
    """A new process's hash in Redis: unique (host, pid, random), so two engines never write
    one hash; a dead engine's expires. Its Prometheus labels are the stable ones (host, model,
    rank)."""
    return f"{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


class EngineReporter:
    def __init__(self, config: CacheConfig, model_name: str, world_size: int, worker_id: int,
                 dtype: str, metrics: Metrics, storage: StorageManager) -> None:
        self.engine_id = new_engine_id()
        self.metrics = metrics
        self._identity: dict[str, FieldValue] = {
            "engine_id": self.engine_id, "model_name": model_name, "world_size": world_size,
            "worker_id": worker_id, "dtype": dtype, "host": socket.gethostname(),
            "pid": os.getpid(), "started_at": round(time.time(), 3),
        }
        self._source = MetricsSource(
            {"host": _host(), "model": model_name, "worker": str(worker_id)}, metrics
        )
        register_source(self._source)
        self._publisher = None
        if storage.remote is not None and config.stats_publish_interval is not None:
            key = engine_stats_key(config.key_prefix, self.engine_id)
            self._publisher = StatsPublisher(
                storage.remote, key, config.stats_publish_interval, self.published_fields, metrics,
                chore=storage.sweep_pins,
            )
        if config.metrics_port is not None:
            from lmcache_remote.telemetry import prometheus

            try:
                prometheus.serve(config.metrics_port, config.metrics_host)
            except OSError as exc:
                logger.warning("cannot serve metrics on %s port %d: %s", config.metrics_host,
                               config.metrics_port, exc)

    def published_fields(self) -> dict[str, FieldValue]:
        fields = dict(self._identity)
        fields.update(counter_fields(self.metrics.counters(), PUBLISHED_COUNTERS))
        fields["updated_at"] = round(time.time(), 3)
        return fields

    def publish(self) -> bool:
        """Publish the counters now (False when off, skipped or failed)."""
        return self._publisher.publish_now() if self._publisher is not None else False

    def close(self) -> None:
        unregister_source(self._source)
        if self._publisher is not None:
            self._publisher.close()
