"""One side of `benchmarks.ab`: the engine's data path timed through the public API only.

Run by `benchmarks.ab` as a script with the checkout under test first on PYTHONPATH (so the
`lmcache_remote` imported is that checkout's, whatever this file's own checkout holds), against
the redis-server whose URL it is given. It prints one JSON object: per operation the seconds of
each repetition. Operations, on a vLLM-like paged cache (kv_split layout, 16-token blocks):

- ``store``: `CacheEngine.store` of the prompt from the paged cache, then `flush` (into Redis);
- ``lookup``: a second engine's `lookup` of the prompt (every chunk in Redis);
- ``retrieve_remote``: that engine's `retrieve` into its paged cache (from Redis);
- ``retrieve_local``: the same `retrieve` again (from its local tier);
- ``miss``: `lookup` and `retrieve` of a prompt nobody stored;
- ``pages_write`` / ``pages_present`` / ``pages_read``: SGLang's page store
  (`storage.pages.PageStore`, what the HiCache backend stands on) writing, finding and reading
  back 128 pages of 1 MiB through its staging, checked exact.
"""

from __future__ import annotations

import json
import sys
import time

import redis
import torch

from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata, PagedKV
from lmcache_remote.storage.pages import PageStore

try:
    from lmcache_remote.naming.keys import PageKey
except ImportError:  # a checkout from before the folder layout (issue 37): keys at the root
    from lmcache_remote.keys import PageKey  # type: ignore[no-redef]

LAYERS, HEADS, HEAD, BLOCK = 8, 8, 128, 16


def paged(tokens: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    blocks = tokens // BLOCK + 4
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn((2, blocks, BLOCK, HEADS, HEAD), generator=gen).to(torch.bfloat16)
              for _ in range(LAYERS)]
    order = torch.randperm(blocks, generator=gen)[: tokens // BLOCK]
    slots = (order[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)
    return caches, slots


def engine(url: str, name: str) -> CacheEngine:
    config = CacheConfig(remote_url=url, key_prefix="ab", chunk_size=256,
                         max_local_cpu_size=2.0, remote_timeout=60.0)
    meta = EngineMetadata(name, 1, 0, torch.bfloat16, LAYERS, HEADS, HEAD)
    return CacheEngine(config, meta)


class Clock:
    """Seconds of each timed step, by operation."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self._start = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, op: str) -> None:
        self.seconds.setdefault(op, []).append(time.perf_counter() - self._start)


def one_repetition(url: str, tokens: int, rep: int, clock: Clock,
                   src: tuple[list[torch.Tensor], torch.Tensor],
                   dst: tuple[list[torch.Tensor], torch.Tensor]) -> None:
    prompt = torch.arange(tokens) + rep * tokens
    writer, reader = engine(url, "ab-model"), engine(url, "ab-model")
    try:
        clock.start()
        writer.store(prompt, PagedKV(*src))
        writer.flush(60)
        clock.stop("store")
        clock.start()
        hit = reader.lookup(prompt)
        clock.stop("lookup")
        assert hit == tokens, hit
        for op in ("retrieve_remote", "retrieve_local"):
            clock.start()
            got = reader.retrieve(prompt, PagedKV(*dst))
            clock.stop(op)
            assert bool(got.all()), op
        for layer in range(LAYERS):  # exact: the reader's slots hold the writer's KV
            a = src[0][layer].flatten(1, 2)[:, src[1]]
            b = dst[0][layer].flatten(1, 2)[:, dst[1]]
            assert torch.equal(a, b)
        other = torch.arange(tokens) + 10**7 + rep
        clock.start()
        reader.lookup(other)
        reader.retrieve(other, PagedKV(*dst))
        clock.stop("miss")
    finally:
        writer.close()
        reader.close()


def pages_repetition(url: str, rep: int, clock: Clock, data: torch.Tensor) -> None:
    config = CacheConfig(remote_url=url, key_prefix="ab", remote_timeout=60.0)
    store = PageStore(config, tuple(data.shape[1:]), data.dtype, 64)
    keys = [PageKey("ab-model", "mha.page-first.bfloat16.p64.tp0of1.ab", f"{rep:032x}{i:032x}")
            for i in range(len(data))]
    got = torch.empty_like(data)
    try:
        clock.start()
        landed = store.write(keys, lambda i, page: page.copy_(data[i]))
        clock.stop("pages_write")
        assert all(landed)
        clock.start()
        present = store.present(keys)
        clock.stop("pages_present")
        assert present == len(keys)
        clock.start()
        served = store.read(keys, lambda i, page: got[i].copy_(page))
        clock.stop("pages_read")
        assert all(served) and torch.equal(got, data)
    finally:
        store.close()


def main(url: str, tokens: int, reps: int) -> None:
    client = redis.Redis.from_url(url)
    clock = Clock()
    src, dst = paged(tokens, 1), paged(tokens, 2)
    for rep in range(reps):
        client.flushall()
        one_repetition(url, tokens, rep, clock, src, dst)
    pages = torch.randn((128, 2, 1 << 18), generator=torch.Generator().manual_seed(3)
                        ).to(torch.bfloat16)  # 128 pages of 1 MiB
    for rep in range(reps):
        client.flushall()
        pages_repetition(url, rep, clock, pages)
    print(json.dumps(clock.seconds))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
