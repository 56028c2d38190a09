"""Access check: may the configured Redis user do what the cache needs, under its prefix?

A Redis ACL user that lacks a command or a key pattern makes every store a dropped write and
every retrieve a miss; counted, but easy to mistake for a cold cache. `check_access(config)`
tells at once: on a connection of its own (never the engine's health gate), bounded by
`remote_timeout`, it sends one pipeline: PING, then MSET, SET PX, EVAL (write with expiry),
EXISTS, GET, GETRANGE and UNLINK on a probe key under the prefix (`keys.probe_key`, written
and deleted in the same round trip, with a 10 s expiry in case the UNLINK never runs), and
TOUCH when `remote_lru_touch` is on (a refused TOUCH is returned, not raised: the engine then
turns its LRU refresh off with a WARNING). It raises

- `BackendPermissionError` naming every refused command (or the failed login), with the
  redis-py message (never the password);
- `BackendUnavailableError` / `BackendTimeoutError` when Redis cannot be reached in time;
- `BackendError` for any other error answer.

`ENGINE_COMMANDS` and `ADMIN_COMMANDS` are the commands the engine and the CLI use; an ACL
user for the cache needs them on `~{prefix}:*` (docs/reliability.md has a ready `ACL SETUSER`).
"""

from __future__ import annotations

import uuid
from typing import Any

import redis
from redis.cluster import RedisCluster

from lmcache_remote.config import CacheConfig, mask_url
from lmcache_remote.errors import BackendError, BackendPermissionError, BackendUnavailableError
from lmcache_remote.naming.keys import probe_key
from lmcache_remote.storage.session.client import make_client, translate
from lmcache_remote.storage.wire.commands import chunk_write_command

#: Commands the engine sends (chunks: EXISTS GET SET MSET UNLINK, GETRANGE of the header of a
#: chunk cut into other parts than planned; a multi-part chunk with `remote_ttl`: MULTI, MSET,
#: PEXPIRE per value, EXEC on a single server, on a cluster EVAL of a script that SETs each
#: value with PX; admission counts (`store_after`): EVAL of a script that runs EXISTS, INCR,
#: PEXPIRE; pins (`storage.pins`): EVAL of scripts over the registry hash (HGET HSET HDEL
#: HGETALL), PERSIST and PEXPIRE of the chunks' values; fleet stats: HSET EXPIRE; the keep
#: policy (`storage.keep`): HMGET HGET HGETALL HSET of its hashes, EVAL of its scripts (ZADD
#: ZREM ZSCORE ZCARD ZPOPMIN HINCRBY HDEL TIME, and PTTL UNLINK of a dropped chunk's values),
#: INFO for its budget; the access check: PING).
ENGINE_COMMANDS = ("ping", "exists", "get", "getrange", "set", "mset", "eval", "unlink", "hset",
                   "expire", "touch", "multi", "exec", "pexpire", "incr", "persist", "hget",
                   "hdel", "hgetall", "hmget", "hincrby", "zadd", "zrem", "zscore", "zcard",
                   "zpopmin", "time", "pttl", "info")
#: Commands the CLI adds (listing, inspecting, exporting, stats, eviction).
ADMIN_COMMANDS = ("scan", "strlen", "object|idletime", "pttl", "mget", "hgetall", "info",
                  "zcard")
#: What the CLI's reads add where the server has it (Redis 7.2 and newer, Valkey; Redis 7.0
#: refuses it in ACL SETUSER): `CLIENT NO-TOUCH`, so that listing, stats and export leave the
#: keys' LRU clocks alone (admin.notouch). Without the right they touch them, as on Redis 7.0.
ADMIN_NO_TOUCH = ("client|no-touch",)
_PROBE_TTL_MS = 10_000
_PROBE = ("mset", "set", "eval", "pexpire", "exists", "get", "getrange", "unlink")
#: Probed last on a single server, where a multi-part chunk with an expiry is a transaction.
_TRANSACTION = ("multi", "exec")
#: Probed after `_PROBE` when the config uses them; refused, they turn a feature off.
_OPTIONAL = ("touch",)


def check_access(config: CacheConfig) -> list[str]:
    """Raise a `BackendError` subclass unless Redis lets this client use the cache; see above.
    Returns the optional commands Redis refused (`TOUCH`, probed when `remote_lru_touch` is
    on: the cache works without it, only the LRU refresh does not); the caller turns off
    what needs them and says so."""
    where = "redis"
    client = None
    try:
        key = probe_key(config.key_prefix, uuid.uuid4().hex)
        try:
            client = make_client(config)  # a cluster client connects here
            client.ping()
            results = _probe(client, key, touch=config.remote_lru_touch)
        except BackendError:
            raise
        except (redis.RedisError, OSError) as exc:
            raise translate(exc, where) from exc
        except Exception as exc:  # redis-py's cluster errors are no RedisError
            raise BackendUnavailableError(
                f"{where}: {type(exc).__name__}: {mask_url(str(exc))}") from exc
        probed = _PROBE + (_TRANSACTION if _transactions(client) else ())
        optional = results[len(probed):]
        results = results[:len(probed)]
        refused = [(cmd, r) for cmd, r in zip(probed, results, strict=True)
                   if isinstance(r, Exception)]
        if refused and refused[-1][0] == "exec" and "multi" in dict(refused):
            refused.pop()  # EXEC without the MULTI it was refused
        if refused:
            names = ", ".join(cmd.upper() for cmd, _ in refused)
            first = translate(refused[0][1], where)
            cls = BackendPermissionError if isinstance(first, BackendPermissionError) \
                else BackendError
            raise cls(f"{where}: key prefix {config.key_prefix!r}: refused {names}: {first}")
        return [cmd for cmd, r in zip(_OPTIONAL, optional, strict=False)
                if isinstance(r, Exception)]
    finally:
        if client is not None:
            client.close()


def _transactions(client: Any) -> bool:
    """Whether this client's writes use MULTI/EXEC (a single server; a cluster's use EVAL)."""
    return not isinstance(client, RedisCluster)


def _probe(client: Any, key: str, touch: bool = False) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("MSET", key, b"lmcr-probe")  # .mset() is refused in cluster pipelines
    pipe.set(key, b"lmcr-probe", px=_PROBE_TTL_MS)
    pipe.execute_command(*chunk_write_command([key], [b"lmcr-probe"], _PROBE_TTL_MS, script=True))
    pipe.pexpire(key, _PROBE_TTL_MS)
    pipe.exists(key)
    pipe.get(key)
    pipe.getrange(key, 0, 79)
    pipe.unlink(key)
    if _transactions(client):
        pipe.execute_command("MULTI")  # an empty transaction: asks for the rights only
        pipe.execute_command("EXEC")
    if touch:
        pipe.touch(key)  # after the unlink: refreshes nothing, only asks for the right
    return list(pipe.execute(raise_on_error=False))
