"""The engine with Redis down, hung, and back: nothing raises, nothing hangs, hits come back."""

from __future__ import annotations

import time

import torch
from kvutil import engine, reference_keys, tokens, view
from servers import RedisServer

from lmcache_remote.storage import redis_tier


def test_starts_and_serves_while_redis_is_down_then_reconnects(private_redis: RedisServer,
                                                                key_prefix: str) -> None:
    url = private_redis.url
    private_redis.stop()
    toks = tokens(1024)
    src, read_src = view("kv_split", torch.bfloat16, 1024, seed=1)
    with engine(url, key_prefix, remote_timeout=0.5, unhealthy_backoff=0.2) as e:
        t0 = time.monotonic()
        assert e.store(toks, src) == 1024  # held by the local tier
        assert e.lookup(toks) == 1024
        dst, read_dst = view("packed", torch.bfloat16, 1024, seed=None)
        assert bool(e.retrieve(toks, dst).all())
        assert torch.equal(read_dst(0, 1024), read_src(0, 1024))
        assert e.flush() is True
        assert time.monotonic() - t0 < 3 * 0.5
        stats = e.stats()
        assert stats["remote"]["errors"] >= 1 and stats["remote"]["dropped_chunks"] >= 4
        assert stats["remote"]["healthy"] is False

        private_redis.start()  # same port
        time.sleep(0.3)  # past the back-off
        more = tokens(512, seed=7)
        src2, _ = view("kv_split", torch.bfloat16, 512, seed=2)
        deadline = time.monotonic() + 5
        while e.store(more, src2) and time.monotonic() < deadline:
            e.flush()
            if e.stats()["remote"].get("written_chunks", 0) >= 2:
                break
            time.sleep(0.2)
        assert e.stats()["remote"]["written_chunks"] >= 2
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
                unhealthy_backoff=5.0) as e:
        assert e.store(toks, src) == 512
        assert e.flush() is True
        private_redis.pause()
        try:
            t0 = time.monotonic()
            assert e.lookup(toks) == 0
            first = time.monotonic() - t0
            t0 = time.monotonic()
            for _ in range(100):
                assert e.lookup(toks) == 0
            burst = time.monotonic() - t0
        finally:
            private_redis.resume()
        assert first < 0.5 + 0.5
        assert burst < 0.5  # skipped at once while backing off


def test_a_failing_later_window_frees_every_buffer_of_the_retrieve(
    redis_url: str, redis_client, key_prefix: str, monkeypatch  # type: ignore[no-untyped-def]
) -> None:
    """A retrieve whose Redis reads fail after earlier windows arrived (here a value of the
    wrong type under a later chunk's key: the server answers WRONGTYPE) misses cleanly and
    gives every buffer back to the pool, over and over."""
    monkeypatch.setattr(redis_tier, "_WINDOW_BYTES", 1)  # one chunk per window
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
