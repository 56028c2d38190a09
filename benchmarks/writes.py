"""Writes at the socket's limit (issue 47): puts and stores, before and after, in one run.

    .venv/bin/python -m benchmarks.writes [--reps 5] [--no-lmcache] [--json PATH]

One private redis-server, the same bf16 bytes for every contender, repetitions interleaved
(`contenders.duel`), for 1 MiB x 256 and 32 MiB x 8 chunks, each on two servers:

- **empty**: every put starts on an emptied server that handed its pages back
  (`LocalRedis.settle`): every byte written costs redis-server a page fault;
- **full**: every put starts on a server full of the contender's own values under
  `maxmemory` (`LocalRedis.fill_with`): writes evict and land in freed pages, as a cache tier
  does in production.

Contenders: the plain socket (pipelined SET from Python, no checks: the limit), the real
LMCache 0.5.6's three puts (`redis://`, with hiredis, `resp://`), `RedisTier.put_each` as it
is and with every put on all 8 lanes (as before issue 47), and `CacheEngine.store` + `flush`
(write-behind, copy out of vLLM's paged layout included) as it is (copy and writes overlap,
a window at a time) and in one window (as before). Each row: the median put GB/s, its spread
(min-max over the repetitions) and the CPU seconds per GB written of the contender's process
and of redis-server (user + system, 10 ms ticks). The markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import contenders, lmcache_rows
from benchmarks.data import (
    CHUNK,
    LLAMA8B,
    MIB1,
    Shape,
    chunk_tensor,
    empty_dense,
    normal_dense,
    paged_like,
)
from benchmarks.engine_rows import TierSource, _config
from benchmarks.server import LocalRedis
from lmcache_remote import CacheEngine
from lmcache_remote.engine import cache_engine
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import MemoryObj
from lmcache_remote.telemetry.metrics import Metrics
from lmcache_remote.values.serde import DEFAULT_PART_SIZE

SETS = [(MIB1, 256), (LLAMA8B, 8)]
REGIMES = ("empty", "full")


def _tier(server: LocalRedis, source: TierSource, before: bool) -> contenders.Contender:
    t = RedisTier(_config(server.url, "raw"), source.shape.layout, source.pool, Metrics())
    if before:  # every put on all its lanes, as before lanes_for
        t.writes.lanes_for = lambda objs: t.writes.write_lanes  # type: ignore[method-assign]
    keys = [s.key for s in source.specs]
    last: list[MemoryObj] = []

    def get() -> None:
        last[:] = t.get(source.specs)

    def after() -> None:
        for obj in last:
            obj.release()
        last.clear()

    name = "RedisTier, 8 lanes (before)" if before else "RedisTier"
    return contenders.Contender(name, lambda: t.put_each(keys, source.objs), get,
                                lambda: t.delete(keys), after=after, close=t.close)


def _store(server: LocalRedis, shape: Shape, kv: Any, dest: Any, num_tokens: int,
           before: bool) -> contenders.Contender:
    # keep_policy redis: on the full server the filler is Redis's to evict (volatile-ttl); the
    # learned policy keeps its own chunks under its line and would drop them on a server full
    # of other data (docs/keep.md)
    e = CacheEngine(_config(server.url, "raw", local_cpu=False, keep_policy="redis"),
                    shape.metadata())
    tokens = list(range(num_tokens))
    salts = itertools.count()
    salt = ["s"]
    window = cache_engine.STORE_WINDOW_BYTES

    def put() -> None:
        salt[0] = f"s{next(salts)}"
        cache_engine.STORE_WINDOW_BYTES = 1 << 62 if before else window
        try:
            assert e.store(tokens, kv, cache_salt=salt[0]) == num_tokens
            assert e.flush()
        finally:
            cache_engine.STORE_WINDOW_BYTES = window

    def get() -> None:
        assert int(e.retrieve(tokens, dest, cache_salt=salt[0]).sum()) == num_tokens

    name = "store + flush, one window (before)" if before else "store + flush"
    return contenders.Contender(name, put, get, server.clear, close=e.close)


def _duel(server: LocalRedis, shape: Shape, count: int, reps: int, regime: str,
          env: lmcache_rows.SideEnv | None) -> list[dict[str, Any]]:
    num_tokens = count * CHUNK
    nbytes = count * shape.chunk_bytes
    dense = normal_dense(shape, num_tokens)
    chunks = [chunk_tensor(dense, shape, i) for i in range(count)]
    kv = paged_like(dense, shape, num_tokens, seed=11)
    dest = paged_like(empty_dense(shape, num_tokens), shape, num_tokens, seed=12)
    source = TierSource(shape, chunks)
    data = lmcache_rows.DataFile(chunks) if env is not None else None
    part = min(DEFAULT_PART_SIZE, chunks[0].nbytes)
    field = [contenders.plain_socket(server, chunks, part)]
    if env is not None and data is not None:
        field += lmcache_rows.contenders(env, server, data, shape, count)
    field += [_tier(server, source, False), _tier(server, source, True),
              _store(server, shape, kv, dest, num_tokens, False),
              _store(server, shape, kv, dest, num_tokens, True)]
    times: dict[str, list[float]] = {}
    cpu: dict[str, contenders.CpuShare] = {}
    try:
        contenders.duel(field, reps, server.settle, keep_open=field, server_pid=server.pid,
                        cpu=cpu, full=server if regime == "full" else None, puts=times)
    finally:
        for c in field:
            c.close()
        source.release()
        if data is not None:
            data.remove()
    rows = []
    for c in field:
        t = times[c.name]
        rows.append({
            "set": f"{shape.chunk_bytes >> 20} MiB x {count}", "server": regime, "name": c.name,
            "gbps": nbytes / statistics.median(t) / 1e9, "low": nbytes / max(t) / 1e9,
            "high": nbytes / min(t) / 1e9,
            "client_s_per_gb": cpu[c.name].put_client / nbytes * 1e9,
            "server_s_per_gb": cpu[c.name].put_server / nbytes * 1e9,
        })
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of the rows, and per set and server the ratios the issue asks."""
    out = ["| chunks | server | contender | put GB/s (spread) | its CPU s/GB | redis-server "
           "CPU s/GB |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['set']} | {r['server']} | {r['name']} | {r['gbps']:.2f} "
                   f"({r['low']:.2f}-{r['high']:.2f}) | {r['client_s_per_gb']:.3f} | "
                   f"{r['server_s_per_gb']:.3f} |")
    out.append("")
    groups: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["set"], r["server"]), {})[r["name"]] = r["gbps"]
    for (chunks, server), fig in groups.items():
        peers = {n: v for n, v in fig.items() if n.startswith("LMCache")}
        line = f"- {chunks}, {server} server:"
        if peers:
            best = max(peers, key=peers.__getitem__)
            line += (f" RedisTier / {best} {fig['RedisTier'] / peers[best]:.2f}x"
                     f" (before: {fig['RedisTier, 8 lanes (before)'] / peers[best]:.2f}x);")
        plain = fig["plain socket"]
        line += (f" store + flush / plain socket {fig['store + flush'] / plain:.2f}x"
                 f" (before: {fig['store + flush, one window (before)'] / plain:.2f}x)")
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.writes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-lmcache", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true", help="two small chunks, no LMCache")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    env = None if args.no_lmcache or args.tiny else lmcache_rows.SideEnv()
    sets = [(MIB1, 4)] if args.tiny else SETS
    rows: list[dict[str, Any]] = []
    started = time.time()
    with LocalRedis() as server:
        for (shape, count), regime in itertools.product(sets, REGIMES):
            rows += _duel(server, shape, count, args.reps, regime, env)
    for line in table(rows):
        print(line)
    print(f"done in {time.time() - started:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
