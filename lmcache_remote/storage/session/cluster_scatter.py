"""ClusterScatter: one batch of commands over a Redis/Valkey Cluster, one pipeline per node.

A cluster's `channel.Channel`, chosen when a tier or store is built (`channel.open_channel`):
the chunk tier's (`chunks.lookup.RemoteLookup`, `chunks.redis_tier.RedisTier`) and the page
store's (`pages.PageStore`) on a `redis+cluster://` URL.

- Every command names keys of one hash slot (a chunk's or a page's `{hash}` tag), so a batch is
  grouped by the slot's primary node (the client's slot table), sent as one pipeline per node,
  and the pipelines run concurrently on a small thread pool, each in a copy of the caller's
  context (the call's deadline, `storage.deadline`, goes with it). A batch costs one round trip
  to the slowest node, not the sum over nodes. Bulk batches go through `bulk.BulkPipeline` on
  the node's connection pool: values leave without a copy (``seals`` too), GET replies land
  where the sink says, and every wait is cut to the call's deadline, so a node on a slow link
  costs at most what is left of the call, not a socket timeout per wait.
- Each node has its own `HealthGate` and `RemoteCaller` (the project's retry policy): a node that
  fails makes its commands `FAILED` while the other nodes keep serving; a node in back-off is
  skipped at once. Only when every node of a batch fails does `run` raise `BackendError`.
- Redirects: a `MOVED`/`ASK`/`TRYAGAIN` answer inside a node pipeline is re-sent through the
  cluster client, which follows it; a `MOVED` or a node failure also schedules a slot-table
  refresh in the background (at most one per second), so the next batch is grouped by the new
  topology (resharding, a replica promoted after a fail-over).
- The cluster client is built at once if the cluster answers, else on first use: a cluster
  unreachable at start-up makes misses until it answers instead of failing the engine's start.

``gate`` is the owner's tier-wide health flag: healthy after a batch with no node failure,
unhealthy after one with any; closing it (`stop_io`) stops every node. ``caller`` runs plain
calls on the cluster client under that gate.
"""

from __future__ import annotations

import contextvars
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
from lmcache_remote.storage.session.client import (
    RemoteCaller,
    make_client,
    shut_down_in_use,
    sockets_in_use,
    translate,
)
from lmcache_remote.storage.session.health import HealthGate
from lmcache_remote.storage.wire.bulk import BulkPipeline, Seal
from lmcache_remote.storage.wire.commands import command_key
from lmcache_remote.storage.wire.resp import Sink
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

logger = logging.getLogger(__name__)

Command = tuple[Any, ...]
"""A Redis command whose first argument (index 1) is a key: ("GET", key), ("MSET", k, v, ...)."""

#: A bulk GET's receiving: (sink, expected reply sizes or None, bytes to keep asked ahead, digest
#: slots).
Receive = tuple[Sink, Sequence[int] | None, int, list[int | None]]

_REDIRECTS = (MovedError, AskError, TryAgainError)
MAX_THREADS = 16
_REFRESH_INTERVAL = 1.0


