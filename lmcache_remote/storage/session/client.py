"""Redis connections: building clients from a URL, the retry policy, and error translation.

`make_client` builds the client the URL names (lmcache_remote.urls): one server, a Redis/Valkey
Cluster (`redis+cluster://`) or a Sentinel-managed master (`redis+sentinel://`).

Every redis-py exception stops here: `translate` turns it into a `BackendError` subclass whose
message carries no password. `RemoteCaller.call` runs one remote operation under the project's
explicit retry policy:

- redis-py's own retries are off (its default turned a refused connection into a 3.6 s wait);
- a connection error (reset, refused, broken pooled connection after a server restart) is
  retried once, at once, if less than half of `remote_timeout` has passed; a timeout is never
  retried, so a hung server costs one `remote_timeout`;
- a `HealthGate` in front: after a failure the remote is skipped (`BackendUnavailableError`
  at once) until its back-off ends, then one call probes it. An error *answer* (OOM, NOPERM)
  is raised but does not close the gate: the server is alive and other calls may succeed.
  Any other exception from the operation becomes a `BackendError` too.
"""

from __future__ import annotations

import contextlib
import socket
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, NoPermissionError, TryAgainError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from lmcache_remote.config import CacheConfig, mask_url
from lmcache_remote.errors import (
    BackendError,
    BackendPermissionError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
)
from lmcache_remote.storage.session.health import HealthGate
from lmcache_remote.storage.wire.deadline import call_deadline
from lmcache_remote.urls import RemoteURL, parse_remote_url

T = TypeVar("T")
RemoteClient = redis.Redis | RedisCluster
"""What `make_client` returns: one server (or a Sentinel-managed master), or a cluster."""
SSL_QUERY_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


