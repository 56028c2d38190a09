"""The redis-py releases the project declares (`redis>=5.0`) drive the bulk path, and a bulk
path that cannot talk to Redis fails the start-up check loudly.

redis-py before 5.3 requires `ConnectionPool.get_connection(command_name, ...)`; the bulk
path called it without one, so with redis-py 5.0.8 every chunk command raised TypeError while
the access check (plain redis-py) passed, and the cache was silently off. The test command
runs the storage and engine tests again with redis-py 5.0.8 installed (scripts/test.sh,
`ensure_oldest_redis`). Here, with the project's redis-py, the bulk path's pool is wrapped in
one with the old signature (a stub of the client library, not of Redis).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from faultkit import check_retrieve, det_kv, sentinel_kv
from kvutil import engine

from lmcache_remote import CacheEngine
from lmcache_remote.errors import BackendError
from lmcache_remote.storage.wire import bulk as wire


class OldPool:
    """A connection pool whose `get_connection` wants a command name, as in redis-py < 5.3."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def get_connection(self, command_name: str, *keys: Any, **options: Any) -> Any:
        return self._pool.get_connection(*wire._connection_args(self._pool))

    def release(self, conn: Any) -> None:
        self._pool.release(conn)


def _old_pool(e: CacheEngine, args: tuple[str, ...] | None = None) -> None:
    bulk = e.storage.remote.wire
    bulk.pool = OldPool(bulk.pool)
    bulk._connection_args = wire._connection_args(bulk.pool) if args is None else args


def test_the_bulk_path_asks_an_old_pool_as_it_wants(redis_url: str, key_prefix: str) -> None:
    with engine(redis_url, key_prefix, store_async=False, local_cpu=False) as e:
        _old_pool(e)
        e.check_remote()
        toks = list(range(512))
        assert e.store(toks, det_kv(toks)) == 512
        dst, read = sentinel_kv(512)
        assert check_retrieve(e.retrieve(toks, dst), toks, read) == 512


def test_a_bulk_path_that_cannot_talk_fails_the_start_up_check(
        redis_url: str, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    with engine(redis_url, key_prefix, local_cpu=False) as e:
        _old_pool(e, args=())  # the call before the fix
        with pytest.raises(BackendError, match="bulk path .* TypeError"):
            e.check_remote()
        e.storage.remote.gate.reset()  # the failure marked the tier unhealthy: start afresh
        with caplog.at_level(logging.ERROR, logger="lmcache_remote.engine"):
            e._check_remote_at_start()  # what the engine runs when it starts
        assert any("cannot use Redis" in r.getMessage() and "bulk path" in r.getMessage()
                   for r in caplog.records)
