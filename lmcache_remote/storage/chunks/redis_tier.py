"""RedisTier: chunks in Redis/Valkey, pipelined, whole-or-absent, never served unchecked.

The remote tier over one server (plain, TLS, a UNIX socket, a Sentinel-managed master) or a
Redis Cluster: which, is its channel's business (`session.channel`, chosen when the tier is
built from the URL), the rest is the same code. Put together from three parts, each with its
contract:

- `lookup.RemoteLookup` (which the tier is): the chunk keys, `contains`, the LRU refreshes,
  and the channel, health gate and caller every call goes through;
- `reads.ChunkReads`: `get`, checked reads into the chunk's own memory;
- `writes.ChunkWrites`: `put_each`, atomic writes over several lanes.

Here: the tier's state (memory, lanes, budget, integrity key), `delete`, and `close`. On a
cluster a node that fails makes its chunks misses (lookups, gets) or dropped writes, counted
in `remote.errors` / `remote.dropped_chunks`, while the other nodes keep serving; only when
every node of a batch fails does a call raise `BackendError`, as one server's does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendUnavailableError
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.chunks.reads import Allocator, ChunkReads
from lmcache_remote.storage.chunks.writes import ChunkWrites
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.storage.session.channel import failed
from lmcache_remote.storage.tier import RemoteTier
from lmcache_remote.storage.value.path import ValuePath, Verdicts
from lmcache_remote.storage.wire.commands import ttl_ms
from lmcache_remote.storage.wire.lanes import LanePool, LaneThreads
from lmcache_remote.telemetry.metrics import Metrics
from lmcache_remote.values.integrity import IntegrityKey
from lmcache_remote.values.sizing import max_part_count

__all__ = ["READ_LANES", "WRITE_LANES", "Allocator", "RedisTier"]

logger = logging.getLogger(__name__)
#: The default number of connections one `put_each` writes over at once on a single server
#: (`CacheConfig.remote_write_lanes` sets it).
WRITE_LANES: int = CacheConfig.remote_write_lanes
#: The default number of connections one `get` reads over at once on a single server (see
#: `ChunkReads._get_wire`; `CacheConfig.remote_read_lanes` sets it).
READ_LANES: int = CacheConfig.remote_read_lanes


class RedisTier(RemoteLookup, RemoteTier):
    """The remote tier over Redis/Valkey: a lookup (`RemoteLookup`, which it is) with its
    reads (`reads`, a `ChunkReads`) and writes (`writes`, a `ChunkWrites`) over one channel
    and one value path. Thread-safe (redis-py's pool is).

    Read buffers come from `allocate(num_tokens)`: the storage manager's, which evicts local
    entries to make room in the shared budget; by default straight from `pool`. A read that
    gets None stops there (`remote.pool_full`). ``client``: a redis-py client to use instead
    of the configured URL's (a `RedisCluster` makes it a cluster's tier)."""

    name = "remote"

    def __init__(
        self,
        config: CacheConfig,
        layout: ChunkLayout,
        pool: MemoryPool,
        metrics: Metrics,
        client: Any = None,
        allocate: Allocator | None = None,
    ) -> None:
        RemoteLookup.__init__(self, config, layout, metrics, client)
        #: The value path (`value.path`): with `integrity_key` every value written carries a
        #: MAC and only values whose MAC verifies are served; the key is read here, at
        #: start-up, never logged.
        self.values = ValuePath.from_config(config, self.serde)
        self.verdicts = Verdicts(metrics, self.log, "chunk", "remote.", "_chunks")
        self.pool = pool
        self.allocate = allocate or (lambda n: pool.allocate(layout.shape(n), layout.dtype))
        self._lanes = LaneThreads()
        self.reads = ChunkReads(self, self.values, self.verdicts, self.allocate, self._lanes,
                                self.delete, config.remote_read_lanes)
        self.writes = ChunkWrites(self, self.values, self._lanes, config.remote_write_lanes,
                                  ttl_ms(config))

    @property
    def integrity(self) -> IntegrityKey | None:
        """The integrity key values are signed and checked with (the value path's), or None."""
        return self.values.integrity

    def get(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj]:
        """The leading run of good chunks (`ChunkReads.get`)."""
        return self.reads.get(specs)

    def put_each(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> list[bool]:
        """Writes the chunks, each in one atomic command; per chunk, whether it landed
        (`ChunkWrites.put_each`)."""
        return self.writes.put_each(keys, objs)

    @property
    def read_lanes(self) -> int:
        """Connections one read uses at once (`CacheConfig.remote_read_lanes`)."""
        return self.reads.read_lanes

    @read_lanes.setter
    def read_lanes(self, lanes: int) -> None:
        self.reads.read_lanes = lanes

    @property
    def write_lanes(self) -> int:
        """Connections one write uses at once (`CacheConfig.remote_write_lanes`)."""
        return self.writes.write_lanes

    @property
    def _readers(self) -> LanePool | None:
        """The read lanes, once started (the step's reads before background ones)."""
        return cast("LanePool | None", self._lanes.started("lmcr_reader"))

    def delete(self, keys: Sequence[CacheEngineKey]) -> int:
        """Deletes the chunks (every value key they may have); how many had a head value.
        A cluster node that failed fails the call (`BackendUnavailableError`)."""
        if not keys:
            return 0
        names, heads = self._delete_names(keys)
        results = self.channel.run([("UNLINK", name) for name in names], "delete")
        lost = sum(1 for r in results if failed(r))
        if lost:
            raise BackendUnavailableError(f"redis cluster: {lost} deletes failed (node down)")
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
