"""Keep what pays: Zipf-popular documents under a flood of one-shot prompts, at a fixed
maxmemory, with `store_after` 1 and 2, and a system prompt with and without a pin.

    .venv/bin/python -m benchmarks.keep [--rounds 3] [--requests 600] [--maxmemory-mb 64]

One private redis-server (`benchmarks.server.LocalRedis`) at `--maxmemory-mb` with
`volatile-lru`, emptied and its counters reset before every run. Each run is one engine
(`CacheEngine`, no local tier: every hit is Redis's; 4 layers, 4 KV heads of 64, bfloat16:
4 KiB of KV a token, 1 MiB a 256-token chunk) serving the same seeded request stream:

- with probability `--popular` (0.3) a popular document, drawn by Zipf (s = 1.1) from
  `--documents` (20) documents of 4 chunks (4 MiB each: 80 MiB in all, more than fits);
- every `--system-every` (25) requests the system prompt (2 chunks);
- otherwise a one-shot prompt of 4 chunks never seen again (the flood: about 1.7 GB over
  600 requests, 25x maxmemory).

A request is a lookup (the hit) and, when it missed anything, a store of the whole prompt
(the engine computed it). Rows, each run once per round, in an order that rotates every round
(interleaved):

- `today`: `store_after: 1`, nothing pinned (what earlier releases did);
- `store_after 2`;
- `today + pin`: `store_after: 1`, the system prompt pinned after its first store;
- `store_after 2 + pin`.

Figures per row (median and range over the rounds): the popular documents' hit rate (hit
tokens over their tokens, the first 100 requests left out as warm-up), the system prompt's
hit rate (its requests after the first), the bytes written to Redis (`remote.written_bytes`)
and Redis's evicted keys. Written to `benchmarks/keep_results.json`; the table for
docs/benchmarks.md is printed.

What this cannot show: a fleet of engines (one engine here; the counts are Redis's, so several
engines share them the same way), timings (the hit rates and bytes are what changes; the time
a hit saves is docs/load-decision.md's).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.server import LocalRedis
from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata, PagedKV

CHUNK = 256
ROWS = {
    "today": {"store_after": 1, "pin": False},
    "store_after 2": {"store_after": 2, "pin": False},
    "today + pin": {"store_after": 1, "pin": True},
    "store_after 2 + pin": {"store_after": 2, "pin": True},
}
WARMUP = 100
RESULTS = Path(__file__).with_name("keep_results.json")


def stream(args: argparse.Namespace, seed: int) -> list[tuple[str, list[int]]]:
    """The request stream: (kind, tokens) with kind `popular`, `system` or `oneshot`."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1 / (k + 1) ** 1.1 for k in range(args.documents)])
    docs = [torch.randint(0, 50_000, (4 * CHUNK,), generator=gen).tolist()
            for _ in range(args.documents)]
    system = torch.randint(0, 50_000, (2 * CHUNK,), generator=gen).tolist()
    out: list[tuple[str, list[int]]] = []
    for i in range(args.requests):
        if i % args.system_every == 0:
            out.append(("system", system))
        elif float(torch.rand(1, generator=gen)) < args.popular:
            k = int(torch.multinomial(weights, 1, generator=gen))
            out.append(("popular", docs[k]))
        else:
            out.append(("oneshot", torch.randint(0, 50_000, (4 * CHUNK,),
                                                 generator=gen).tolist()))
    return out


def run(server: LocalRedis, requests: list[tuple[str, list[int]]], row: dict[str, Any],
        maxmemory: int) -> dict[str, Any]:
    client = server.client()
    server.clear()
    server.settle()
    client.config_set("maxmemory", maxmemory)
    client.config_set("maxmemory-policy", "volatile-lru")
    client.config_resetstat()
    meta = EngineMetadata("keep-bench", 1, 0, torch.bfloat16, 4, 4, 64)
    config = CacheConfig(remote_url=server.url, key_prefix="keep", local_cpu=False,
                         store_async=False, stats_publish_interval=None, load_policy="always",
                         store_after=row["store_after"], pin_budget=0.05,
                         keep_policy="redis")  # issue 44's rows: Redis's own eviction
    caches = [torch.randn(2, 64, 16, 4, 64).to(torch.bfloat16) for _ in range(4)]
    slots = torch.arange(4 * CHUNK, dtype=torch.int64)
    hits = {"popular": [0, 0], "system": [0, 0]}
    pinned = False
    start = time.perf_counter()
    with CacheEngine(config, meta) as engine:
        for i, (kind, tokens) in enumerate(requests):
            hit = engine.lookup(tokens)
            if kind == "popular" and i >= WARMUP:
                hits["popular"][0] += hit
                hits["popular"][1] += len(tokens)
            if kind == "system" and i > 0:
                hits["system"][0] += hit
                hits["system"][1] += len(tokens)
            if hit < len(tokens):
                engine.store(tokens, PagedKV(caches, slots[:len(tokens)]))
            if kind == "system" and row["pin"] and not pinned and engine.lookup(tokens):
                engine.pin(tokens)
                assert engine.flush()
                pinned = True
        written = int(engine.metrics.get("remote.written_bytes"))
        refused = int(engine.metrics.get("pins.refused_chunks"))
    evicted = int(client.info("stats")["evicted_keys"])
    client.close()
    assert refused == 0
    return {"popular_hit_rate": hits["popular"][0] / max(1, hits["popular"][1]),
            "system_hit_rate": hits["system"][0] / max(1, hits["system"][1]),
            "written_bytes": written, "evicted_keys": evicted,
            "seconds": time.perf_counter() - start}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--documents", type=int, default=20)
    parser.add_argument("--popular", type=float, default=0.3)
    parser.add_argument("--system-every", type=int, default=25)
    parser.add_argument("--maxmemory-mb", type=int, default=64)
    args = parser.parse_args()
    maxmemory = args.maxmemory_mb * 1024 * 1024
    names = list(ROWS)
    per_row: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with LocalRedis() as server:
        version = server.version()
        for r in range(args.rounds):
            requests = stream(args, seed=r)  # one stream a round, the same for every row
            for name in names[r % len(names):] + names[:r % len(names)]:
                per_row[name].append(run(server, requests, ROWS[name], maxmemory))
                print(f"round {r} {name}: {per_row[name][-1]}", flush=True)
    table = {name: {key: summary([run_[key] for run_ in runs])
                    for key in ("popular_hit_rate", "system_hit_rate", "written_bytes",
                                "evicted_keys")}
             for name, runs in per_row.items()}
    doc = {"args": vars(args), "redis": version, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d"), "rows": table, "runs": per_row}
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    today = table["today"]["written_bytes"]["median"]
    print("\n| row | popular documents' hit rate | system prompt's hit rate | bytes written "
          "to Redis | vs today | evicted keys |")
    print("|---|---|---|---|---|---|")
    for name in names:
        row = table[name]

        def rate(key: str, row: dict[str, Any] = row) -> str:
            s = row[key]
            return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"

        w = row["written_bytes"]
        print(f"| {name} | {rate('popular_hit_rate')} | {rate('system_hit_rate')} | "
              f"{w['median'] / 2**20:.0f} MiB ({w['min'] / 2**20:.0f}-{w['max'] / 2**20:.0f}) | "
              f"{w['median'] / today:.2f}x | {row['evicted_keys']['median']:.0f} |")


if __name__ == "__main__":
    main()
