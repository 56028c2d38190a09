"""ClusterRedisTier: the Redis tier over a Redis/Valkey Cluster, one shard's failure a local miss.

It keeps RedisTier's layout, checks and windows, and replaces the batch operations with a
per-node scatter/gather: `ClusterLookup` the lookups (`contains`, and all the vLLM scheduler's
lookup of a cluster needs), `ClusterRedisTier` also the reads, writes and deletes (`_fetch`,
`_bulk_get`, `_write`, `delete`):

- Every command of a batch names one chunk's keys, which share a hash slot (the `{hash}` tag),
  so the batch is grouped by the slot's primary node (from the client's slot table), sent as
  one pipeline per node, and the pipelines run concurrently on a small thread pool. A batch
  costs one round trip to the slowest node, not the sum over nodes. Writes, lookups and chunk
  reads go through `bulk.BulkPipeline` on the node's connection pool: values leave without a
  copy, and GET replies land in the chunk's own memory (raw) or the read's arena, as on a
  single node (the nodes' threads take turns in the receive sink).
- Each node has its own `HealthGate` and `RemoteCaller` (the project's retry policy): a node
  that fails makes its chunks misses (lookups, gets) or dropped writes, counted in
  `remote.errors` / `remote.dropped_chunks`, while the other nodes keep serving. A node in
  back-off is skipped at once. Only when every node of a batch fails does the tier raise
  `BackendError`, as the single-node tier does, and the manager counts a whole-batch failure.
- Redirects: a `MOVED`/`ASK`/`TRYAGAIN` answer inside a node pipeline is re-sent through the
  cluster client, which follows it; a `MOVED` or a node failure also schedules a slot-table
  refresh in the background (at most one per second), so the next batch is grouped by the new
  topology (resharding, a replica promoted after a fail-over).
- The cluster client is built when the tier is, or, if the cluster does not answer then, on
  first use: a cluster unreachable at start-up makes misses until it answers, like a single
  server that is down, instead of failing the engine's start. Until it is built, `client` is a
  placeholder with only `close()`.

`base.gate` stays the tier-wide health flag the manager reports: healthy after a batch with no
node failure, unhealthy after one with any.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, MovedError, TryAgainError

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendError, BackendUnavailableError
from lmcache_remote.keys import CacheEngineKey
from lmcache_remote.memory import ChunkLayout, MemoryPool
from lmcache_remote.metrics import Metrics
from lmcache_remote.storage.bulk import BulkPipeline, Seal, apply_seals
from lmcache_remote.storage.client import RemoteCaller, make_client, translate
from lmcache_remote.storage.health import HealthGate
from lmcache_remote.storage.redis_commands import chunk_write_command, command_key
from lmcache_remote.storage.redis_tier import Allocator, RedisTier
from lmcache_remote.storage.remote_lookup import RemoteLookup, shut_down_in_use
from lmcache_remote.storage.resp import Reply, Sink

logger = logging.getLogger(__name__)

Command = tuple[Any, ...]
"""A Redis command whose first argument (index 1) is a key: ("GET", key), ("MSET", k, v, ...)."""

_REDIRECTS = (MovedError, AskError, TryAgainError)
_MAX_THREADS = 16
_REFRESH_INTERVAL = 1.0


class _Failed:
    """The result of a command whose node failed (or whose redirect could not be followed)."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED: Any = _Failed()
