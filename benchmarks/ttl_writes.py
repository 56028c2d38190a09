"""Writing multi-part chunks with an expiry: the transaction against the script and a plain MSET.

    .venv/bin/python -m benchmarks.ttl_writes [--rounds 7] [--chunks 8]

`RedisTier.put_each` of `--chunks` chunks of 32 MiB (raw codec, 8 or more parts each) on one
private redis-server, three rows in an order that rotates every round (interleaved), the
server emptied and settled before each:

- `MSET`: `remote_ttl: null`, one MSET a chunk (no expiry);
- `transaction`: `remote_ttl` set, MULTI, the MSET, a PEXPIRE per value, EXEC (what a single
  server writes since `remote_ttl` became the default);
- `EVAL`: the script that SETs each value with PX (what a Cluster's tier still writes, and
  every tier before), forced here on the single server.

GB/s of raw KV per row, median and range; the ratios against MSET from the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.server import LocalRedis
from lmcache_remote.config import CacheConfig
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks import writes as remote_writes
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
from lmcache_remote.storage.wire.commands import chunk_write_command
from lmcache_remote.telemetry.metrics import Metrics

ROWS = ("MSET", "transaction", "EVAL")


def _script_form(keys: Any, values: Any, ttl_ms: int | None) -> tuple[list[Any], int]:
    return [chunk_write_command(keys, values, ttl_ms, script=True)], 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    layout = ChunkLayout(32, 8, 128, torch.bfloat16)  # 128 KiB a token: 32 MiB a chunk
    pool = MemoryPool((args.chunks + 1) * layout.nbytes(256))
    objs = []
    for _ in range(args.chunks):
        obj = pool.allocate(layout.shape(256), torch.bfloat16)
        assert obj is not None
        obj.tensor.copy_(torch.randn(obj.tensor.shape))
        objs.append(obj)
    nbytes = sum(o.nbytes for o in objs)
    speeds: dict[str, list[float]] = {row: [] for row in ROWS}
    honest = remote_writes.chunk_write_commands
    with LocalRedis() as server:
        tiers = {row: RedisTier(CacheConfig(remote_url=server.url, key_prefix="ttlw",
                                            remote_ttl=None if row == "MSET" else 3600.0),
                                layout, pool, Metrics()) for row in ROWS}
        for r in range(args.rounds):
            for row in ROWS[r % 3:] + ROWS[:r % 3]:
                server.clear()
                server.settle()
                keys = [CacheEngineKey("m", 1, 0, "bfloat16", os.urandom(16).hex())
                        for _ in objs]
                remote_writes.chunk_write_commands = (  # type: ignore[assignment]
                    _script_form if row == "EVAL" else honest)
                try:
                    start = time.perf_counter()
                    assert all(tiers[row].put_each(keys, objs))
                    speeds[row].append(nbytes / (time.perf_counter() - start) / 1e9)
                finally:
                    remote_writes.chunk_write_commands = honest
        version = server.version()
        for tier in tiers.values():
            tier.close()
    base = statistics.median(speeds["MSET"])
    print(f"redis {version}, {args.chunks} chunks of 32 MiB, {args.rounds} rounds\n")
    print("| write | GB/s (median, range) | vs MSET |\n|---|---|---|")
    for row in ROWS:
        s = speeds[row]
        print(f"| {row} | {statistics.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) | "
              f"{statistics.median(s) / base:.2f}x |")


if __name__ == "__main__":
    main()
