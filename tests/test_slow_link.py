"""`remote_timeout` bounds a whole call on a link that is slow rather than dead.

Through `throttle.Throttle` (replies forwarded at a set rate), a retrieve of 8 MiB with
`remote_timeout` 1 s took 10.9 s at about 1.6 MB/s before: the timeout was per system call,
and each of the many small waits was well inside it. Now each call ends within
`remote_timeout` plus `MARGIN` (the documented margin: time spent outside the waits, such as
decoding and Python's own work; docs/reliability.md), and what did not arrive is a miss, never
wrong KV. Elapsed time is the property under test here; the margin is generous next to the
failure it guards against (ten times the timeout).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from throttle import Throttle

from lmcache_remote import CacheConfig, CacheEngine, DenseKV, EngineMetadata

TIMEOUT = 1.0
MARGIN = 0.5
#: 4 layers x (K, V) x 256 tokens x 8 heads x 64 x bfloat16 = 2 MiB a chunk; 4 chunks
META = EngineMetadata("slow/model", 1, 0, torch.bfloat16, 4, 8, 64)
TOKENS = list(range(1024))


def _kv(fill: float | None) -> DenseKV:
    gen = torch.Generator().manual_seed(3)
    def make() -> torch.Tensor:
        if fill is None:
            return torch.randn(1, 8, len(TOKENS), 64, generator=gen).to(torch.bfloat16)
        return torch.full((1, 8, len(TOKENS), 64), fill, dtype=torch.bfloat16)
    return DenseKV([make() for _ in range(4)], [make() for _ in range(4)])


def _engine(url: str, prefix: str) -> CacheEngine:
    # `always`: these cases show the deadlines on a slow link, which the load decision
    # would otherwise stop meeting after the first slow read (tests/test_load_decision.py)
    return CacheEngine(CacheConfig(remote_url=url, key_prefix=prefix, local_cpu=False,
                                   remote_timeout=TIMEOUT, store_async=False,
                                   stats_publish_interval=None, load_policy="always"), META)


@pytest.mark.parametrize("rate", [300 * 1024, 1_600_000, 50_000_000])
def test_every_call_ends_within_the_timeout_on_a_slow_link(
        private_redis: Any, key_prefix: str, rate: float) -> None:
    stored = _kv(None)
    with _engine(private_redis.url, key_prefix) as writer:
        assert writer.store(TOKENS, stored) == len(TOKENS)
    proxy = Throttle(private_redis.port, rate)
    try:
        with _engine(proxy.url, key_prefix) as reader:
            start = time.monotonic()
            promised = reader.lookup(TOKENS)
            assert time.monotonic() - start <= TIMEOUT + MARGIN
            dst = _kv(-1.0)
            start = time.monotonic()
            hit = reader.retrieve(TOKENS, dst)
            elapsed = time.monotonic() - start
            assert elapsed <= TIMEOUT + MARGIN, elapsed
            n = int(hit.sum())
            assert bool(hit[:n].all()) and not bool(hit[n:].any())  # a prefix, or nothing
            for got, want in zip(dst._keys + dst._values, stored._keys + stored._values,
                                 strict=True):
                assert torch.equal(got[:, :n], want[:, :n])  # what came is exact
                assert bool((got[:, n:] == -1.0).all())  # the rest untouched: a miss
            if rate >= 50_000_000:  # 8 MiB in a fraction of the timeout: all of it
                assert promised == n == len(TOKENS)
    finally:
        proxy.close()


def test_a_keyed_read_in_runs_ends_within_the_timeout_on_a_slow_link(
        private_redis: Any, key_prefix: str, tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read with an `integrity_key` comes in runs, each received on a receiver thread while
    the one before is checked (`chunks.reads.VERIFY_RUN_BYTES`, one chunk a run here): on a
    link slow enough that the deadline falls in the middle of a run, the call still ends within
    the timeout, serves only exact tokens, and leaves no chunk buffer held."""
    import threading

    from lmcache_remote.storage.chunks import reads as remote_reads

    monkeypatch.setattr(remote_reads, "VERIFY_RUN_BYTES", 1)
    key = tmp_path / "integrity.key"
    key.write_bytes(b"5e" * 32)
    key.chmod(0o600)

    def keyed(url: str) -> CacheEngine:
        return CacheEngine(CacheConfig(remote_url=url, key_prefix=key_prefix, local_cpu=False,
                                       remote_timeout=TIMEOUT, store_async=False,
                                       stats_publish_interval=None, remote_read_lanes=1,
                                       integrity_key=f"file:{key}"), META)

    stored = _kv(None)
    with keyed(private_redis.url) as writer:
        assert writer.store(TOKENS, stored) == len(TOKENS)
    proxy = Throttle(private_redis.port, 3_000_000)  # a 2 MiB chunk in about 0.7 s
    try:
        with keyed(proxy.url) as reader:
            dst = _kv(-1.0)
            start = time.monotonic()
            hit = reader.retrieve(TOKENS, dst)
            elapsed = time.monotonic() - start
            assert elapsed <= TIMEOUT + MARGIN, elapsed
            assert any(t.name.startswith("lmcr_receiver") for t in threading.enumerate())
            n = int(hit.sum())
            assert n < len(TOKENS) and bool(hit[:n].all()) and not bool(hit[n:].any())
            for got, want in zip(dst._keys + dst._values, stored._keys + stored._values,
                                 strict=True):
                assert torch.equal(got[:, :n], want[:, :n])
                assert bool((got[:, n:] == -1.0).all())
            assert reader.storage.remote.pool.used_bytes == 0
    finally:
        proxy.close()


