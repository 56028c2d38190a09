"""The engine and its Redis tier on the benchmark's data: store, retrieve, lookup, hashing."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from benchmarks.data import CHUNK, Shape, normal_dense, same_kv
from benchmarks.server import LocalRedis
from benchmarks.timing import median_seconds
from lmcache_remote import CacheConfig, CacheEngine, DenseKV, KVView
from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import MemoryObj, MemoryPool
from lmcache_remote.telemetry.metrics import Metrics
from lmcache_remote.values.serde import Serde

_salts = itertools.count()


def _config(url: str | None, codec: str, **overrides: Any) -> CacheConfig:
    base: dict[str, Any] = {"remote_url": url, "serde": codec, "key_prefix": "bench",
                            "chunk_size": CHUNK, "remote_timeout": 60.0,
                            "max_local_cpu_size": 4.0, "store_queue_size": 2.0}
    base.update(overrides)
    return CacheConfig(**base)


class TierSource:
    """The chunks as `MemoryObj`s in one pool, and their specs (keys); the pool has room for
    ``copies`` times the chunks (a second copy for what a get reads back)."""

    def __init__(self, shape: Shape, chunks: Sequence[torch.Tensor], copies: int = 2) -> None:
        self.shape = shape
        self.pool = MemoryPool(copies * len(chunks) * shape.chunk_bytes + (1 << 20),
                               pin_memory=False)
        db = TokenDatabase(KeyNamespace(shape.name, 1, 0, str(shape.dtype)[6:]), CHUNK, False)
        self.specs = db.chunks(list(range(len(chunks) * CHUNK)))
        self.objs: list[MemoryObj] = []
        for chunk in chunks:
            obj = self.pool.allocate(tuple(chunk.shape), chunk.dtype)
            assert obj is not None
            obj.tensor.copy_(chunk)
            self.objs.append(obj)

    def release(self) -> None:
        for obj in self.objs:
            obj.release()
        self.objs = []


@contextlib.contextmanager
def _tier_put(server: LocalRedis, shape: Shape, chunks: Sequence[torch.Tensor], codec: str,
              fit: bool = True) -> Iterator[Callable[[], object]]:
    """A fresh `RedisTier` over the chunks and an emptied server: yields the call that writes
    them (parts cut uniformly at `remote_part_size` when not ``fit``); empties the server
    again on exit."""
    source = TierSource(shape, chunks, copies=1)
    config = _config(server.url, codec)
    tier = RedisTier(config, shape.layout, source.pool, Metrics())
    if not fit:
        tier.serde = tier.values.serde = Serde(codec, config.remote_part_size,
                                               fit_size_classes=False)
    try:
        server.clear()
        yield lambda: tier.put_each([s.key for s in source.specs], source.objs)
    finally:
        server.clear()
        tier.close()
        source.release()


def redis_memory(server: LocalRedis, shape: Shape, chunks: Sequence[torch.Tensor], codec: str
                 ) -> float:
    """Growth of Redis's `used_memory` per raw KV byte when the tier writes the chunks."""
    with _tier_put(server, shape, chunks, codec) as put:
        before = server.used_memory()
        put()
        return (server.used_memory() - before) / sum(c.nbytes for c in chunks)


#: Chunk shapes of real models (layers, KV heads, head size; bfloat16, 256 tokens) for the
#: Redis-memory rows: their sizes are powers of two or small multiples of one.
MEMORY_SHAPES = {
    "64 KiB (2 layers, 2 KV heads x 16)": (2, 2, 16),
    "3 MiB (24 layers, 2 x 64: a 0.5B model)": (24, 2, 64),
    "7 MiB (28 layers, 2 x 128: a 1.5B model)": (28, 2, 128),
    "32 MiB (32 layers, 8 x 128: an 8B model)": (32, 8, 128),
}


