"""A store copies its chunks out of the engine's cache a window at a time and hands each to
the write-behind queue at once, so Redis is written while the rest is still being copied
(`CacheEngine.store_windows`); a synchronous store stays one window. Against a real Redis:
the copy of the second window waits, here, until the first window's chunk is in Redis, which
happens only if the writer started before the copy was done."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import redis
import torch
from kvutil import BLOCK, BLOCKS, HEAD, HEADS, LAYERS, engine, reference_keys, tokens

from lmcache_remote import PagedKV
from lmcache_remote.engine import cache_engine

CHUNK = 256


class WaitingKV(PagedKV):
    """A paged cache whose gathers after the first wait until ``go`` is set (at most
    ``patience`` seconds); ``calls`` counts the gathers."""

    def __init__(self, caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 go: threading.Event, patience: float) -> None:
        super().__init__(caches, slot_mapping)
        self.go = go
        self.patience = patience
        self.calls = 0
        self.waited: list[bool] = []

    def gather(self, ranges: Sequence[tuple[int, int]], dsts: Sequence[torch.Tensor]) -> None:
        self.calls += 1
        if self.calls > 1:
            self.waited.append(self.go.wait(self.patience))
        super().gather(ranges, dsts)


def _cache(seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, generator=gen).to(torch.bfloat16)
              for _ in range(LAYERS)]
    return caches, torch.randperm(BLOCKS * BLOCK, generator=gen)[:4 * CHUNK]


def test_the_first_window_is_written_while_the_next_is_copied(
    redis_url: str, key_prefix: str, redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cache_engine, "STORE_WINDOW_BYTES", 1)  # a window per chunk
    toks = tokens(4 * CHUNK, seed=11)
    first = reference_keys(toks, key_prefix)[0]
    go = threading.Event()

    def watch() -> None:  # sets `go` once chunk 0 is in Redis
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not go.is_set():
            if redis_client.exists(first):
                go.set()
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    kv = WaitingKV(*_cache(3), go=go, patience=30)
    try:
        with engine(redis_url, key_prefix, local_cpu=False) as e:
            assert e.store(toks, kv) == 4 * CHUNK
            assert e.flush()
    finally:
        go.set()
        watcher.join()
    assert kv.calls == 4
    assert kv.waited[0], "chunk 0 reached Redis only after the whole store was copied"
    assert all(redis_client.exists(k) for k in reference_keys(toks, key_prefix))


def test_a_synchronous_store_copies_once_and_writes_once(
    redis_url: str, key_prefix: str, redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cache_engine, "STORE_WINDOW_BYTES", 1)
    toks = tokens(4 * CHUNK, seed=12)
    go = threading.Event()
    go.set()
    kv = WaitingKV(*_cache(4), go=go, patience=0)
    with engine(redis_url, key_prefix, local_cpu=False, store_async=False) as e:
        assert e.store(toks, kv) == 4 * CHUNK
        assert e.metrics.get("remote.written_chunks") == 4
    assert kv.calls == 1
    assert all(redis_client.exists(k) for k in reference_keys(toks, key_prefix))
