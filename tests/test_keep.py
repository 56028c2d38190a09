"""The keep policy against real servers (docs/keep.md): a flood past `maxmemory` leaves Redis
evicting nothing and every chunk whole, the lowest score goes first with children before
parents, admission learns to refuse what is never read again, several engines and a restart
share what was learned, pins and `store_after` keep working, on Redis 7, Valkey 9 and a
Cluster; and the server advice says what the policy needs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import yaml

from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata, PagedKV
from lmcache_remote.admin.private_server import RedisServer, ValkeyServer
from lmcache_remote.admin.server import REQUIRED_POLICY, keep_warnings
from lmcache_remote.config import GIB
from lmcache_remote.naming.keys import keep_key, scan_pattern, split_part_key
from lmcache_remote.storage.keep import book as keep_book
from lmcache_remote.storage.keep.book import KeepBook
from tests.cliutil import run, run_json
from tests.cluster_servers import ClusterServers

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64
#: 1 layer, 1 KV head of 128 in bfloat16: 512 bytes a token, 32 KiB a chunk, cut in two values
META = EngineMetadata("keep/model", 1, 0, torch.bfloat16, 1, 1, 128)
RAW = 32 * 1024
MAX_TOKENS = 16 * CHUNK


@pytest.fixture(scope="module")
def kv() -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    blocks = MAX_TOKENS // CHUNK
    cache = torch.randn(2, blocks, CHUNK, 1, 128, generator=gen).to(torch.bfloat16)
    return [cache], torch.arange(blocks * CHUNK, dtype=torch.int64)


def engine(url: str, prefix: str, **overrides: Any) -> CacheEngine:
    fields: dict[str, Any] = {"chunk_size": CHUNK, "remote_url": url, "key_prefix": prefix,
                              "local_cpu": False, "store_async": False,
                              "stats_publish_interval": None, "load_policy": "always",
                              "remote_timeout": 5.0}
    fields.update(overrides)
    return CacheEngine(CacheConfig(**fields), META)


def prompt(seed: int, chunks: int, head: list[int] | None = None) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(0, 50_000, (chunks * CHUNK,), generator=gen).tolist()
    return (head or []) + body


def book_of(e: CacheEngine) -> KeepBook:
    remote = e.storage.remote
    assert remote is not None and remote.keep is not None
    return remote.keep


def serve(e: CacheEngine, tokens: list[int], kv: tuple[list[torch.Tensor], torch.Tensor]
          ) -> int:
    """A request: its hit, then a store of its prompt."""
    hit = e.lookup(tokens)
    e.store(tokens, PagedKV(kv[0], kv[1][:len(tokens)]))
    return hit


def chunks_held(client: Any, prefix: str) -> dict[str, set[int]]:
    """Every chunk in Redis under ``prefix``: its value-0 key -> the part indexes there."""
    out: dict[str, set[int]] = {}
    for key in client.scan_iter(match=scan_pattern(prefix), count=1000):
        chunk, part = split_part_key(prefix, key)
        out.setdefault(chunk.redis_key(prefix), set()).add(part)
    return out


def assert_whole(client: Any, prefix: str) -> dict[str, set[int]]:
    held = chunks_held(client, prefix)
    broken = {k: parts for k, parts in held.items() if parts != {0, 1}}
    assert broken == {}, "a chunk lost a value alone (or kept one)"
    return held


def indexed(client: Any, prefix: str) -> set[str]:
    return {f"{prefix}:{m.decode()}" for m in client.zrange(keep_key(prefix, "index"), 0, -1)}


def fill_to(client: Any, chunks: int) -> int:
    """Sets `maxmemory` to the server's memory now plus about ``chunks`` chunks' worth (call
    it once the engine's connections are open: each holds buffers in the server's memory)."""
    used = int(client.info("memory")["used_memory"])
    limit = used + chunks * (RAW + 4096)
    client.config_set("maxmemory", limit)
    client.config_set("maxmemory-policy", REQUIRED_POLICY)
    client.config_resetstat()
    return limit


def test_the_geometry_cuts_chunks_in_two_values(kv: Any, redis_url: str,
                                                key_prefix: str) -> None:
    """The tests below rely on it: a chunk Redis evicted one value of would show."""
    with engine(redis_url, key_prefix) as e:
        serve(e, prompt(1, 1), kv)
        client = redis.Redis.from_url(redis_url)
        assert list(chunks_held(client, key_prefix).values()) == [{0, 1}]


@pytest.fixture(params=["redis", "valkey"])
def flood_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    cls = RedisServer if request.param == "redis" else ValkeyServer
    server = cls("--maxmemory-policy", REQUIRED_POLICY).start()
    try:
        yield server
    finally:
        server.stop()


def test_a_flood_past_maxmemory_is_dropped_whole_by_the_policy(
        flood_server: RedisServer, kv: Any) -> None:
    client = redis.Redis.from_url(flood_server.url)
    prefix = "flood"
    with engine(flood_server.url, prefix) as e:
        serve(e, prompt(999, 8), kv)  # every connection open
        limit = fill_to(client, 600)
        book_of(e).refresh()  # the server's memory now (an engine reads it twice a second)
        for i in range(900):  # 3,600 chunks, six times what fits
            serve(e, prompt(1000 + i, 4), kv)
        stats = e.stats()["keep"]
        book_of(e).flush()
    info = client.info()
    assert info["evicted_keys"] == 0, "Redis's own eviction ran"
    assert int(info["used_memory"]) <= limit
    held = assert_whole(client, prefix)
    assert len(held) >= 300, "the policy left most of the room unused"
    assert stats["evicted_chunks"] > 0
    assert indexed(client, prefix) == set(held), "a chunk held and not indexed, or the reverse"
    # what an operator sees: the policy's state, no warning on the server the cache needs
    shown = run_json("stats", "--url", flood_server.url, "--prefix", prefix)
    assert shown["keep"]["chunks"] == len(held) and shown["keep"]["ghosts"] > 0
    assert shown["warnings"] == [] and shown["redis"]["evicted_keys"] == 0


def _wait_server_ms(client: Any, ms: int) -> None:
    """Polls the server's clock until ``ms`` milliseconds passed (scores are server ms)."""
    def now() -> int:
        sec, usec = client.time()
        return int(sec) * 1000 + int(usec) // 1000

    start = now()
    deadline = start + 10_000
    while now() < start + ms:
        assert now() < deadline


