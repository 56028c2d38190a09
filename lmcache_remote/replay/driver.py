"""The replay: a trace's requests through the real `CacheEngine`, against a real Redis whose
`maxmemory` holds a given number of tokens of KV, at the trace's pace or a stated multiple.

`replay(trace, settings)`:

1. starts a private server (`admin.private_server`: redis-server, or valkey-server) on a
   loopback port, with `maxmemory` set to hold ``capacity_tokens`` tokens of KV: the
   server's memory when empty, plus that many tokens' chunks at what one chunk is measured
   to cost there (its values, keys and Redis's bookkeeping, written and removed before the
   run), under ``maxmemory_policy`` (docker-compose.yml's `volatile-lru` by default);
2. runs ``processes`` engine processes (one: this process), each a `CacheEngine` with Redis
   as its only tier (``local_cpu`` off unless asked: every hit is the shared tier's), a KV
   cache of one layer in bfloat16 with ``bytes_per_token`` of KV a token, and every
   ``processes``-th request: at its time (``(t - t0) / speedup`` after the start, as soon as
   it can when behind) a `lookup` of its prompt, whose answer is its hit, then a `store` of
   the prompt (the engine computed what it missed);
3. reports the token hit rate of the requests from ``measure_from`` on (a fraction of the
   trace's span: the earlier ones warm the cache and the policy up), the chunks and bytes
   the engines wrote to Redis, Redis's own evictions and expiries, how late requests ran,
   and the engines' keep counters.

What it cannot show: the model's compute (no forward runs: a store copies KV made up for it,
a hit loads nothing), the time a hit saves (docs/load-decision.md), traffic beyond one
machine's loopback.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from pathlib import Path
from typing import Any

from lmcache_remote.admin.private_server import RedisServer
from lmcache_remote.replay.trace import Trace, read_trace

__all__ = ["ReplayResult", "ReplaySettings", "replay"]

#: Chunks written (and removed) to measure what one chunk costs the server.
_SAMPLE_CHUNKS = 64


@dataclasses.dataclass(frozen=True)
class ReplaySettings:
    """How a trace is replayed (see the module doc)."""

    capacity_tokens: int
    keep_policy: str = "learned"
    speedup: float = 10.0
    processes: int = 1
    bytes_per_token: int = 64
    measure_from: float = 0.5
    maxmemory_policy: str = "volatile-lru"
    local_cpu_gib: float | None = None
    server: str = "redis"
    config: tuple[tuple[str, Any], ...] = ()
    """Further `CacheConfig` fields, as (name, value) pairs."""

    def __post_init__(self) -> None:
        if self.capacity_tokens <= 0:
            raise ValueError("capacity_tokens must be positive")
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        if self.processes < 1:
            raise ValueError("processes must be 1 or more")
        if self.bytes_per_token < 4 or self.bytes_per_token % 4:
            raise ValueError("bytes_per_token must be a positive multiple of 4 (K and V in "
                             "bfloat16)")
        if not 0.0 <= self.measure_from < 1.0:
            raise ValueError("measure_from must be in [0, 1)")
        if self.server not in ("redis", "valkey"):
            raise ValueError("server must be 'redis' or 'valkey'")


@dataclasses.dataclass
class ReplayResult:
    """What a replay measured (see the module doc)."""

    settings: ReplaySettings
    hit_tokens: int
    prompt_tokens: int
    requests: int
    written_chunks: int
    written_bytes: int
    evicted_keys: int
    expired_keys: int
    maxmemory: int
    chunk_cost: int
    late_requests: int
    max_lag_s: float
    seconds: float
    server_version: str
    counters: dict[str, float]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["settings"] = dataclasses.asdict(self.settings)
        out["settings"]["config"] = dict(self.settings.config)
        out["hit_rate"] = self.hit_rate
        return out


def _metadata(bytes_per_token: int) -> Any:
    import torch

    from lmcache_remote.engine import EngineMetadata

    return EngineMetadata("replay", 1, 0, torch.bfloat16, 1, 1, bytes_per_token // 4)


def _config(settings: ReplaySettings, url: str, prefix: str, chunk_size: int,
            keep_policy: str) -> Any:
    from lmcache_remote.config import CacheConfig

    fields: dict[str, Any] = {
        "chunk_size": chunk_size, "remote_url": url, "key_prefix": prefix,
        "local_cpu": settings.local_cpu_gib is not None,
        "max_local_cpu_size": settings.local_cpu_gib or 1.0,
        "stats_publish_interval": None, "load_policy": "always",
        "keep_policy": keep_policy, "serde": "raw",
    }
    fields.update(dict(settings.config))
    return CacheConfig(**fields)


def _kv(max_tokens: int, chunk_size: int, bytes_per_token: int) -> tuple[list[Any], Any]:
    import torch

    blocks = -(-max_tokens // chunk_size) + 1
    cache = torch.zeros(2, blocks, chunk_size, 1, bytes_per_token // 4, dtype=torch.bfloat16)
    cache.view(torch.int16).copy_(torch.randint(-2**15, 2**15, cache.shape, dtype=torch.int16))
    return [cache], torch.arange(blocks * chunk_size, dtype=torch.int64)


def _worker(args: dict[str, Any]) -> dict[str, Any]:
    """One engine process's share of the trace (see the module doc)."""
    from lmcache_remote.connectors import PagedKV
    from lmcache_remote.engine import CacheEngine

    trace = read_trace(args["path"], block_size=args["block_size"], limit=args["limit"])
    settings: ReplaySettings = args["settings"]
    mine = trace.requests[args["rank"]::settings.processes]
    size = trace.block_size
    caches, slots = _kv(max((r.input_length for r in mine), default=size), size,
                        settings.bytes_per_token)
    config = _config(settings, args["url"], args["prefix"], size, settings.keep_policy)
    t0 = args["t0"]
    start = args["start"]
    hits = []
    late = 0
    max_lag = 0.0
    with CacheEngine(config, _metadata(settings.bytes_per_token)) as engine:
        for request in mine:
            due = start + (request.time - t0) / settings.speedup
            lag = time.time() - due
            if lag < 0:
                time.sleep(-lag)
            else:
                max_lag = max(max_lag, lag)
                late += lag > 1.0
            tokens = request.tokens()
            hit = engine.lookup(tokens, cache_salt=request.cache_salt)
            hits.append((request.time, request.input_length, hit))
            if hit < request.full_blocks * size:
                engine.store(tokens, PagedKV(caches, slots[:len(tokens)]),
                             cache_salt=request.cache_salt)
        engine.flush()
        counters = {f"{scope}.{k}": float(v) for scope, values in engine.stats().items()
                    if isinstance(values, dict) for k, v in values.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {"hits": hits, "late": late, "max_lag": max_lag, "counters": counters}


def _chunk_cost(settings: ReplaySettings, url: str, client: Any, chunk_size: int) -> int:
    """What one full chunk costs the server: ``_SAMPLE_CHUNKS`` written by the engine (no
    keep policy), the server's memory before and after, then removed."""
    import numpy as np

    from lmcache_remote.connectors import PagedKV
    from lmcache_remote.engine import CacheEngine

    before = int(client.info("memory")["used_memory"])
    config = _config(settings, url, "replay-sample", chunk_size, "redis")
    caches, slots = _kv(_SAMPLE_CHUNKS * chunk_size, chunk_size, settings.bytes_per_token)
    tokens = np.arange(_SAMPLE_CHUNKS * chunk_size, dtype=np.uint32)
    with CacheEngine(config, _metadata(settings.bytes_per_token)) as engine:
        engine.store(tokens, PagedKV(caches, slots[:len(tokens)]))
        engine.flush()
    after = int(client.info("memory")["used_memory"])
    keys = list(client.scan_iter(match="replay-sample:*", count=1000))
    if keys:
        client.unlink(*keys)
    return max(1, (after - before) // _SAMPLE_CHUNKS)


def _server(settings: ReplaySettings) -> RedisServer:
    if settings.server == "valkey":
        from lmcache_remote.admin.private_server import ValkeyServer

        return ValkeyServer("--protected-mode", "no")
    return RedisServer("--protected-mode", "no")


def replay(trace: Trace | str | Path, settings: ReplaySettings, *,
           limit: int | None = None) -> ReplayResult:
    """Replays the trace (a `Trace` read from a file, or a path) as the module doc says."""
    if not isinstance(trace, Trace):
        trace = read_trace(trace, limit=limit)
    if not trace.source:
        raise ValueError("replay needs a trace read from a file (engine processes read it)")
    if not trace.requests:
        raise ValueError("the trace has no requests")
    measure_from = trace.split_time(settings.measure_from)
    began = time.monotonic()
    with _server(settings) as server:
        client = server.client()
        client.config_set("maxmemory-policy", settings.maxmemory_policy)
        cost = _chunk_cost(settings, server.url, client, trace.block_size)
        empty = int(client.info("memory")["used_memory"])
        chunks = settings.capacity_tokens // trace.block_size
        maxmemory = empty + chunks * cost
        client.config_set("maxmemory", maxmemory)
        client.config_resetstat()
        start = time.time() + 2.0  # the engines start within it (spawn and import: ~1-2 s)
        args = [{"path": trace.source, "block_size": trace.block_size, "limit": len(trace),
                 "settings": settings, "rank": rank, "url": server.url, "prefix": "replay",
                 "t0": trace.requests[0].time, "start": start}
                for rank in range(settings.processes)]
        if settings.processes == 1:
            outs = [_worker(args[0])]
        else:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(settings.processes) as pool:
                outs = pool.map(_worker, args)
        stats = client.info("stats")
        version = str(client.info("server").get("redis_version", "?"))
        client.close()
    hit_tokens = prompt_tokens = requests = 0
    for out in outs:
        for t, length, hit in out["hits"]:
            if t >= measure_from:
                hit_tokens += hit
                prompt_tokens += length
                requests += 1
    counters: dict[str, float] = {}
    for out in outs:
        for k, v in out["counters"].items():
            counters[k] = counters.get(k, 0.0) + v
    return ReplayResult(
        settings=settings, hit_tokens=hit_tokens, prompt_tokens=prompt_tokens,
        requests=requests, written_chunks=int(counters.get("remote.written_chunks", 0)),
        written_bytes=int(counters.get("remote.written_bytes", 0)),
        evicted_keys=int(stats.get("evicted_keys", 0)),
        expired_keys=int(stats.get("expired_keys", 0)), maxmemory=maxmemory,
        chunk_cost=cost, late_requests=sum(o["late"] for o in outs),
        max_lag_s=max(o["max_lag"] for o in outs), seconds=time.monotonic() - began,
        server_version=version, counters=counters)
