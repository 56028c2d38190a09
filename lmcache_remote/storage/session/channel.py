"""Channel: batches of commands to Redis/Valkey, each command's reply or `FAILED`, for chunks
and pages alike; the one place where a single server and a cluster part ways.

- `Channel` (a protocol): `run(commands, what, ...)` answers each command in order, `FAILED`
  where the server (a cluster: the node) that holds its key failed, and raises
  `BackendError` only when every server the batch needed failed. A single server is one
  server: its batch is answered whole or raises; a cluster's failed node costs only its own
  commands. With ``receive`` bulk GET replies land where its sink says (raw values in the
  chunk's or page's own memory, hashed as they land); with ``seals`` values are sealed as
  they leave. Each channel says what it can do: `takes_packed` (commands may be RESP bytes
  packed once), `transactions` (MULTI/EXEC in a batch), `bulk_path` (values sent and
  received in place, sealed on the way out). It owns the client, its health gate (`gate`:
  the tier-wide flag the manager reports) and `caller` for plain redis-py calls under the
  project's retry policy, and stops (`stop_io`) and closes them.
- `ServerChannel`: one server (plain, TLS, a UNIX socket, a Sentinel-managed master) through
  `bulk.BulkPipeline` on redis-py's pool, every batch under `RemoteCaller`.
- `cluster_scatter.ClusterScatter`: a Redis Cluster, one pipeline per node in parallel.
- `open_channel(config, ...)`: the channel the configured URL (or a given client) names,
  chosen once, when a tier or store is built.
- `write_values(channel, batch, seals, ttl_ms, what)`: groups of values (a chunk's, a page's)
  each written by one atomic command (`wire.commands`: a transaction on a single server, a
  script per group on a cluster); per group, whether it landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from redis.cluster import RedisCluster

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendError
from lmcache_remote.storage.session.client import (
    RemoteCaller,
    make_client,
    shut_down_in_use,
    sockets_in_use,
)
from lmcache_remote.storage.session.cluster_scatter import (
    FAILED,
    ClusterScatter,
    Command,
    Receive,
    failed,
)
from lmcache_remote.storage.session.health import HealthGate
from lmcache_remote.storage.wire.bulk import BulkPipeline, Seal, supports
from lmcache_remote.storage.wire.commands import (
    check_transactions,
    chunk_write_command,
    write_batch,
)
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger
from lmcache_remote.urls import parse_remote_url

__all__ = ["FAILED", "Channel", "ServerChannel", "failed", "open_channel", "write_values"]


class Channel(Protocol):
    """Batches to Redis, each command's reply or `FAILED`; see the module doc."""

    gate: HealthGate
    caller: RemoteCaller
    takes_packed: bool
    transactions: bool
    bulk_path: bool

    @property
    def bulk(self) -> BulkPipeline | None:
        """A single server's bulk pipeline (None on a cluster, or a client it cannot drive)."""

    @property
    def client(self) -> Any:
        """The redis-py client as it is now (a cluster's: a placeholder until it answers)."""

    def run(self, commands: Sequence[Any], what: str, *, bulk: bool = True,
            receive: Receive | None = None, seals: Sequence[Seal | None] | None = None,
            raise_on_error: bool = True) -> list[Any]:
        """Each command's reply, in order, `FAILED` where its server failed; `BackendError`
        when every server it needed failed. ``bulk=False``: redis-py's pipeline (replies as
        bytes; with ``raise_on_error=False`` an error answer is its reply)."""

    def redis_client(self) -> Any:
        """The redis-py client for plain commands (a cluster's, connecting on use)."""

    def ping(self) -> bool:
        """True when every server answers now (honours the health gates' back-off)."""

    def stop_io(self) -> None:
        """No new call starts, every call in flight fails now (its sockets shut down, not
        closed)."""

    def sockets_busy(self) -> bool:
        """Whether some thread holds one of the connections now (is doing I/O)."""

    def close(self) -> None:
        """`stop_io`, then the connections close."""


