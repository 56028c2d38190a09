"""SCAN over every key of a deployment: the one place that knows where keys live.

`scan_batches(client, match, count)` is the only function in the project that issues SCAN.
Everything that lists keys (the admin API behind `lmcache-remote stats`, `ls`, `evict`,
`export`) goes through it, so that it works the same on:

- a single server (`redis.Redis`): one SCAN cursor over the server's database;
- a Redis Cluster (`redis.cluster.RedisCluster`): one SCAN cursor per **primary** node
  (`client.get_primaries()`), each node scanned to completion in turn. Replicas are skipped:
  they hold copies of the primaries' keys.

Promises:

- Streaming: keys come in lists of at most about `count` keys (what one SCAN call returns);
  memory stays constant however many keys the server holds.
- Every batch comes with the client of the node that returned it. Per-key commands on a batch
  (STRLEN, GETRANGE, UNLINK, ...) can be pipelined on that node client directly: on a cluster
  all values of one chunk share a hash slot, hence a node, so a chunk is never split between
  batches of different nodes.
- SCAN's own guarantees hold: a key present during the whole scan is returned at least once;
  a key added or removed meanwhile may or may not be; a key may (rarely, during a rehash) be
  returned twice. Deleting the keys of a batch while scanning is safe.
- redis-py exceptions are not translated here; callers wrap the iteration (see `translate`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis

DEFAULT_COUNT = 1000


def scan_nodes(client: Any) -> list[redis.Redis]:
    """The clients to scan: each primary of a cluster, or the single server's client."""
    from redis.cluster import RedisCluster  # light, but only needed here

    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


def scan_batches(
    client: Any, match: str, count: int = DEFAULT_COUNT
) -> Iterator[tuple[redis.Redis, list[bytes]]]:
    """(node client, keys) for every non-empty SCAN page matching `match`, node after node."""
    for node in scan_nodes(client):
        cursor = 0
        while True:
            cursor, keys = node.scan(cursor=cursor, match=match, count=count)
            cursor = int(cursor)
            if keys:
                yield node, [k if isinstance(k, bytes) else str(k).encode() for k in keys]
            if cursor == 0:
                break


def scan_keys(client: Any, match: str, count: int = DEFAULT_COUNT) -> Iterator[bytes]:
    """Every key matching `match` on the server or on every cluster primary, streamed."""
    for _node, keys in scan_batches(client, match, count):
        yield from keys
