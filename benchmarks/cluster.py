"""Store/retrieve throughput on a three-master Redis Cluster beside a single Redis, same data.

    .venv/bin/python -m benchmarks.cluster [--tokens 8192] [--request 2048] [--serde raw]
                                           [--valkey] [--json]

Starts a single `redis-server` and a 3-master cluster (`tests/cluster_servers.py`) on loopback,
then for each: one `CacheEngine` per deployment (no local CPU tier, synchronous stores, so
every byte crosses the wire inside the timed call) stores the same KV, request by request, then
retrieves it into a fresh cache and checks it is bit-exact. The KV has the shape of
Llama-3.1-8B (32 layers, 8 KV heads, head size 128, bf16: 128 KiB per token), random values.
Prints GB/s (10^9 bytes of KV per second) per deployment and the cluster/single ratios.

One run, no warm-up beyond the first request: figures for sizing, not a statistic. On a
machine with fewer cores than the cluster has masters, the servers compete with the client
for CPU and the cluster cannot show its bandwidth; docs/deploy.md reads the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from lmcache_remote import CacheConfig, CacheEngine, DenseKV, EngineMetadata
from lmcache_remote.admin.private_server import RedisServer, ValkeyServer
from tests.cluster_servers import ClusterServers

LAYERS, HEADS, HEAD = 32, 8, 128
DTYPE = torch.bfloat16


def _kv(tokens: int, seed: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (HEADS, tokens, HEAD)
    if seed is None:
        return ([torch.zeros(shape, dtype=DTYPE) for _ in range(LAYERS)],
                [torch.zeros(shape, dtype=DTYPE) for _ in range(LAYERS)])
    gen = torch.Generator().manual_seed(seed)
    make = lambda: torch.randn(shape, generator=gen).to(DTYPE)  # noqa: E731
    return [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]


def _run(url: str, args: argparse.Namespace, kv: Any) -> dict[str, float]:
    cfg = CacheConfig(remote_url=url, key_prefix="lmcrbench", local_cpu=False,
                      store_async=False, serde=args.serde, remote_timeout=30.0,
                      max_local_cpu_size=4.0)
    meta = EngineMetadata("bench/llama-3.1-8b", 1, 0, DTYPE, LAYERS, HEADS, HEAD)
    keys, values = kv
    requests = args.tokens // args.request
    nbytes = 2 * LAYERS * HEADS * HEAD * DTYPE.itemsize * args.request * requests
    with CacheEngine(cfg, meta) as eng:
        spans = [slice(r * args.request, (r + 1) * args.request) for r in range(requests)]
        ids = [torch.arange(s.start, s.stop) + 7 for s in spans]
        started = time.perf_counter()
        for tok, s in zip(ids, spans, strict=True):
            stored = eng.store(tok, DenseKV([k[:, s] for k in keys], [v[:, s] for v in values]))
            assert stored == args.request, f"stored {stored} of {args.request} tokens"
        store_s = time.perf_counter() - started
        dst_keys, dst_values = _kv(args.tokens, None)
        started = time.perf_counter()
        for tok, s in zip(ids, spans, strict=True):
            view = DenseKV([k[:, s] for k in dst_keys], [v[:, s] for v in dst_values])
            hit = eng.retrieve(tok, view)
            assert bool(hit.all()), "a chunk was missing"
        retrieve_s = time.perf_counter() - started
    for a, b in zip(keys + values, dst_keys + dst_values, strict=True):
        assert torch.equal(a, b), "retrieved KV differs"
    return {"bytes": nbytes, "store_gbps": nbytes / store_s / 1e9,
            "retrieve_gbps": nbytes / retrieve_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of KV in all")
    parser.add_argument("--request", type=int, default=2048, help="tokens per store/retrieve")
    parser.add_argument("--serde", default="raw", choices=["raw", "lz4"])
    parser.add_argument("--valkey", action="store_true", help="valkey-server instead of redis")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args()
    server_cls = ValkeyServer if args.valkey else RedisServer
    kv = _kv(args.tokens, seed=1)
    results: dict[str, Any] = {"tokens": args.tokens, "request_tokens": args.request,
                               "serde": args.serde, "server": server_cls.default_name,
                               "cpus": os.cpu_count()}
    with server_cls() as single:
        results["single"] = _run(single.url, args, kv)
    with ClusterServers(3, 0, server_cls) as cluster:
        results["cluster3"] = _run(cluster.url, args, kv)
    for op in ("store_gbps", "retrieve_gbps"):
        results[f"ratio_{op.removesuffix('_gbps')}"] = (
            results["cluster3"][op] / results["single"][op]
        )
    if args.json:
        print(json.dumps(results))
        return
    gib = results["single"]["bytes"] / 2**30
    print(f"{gib:.2f} GiB of KV ({args.tokens} tokens, Llama-3.1-8B shape, {args.serde}), "
          f"{args.request} tokens per call, {results['server']}, {results['cpus']} CPUs")
    print(f"{'deployment':<12} {'store GB/s':>11} {'retrieve GB/s':>14}")
    for name in ("single", "cluster3"):
        r = results[name]
        print(f"{name:<12} {r['store_gbps']:>11.2f} {r['retrieve_gbps']:>14.2f}")
    print(f"{'ratio':<12} {results['ratio_store']:>10.2f}x {results['ratio_retrieve']:>13.2f}x")


if __name__ == "__main__":
    main()
