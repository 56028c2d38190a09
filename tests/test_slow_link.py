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
    return CacheEngine(CacheConfig(remote_url=url, key_prefix=prefix, local_cpu=False,
                                   remote_timeout=TIMEOUT, store_async=False,
                                   stats_publish_interval=None), META)


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