def split_ssl_params(url: str) -> tuple[str, dict[str, str]]:
    """The URL without its `ssl_*` query parameters, and those parameters."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    ssl = {k: v for k, v in query if k in SSL_QUERY_PARAMS}
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k not in SSL_QUERY_PARAMS])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), ssl


def client_kwargs(config: CacheConfig) -> dict[str, Any]:
    """redis-py keyword arguments that bound every call by `remote_timeout`, retries off."""
    return {
        "socket_timeout": config.remote_timeout,
        "socket_connect_timeout": config.remote_timeout,
        "retry": Retry(NoBackoff(), 0),
        "retry_on_timeout": False,
        "health_check_interval": 0,
        "socket_keepalive": True,
    }


def make_client(config: CacheConfig, url: str | None = None) -> RemoteClient:
    """A redis-py client for `url` (default: the config's), TLS options from config or URL.

    The URL's form picks the kind (lmcache_remote.urls): one server gives a `redis.Redis`,
    `redis+cluster://` a `RedisCluster`, `redis+sentinel://` a `redis.Redis` on the master that
    Sentinel names (it follows fail-overs). All use the same bounded timeouts, retries off.
    """
    url = url if url is not None else config.remote_url
    if url is None:
        raise ConfigError("remote_url", "no remote URL configured")
    parsed = parse_remote_url(url)
    if parsed.kind == "cluster":
        return _cluster_client(config, parsed)
    if parsed.kind == "sentinel":
        return _sentinel_client(config, parsed)
    clean, ssl_params = split_ssl_params(url)
    kwargs = client_kwargs(config)
    if clean.startswith("rediss://"):
        kwargs.update(
            ssl_ca_certs=config.ssl_ca_certs,
            ssl_certfile=config.ssl_certfile,
            ssl_keyfile=config.ssl_keyfile,
            ssl_cert_reqs=config.ssl_cert_reqs,
        )
        kwargs.update(ssl_params)
    elif ssl_params:
        raise ConfigError("remote_url", "ssl_* parameters need a rediss:// URL")
    try:
        return redis.Redis.from_url(clean, **kwargs)
    except ValueError as exc:
        raise ConfigError("remote_url", f"{mask_url(url)}: {exc}") from None


def _tls_kwargs(config: CacheConfig, parsed: RemoteURL) -> dict[str, Any]:
    """TLS options for a `rediss+...` URL (config, then URL query), or {} without TLS."""
    if not parsed.tls:
        return {}
    kwargs: dict[str, Any] = {
        "ssl": True,
        "ssl_ca_certs": config.ssl_ca_certs,
        "ssl_certfile": config.ssl_certfile,
        "ssl_keyfile": config.ssl_keyfile,
        "ssl_cert_reqs": config.ssl_cert_reqs,
    }
    kwargs.update(parsed.ssl_params)
    return kwargs


def _cluster_client(config: CacheConfig, parsed: RemoteURL) -> RedisCluster:
    """A RedisCluster on the seed nodes, as bounded as the single-node client.

    redis-py's cluster-level retries are off (`retry` with 0 retries: a down shard costs one
    refused connect, not ten back-offs); redirects (MOVED/ASK) are still followed, and a
    MOVED or a connection error refreshes the slot table. `require_full_coverage=False`: a
    cluster with a shard down still serves the other shards' slots.
    """
    kwargs = client_kwargs(config)
    for name in ("retry", "health_check_interval", "retry_on_timeout"):  # not per node
        del kwargs[name]
    kwargs.update(_tls_kwargs(config, parsed))
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in parsed.nodes],
            username=parsed.username,
            password=parsed.password,
            retry=Retry(NoBackoff(), 0),
            require_full_coverage=False,
            **kwargs,
        )
    except (redis.RedisError, OSError) as exc:
        raise translate(exc, "redis cluster") from exc


def _sentinel_client(config: CacheConfig, parsed: RemoteURL) -> redis.Redis:
    """The master of `parsed.service`, through Sentinel; it re-asks Sentinel after a failure.

    The sentinels get the same bounded timeouts and no retries; a fail-over is followed on
    the next connection (and a demoted master's READONLY answer drops the connection).
    """
    assert parsed.service is not None  # the parser guarantees it for a sentinel URL
    sentinel_kwargs = client_kwargs(config)
    del sentinel_kwargs["retry_on_timeout"]  # deprecated on redis.Redis; timeouts never retry
    sentinel_kwargs.update(
        username=parsed.param("sentinel_username"),
        password=parsed.param("sentinel_password"),
    )
    sentinel = Sentinel(list(parsed.nodes), sentinel_kwargs=sentinel_kwargs)
    master_kwargs = client_kwargs(config)
    master_kwargs.update(_tls_kwargs(config, parsed))
    return sentinel.master_for(
        parsed.service,
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        **master_kwargs,
    )


def translate(exc: BaseException, where: str = "redis") -> BackendError:
    """The library error for a redis-py (or socket) exception; no password in the message."""
    text = mask_url(str(exc))
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, MasterNotFoundError):  # redis-py appends every sentinel client's repr
        return BackendUnavailableError(f"{where}: unavailable ({text.split(' : ')[0]})")
    if isinstance(exc, (redis.TimeoutError, TimeoutError)):
        return BackendTimeoutError(f"{where}: timed out ({text})")
    if isinstance(exc, (redis.AuthenticationError, NoPermissionError)) or (
        isinstance(exc, redis.ResponseError) and text.startswith(("NOPERM", "NOAUTH", "WRONGPASS"))
    ):
        return BackendPermissionError(f"{where}: permission denied ({text})")
    if isinstance(exc, (redis.ConnectionError, OSError)):
        return BackendUnavailableError(f"{where}: unavailable ({text})")
    return BackendError(f"{where}: {type(exc).__name__}: {text}")


_FAILURES = (redis.RedisError, OSError)
_DOWN_ANSWERS = (ClusterDownError, TryAgainError)


class RemoteCaller:
    """Runs remote operations under the retry policy and a health gate."""

    def __init__(self, timeout: float, gate: HealthGate, where: str = "redis") -> None:
        self.timeout = timeout
        self.gate = gate
        self.where = where

    def call(self, op: Callable[[], T]) -> T:
        if not self.gate.allow():
            why = "the tier is closed" if self.gate.closed else "skipped while unhealthy " \
                "(backing off)"
            raise BackendUnavailableError(f"{self.where}: {why}")
        start = time.monotonic()
        try:
            with call_deadline(self.timeout):  # the whole call, however slow the link
                result = self._with_retry(op, start)
        except redis.ResponseError as exc:
            # The server answered (OOM under noeviction, NOPERM, ...): it is alive, so reads
            # must go on; only a cluster that reports itself down counts against its health.
            if isinstance(exc, _DOWN_ANSWERS):
                self.gate.failure()
            else:
                self.gate.success()
            raise translate(exc, self.where) from exc
        except _FAILURES as exc:
            self.gate.failure()
            raise translate(exc, self.where) from exc
        except Exception as exc:  # a reply the client could not handle: never past storage
            self.gate.failure()
            raise BackendError(
                f"{self.where}: unexpected {type(exc).__name__}: {mask_url(str(exc))}"
            ) from exc
        except BaseException:  # KeyboardInterrupt: still end a probe, or the gate stays shut
            self.gate.failure()
            raise
        self.gate.success()
        return result

    def _with_retry(self, op: Callable[[], T], start: float) -> T:
        try:
            return op()
        except redis.TimeoutError:
            raise
        except redis.ConnectionError:
            if time.monotonic() - start > self.timeout / 2 or self.gate.closed:
                raise  # too late, or the tier is closing (its connections were cut)
            return op()


def sockets_in_use(client: Any) -> list[socket.socket]:
    """The sockets of the connections of `client`'s pool that some thread holds now (every
    connection of a `BlockingConnectionPool`, which does not keep the two apart)."""
    pool = getattr(client, "connection_pool", None)
    in_use = getattr(pool, "_in_use_connections", None)
    if in_use is None:
        in_use = getattr(pool, "_connections", None) or ()
    return [sock for conn in list(in_use)
            if (sock := getattr(conn, "_sock", None)) is not None]


def shut_down_in_use(client: Any) -> None:
    """Shuts down (`socket.shutdown`, not close) every socket of `sockets_in_use`: a send or
    receive blocked on it returns at once, and its descriptor cannot be reused meanwhile."""
    for sock in sockets_in_use(client):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
