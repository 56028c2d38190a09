"""The engine and its Redis tier on the benchmark's data: store, retrieve, lookup, hashing."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.data import CHUNK, Shape, empty_dense, normal_dense, same_kv
from benchmarks.server import LocalRedis
from benchmarks.timing import median_seconds
from lmcache_remote import CacheConfig, CacheEngine, DenseKV
from lmcache_remote.hashing import KeyNamespace, TokenDatabase
from lmcache_remote.memory import MemoryObj, MemoryPool
from lmcache_remote.metrics import Metrics
from lmcache_remote.storage.redis_tier import RedisTier

_salts = itertools.count()


def _config(url: str | None, codec: str, **overrides: Any) -> CacheConfig:
    base: dict[str, Any] = {"remote_url": url, "serde": codec, "key_prefix": "bench",
                            "chunk_size": CHUNK, "remote_timeout": 60.0,
                            "max_local_cpu_size": 4.0, "store_queue_size": 2.0}
    base.update(overrides)
    return CacheConfig(**base)


def tier_rows(server: LocalRedis, shape: Shape, chunks: Sequence[torch.Tensor], codec: str,
              reps: int) -> tuple[float, float, float]:
    """Seconds (median) for `RedisTier.put` and `RedisTier.get` of the chunks: the data path
    through Redis alone (encode, send, receive, check, decode), no KV copies; and the growth
    of Redis's `used_memory` per raw KV byte when the chunks are written."""
    pool = MemoryPool(2 * len(chunks) * shape.chunk_bytes + (1 << 20), pin_memory=False)
    db = TokenDatabase(KeyNamespace(shape.name, 1, 0, str(shape.dtype)[6:]), CHUNK, False)
    specs = db.chunks(list(range(len(chunks) * CHUNK)))
    objs: list[MemoryObj] = []
    for chunk in chunks:
        obj = pool.allocate(tuple(chunk.shape), chunk.dtype)
        assert obj is not None
        obj.tensor.copy_(chunk)
        objs.append(obj)
    tier = RedisTier(_config(server.url, codec), shape.layout, pool, Metrics())
    keys = [s.key for s in specs]

    def get() -> None:
        got = tier.get(specs)
        assert len(got) == len(specs)
        for obj in got:
            obj.release()

    try:
        t_put = median_seconds(lambda: tier.put(keys, objs), reps, setup=lambda: tier.delete(keys))
        t_get = median_seconds(get, reps)
        got = tier.get(specs)
        assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(got, objs, strict=True))
        for obj in got + objs:
            obj.release()
        tier.delete(keys)
        before = server.used_memory()
        tier.put(keys, objs)
        memory = (server.used_memory() - before) / sum(c.nbytes for c in chunks)
        tier.delete(keys)
    finally:
        tier.close()
    return t_put, t_get, memory


def engine_rows(server: LocalRedis, shape: Shape, kv: DenseKV, num_tokens: int, codec: str,
                reps: int) -> dict[str, float]:
    """Median seconds of: a synchronous store; an asynchronous store until it returns and
    until `flush` says the data is in Redis; a retrieve from Redis (local tier off); a
    retrieve from the local tier."""
    tokens = list(range(num_tokens))
    dest = empty_dense(shape, num_tokens)
    out: dict[str, float] = {}
    meta = shape.metadata()

    def fresh() -> str:
        server.clear()
        return f"s{next(_salts)}"

    with CacheEngine(_config(server.url, codec, store_async=False, local_cpu=False), meta) as e:
        salt = ""

        def sync_store() -> None:
            assert e.store(tokens, kv, cache_salt=salt) == num_tokens

        def setup() -> None:
            nonlocal salt
            salt = fresh()

        out["store_sync"] = median_seconds(sync_store, reps, setup=setup)

        def retrieve() -> None:
            assert int(e.retrieve(tokens, dest, cache_salt=salt).sum()) == num_tokens

        out["retrieve_redis"] = median_seconds(retrieve, reps)
        assert same_kv(kv, dest, shape, num_tokens)
    with CacheEngine(_config(server.url, codec, local_cpu=False), meta) as e:
        returns, landed = [], []
        for i in range(reps + 1):
            salt = fresh()
            start = time.perf_counter()
            assert e.store(tokens, kv, cache_salt=salt) == num_tokens
            t_return = time.perf_counter() - start
            assert e.flush()
            if i:
                returns.append(t_return)
                landed.append(time.perf_counter() - start)
        out["store_async_return"] = sorted(returns)[len(returns) // 2]
        out["store_async_landed"] = sorted(landed)[len(landed) // 2]
        dropped = e.stats()["remote"].get("dropped_chunks", 0)
        assert dropped == 0, f"{dropped} chunks dropped"
    with CacheEngine(_config(None, codec, local_cpu=True), meta) as e:
        assert e.store(tokens, kv) == num_tokens

        def local() -> None:
            assert int(e.retrieve(tokens, dest).sum()) == num_tokens

        out["retrieve_local"] = median_seconds(local, reps)
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
