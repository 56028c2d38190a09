"""Keep what pays (docs/pins.md): admission by `store_after`, pins Redis never evicts, a
request's retention, the pin budget, on real servers: Redis 7 (Debian's 7.0 here), Valkey 9
and a Redis Cluster, each flooded past its maxmemory under `volatile-lru`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import torch
from cluster_servers import ClusterServers
from conftest import _start
from kvutil import engine, reference_hashes, tokens, view

from lmcache_remote import CacheConfig
from lmcache_remote.admin import CacheAdmin, EntryFilter, PinRefused
from lmcache_remote.naming.keys import CacheEngineKey, pins_key
from lmcache_remote.storage.session.scan import scan_nodes
from tests.servers import RedisServer, ValkeyServer

N = 2560  # ten chunks of 256 tokens, 32 KiB each (8 parts of 4 KiB: every value is pinned)
PARTS = {"remote_part_size": 4096}
BF16 = torch.bfloat16


def _hashes(toks: list[int], salt: str | None = None) -> list[str]:
    """The hashes of the prompt's full chunks, in order (the spec's way, kvutil)."""
    return reference_hashes(toks, 256, salt)[:len(toks) // 256]


def _keys(prefix: str, toks: list[int], salt: str | None = None) -> list[str]:
    return [CacheEngineKey("test/model", 1, 0, "bfloat16", h).redis_key(prefix)
            for h in _hashes(toks, salt)]


def _client(url: str) -> Any:
    if url.startswith("redis+cluster://"):
        nodes = [redis.cluster.ClusterNode(*hp.split(":"))
                 for hp in url.removeprefix("redis+cluster://").split(",")]
        return redis.cluster.RedisCluster(startup_nodes=nodes)
    return redis.Redis.from_url(url)


def _value_keys(client: Any, key: str) -> list[str]:
    """A chunk's value keys that are in Redis now (the chunk key, then `#1`, ...)."""
    out = [key] if client.exists(key) else []
    i = 1
    while client.exists(f"{key}#{i}"):
        out.append(f"{key}#{i}")
        i += 1
    return out


def _evicted(client: Any) -> int:
    return sum(int(node.info("stats")["evicted_keys"]) for node in scan_nodes(client))


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterServers]:
    servers = ClusterServers(3, 0, RedisServer).start()
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(params=["redis", "valkey", "cluster"])
def any_url(request: pytest.FixtureRequest) -> str:
    """Redis 7 (the session's), Valkey 9 and a 3-node Redis Cluster."""
    if request.param == "cluster":
        return str(request.getfixturevalue("cluster").url)
    return str(request.getfixturevalue(f"{request.param}_server").url)


# -- admission ------------------------------------------------------------------------------


def test_store_after_two_writes_a_chunk_at_the_fleets_second_try(any_url: str,
                                                                 key_prefix: str) -> None:
    """Two engines share the count in Redis: the first try writes nothing to Redis or to the
    local tier (no lookup finds it), the second (another engine) writes it, and a third
    engine then reads it bit for bit."""
    toks = tokens(N, seed=3)
    kv, read = view("kv_split", BF16, N, seed=4)
    client = _client(any_url)
    common = dict(store_after=2, store_async=False, stats_publish_interval=None, **PARTS)
    with engine(any_url, key_prefix, **common) as first, \
            engine(any_url, key_prefix, **common) as second:
        assert first.store(toks, kv) == 0
        assert first.lookup(toks) == 0 and second.lookup(toks) == 0
        assert first.metrics.get("store.not_admitted_chunks") == N // 256
        chunk = CacheEngineKey("test/model", 1, 0, "bfloat16", _hashes(toks)[0])
        count_key = chunk.store_count_key(key_prefix)
        assert int(client.get(count_key)) == 1
        assert 0 < client.pttl(count_key) <= 24 * 3600 * 1000
        assert not any(client.exists(k) for k in _keys(key_prefix, toks))
        assert second.store(toks, kv) == N
        assert first.lookup(toks) == N
    with engine(any_url, key_prefix, **common) as third:
        out, read_out = view("kv_split", BF16, N, seed=None)
        assert bool(third.retrieve(toks, out).all())
        assert torch.equal(read_out(0, N), read(0, N))
    client.close()


def test_a_count_not_reached_in_its_window_starts_again(redis_url: str, key_prefix: str,
                                                        redis_client: redis.Redis) -> None:
    toks = tokens(512, seed=5)
    kv, _ = view("kv_split", BF16, 512, seed=6)
    with engine(redis_url, key_prefix, store_after=2, store_after_window=0.3,
                store_async=False, stats_publish_interval=None) as e:
        assert e.store(toks, kv) == 0
        count_key = CacheEngineKey("test/model", 1, 0, "bfloat16",
                                   _hashes(toks)[0]).store_count_key(key_prefix)
        deadline = time.monotonic() + 10
        while redis_client.exists(count_key):  # Redis expires the count
            assert time.monotonic() < deadline, "the count never expired"
            time.sleep(0.05)
        assert e.store(toks, kv) == 0  # a first try again
        assert e.lookup(toks) == 0
        assert e.store(toks, kv) == 512  # the second within the window
        assert e.lookup(toks) == 512


def test_without_redis_this_process_counts(key_prefix: str) -> None:
    toks = tokens(512, seed=7)
    kv, _ = view("kv_split", BF16, 512, seed=8)
    with engine(None, key_prefix, store_after=3) as e:
        assert e.store(toks, kv) == 0 and e.store(toks, kv) == 0
        assert e.lookup(toks) == 0
        assert e.store(toks, kv) == 512
        assert e.lookup(toks) == 512


# -- pins -----------------------------------------------------------------------------------


@pytest.fixture(params=["redis", "valkey", "cluster"])
def flooded_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A server (or a 3-node cluster) of its own at 16 MB per node, `volatile-lru`."""
    args = ("--maxmemory", "16mb", "--maxmemory-policy", "volatile-lru")
    if request.param == "cluster":
        servers = ClusterServers(3, 0, RedisServer, *args).start()
        try:
            yield servers.url
        finally:
            servers.stop()
        return
    server = _start(RedisServer if request.param == "redis" else ValkeyServer, *args)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.parametrize("keep", ["redis", "learned"])
def test_a_pinned_prefix_survives_a_flood_past_maxmemory(flooded_url: str, key_prefix: str,
                                                          keep: str) -> None:
    """A request pins its prefix (`store(..., retain=)`), another prefix is stored without a
    pin, then a flood of one-shot prompts writes three times maxmemory: Redis evicts (with
    `keep_policy: redis`) or the keep policy does, whole chunks, with Redis evicting nothing
    (`learned`); the unpinned prefix goes, the pinned prefix is all there and reads back bit
    for bit."""
    client = _client(flooded_url)
    nodes = len(scan_nodes(client))
    pinned, plain = tokens(N, seed=11), tokens(N, seed=12)
    kv, read = view("kv_split", BF16, N, seed=13)
    # 16 MB servers and parts of 4 KiB: each value's key and bookkeeping is a quarter of its
    # bytes, more than the default 5% headroom holds between two reads of the server's memory
    # (docs/keep.md: on a small server, lower keep_fill)
    common = dict(local_cpu=False, stats_publish_interval=None, keep_policy=keep,
                  keep_fill=0.8, **PARTS)
    with engine(flooded_url, key_prefix, **common) as e:
        assert e.store(pinned, kv, retain=3600) == N
        assert e.store(plain, kv) == N
        assert e.flush()
        assert e.metrics.get("pins.pinned_chunks") == N // 256
        for key in _keys(key_prefix, pinned):
            ttls = [client.pttl(k) for k in _value_keys(client, key)]
            assert len(ttls) > 2 and set(ttls) == {-1}, ttls  # every value, no expiry
        assert all(client.pttl(k) > 0 for k in _value_keys(client, _keys(key_prefix, plain)[0]))
        for i in range(160 * nodes):  # 10 chunks of 32 KiB each: 3x maxmemory
            e.store(tokens(N, seed=1000 + i), kv)
            if i % 40 == 39:
                assert e.flush()
        assert e.flush()
        policy_evicted = e.metrics.get("keep.evicted_chunks")
    if keep == "redis":
        assert _evicted(client) > 0
    else:
        assert policy_evicted > 0 and _evicted(client) == 0
    with engine(flooded_url, key_prefix, **common) as reader:
        assert reader.lookup(plain) < N  # the rest stays an LRU cache that evicts
        out, read_out = view("kv_split", BF16, N, seed=None)
        assert bool(reader.retrieve(pinned, out).all())
        assert torch.equal(read_out(0, N), read(0, N))
    client.close()


def test_operator_pins_by_filter_and_unpins(any_url: str, key_prefix: str) -> None:
    """`CacheAdmin.pin` by tokens and salt pins exactly that prompt's chunks (every value
    without expiry, the registry's bytes), `unpin` gives them `remote_ttl` back."""
    client = _client(any_url)
    salted, other = tokens(600, seed=21), tokens(600, seed=22)
    kv, _ = view("kv_split", BF16, 600, seed=23)
    with engine(any_url, key_prefix, store_async=False, stats_publish_interval=None,
                **PARTS) as e:
        assert e.store(salted, kv, cache_salt="tenant-a") == 512
        assert e.store(other, kv) == 512
    config = CacheConfig(remote_url=any_url, key_prefix=key_prefix)
    with CacheAdmin(config) as admin:
        flt = EntryFilter(chunk_hashes=frozenset(_hashes(salted, "tenant-a")))
        result = admin.pin(flt)
        assert result.matched == 2 and result.bytes == result.pinned_bytes > 2 * 32768
        pins = admin.pins()
        assert set(pins) == set(_keys(key_prefix, salted[:512], "tenant-a"))
        for key in pins:
            ttls = [client.pttl(k) for k in _value_keys(client, key)]
            assert len(ttls) > 2 and set(ttls) == {-1}, ttls
        assert all(client.pttl(k) > 0 for k in _keys(key_prefix, other[:512]))
        assert admin.stats()["pins"]["entries"] == 2
        assert admin.pin(flt).bytes == 0  # already pinned: nothing new
        gone = admin.unpin(EntryFilter(model_name="test/model"))
        assert gone.matched == 2 and gone.pinned_bytes == 0 and admin.pins() == {}
        for key in pins:
            assert all(client.pttl(k) > 0 for k in _value_keys(client, key))
    client.close()


