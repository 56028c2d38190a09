"""The engine with Redis down, hung, and back: nothing raises, nothing hangs, hits come back."""

from __future__ import annotations

import torch
from faultkit import bound, timed, wait_for
from kvutil import engine, reference_keys, tokens, view
from servers import RedisServer, unread_bytes

from lmcache_remote.storage.wire import windows as wire_windows


def test_starts_and_serves_while_redis_is_down_then_reconnects(private_redis: RedisServer,
                                                                key_prefix: str) -> None:
    url = private_redis.url
    private_redis.stop()
    toks = tokens(1024)
    src, read_src = view("kv_split", torch.bfloat16, 1024, seed=1)
    with engine(url, key_prefix, remote_timeout=0.5, unhealthy_backoff=0.2) as e:
        accepted, took = timed(lambda: e.store(toks, src))
        assert accepted == 1024 and took < bound(1, 0.5)  # held by the local tier
        assert e.lookup(toks) == 1024
        dst, read_dst = view("packed", torch.bfloat16, 1024, seed=None)
        hit, took = timed(lambda: e.retrieve(toks, dst))
        assert bool(hit.all()) and took < bound(1, 0.5)
        assert torch.equal(read_dst(0, 1024), read_src(0, 1024))
        flushed, took = timed(e.flush)
        assert flushed is True and took < bound(2, 0.5)
        stats = e.stats()
        assert stats["remote"]["errors"] >= 1 and stats["remote"]["dropped_chunks"] >= 4
        assert stats["remote"]["healthy"] is False

        private_redis.start()  # same port
        more = tokens(512, seed=7)
        src2, _ = view("kv_split", torch.bfloat16, 512, seed=2)

        def written_again() -> bool:  # stores go on; once the back-off ends they reach Redis
            e.store(more, src2)
            e.flush()
            return int(e.stats()["remote"].get("written_chunks", 0)) >= 2

        assert wait_for(written_again, poll=0.2)
        assert e.stats()["remote"]["healthy"] is True
    with engine(url, key_prefix, local_cpu=False) as fresh:
        assert fresh.lookup(more) == 512


def test_store_to_dead_redis_without_local_tier_accepts_nothing(private_redis: RedisServer,
                                                                 key_prefix: str) -> None:
    url = private_redis.url
    private_redis.kill()
    src, _ = view("kv_split", torch.bfloat16, 512, seed=1)
    with engine(url, key_prefix, local_cpu=False, remote_timeout=0.5) as e:
        assert e.store(tokens(512), src) == 0
        assert e.lookup(tokens(512)) == 0
        dst, _ = view("kv_split", torch.bfloat16, 512, seed=None)
        assert not e.retrieve(tokens(512), dst).any()


def test_hung_redis_costs_one_timeout_then_is_skipped(private_redis: RedisServer,
                                                      key_prefix: str) -> None:
    toks = tokens(512)
    src, _ = view("kv_split", torch.bfloat16, 512, seed=1)
    with engine(private_redis.url, key_prefix, local_cpu=False, remote_timeout=0.5,
                unhealthy_backoff=30.0, stats_publish_interval=None) as e:
        assert e.store(toks, src) == 512
        assert e.flush() is True
        private_redis.pause()
        try:
            found, first = timed(lambda: e.lookup(toks))
            assert found == 0 and first < bound(1, 0.5)  # one timeout
            sent = unread_bytes(private_redis.port)
            assert sent > 0  # that lookup reached the server
            for _ in range(100):
                assert e.lookup(toks) == 0
            # skipped at once while backing off: not one byte more reached the server
            assert unread_bytes(private_redis.port) == sent
        finally:
            private_redis.resume()


def test_a_failing_later_window_frees_every_buffer_of_the_retrieve(
    redis_url: str, redis_client, key_prefix: str, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    """A retrieve whose Redis reads fail after earlier windows arrived (here a value of the
    wrong type under a later chunk's key: the server answers WRONGTYPE) misses cleanly and
    gives every buffer back to the pool, over and over."""
    monkeypatch.setattr(wire_windows, "WINDOW_BYTES", 1)  # one chunk per window
    n = 6 * 256
    src, _ = view("kv_split", torch.bfloat16, n, seed=3)
    with engine(redis_url, key_prefix, local_cpu=False, store_async=False) as e:
        assert e.store(tokens(n), src) == n
        bad = reference_keys(tokens(n), key_prefix)[4]
        redis_client.unlink(bad, f"{bad}#1")
        redis_client.rpush(bad, b"not a chunk")
        for _ in range(3):
            dst, _ = view("kv_split", torch.bfloat16, n, seed=None)
            hit = e.retrieve(tokens(n), dst)
            assert int(hit.sum()) in (0, 4 * 256)  # nothing, or the chunks before the bad one
            assert e.stats()["pool"]["used_bytes"] == 0