class _Failed:
    """The result of a command whose node failed (or whose redirect could not be followed)."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED: Any = _Failed()


def failed(reply: Any) -> bool:
    """Whether a reply of `ClusterScatter.run` stands for no answer (its node failed)."""
    return reply is FAILED or isinstance(reply, Exception)


class _Unconnected:
    """Stands in for the cluster client until it is built; only `close` is ever called."""

    connection_pool = None

    def close(self) -> None:
        pass


class ClusterScatter:
    """Batches over a `RedisCluster`, one pipeline per node; see the module doc. Thread-safe.
    A `channel.Channel`."""

    takes_packed = False  # commands are grouped by their key: tuples, never packed bytes
    transactions = False  # a batch spans nodes: one atomic command per chunk or page
    bulk_path = True
    bulk = None

    def __init__(self, config: CacheConfig, gate: HealthGate, metrics: Metrics,
                 log: RateLimitedLogger, longest: int, error_metric: str | None = "remote.errors",
                 client: RedisCluster | None = None) -> None:
        self.config = config
        self.gate = gate
        self.metrics = metrics
        self._log = log
        self._longest = longest
        self._error_metric = error_metric
        self._cluster: RedisCluster | None = client
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._callers: dict[str, RemoteCaller] = {}
        self._executor = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="lmcr-cluster")
        self._connect_caller = RemoteCaller(config.remote_timeout, HealthGate(
            config.unhealthy_backoff), "redis cluster")
        self.caller = RemoteCaller(config.remote_timeout, gate, "redis cluster")
        self._refresh_at = 0.0
        self._refreshing = False
        if client is None:
            try:  # at once when the cluster answers, so the client is usable from the start
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
        return self._cluster

    def _connect(self) -> RedisCluster:
        try:
            client = make_client(self.config)
        except BackendError as exc:  # make_client translated it; the caller wants redis-py's
            raise redis.ConnectionError(str(exc)) from exc
        assert isinstance(client, RedisCluster)  # the caller checked the URL's kind
        return client

    @property
    def client(self) -> Any:
        """The cluster client once built, a placeholder with only `close()` until then."""
        return self._cluster if self._cluster is not None else _Unconnected()

    def redis_client(self) -> RedisCluster:
        return self.cluster()

    def sockets_busy(self) -> bool:
        cluster = self._cluster
        return any(sockets_in_use(node.redis_connection)
                   for node in (cluster.get_nodes() if cluster is not None else ())
                   if node.redis_connection is not None)

    def node_caller(self, node: ClusterNode) -> RemoteCaller:
        """The node's own caller (its gate closed from the start once `stop_io` ran)."""
        with self._lock:
            caller = self._callers.get(node.name)
            if caller is None:
                gate = HealthGate(self.config.unhealthy_backoff)
                if self.gate.closed:  # stopped: no node is called any more
                    gate.close()
                caller = RemoteCaller(self.config.remote_timeout, gate, f"redis {node.name}")
                self._callers[node.name] = caller
            return caller

    def ping(self) -> bool:
        """True if every primary of the cluster answers now."""
        cluster = self.cluster()
        return all(
            bool(self.node_caller(node).call(cluster.get_redis_connection(node).ping))
            for node in cluster.get_primaries()
        )

    def stop_io(self) -> None:
        """Every node's gate and ``gate`` closed, their connections in use shut down."""
        self.gate.close()
        self._connect_caller.gate.close()
        with self._lock:
            callers = list(self._callers.values())
        for caller in callers:
            caller.gate.close()
        cluster = self._cluster
        for node in cluster.get_nodes() if cluster is not None else ():
            shut_down_in_use(node.redis_connection)

    def close(self) -> None:
        """`stop_io`, then waits for the node threads and closes the cluster client."""
        self.stop_io()
        self._executor.shutdown(wait=True)
        self.client.close()

    # -- scatter / gather ---------------------------------------------------------------------

    def run(self, commands: Sequence[Command], what: str, *, bulk: bool = True,
            receive: Receive | None = None, seals: Sequence[Seal | None] | None = None,
            raise_on_error: bool = True) -> list[Any]:
        """Each command's reply, in order; `FAILED` where its node failed.

        Raises `BackendError` only when the batch had commands and every node it needed failed.
        `bulk=False` keeps redis-py's pipeline (replies as `bytes`). `receive`: (sink, expected
        reply sizes, bytes to keep asked ahead, digest slots) for bulk GETs, indexed like
        ``commands``: each node's bulk replies land where the sink says (a callable sink is
        called from the nodes' threads one at a time), and their digests where the loop made
        them. `seals`, indexed like ``commands``: sealed on the way out, as on a single node.
        An error answer is always its command's reply (``raise_on_error`` is a single
        server's choice).
        """
        if not commands:
            return []
        cluster = self.cluster()
        groups, unrouted = self._group(cluster, commands)
        if receive is not None and callable(receive[0]):
            receive = (_serialised(receive[0]), *receive[1:])
        results: list[Any] = [FAILED] * len(commands)
        futures: list[tuple[list[int], Future[list[Any]], list[int | None]]] = []
        for node, indices in groups.values():
            batch = [commands[i] for i in indices]
            node_receive = None
            node_digests: list[int | None] = [None] * len(indices)
            if receive is not None:
                sink, sizes, ahead, _ = receive
                node_sizes = None if sizes is None else [sizes[i] for i in indices]
                node_receive = (_shifted(sink, indices), node_sizes, ahead, node_digests)
            node_seals = None if seals is None else [seals[i] for i in indices]
            context = contextvars.copy_context()  # the call's deadline goes with the task
            futures.append((indices, self._executor.submit(
                context.run, self._run_node, cluster, node, batch, bulk, node_receive,
                node_seals), node_digests))
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
            self.refresh_topology()
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
        if self._error_metric is not None:  # else the owner counts the batch it fails
            self.metrics.inc(self._error_metric, len(errors) + (1 if unrouted else 0))
        self._log.warning(
            f"cluster-{what}", "redis cluster %s: %d of %d nodes failed, their commands "
            "missed: %s", what, len(errors), groups, errors[0] if errors else "slots not covered",
        )

    def _run_node(
        self, cluster: RedisCluster, node: ClusterNode, commands: list[Command], bulk: bool,
        receive: Receive | None = None, seals: Sequence[Seal | None] | None = None,
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
                        return BulkPipeline(client).execute(commands, seals=seals)
                    sink, sizes, ahead, digests = receive
                    return BulkPipeline(client).execute(
                        commands, sink, reply_sizes=sizes, inflight_bytes=ahead,
                        digests=digests, seals=seals, max_bulk=self._longest)
                except redis.ResponseError:
                    pass  # MOVED/ASK/OOM...: redo below, keeping each answer (all idempotent)
            pipe = client.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            return cast(list[Any], pipe.execute(raise_on_error=False))

        try:
            replies = self.node_caller(node).call(op)
        except BackendError:
            self.refresh_topology()
            raise
        redirected = [i for i, r in enumerate(replies) if isinstance(r, _REDIRECTS)]
        if redirected:
            if any(isinstance(replies[i], MovedError) for i in redirected):
                self.refresh_topology()
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

    def refresh_topology(self) -> None:
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


def _serialised(sink: Callable[[int, int], Any]) -> Callable[[int, int], Any]:
    """A callable sink the nodes' threads call one at a time."""
    lock = threading.Lock()

    def call(index: int, length: int) -> Any:
        with lock:
            return sink(index, length)

    return call


def _shifted(sink: Sink, indices: Sequence[int]) -> Sink:
    """A node's sink: its i-th reply is the batch's reply ``indices[i]``."""
    if not callable(sink):
        return [sink[i] for i in indices]
    return lambda index, length: sink(indices[index], length)
