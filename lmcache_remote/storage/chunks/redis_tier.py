"""RedisTier: chunks in Redis/Valkey, pipelined, whole-or-absent, never served unchecked.

The remote tier over one server (plain, TLS, a UNIX socket, a Sentinel-managed master), put
together from three parts, each with its contract:

- `lookup.RemoteLookup`: the chunk keys, `contains`, the LRU refreshes, the health
  gate and the caller every call goes through;
- `reads.RemoteReads`: `get`, checked reads into the chunk's own memory;
- `writes.RemoteWrites`: `put_each`, atomic writes over several lanes.

Here: the tier's state (memory, lanes, budget, integrity key), `delete`, and `close`. A Redis
Cluster has its own tier on the same parts (`cluster_tier.ClusterRedisTier`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis

from lmcache_remote.config import CacheConfig
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.chunks.reads import Allocator, RemoteReads
from lmcache_remote.storage.chunks.writes import RemoteWrites
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
from lmcache_remote.storage.value.path import ValuePath, Verdicts
from lmcache_remote.storage.wire import windows as wire_windows
from lmcache_remote.storage.wire.arena import ArenaPool
from lmcache_remote.storage.wire.commands import ttl_ms
from lmcache_remote.storage.wire.lanes import LanePool, LaneThreads
from lmcache_remote.storage.wire.windows import ByteBudget
from lmcache_remote.telemetry.metrics import Metrics
from lmcache_remote.values.integrity import IntegrityKey
from lmcache_remote.values.sizing import max_part_count

__all__ = ["READ_LANES", "WRITE_LANES", "Allocator", "RedisTier"]

logger = logging.getLogger(__name__)
#: The default number of connections one `put_each` writes over at once on a single server
#: (`CacheConfig.remote_write_lanes` sets it).
WRITE_LANES: int = CacheConfig.remote_write_lanes
#: The default number of connections one `get` reads over at once on a single server (see
#: `RemoteReads._get_wire`; `CacheConfig.remote_read_lanes` sets it).
READ_LANES: int = CacheConfig.remote_read_lanes


class RedisTier(RemoteWrites, RemoteReads):
    """The remote tier over one Redis/Valkey server. Thread-safe (redis-py's pool is).

    Read buffers come from `allocate(num_tokens)`: the storage manager's, which evicts local
    entries to make room in the shared budget; by default straight from `pool`. A read that
    gets None stops there (`remote.pool_full`)."""

    name = "remote"

    def __init__(
        self,
        config: CacheConfig,
        layout: ChunkLayout,
        pool: MemoryPool,
        metrics: Metrics,
        client: redis.Redis | None = None,
        allocate: Allocator | None = None,
    ) -> None:
        RemoteLookup.__init__(self, config, layout, metrics, client)
        #: The value path (`value.path`): with `integrity_key` every value written carries a
        #: MAC and only values whose MAC verifies are served; the key is read here, at
        #: start-up, never logged.
        self.values = ValuePath.from_config(config, self.serde)
        self.integrity: IntegrityKey | None = self.values.integrity
        self.verdicts = Verdicts(metrics, self._log, "chunk", "remote.", "_chunks")
        self.pool = pool
        self.allocate = allocate or (lambda n: pool.allocate(layout.shape(n), layout.dtype))
        self._arenas = ArenaPool()
        self._ttl_ms = ttl_ms(config)
        self.write_lanes = config.remote_write_lanes
        self.read_lanes = config.remote_read_lanes
        self._lanes = LaneThreads()
        self._write_budget = ByteBudget(wire_windows.WINDOW_BYTES)

    def _lane_pool(self, name: str, lanes: int) -> Any:
        """The lane threads ``name``, started on first use: ``_writers`` or ``_receivers`` (an
        executor) or ``_readers`` (a `lanes.LanePool`: reads inside `background_reads` yield
        to others)."""
        return self._lanes.get(f"lmcr{name[:-1]}", lanes, step_first=name == "_readers")

    @property
    def _readers(self) -> LanePool | None:
        """The read lanes, once started (the step's reads before background ones)."""
        return self._lanes.started("lmcr_reader")

    def delete(self, keys: Sequence[CacheEngineKey]) -> int:
        if not keys:
            return 0
        names, heads = self._delete_names(keys)

        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.unlink(name)
            return pipe.execute()

        results = self.caller.call(op)
        return sum(int(r) for n, r in zip(names, results, strict=True) if n in heads)

    def _delete_names(self, keys: Sequence[CacheEngineKey]) -> tuple[list[str], set[str]]:
        """Every value key the chunks may have (at least as many parts as any chunk of up to
        `chunk_size` tokens is cut into: `max_part_count`), and the heads (whose count is the
        number of chunks deleted)."""
        full = max_part_count(self.layout.nbytes(self.config.chunk_size), self.serde.part_size)
        names = [k for key in keys for k in key.part_keys(self.prefix, full)]
        return names, {key.redis_key(self.prefix) for key in keys}

    def _join_threads(self) -> None:
        """Waits for the lane threads (`close`)."""
        self._lanes.shutdown()
