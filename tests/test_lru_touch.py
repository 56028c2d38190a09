"""Redis's LRU sees what is used: chunks a lookup promises or the local tier serves are
refreshed with TOUCH (`storage.toucher`), so under `allkeys-lru` the hot prefixes stay.

A hot prefix lives in an engine's local tier: its retrieves never reach Redis, and a lookup's
EXISTS does not refresh a key. Written first and never read in Redis, it looked the coldest
and went first. Here the hot prefix and a cold set are written, both grow idle (polled, 2 s),
the engine serves the hot prefix from its local tier, then Redis is made to evict about 70% of
the old keys. With the refresh every hot chunk stays; without it (`remote_lru_touch: false`)
the hot chunks are as old as the cold ones and nearly all go (each one stays with a chance of
about 0.3: all eight staying is ~1e-4).

The switch itself: with it on, a chunk served from the local tier has its values' idle time
in Redis (OBJECT IDLETIME, which touches nothing) fall once the toucher sends; with it off the
tier has no toucher, no toucher thread starts, nothing is touched and the idle times only grow;
the vLLM scheduler's `PrefixLookup` touches nothing either.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis
from cliutil import chunk_keys
from faultkit import check_retrieve, det_kv, sentinel_kv
from kvutil import engine, metadata, tokens

from lmcache_remote import CacheConfig
from lmcache_remote.integrations.vllm_core import PrefixLookup

HOT, COLD1, COLD2 = 8 * 256, 200 * 256, 140 * 256


def _store(url: str, prefix: str, toks: list[int]) -> None:
    with engine(url, prefix, store_async=False, local_cpu=False,
                stats_publish_interval=None, keep_policy="redis") as e:
        assert e.store(toks, det_kv(toks)) == len(toks)


@pytest.mark.parametrize("touch", [True, False], ids=["refreshed", "not-refreshed"])
def test_hot_prefixes_served_locally_stay_in_redis(
        redis_factory: Any, key_prefix: str, touch: bool) -> None:
    server = redis_factory("--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10")
    client = redis.Redis.from_url(server.url)
    hot = tokens(HOT, seed=1)
    # keep_policy redis: the LRU refresh is what a server that evicts by itself needs
    with engine(server.url, key_prefix, store_async=False, max_local_cpu_size=0.25,
                stats_publish_interval=None, remote_lru_touch=touch, keep_policy="redis") as e:
        assert e.store(hot, det_kv(hot)) == HOT
        hot_keys = chunk_keys(client, key_prefix)
        _store(server.url, key_prefix, tokens(COLD1, seed=2))
        deadline = time.monotonic() + 60
        while min(int(client.object("idletime", k)) for k in hot_keys) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        dst, read = sentinel_kv(HOT)
        assert e.lookup(hot) == HOT
        assert check_retrieve(e.retrieve(hot, dst), hot, read) == HOT  # from the local tier
        assert e.stats()["local"].get("hit_tokens", 0) >= HOT
        if touch:
            e.storage.remote.toucher.flush()  # what its thread sends within a second
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used + (256 << 10))
        _store(server.url, key_prefix, tokens(COLD2, seed=3))
        assert int(client.info("stats")["evicted_keys"]) > 0
        left = client.exists(*hot_keys)
        if touch:
            assert e.stats()["remote"].get("touched_keys", 0) >= len(hot_keys)
            assert left == len(hot_keys)
        else:
            assert left < len(hot_keys)


def _idle(client: redis.Redis, keys: set[bytes]) -> dict[bytes, int]:
    return {k: int(client.object("idletime", k)) for k in keys}


def _toucher_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "lmcr-toucher"}


@pytest.mark.parametrize("touch", [True, False], ids=["on", "off"])
def test_remote_lru_touch_switch(private_redis: Any, key_prefix: str, touch: bool) -> None:
    client = redis.Redis.from_url(private_redis.url)
    hot = tokens(4 * 256, seed=4)
    threads = _toucher_threads()
    with engine(private_redis.url, key_prefix, store_async=False, max_local_cpu_size=0.25,
                stats_publish_interval=None, remote_lru_touch=touch) as e:
        assert e.store(hot, det_kv(hot)) == len(hot)
        keys = chunk_keys(client, key_prefix)
        assert len(keys) >= 4
        deadline = time.monotonic() + 60
        while min(_idle(client, keys).values()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        before = _idle(client, keys)
        dst, read = sentinel_kv(len(hot))
        assert e.lookup(hot) == len(hot)
        assert check_retrieve(e.retrieve(hot, dst), hot, read) == len(hot)
        assert e.stats()["local"].get("hit_tokens", 0) >= len(hot)  # Redis saw no GET
        remote = e.storage.remote
        if touch:
            remote.toucher.flush()  # what its thread sends within a second
            after = _idle(client, keys)
            assert all(after[k] < before[k] for k in keys), (before, after)
            assert e.stats()["remote"].get("touched_keys", 0) >= len(keys)
        else:
            assert remote.toucher is None
            assert _toucher_threads() == threads  # none started for this engine
            after = _idle(client, keys)
            assert all(after[k] >= before[k] for k in keys), (before, after)
            assert e.stats()["remote"].get("touched_keys", 0) == 0


def test_prefix_lookup_touches_nothing_when_switched_off(private_redis: Any,
                                                         key_prefix: str) -> None:
    toks = tokens(2 * 256, seed=5)
    _store(private_redis.url, key_prefix, toks)
    config = CacheConfig(remote_url=private_redis.url, key_prefix=key_prefix, chunk_size=256,
                         remote_timeout=1.0, stats_publish_interval=None, remote_lru_touch=False)
    meta = metadata()  # the engines' of kvutil: the same keys
    lookup = PrefixLookup(config, meta.layout, [meta.namespace])
    try:
        assert lookup._remote is not None and lookup._remote.toucher is None
        assert lookup(toks) == len(toks)
        assert lookup.metrics.counters().get("remote.touched_keys", 0) == 0
    finally:
        lookup.close()