def allocation_rows(server: LocalRedis, total_mib: int) -> dict[str, tuple[float, float]]:
    """Per `MEMORY_SHAPES` entry: bytes Redis allocates (`MEMORY USAGE` of every key written,
    keys included) per raw KV byte, with the tier's planned part sizes and with a uniform cut
    at `remote_part_size` (what the tier did before planning); ~``total_mib`` of raw KV each."""
    out = {}
    for name, (layers, heads, head) in MEMORY_SHAPES.items():
        shape = Shape(name, layers, heads, head)
        count = max(2, (total_mib << 20) // shape.chunk_bytes)
        gen = torch.Generator().manual_seed(3)
        chunks = [torch.randn(shape.layout.shape(CHUNK), generator=gen).to(shape.dtype)
                  for _ in range(count)]
        out[name] = (_allocated(server, shape, chunks, True),
                     _allocated(server, shape, chunks, False))
    return out


def _allocated(server: LocalRedis, shape: Shape, chunks: Sequence[torch.Tensor],
               fit: bool) -> float:
    with _tier_put(server, shape, chunks, "raw", fit) as put:
        put()
        return server.key_bytes("bench:*") / sum(c.nbytes for c in chunks)


def write_behind_rows(server: LocalRedis, shape: Shape, kv: KVView, dest: KVView,
                      dense: DenseKV, num_tokens: int, codec: str, reps: int
                      ) -> dict[str, float]:
    """Median seconds of: the KV copy alone (gather into reused chunk buffers, from ``kv`` and
    from the same KV in the Hugging Face layout); an asynchronous store of ``kv`` until it
    returns and until `flush` says the data is in Redis; a retrieve from the local tier into
    ``dest``."""
    tokens = list(range(num_tokens))
    out: dict[str, float] = {}
    meta = shape.metadata()
    ranges = [(i, i + CHUNK) for i in range(0, num_tokens, CHUNK)]
    bufs = [torch.empty(shape.layout.shape(CHUNK), dtype=shape.dtype) for _ in ranges]
    out["gather"] = median_seconds(lambda: kv.gather(ranges, bufs), reps)
    out["gather_dense"] = median_seconds(lambda: dense.gather(ranges, bufs), reps)
    with CacheEngine(_config(server.url, codec, local_cpu=False), meta) as e:
        returns, landed = [], []
        for i in range(reps + 1):
            server.clear()
            server.settle()  # Redis freeing the last repetition's values is not the store's
            start = time.perf_counter()
            assert e.store(tokens, kv, cache_salt=f"a{next(_salts)}") == num_tokens
            t_return = time.perf_counter() - start
            assert e.flush()
            if i:
                returns.append(t_return)
                landed.append(time.perf_counter() - start)
        out["store_async_return"] = statistics.median(returns)
        out["store_async_landed"] = statistics.median(landed)
        dropped = e.stats()["remote"].get("dropped_chunks", 0)
        assert dropped == 0, f"{dropped} chunks dropped"
    with CacheEngine(_config(None, codec, local_cpu=True), meta) as e:
        assert e.store(tokens, kv) == num_tokens

        def local() -> None:
            assert int(e.retrieve(tokens, dest).sum()) == num_tokens

        out["retrieve_local"] = median_seconds(local, reps)
        assert same_kv(kv, dest, shape, num_tokens)
    server.clear()
    return out


def lookup_rows(server: LocalRedis, shape: Shape, reps: int,
                num_tokens: int = 512 * CHUNK) -> dict[str, float]:
    """Median seconds of `lookup` for a ``num_tokens`` prompt, all hit and all miss, against
    Redis (local tier off: every chunk is asked of Redis in one round trip)."""
    tokens = torch.arange(num_tokens) % 50_000
    kv = normal_dense(shape, num_tokens, seed=5)
    with CacheEngine(_config(server.url, "raw", local_cpu=False, store_async=False),
                     shape.metadata()) as e:
        assert e.store(tokens, kv) == num_tokens
        assert e.lookup(tokens) == num_tokens
        hit = median_seconds(lambda: e.lookup(tokens), reps * 4)
        miss = median_seconds(lambda: e.lookup(tokens, cache_salt="miss"), reps * 4)
        assert e.lookup(tokens, cache_salt="miss") == 0
    server.clear()
    return {"hit": hit, "miss": miss}


def hashing_rows(reps: int, num_tokens: int = 128 * 1024) -> dict[str, float]:
    """Median seconds to cut and hash a ``num_tokens`` prompt into chunk keys."""
    db = TokenDatabase(KeyNamespace("bench/model", 1, 0, "bfloat16"), CHUNK, False)
    tokens = torch.randint(0, 128_000, (num_tokens,))
    as_list = tokens.tolist()
    return {
        "tensor": median_seconds(lambda: db.prefix_keys(tokens), reps * 4),
        "list": median_seconds(lambda: db.prefix_keys(as_list), reps * 4),
    }