#: A bulk GET's receiving: (sink, expected reply sizes, bytes asked ahead, digest slots).
Receive = tuple[Sink, Sequence[int], int, list[int | None]]


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
        config = self.config
        self._cluster: RedisCluster | None = client
        if client is not None:
            self.client = cast(Any, client)
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._callers: dict[str, RemoteCaller] = {}
        self._executor = ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="lmcr-cluster")
        self._connect_caller = RemoteCaller(config.remote_timeout, HealthGate(
            config.unhealthy_backoff), "redis cluster")
        self._refresh_at = 0.0
        self._refreshing = False
        if client is None:
            try:  # at once when the cluster answers, so `client` is usable from the start
                self.cluster()
            except BackendError as exc:
                logger.warning("redis cluster not reachable yet, will retry on use: %s", exc)

    # -- the client ---------------------------------------------------------------------------

    def cluster(self) -> RedisCluster:
        """The cluster client, built on first use (`BackendUnavailableError` while unreachable)."""
        if self._cluster is not None:
            return self._cluster
        with self._connect_lock:
            if self._cluster is None:
                self._cluster = self._connect_caller.call(self._connect)
                self.client = cast(Any, self._cluster)
        return self._cluster

    def _connect(self) -> RedisCluster:
        try:
            client = make_client(self.config)
        except BackendError as exc:  # make_client translated it; the caller wants redis-py's
            raise redis.ConnectionError(str(exc)) from exc
        assert isinstance(client, RedisCluster)  # tiers.make_remote_tier checked the URL's kind
        return client

    def _caller(self, node: ClusterNode) -> RemoteCaller:
        with self._lock:
            caller = self._callers.get(node.name)
            if caller is None:
                gate = HealthGate(self.config.unhealthy_backoff)
                if self.gate.closed:  # stopped: no node is called any more
                    gate.close()
                caller = RemoteCaller(self.config.remote_timeout, gate, f"redis {node.name}")
                self._callers[node.name] = caller
            return caller

    # -- lookups ------------------------------------------------------------

    def contains(self, specs: Sequence[Any]) -> list[bool]:
        if not specs:
            return []
        key_lists = [self._keys(s) for s in specs]
        results = self._run([("EXISTS", *keys) for keys in key_lists], "lookup")
        counts = [None if r is FAILED or isinstance(r, Exception) else int(r) for r in results]
        return self._present(specs, key_lists, counts)

    def _lookup_run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """`RedisTier._lookup_run` per node (a failed node's replies are `FAILED`)."""
        return self._run(list(commands), "lookup", bulk=False)

    def ping(self) -> bool:
        """True if every primary of the cluster answers now."""
        cluster = self.cluster()
        return all(
            bool(self._caller(node).call(cluster.get_redis_connection(node).ping))
            for node in cluster.get_primaries()
        )

    def stop_io(self) -> None:
        """`RedisTier.stop_io` for every node: their gates closed, their connections in use
        shut down."""
        super().stop_io()
        self._connect_caller.gate.close()
        with self._lock:
            callers = list(self._callers.values())
        for caller in callers:
            caller.gate.close()
        cluster = self._cluster
        for node in cluster.get_nodes() if cluster is not None else ():
            shut_down_in_use(node.redis_connection)

    def close(self) -> None:
        self.stop_io()
        self._executor.shutdown(wait=True)
        super().close()

    # -- scatter / gather ---------------------------------------------------------------------

    def _run(self, commands: Sequence[Command], what: str, bulk: bool = True,
             receive: Receive | None = None) -> list[Any]:
        """Each command's reply, in order; `FAILED` where its node failed.

        Raises `BackendError` only when the batch had commands and every node it needed failed.
        `bulk=False` keeps redis-py's pipeline (replies as `bytes`, what `_fetch` hands on).
        `receive`: (sink, expected reply sizes, bytes to keep asked ahead, digest slots) for
        bulk GETs, indexed like ``commands``: each node's bulk replies land where the sink
        says, and their digests where the loop made them, as on a single node.
        """
        if not commands:
            return []
        cluster = self.cluster()
        groups, unrouted = self._group(cluster, commands)
        results: list[Any] = [FAILED] * len(commands)
        futures: list[tuple[list[int], Future[list[Any]], list[int | None]]] = []
        for node, indices in groups.values():
            batch = [commands[i] for i in indices]
            node_receive = None
            node_digests: list[int | None] = [None] * len(indices)
            if receive is not None:
                sink, sizes, ahead, _ = receive
                node_receive = (_shifted(sink, indices), [sizes[i] for i in indices], ahead,
                                node_digests)
            futures.append((indices, self._executor.submit(
                self._run_node, cluster, node, batch, bulk, node_receive), node_digests))
        errors: list[BackendError] = []
        for indices, future, node_digests in futures:
            try:
                replies = future.result()
            except BackendError as exc:
                errors.append(exc)
                continue
            for i, reply in zip(indices, replies, strict=True):
                results[i] = reply
            if receive is not None:
                for i, digest in zip(indices, node_digests, strict=True):
                    receive[3][i] = digest
        self._account(what, errors, len(futures), unrouted)
        return results

    def _group(
        self, cluster: RedisCluster, commands: Sequence[Command]
    ) -> tuple[dict[str, tuple[ClusterNode, list[int]]], int]:
        """Command indices per primary node, and how many commands had no node (slot uncovered)."""
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        unrouted = 0
        manager = cluster.nodes_manager
        for i, cmd in enumerate(commands):
            try:
                node = manager.get_node_from_slot(cluster.keyslot(command_key(cmd)))
            except redis.RedisError:
                unrouted += 1
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        if unrouted:
            self._refresh_topology()
        return groups, unrouted

    def _account(self, what: str, errors: list[BackendError], groups: int, unrouted: int) -> None:
        if not errors and not unrouted:
            self.gate.success()
            return
        self.gate.failure()
        if len(errors) == groups:  # nothing of the batch was served
            if errors:
                raise errors[0]
            raise BackendUnavailableError(f"redis cluster: no node serves these slots ({what})")
        self.metrics.inc("remote.errors", len(errors) + (1 if unrouted else 0))
        self._log.warning(
            f"cluster-{what}", "redis cluster %s: %d of %d nodes failed, their chunks missed: %s",
            what, len(errors), groups, errors[0] if errors else "slots not covered",
        )

    def _run_node(
        self, cluster: RedisCluster, node: ClusterNode, commands: list[Command], bulk: bool,
        receive: Receive | None = None,
    ) -> list[Any]:
        """One pipeline on one node under its own gate; redirected commands re-sent.

        `bulk`: send through `bulk.BulkPipeline` (values leave as memoryviews, no packer
        copy); it raises on the first error answer (a redirect is one), and then the batch is
        sent again through redis-py's pipeline, which keeps each command's answer.
        """
        client = cluster.get_redis_connection(node)

        def op() -> list[Any]:
            if bulk:
                try:
                    if receive is None:
                        return BulkPipeline(client).execute(commands)
                    sink, sizes, ahead, digests = receive
                    return BulkPipeline(client).execute(
                        commands, sink, reply_sizes=sizes, inflight_bytes=ahead,
                        digests=digests, max_bulk=self._longest)
                except redis.ResponseError:
                    pass  # MOVED/ASK/OOM...: redo below, keeping each answer (all idempotent)
            pipe = client.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            return cast(list[Any], pipe.execute(raise_on_error=False))

        try:
            replies = self._caller(node).call(op)
        except BackendError:
            self._refresh_topology()
            raise
        redirected = [i for i, r in enumerate(replies) if isinstance(r, _REDIRECTS)]
        if redirected:
            if any(isinstance(replies[i], MovedError) for i in redirected):
                self._refresh_topology()
            for i in redirected:
                replies[i] = self._follow(cluster, commands[i])
        return replies

    @staticmethod
    def _follow(cluster: RedisCluster, cmd: Command) -> Any:
        """Re-send one redirected command through the cluster client, which follows MOVED/ASK."""
        try:
            return cluster.execute_command(*cmd)
        except (redis.RedisError, OSError) as exc:
            logger.debug("redirected %s failed: %s", cmd[0], translate(exc, "redis cluster"))
            return FAILED

    # -- topology -----------------------------------------------------------------------------

    def _refresh_topology(self) -> None:
        """Re-read the slot table in the background, at most once per `_REFRESH_INTERVAL`."""
        with self._lock:
            now = time.monotonic()
            if self._refreshing or now < self._refresh_at or self._cluster is None:
                return
            self._refreshing = True
            self._refresh_at = now + _REFRESH_INTERVAL
            cluster = self._cluster
        threading.Thread(
            target=self._refresh, args=(cluster.nodes_manager.initialize,),
            name="lmcr-cluster-refresh", daemon=True,
        ).start()

    def _refresh(self, initialize: Callable[[], None]) -> None:
        try:
            initialize()
        except Exception as exc:  # a failed refresh leaves the old table; the next one retries
            logger.debug("cluster topology refresh failed: %s", translate(exc, "redis cluster"))
        finally:
            with self._lock:
                self._refreshing = False



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
        if callable(sink):
            lock = threading.Lock()
            inner = sink

            def sink(index: int, length: int) -> Any:
                with lock:
                    return inner(index, length)

        results = self._run(commands, "get", receive=(sink, sizes, ahead, digests))
        return [None if r is FAILED or isinstance(r, Exception) else r for r in results]

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
            if result is FAILED or isinstance(result, Exception):
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
        failed = sum(1 for r in results if r is FAILED or isinstance(r, Exception))
        if failed:
            raise BackendUnavailableError(f"redis cluster: {failed} deletes failed (node down)")
        return sum(int(r) for n, r in zip(names, results, strict=True) if n in heads)


def _shifted(sink: Sink, indices: Sequence[int]) -> Sink:
    """A node's sink: its i-th reply is the batch's reply ``indices[i]``."""
    if not callable(sink):
        return [sink[i] for i in indices]
    return lambda index, length: sink(indices[index], length)