class ServerChannel:
    """`Channel` over one server; see the module doc. Thread-safe (redis-py's pool is)."""

    transactions = True

    def __init__(self, config: CacheConfig, client: Any, gate: HealthGate, longest: int,
                 name: str = "redis") -> None:
        self._client = client
        self.gate = gate
        self.caller = RemoteCaller(config.remote_timeout, gate, name)
        self._bulk = BulkPipeline(client) if supports(client) else None
        self.bulk_path = self.takes_packed = self._bulk is not None  # redis-py's takes tuples
        self._longest = longest

    @property
    def bulk(self) -> BulkPipeline | None:
        return self._bulk

    @property
    def client(self) -> Any:
        return self._client

    def run(self, commands: Sequence[Any], what: str, *, bulk: bool = True,
            receive: Receive | None = None, seals: Sequence[Seal | None] | None = None,
            raise_on_error: bool = True) -> list[Any]:
        if not commands:
            return []
        wire = self._bulk
        if bulk and wire is not None:
            if receive is None:
                return list(self.caller.call(lambda: wire.execute(commands, seals=seals)))
            sink, sizes, ahead, digests = receive
            return list(self.caller.call(lambda: wire.execute(
                commands, sink, reply_sizes=sizes, inflight_bytes=ahead, digests=digests,
                seals=seals, max_bulk=self._longest)))
        if receive is not None or seals is not None:
            raise BackendError(f"the bulk path cannot drive a {type(self._client).__name__}")

        def op() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute(raise_on_error=raise_on_error))

        return list(self.caller.call(op))

    def redis_client(self) -> Any:
        return self._client

    def ping(self) -> bool:
        return bool(self.caller.call(self._client.ping))

    def stop_io(self) -> None:
        self.gate.close()
        shut_down_in_use(self._client)

    def sockets_busy(self) -> bool:
        return bool(sockets_in_use(self._client))

    def close(self) -> None:
        self.stop_io()
        self._client.close()


def open_channel(config: CacheConfig, metrics: Metrics, log: RateLimitedLogger, longest: int,
                 *, client: Any = None, name: str = "redis",
                 error_metric: str | None = "remote.errors") -> Channel:
    """The channel the configured `remote_url` names (or ``client``, when given): a cluster's
    (`ClusterScatter`, built on first use if the cluster does not answer yet) for a
    `redis+cluster://` URL or a `RedisCluster`, else one server's. ``longest``: the longest
    reply a bulk read accepts; ``error_metric``: where a cluster counts its node failures
    (None: the owner counts the batch it fails)."""
    gate = HealthGate(config.unhealthy_backoff)
    cluster = (isinstance(client, RedisCluster) if client is not None
               else config.remote_url is not None
               and parse_remote_url(config.remote_url).kind == "cluster")
    if cluster:
        return ClusterScatter(config, gate, metrics, log, longest, error_metric=error_metric,
                              client=client)
    return ServerChannel(config, client if client is not None else make_client(config), gate,
                         longest, name)


def write_values(channel: Channel, batch: Sequence[tuple[Sequence[str], Sequence[Any]]],
                 seals: Sequence[Seal | None] | None, ttl_ms: int | None, what: str
                 ) -> list[bool]:
    """Writes each group of values (its keys, its values) by one atomic command; per group,
    whether it landed (False where its node failed). On a single server a batch of
    transactions (`write_batch`): all land or it raises; on a cluster one
    `chunk_write_command` per group, sealed as it leaves."""
    if channel.transactions:
        commands, command_seals, execs = write_batch(batch, seals, ttl_ms)
        check_transactions(channel.run(commands, what, seals=command_seals), execs)
        return [True] * len(batch)
    scripts: list[Command] = [chunk_write_command(keys, values, ttl_ms)
                              for keys, values in batch]
    replies = channel.run(scripts, what, seals=seals)
    return [not failed(reply) for reply in replies]
