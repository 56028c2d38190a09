"""Where the remote tier is chosen: `make_remote_tier` builds the tier the configured URL names,
`make_remote_lookup` the lookup alone (keys and `contains`, no reads or writes).

One tier for every URL: a `RedisTier` (or `RemoteLookup`) whose channel (`session.channel.
open_channel`) is a cluster's for a `redis+cluster://` URL (per-node scatter/gather) and one
server's for every other (a single server, TLS, a UNIX socket, a Sentinel-managed master). The
storage manager asks for the tier, the vLLM scheduler's lookup for the lookup.
"""

from __future__ import annotations

from lmcache_remote.config import CacheConfig
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.chunks.redis_tier import Allocator, RedisTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
from lmcache_remote.telemetry.metrics import Metrics


def make_remote_tier(
    config: CacheConfig, layout: ChunkLayout, pool: MemoryPool, metrics: Metrics,
    allocate: Allocator | None = None,
) -> RedisTier:
    """The remote tier the configured URL names. `allocate` gives the tier its read buffers
    (`RedisTier`'s parameter of that name)."""
    assert config.remote_url is not None
    return RedisTier(config, layout, pool, metrics, allocate=allocate)


def make_remote_lookup(config: CacheConfig, layout: ChunkLayout, metrics: Metrics
                       ) -> RemoteLookup:
    """The lookup of the configured URL's chunks."""
    assert config.remote_url is not None
    return RemoteLookup(config, layout, metrics)
