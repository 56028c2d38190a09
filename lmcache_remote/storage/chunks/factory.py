"""Where the remote tier is chosen: `make_remote_tier` builds the tier the configured URL names,
`make_remote_lookup` the lookup alone (keys and `contains`, no reads or writes).

A `redis+cluster://` URL gets the cluster's (`ClusterRedisTier`, `ClusterLookup`: per-node
scatter/gather); every other URL (a single server, TLS, a UNIX socket, a Sentinel-managed
master) a `RedisTier` or `RemoteLookup` over the bulk pipeline. The storage manager asks for
the tier, the vLLM scheduler's lookup for the lookup.
"""

from __future__ import annotations

from lmcache_remote.config import CacheConfig
from lmcache_remote.storage.chunks.cluster_tier import ClusterLookup, ClusterRedisTier
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.chunks.redis_tier import Allocator, RedisTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
from lmcache_remote.telemetry.metrics import Metrics
from lmcache_remote.urls import parse_remote_url


def make_remote_tier(
    config: CacheConfig, layout: ChunkLayout, pool: MemoryPool, metrics: Metrics,
    allocate: Allocator | None = None,
) -> RedisTier:
    """The remote tier the configured URL names: `ClusterRedisTier` for a cluster URL.
    `allocate` gives the tier its read buffers (`RedisTier`'s parameter of that name)."""
    assert config.remote_url is not None
    if parse_remote_url(config.remote_url).kind == "cluster":
        return ClusterRedisTier(config, layout, pool, metrics, allocate=allocate)
    return RedisTier(config, layout, pool, metrics, allocate=allocate)


def make_remote_lookup(config: CacheConfig, layout: ChunkLayout, metrics: Metrics
                       ) -> RemoteLookup:
    """The lookup of the configured URL's chunks: `ClusterLookup` for a cluster URL."""
    assert config.remote_url is not None
    if parse_remote_url(config.remote_url).kind == "cluster":
        return ClusterLookup(config, layout, metrics)
    return RemoteLookup(config, layout, metrics)