def test_page_calls_on_a_slow_cluster_link_end_within_the_timeout(key_prefix: str) -> None:
    """The page store (SGLang's backend) on a Redis Cluster whose every node is reached through
    a crawling link: each master announces its `Throttle` (`cluster-announce-port`), so the
    client's slot table sends every connection through one. 24 pages of 1 MiB at about 300 KiB
    a second per node took about half a minute when only each wait was bounded (redis-py's
    cluster pipeline); now the read and the lookup each end within the timeout, and what came
    is a leading run of exact pages."""
    from lmcache_remote import load_config
    from lmcache_remote.naming.keys import PageKey
    from lmcache_remote.storage.pages import PageStore
    from tests.cluster_servers import ClusterServers
    from tests.servers import RedisServer

    shape, count = (2, 256 * 1024), 24  # 1 MiB of bfloat16 a page
    names = [PageKey("slow/model", "mha.page-first.bfloat16.p16.tp0of1.r2x524288", f"{i:064x}")
             for i in range(count)]
    gen = torch.Generator().manual_seed(5)
    data = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(count)]

    def page_store(url: str) -> PageStore:
        config = load_config(remote_url=url, key_prefix=key_prefix, remote_timeout=TIMEOUT)
        return PageStore(config, shape, torch.bfloat16, 16)

    cluster = ClusterServers(3, 0, RedisServer).start()
    proxies: list[Throttle] = []
    try:
        writer = page_store(cluster.url)
        assert writer.write(names, lambda i, page: page.copy_(data[i])) == [True] * count
        writer.close()
        for master in cluster.masters:
            proxy = Throttle(master.port, 300 * 1024)
            proxies.append(proxy)
            master.client().config_set("cluster-announce-port", proxy.port)
        through = {p.port for p in proxies}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every node's slot table names the proxies
            seen = {int(slot[2][1]) for m in cluster.masters
                    for slot in m.client().execute_command("CLUSTER", "SLOTS")}
            if seen == through:
                break
            time.sleep(0.1)
        assert seen == through
        reader = page_store(f"redis+cluster://127.0.0.1:{proxies[0].port}")
        try:
            got: dict[int, torch.Tensor] = {}
            start = time.monotonic()
            served = reader.read(names, lambda i, page: got.__setitem__(i, page.clone()))
            elapsed = time.monotonic() - start
            assert elapsed <= TIMEOUT + MARGIN, elapsed
            n = sum(served)
            assert served == [True] * n + [False] * (count - n) and n < count
            assert all(torch.equal(got[i], data[i]) for i in range(n))
            start = time.monotonic()
            reader.present(names)  # 24 small replies: answered or not, within the timeout
            assert time.monotonic() - start <= TIMEOUT + MARGIN
            assert reader.metrics.get("pages.errors") >= 1  # counted, never raised
        finally:
            reader.close()
    finally:
        for proxy in proxies:
            proxy.close()
        cluster.stop()
