"""Reads of the admin tools that leave Redis's LRU clock alone.

Every read command (GETRANGE, STRLEN, GET) refreshes a key's LRU clock; under `allkeys-lru`
an `ls`, `stats` or `export` would then make every chunk look just used, and `evict
--older-than` would match nothing. So the admin tools read through `ReadPipeline`: a pipeline
(one connection) that starts with `CLIENT NO-TOUCH ON` and ends with `CLIENT NO-TOUCH OFF`,
where the server has it (Redis 7.2 and newer, Valkey): then no read of the admin tools touches
a key. Where it does not (Redis 7.0 and 7.1: the command is refused, which is ignored), the
callers read `OBJECT IDLETIME` before anything else of a key, so what they report is the idle
time before their own reads; those reads still refresh the clock there (docs/cli.md says so).
`OBJECT IDLETIME`, `PTTL` and `MEMORY USAGE` never touch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ReadPipeline"]


class ReadPipeline:
    """A non-transactional pipeline of `node` bracketed by `CLIENT NO-TOUCH ON` / `OFF`.

    Queue commands on `pipe` (a redis-py pipeline); `execute(raise_on_error=True)` returns
    their replies alone, as redis-py's does (the first error raised, or errors as replies)."""

    def __init__(self, node: Any, key: str | bytes | None = None) -> None:
        """`node`: one server's client, or a cluster's with `key`: the client of the primary
        that holds `key` (and so every value of its chunk: one hash tag)."""
        from redis.cluster import RedisCluster

        if isinstance(node, RedisCluster):
            if key is None:
                raise ValueError("a cluster read needs the key that names its node")
            node = node.get_redis_connection(node.get_node_from_key(key))
        self.pipe = node.pipeline(transaction=False)
        self.pipe.execute_command("CLIENT", "NO-TOUCH", "ON")

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        self.pipe.execute_command("CLIENT", "NO-TOUCH", "OFF")
        replies = list(self.pipe.execute(raise_on_error=False))[1:-1]
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies
