"""A process opens no more Redis connections than docs/deploy.md's formula says
(`storage.session.connection_count`), counted by the server itself (`CLIENT LIST`) while every
write lane is busy and a retrieve runs over the read lanes.

The server's writes are paused (`CLIENT PAUSE WRITE`): each write lane then holds its
connection in a SET that waits, the stats publisher in its HSET, while reads (GET, EXISTS)
still run. Windows are made one chunk small (`WINDOW_BYTES` and `LANE_CHUNKS` patched), so
a store of nine small chunks fills every lane, as a store of a few hundred 1 MiB chunks does
(chunks of over 2 MiB take fewer lanes: `ChunkWrites.lanes_for`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
import torch
from kvutil import engine, tokens, view

from lmcache_remote import CacheConfig
from lmcache_remote.storage.chunks import writes as chunk_writes
from lmcache_remote.storage.session.connection_count import (
    ConnectionCount,
    engine_connections,
    fleet_connections,
    lookup_connections,
)
from lmcache_remote.storage.wire import windows as wire_windows
from tests.faultkit import wait_for
from tests.servers import RedisServer

CHUNK = 256
CHUNK_BYTES = 2 * 2 * 2 * 8 * 2 * CHUNK  # kvutil's geometry, bfloat16: 32 KiB
N = 9 * CHUNK  # one chunk per window: more windows than the 8 write lanes


@pytest.fixture(autouse=True)
def one_chunk_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of one chunk over every lane: `lanes_for` gives each lane's window one chunk
    (`LANE_CHUNKS` 1) and all 8 lanes (8 chunks fill `WINDOW_BYTES`)."""
    monkeypatch.setattr(chunk_writes, "LANE_CHUNKS", 1)
    monkeypatch.setattr(wire_windows, "WINDOW_BYTES", 8 * CHUNK_BYTES)


@pytest.fixture
def admin(private_redis: RedisServer) -> Iterator[redis.Redis]:
    client = private_redis.client()
    yield client
    client.execute_command("CLIENT", "UNPAUSE")
    client.close()


def others(admin: redis.Redis) -> int:
    """Connections to the server other than `admin`'s own."""
    me = admin.client_id()
    return sum(1 for c in admin.client_list() if int(c["id"]) != me)


def test_the_formula() -> None:
    cfg = CacheConfig()
    assert engine_connections(cfg).total == 8 + 4 + 1 + 1 + 1
    assert engine_connections(cfg, callers=3).describe() == (
        "17 (8 write lanes + 4 read lanes + toucher + publisher + 3 callers)")
    small = CacheConfig(remote_write_lanes=2, remote_read_lanes=1, remote_lru_touch=False,
                        stats_publish_interval=None)
    assert engine_connections(small).describe() == "4 (2 write lanes + 1 read lane + 1 caller)"
    assert lookup_connections(cfg).total == 1
    assert fleet_connections(cfg, engines=64, tensor_parallel=8) == 64 * (8 * 17 + 1)
    assert engine_connections(CacheConfig(remote_url=None)) == ConnectionCount()
    cluster = CacheConfig(remote_url="redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    assert engine_connections(cluster).write_lanes == 0  # a cluster's I/O runs on node threads
    assert engine_connections(cluster).node_threads > 0


@pytest.mark.parametrize("lanes", [(3, 2), (8, 4)], ids=["3w2r", "defaults"])
def test_no_more_connections_than_the_formula(private_redis: RedisServer, admin: redis.Redis,
                                              key_prefix: str, lanes: tuple[int, int]) -> None:
    writes, reads = lanes
    settings = {"remote_write_lanes": writes, "remote_read_lanes": reads,
                "local_cpu": False, "remote_timeout": 30.0, "stats_publish_interval": 0.2,
                "max_local_cpu_size": 0.5}
    with engine(private_redis.url, key_prefix, **settings) as e:
        bound = engine_connections(e.config, callers=1).total
        kv, _ = view("kv_split", torch.bfloat16, N, seed=1)
        stored = tokens(N)
        assert e.store(stored, kv) == N
        assert e.flush(30.0)
        assert others(admin) <= bound

        admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        other_tokens = tokens(N, seed=1)
        assert e.store(other_tokens, kv) == N  # queued: the write-behind thread takes it
        # every write lane blocks in its SET on a connection of its own
        assert wait_for(lambda: others(admin) >= writes, limit=30)

        seen: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                seen.append(others(admin))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            out, _ = view("kv_split", torch.bfloat16, N, seed=None)
            hit = e.retrieve(stored, out)  # reads run under a write pause, over the read lanes
        finally:
            done.set()
            sampler.join()
        assert int(hit.sum()) == N
        held = others(admin)
        # the read needed connections beyond the write lanes' (all held), never more than
        # the formula's
        assert writes + 1 <= held <= bound
        assert max(seen, default=0) <= bound
        admin.execute_command("CLIENT", "UNPAUSE")
        assert e.flush(30.0)
        assert others(admin) <= bound
    assert wait_for(lambda: others(admin) == 0, limit=30)  # closing closes every one