def test_a_pin_past_the_budget_is_refused_whole(redis_url: str, key_prefix: str,
                                                redis_client: redis.Redis) -> None:
    toks = tokens(1024, seed=31)
    kv, _ = view("kv_split", BF16, 1024, seed=32)
    with engine(redis_url, key_prefix, store_async=False, stats_publish_interval=None) as e:
        e.store(toks, kv)
    budget = 3 * 33000 / 2**30  # three chunks of about 32 KiB fit, four do not
    with CacheAdmin(CacheConfig(remote_url=redis_url, key_prefix=key_prefix,
                                pin_budget=budget)) as admin:
        with pytest.raises(PinRefused, match="past the pin budget"):
            admin.pin(EntryFilter())
        assert admin.pins() == {}
        assert all(redis_client.pttl(k) > 0 for k in _keys(key_prefix, toks))
    with engine(redis_url, key_prefix, store_async=False, stats_publish_interval=None,
                pin_budget=budget) as e:
        e.pin(toks)  # a request's pin past the budget: counted, not raised
        assert e.metrics.get("pins.refused_chunks") == 4
        assert not redis_client.exists(pins_key(key_prefix)) or redis_client.hlen(
            pins_key(key_prefix)) <= 1


def test_a_requests_retention_ends_and_the_chunks_expire_again(
        redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    toks = tokens(512, seed=41)
    kv, _ = view("kv_split", BF16, 512, seed=42)
    with engine(redis_url, key_prefix, store_async=False, stats_publish_interval=None) as e:
        assert e.store(toks, kv, retain=60) == 512
        keys = _keys(key_prefix, toks)
        assert [redis_client.pttl(k) for k in keys] == [-1, -1]
        registry = e.storage.pins
        assert registry is not None
        ends = {p.until for p in registry.entries().values()}
        assert len(ends) == 1 and 50 < ends.pop() - time.time() <= 60
        assert registry.sweep(now=time.time() + 30) == 0  # not yet
        assert registry.sweep(now=time.time() + 61) == 2
        assert registry.entries() == {} and registry.pinned_bytes() == 0
        assert all(redis_client.pttl(k) > 0 for k in keys)


def test_a_request_cannot_hold_longer_than_max_retain_seconds(
        redis_url: str, key_prefix: str) -> None:
    toks = tokens(256, seed=51)
    kv, _ = view("kv_split", BF16, 256, seed=52)
    with engine(redis_url, key_prefix, store_async=False, stats_publish_interval=None,
                max_retain_seconds=10) as e:
        e.store(toks, kv, retain=3600)
        assert e.storage.pins is not None
        (pin,) = e.storage.pins.entries().values()
        assert pin.until is not None and pin.until - time.time() <= 10

