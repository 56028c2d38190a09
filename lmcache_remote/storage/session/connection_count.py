"""How many Redis connections a process of the cache may hold at once (docs/deploy.md's formula).

redis-py's pool opens a connection when a thread needs one and none is idle, and keeps it open
until the client closes: a process holds as many connections as it ever had threads doing
I/O at once. Each thread holds at most one connection at a time, so the count is the number
of threads that may do I/O at once. For a `CacheEngine` on a single server (or a Sentinel's
master):

- `remote_write_lanes`: the lane threads a store's windows are written on (the write-behind
  thread, or a caller of a synchronous store, waits for them and holds none meanwhile; a
  store of one window is written by that thread itself, with the lanes idle);
- `remote_read_lanes`: the lane threads a retrieve's windows are read on, shared by every read
  of the engine;
- the toucher thread (`remote_lru_touch`) and the stats publisher's (`stats_publish_interval`);
- one per thread that calls the engine at once (`callers`): a lookup's `EXISTS`, a read or a
  synchronous store of one window, `flush()`'s publish run on the caller's own connection.

The start-up access check opens one connection of its own and closes it before the engine
serves. The vLLM scheduler's `PrefixLookup` holds one (its lookups run one at a time, its
touches inline). On a Redis Cluster every node's I/O runs on the tier's node threads
(`cluster_scatter.MAX_THREADS`), so each node sees at most those, the toucher, the publisher,
the slot-table refresh and the callers, whatever the lanes.
"""

from __future__ import annotations

import dataclasses

from lmcache_remote.config import CacheConfig
from lmcache_remote.storage.session.cluster_scatter import MAX_THREADS as CLUSTER_NODE_THREADS
from lmcache_remote.urls import parse_remote_url

__all__ = ["ConnectionCount", "engine_connections", "fleet_connections", "lookup_connections",
           "VLLM_WORKER_CALLERS"]

#: Threads of a vLLM worker that call its engine: the model runner's (loads and stores inside
#: the step), the background loader and the background saver.
VLLM_WORKER_CALLERS = 3


@dataclasses.dataclass(frozen=True)
class ConnectionCount:
    """The most connections a process holds to one Redis server (one node of a cluster)."""

    write_lanes: int = 0
    read_lanes: int = 0
    node_threads: int = 0
    toucher: int = 0
    publisher: int = 0
    refresh: int = 0
    callers: int = 0

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def describe(self) -> str:
        """``15 (8 write lanes + 4 read lanes + toucher + publisher + 1 caller)``."""
        parts = []
        for name, value in dataclasses.asdict(self).items():
            if not value:
                continue
            label = name.replace("_", " ")
            if name in ("toucher", "publisher", "refresh") and value == 1:
                parts.append(label)
            else:
                parts.append(f"{value} {label.removesuffix('s') if value == 1 else label}")
        return f"{self.total} ({' + '.join(parts)})" if parts else "0"


def engine_connections(config: CacheConfig, callers: int = 1) -> ConnectionCount:
    """The most connections a `CacheEngine` with this config holds to one server (per node of
    a cluster) while `callers` threads call it at once; see the module docstring."""
    if config.remote_url is None:
        return ConnectionCount()
    common = {"toucher": int(config.remote_lru_touch),
              "publisher": int(config.stats_publish_interval is not None),
              "callers": callers}
    if parse_remote_url(config.remote_url).kind == "cluster":
        return ConnectionCount(node_threads=CLUSTER_NODE_THREADS, refresh=1, **common)
    return ConnectionCount(write_lanes=config.remote_write_lanes,
                           read_lanes=config.remote_read_lanes, **common)


def lookup_connections(config: CacheConfig) -> ConnectionCount:
    """The vLLM scheduler's `PrefixLookup`: one connection (per node of a cluster: its node
    threads and the refresh)."""
    if config.remote_url is None:
        return ConnectionCount()
    if parse_remote_url(config.remote_url).kind == "cluster":
        return ConnectionCount(node_threads=CLUSTER_NODE_THREADS, refresh=1, callers=1)
    return ConnectionCount(callers=1)


def fleet_connections(config: CacheConfig, engines: int, tensor_parallel: int = 1,
                      worker_callers: int = VLLM_WORKER_CALLERS) -> int:
    """The most connections a fleet of `engines` vLLM engines, each with `tensor_parallel`
    workers and one scheduler, holds to one server (one node of a cluster)."""
    worker = engine_connections(config, worker_callers).total
    return engines * (tensor_parallel * worker + lookup_connections(config).total)