def test_the_lowest_score_goes_first_children_before_parents(
        private_redis: RedisServer, kv: Any) -> None:
    client = redis.Redis.from_url(private_redis.url)
    cost = keep_book.chunk_cost(RAW, 2)
    prefix = "order"
    a, b, c = prompt(1, 3), prompt(2, 3), prompt(3, 2)
    with engine(private_redis.url, prefix, keep_budget=6.5 * cost / GIB) as e:
        serve(e, a, kv)
        serve(e, b, kv)
        _wait_server_ms(client, 20)
        assert e.lookup(a) == len(a)  # A read again: scored after B
        serve(e, c, kv)  # room for C: the two lowest scores go, B's last two chunks
        assert e.lookup(a) == len(a)
        assert e.lookup(c) == len(c)
        assert e.lookup(b) == CHUNK, "B's first chunk (a parent) outlives its children"
    held = assert_whole(client, prefix)
    assert len(held) == 6


def test_admission_learns_to_refuse_what_is_never_read_again(
        private_redis: RedisServer, kv: Any) -> None:
    prefix = "learn"
    cost = keep_book.chunk_cost(RAW, 2)
    system = prompt(7, 1)
    with engine(private_redis.url, prefix, keep_budget=12.5 * cost / GIB) as e:
        for i in range(120):  # one-shot prompts after a shared system prompt
            serve(e, prompt(2000 + i, 3, head=system), kv)
        book = book_of(e)
        book.flush()
        book.refresh()
        written = e.stats()["remote"]["written_chunks"]
        refused = e.stats()["keep"].get("refused_chunks", 0)
        room = max(0, int((book._target - book._held) // cost))  # what a full cache has left
        for i in range(20):
            assert serve(e, prompt(3000 + i, 3, head=system), kv) == CHUNK  # the system prompt
        stats = e.stats()
        assert stats["remote"]["written_chunks"] - written <= room, "a one-shot chunk written"
        assert stats["keep"]["refused_chunks"] >= refused + 20 * 3 - room
        # a prompt seen before (a ghost now) is of a class never seen refused: admitted
        again = prompt(2110, 3, head=system)  # evicted: one of the ghosts still remembered
        before = e.stats()["remote"]["written_chunks"]
        serve(e, again, kv)
        assert e.stats()["remote"]["written_chunks"] == before + 3


def test_engines_share_what_they_learn_and_a_restart_keeps_it(
        private_redis: RedisServer, kv: Any) -> None:
    client = redis.Redis.from_url(private_redis.url)
    prefix = "fleet"
    cost = keep_book.chunk_cost(RAW, 2)
    budget = {"keep_budget": 10.5 * cost / GIB}
    first = prompt(1, 4)
    with engine(private_redis.url, prefix, **budget) as one, \
            engine(private_redis.url, prefix, **budget) as two:
        serve(one, first, kv)
        for i in range(60):  # the other engine's flood evicts the first's chunks, whole
            serve(two, prompt(500 + i, 4), kv)
        book_of(two).flush()
        assert one.lookup(first) == 0
    figures = client.hgetall(keep_key(prefix, "figures"))
    accesses = sum(int(v) for k, v in figures.items() if k.startswith(b"n:"))
    assert accesses >= 61 * 4
    assert_whole(client, prefix)
    with engine(private_redis.url, prefix, **budget) as restarted:  # what was learned stays
        book = book_of(restarted)
        book.refresh()
        assert sum(book.figures.accesses.values()) == accesses
        serve(restarted, prompt(900, 4), kv)  # a one-shot class learned as such: refused
        assert restarted.stats()["keep"]["refused_chunks"] == 4


def test_pins_and_store_after_keep_working(private_redis: RedisServer, kv: Any) -> None:
    client = redis.Redis.from_url(private_redis.url)
    prefix = "pinned"
    cost = keep_book.chunk_cost(RAW, 2)
    pinned = prompt(1, 2)
    with engine(private_redis.url, prefix, keep_budget=6.5 * cost / GIB) as e:
        serve(e, pinned, kv)
        e.pin(pinned)
        for i in range(30):
            serve(e, prompt(100 + i, 3), kv)
        assert e.lookup(pinned) == len(pinned), "a pinned chunk was evicted"
        assert e.stats()["keep"]["pinned_kept_chunks"] >= 1
    assert_whole(client, prefix)
    with engine(private_redis.url, "after", store_after=2) as e:
        once = prompt(40, 2)
        serve(e, once, kv)
        assert e.lookup(once) == 0  # tried once: not written
        serve(e, once, kv)
        assert e.lookup(once) == len(once)


@pytest.fixture(scope="module")
def keep_cluster() -> Iterator[ClusterServers]:
    from tests.test_cluster import _start

    servers = _start(RedisServer)
    try:
        yield servers
    finally:
        servers.stop()


def test_a_cluster_drops_whole_chunks_under_its_primaries_memory(
        keep_cluster: ClusterServers, kv: Any) -> None:
    prefix = "kcluster"
    clients = [redis.Redis(host=n.host, port=n.port) for n in keep_cluster.masters]
    with engine(keep_cluster.url, prefix) as e:
        serve(e, prompt(3999, 8), kv)
        for c in clients:
            fill_to(c, 300)
        book_of(e).refresh()
        for i in range(675):
            serve(e, prompt(4000 + i, 4), kv)
        assert e.stats()["keep"]["evicted_chunks"] > 0
        book_of(e).flush()
    held: dict[str, set[int]] = {}
    for c in clients:
        assert c.info("stats")["evicted_keys"] == 0
        for key, parts in chunks_held(c, prefix).items():
            held.setdefault(key, set()).update(parts)
    assert held and all(parts == {0, 1} for parts in held.values())
    first = keep_cluster.masters[0]
    cluster = redis.RedisCluster(host=first.host, port=first.port)
    try:
        members = {f"{prefix}:{m.decode()}"
                   for m in cluster.zrange(keep_key(prefix, "index"), 0, -1)}
    finally:
        cluster.close()
    assert members == set(held)


def test_stats_warns_on_its_own_line_when_the_server_defeats_the_policy(
        redis_factory: Callable[..., RedisServer]) -> None:
    lru = redis_factory("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    result = run("stats", "--url", lru.url)
    assert result.exit_code == 0
    lines = [line for line in result.stderr.splitlines() if "keep policy" in line]
    assert lines and lines[0].startswith("warning:") and REQUIRED_POLICY in result.stderr
    assert "warning" not in result.stdout  # the table alone on stdout
    unbounded = redis_factory("--maxmemory-policy", REQUIRED_POLICY)  # no maxmemory
    assert any("no budget" in w for w in run_json("stats", "--url", unbounded.url)["warnings"])


def test_the_server_advice_is_stated_once_and_followed() -> None:
    assert keep_warnings("allkeys-lru", 1 << 30, "learned", None)
    assert keep_warnings(REQUIRED_POLICY, 0, "learned", None)
    assert keep_warnings(REQUIRED_POLICY, 0, "learned", 1.0) == []
    assert keep_warnings(REQUIRED_POLICY, 1 << 30, "learned", None) == []
    assert keep_warnings("allkeys-lru", 0, "redis", None) == []
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    text = yaml.safe_dump(compose)
    assert f"--maxmemory-policy\n    - {REQUIRED_POLICY}" in text or REQUIRED_POLICY in text
    assert "allkeys-" not in (ROOT / "docker-compose.yml").read_text()
    assert f"maxmemory-policy {REQUIRED_POLICY}" in (ROOT / "docs" / "deploy.md").read_text()
    assert math.isclose(CacheConfig().keep_fill, 0.95)
    assert CacheConfig().keep_policy == "learned"
