"""ClusterRedisTier: the Redis tier over a Redis/Valkey Cluster, one shard's failure a local miss.

It keeps RedisTier's layout, checks and windows, and replaces the batch operations with
`cluster_scatter.ClusterScatter`'s per-node scatter/gather: `ClusterLookup` the lookups
(`contains`, and all the vLLM scheduler's lookup of a cluster needs), `ClusterRedisTier` also the
reads, writes and deletes (`_fetch`, `_bulk_get`, `_write`, `delete`):

- Every command of a batch names one chunk's keys, which share a hash slot (the `{hash}` tag),
  so the batch goes out as one pipeline per node, concurrently (the scatter's module doc).
  Writes, lookups and chunk reads go through `bulk.BulkPipeline` on the node's connection
  pool: values leave without a copy, and GET replies land in the chunk's own memory (raw) or
  the read's arena, as on a single node.
- A node that fails makes its chunks misses (lookups, gets) or dropped writes, counted in
  `remote.errors` / `remote.dropped_chunks`, while the other nodes keep serving. Only when every
  node of a batch fails does the tier raise `BackendError`, as the single-node tier does, and
  the manager counts a whole-batch failure. Redirects are followed, the slot table refreshed.
- The cluster client is built when the tier is, or, if the cluster does not answer then, on
  first use: a cluster unreachable at start-up makes misses until it answers, like a single
  server that is down, instead of failing the engine's start. Until it is built, `client` is a
  placeholder with only `close()`.

`base.gate` stays the tier-wide health flag the manager reports: healthy after a batch with no
node failure, unhealthy after one with any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from redis.cluster import RedisCluster

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendUnavailableError
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.chunks.redis_tier import Allocator, RedisTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
from lmcache_remote.storage.session.cluster_scatter import ClusterScatter, Command, Receive, failed
from lmcache_remote.storage.wire.bulk import Seal, apply_seals
from lmcache_remote.storage.wire.commands import chunk_write_command
from lmcache_remote.storage.wire.resp import Reply
from lmcache_remote.telemetry.metrics import Metrics


class _Unconnected:
    """Stands in for the cluster client until it is built; only `close` is ever called."""

    def close(self) -> None:
        pass


class ClusterLookup(RemoteLookup):
    """`RemoteLookup` over a `RedisCluster` (the vLLM scheduler's lookup of a cluster, and the
    lookups of `ClusterRedisTier`); see the module doc. Thread-safe."""

    def __init__(
        self,
        config: CacheConfig,
        layout: ChunkLayout,
        metrics: Metrics,
        client: RedisCluster | None = None,
    ) -> None:
        RemoteLookup.__init__(self, config, layout, metrics, client=cast(Any, _Unconnected()))
        self._init_cluster(client)

    def _init_cluster(self, client: RedisCluster | None) -> None:
        """The cluster's own state, after the base's (`client` stands in until then)."""
        if client is not None:
            self.client = cast(Any, client)
        self.scatter = ClusterScatter(self.config, self.gate, self.metrics, self._log,
                                      self._longest, client=client,
                                      on_connect=self._connected)

    def _connected(self, cluster: RedisCluster) -> None:
        self.client = cast(Any, cluster)

    def cluster(self) -> RedisCluster:
        """The cluster client, built on first use (`BackendUnavailableError` while unreachable)."""
        return self.scatter.cluster()

    def redis_client(self) -> Any:
        return self.cluster()

    def _run(self, commands: Sequence[Command], what: str, bulk: bool = True,
             receive: Receive | None = None) -> list[Any]:
        """`ClusterScatter.run`: each command's reply, `FAILED` where its node failed."""
        return self.scatter.run(commands, what, bulk, receive)

    # -- lookups ------------------------------------------------------------

    def contains(self, specs: Sequence[Any]) -> list[bool]:
        if not specs:
            return []
        key_lists = [self._keys(s) for s in specs]
        results = self._run([("EXISTS", *keys) for keys in key_lists], "lookup")
        counts = [None if failed(r) else int(r) for r in results]
        return self._not_known_foreign(specs, self._present(specs, key_lists, counts))

    def _lookup_batch(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`RemoteLookup._lookup_batch` per node: a failed node's replies are None."""
        return [None if failed(r) else r for r in self._run(list(commands), "lookup")]

    def _lookup_run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`RedisTier._lookup_run` per node (a failed node's replies are `FAILED`)."""
        return self._run(list(commands), "lookup", bulk=False)

    def ping(self) -> bool:
        """True if every primary of the cluster answers now."""
        return self.scatter.ping()

    def stop_io(self) -> None:
        """`RedisTier.stop_io` for every node: their gates closed, their connections in use
        shut down."""
        super().stop_io()
        self.scatter.stop_io()

    def close(self) -> None:
        self.stop_io()
        self.scatter.close()
        super().close()


class ClusterRedisTier(ClusterLookup, RedisTier):
    """RedisTier over a `RedisCluster`: `ClusterLookup`'s lookups, and reads, writes and
    deletes scattered per node; see the module doc. Thread-safe."""

    def __init__(
        self,
        config: CacheConfig,
        layout: ChunkLayout,
        pool: MemoryPool,
        metrics: Metrics,
        client: RedisCluster | None = None,
        allocate: Allocator | None = None,
    ) -> None:
        RedisTier.__init__(self, config, layout, pool, metrics, client=cast(Any, _Unconnected()),
                           allocate=allocate)
        self._init_cluster(client)

    def _fetch(self, key_lists: Sequence[Sequence[str]]) -> list[list[bytes | None]]:
        flat = self._run([("GET", key) for keys in key_lists for key in keys], "get", bulk=False)
        out: list[list[bytes | None]] = []
        pos = 0
        for keys in key_lists:
            values = flat[pos:pos + len(keys)]
            out.append([v if isinstance(v, bytes) else None for v in values])
            pos += len(keys)
        return out

    def _bulk_get(self, commands: list[tuple[str, str]], sink: Any, sizes: list[int],
                  ahead: int, digests: list[int | None]) -> list[Reply]:
        """The GETs scattered per node, each node's replies received where ``sink`` says (a
        callable sink is called from the nodes' threads one at a time); a failed node's values
        are misses (None)."""
        results = self._run(commands, "get", receive=(sink, sizes, ahead, digests))
        return [None if failed(r) else r for r in results]

    def _write(self, batch: Sequence[tuple[list[str], list[Any]]],
               seals: Sequence[Seal | None] | None = None) -> list[bool]:
        """Per chunk, whether it landed: a node that failed loses only its own chunks. The
        cluster has no `wire` of its own, so its values come sealed (``seals`` is None)."""
        apply_seals(seals or ())
        commands: list[Command] = []
        owner: list[int] = []  # the batch entry each command belongs to
        for i, (keys, values) in enumerate(batch):
            commands.append(chunk_write_command(keys, values, self._ttl_ms))
            owner.append(i)
        results = self._run(commands, "write")
        ok = [True] * len(batch)
        for i, result in zip(owner, results, strict=True):
            if failed(result):
                ok[i] = False
        written = sum(ok)
        nbytes = sum(
            len(memoryview(v)) for (_, values), good in zip(batch, ok, strict=True) if good
            for v in values
        )
        self.metrics.inc("remote.written_chunks", written)
        self.metrics.inc("remote.written_bytes", nbytes)
        return ok

    def delete(self, keys: Sequence[CacheEngineKey]) -> int:
        if not keys:
            return 0
        names, heads = self._delete_names(keys)
        results = self._run([("UNLINK", name) for name in names], "delete")
        lost = sum(1 for r in results if failed(r))
        if lost:
            raise BackendUnavailableError(f"redis cluster: {lost} deletes failed (node down)")
        return sum(int(r) for n, r in zip(names, results, strict=True) if n in heads)

