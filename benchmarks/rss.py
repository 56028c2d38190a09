"""Peak RSS of an engine storing a lot of KV, measured in a child process.

Run as ``python -m benchmarks.rss URL TOTAL_MIB LOCAL_MIB QUEUE_MIB CODEC SHAPE``; prints one
JSON line: the RSS rise during the stores (peak minus the level before them, the source KV
already allocated), and the configured bounds.
"""

from __future__ import annotations

import json
import sys


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(argv: list[str]) -> None:
    url, total_mib, local_mib, queue_mib, codec, shape_name = argv
    import torch

    from benchmarks.data import CHUNK, LLAMA8B, TINY, normal_dense
    from lmcache_remote import CacheConfig, CacheEngine

    shape = {"llama": LLAMA8B, "tiny": TINY}[shape_name]
    per_request = max(1, min(8, int(total_mib) * 2**20 // shape.chunk_bytes))
    requests = max(1, int(total_mib) * 2**20 // (per_request * shape.chunk_bytes))
    num_tokens = per_request * CHUNK
    kv = normal_dense(shape, num_tokens, seed=7)
    tokens = torch.arange(num_tokens)
    config = CacheConfig(remote_url=url, serde=codec, key_prefix="bench-rss", chunk_size=CHUNK,
                         max_local_cpu_size=int(local_mib) / 1024,
                         store_queue_size=int(queue_mib) / 1024, remote_timeout=60.0)
    with CacheEngine(config, shape.metadata()) as engine:
        engine.store(tokens, kv, cache_salt="warm-up")  # imports, threads, first connection
        engine.flush()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        stored = 0
        for i in range(requests):
            stored += engine.store(tokens, kv, cache_salt=f"r{i}")
        engine.flush()
        peak = _status("VmHWM")
        stats = engine.stats()
    print(json.dumps({
        "rise": peak - before, "stored_bytes": stored // CHUNK * shape.chunk_bytes,
        "offered_bytes": requests * num_tokens // CHUNK * shape.chunk_bytes,
        "local_bytes": int(local_mib) * 2**20, "queue_bytes": int(queue_mib) * 2**20,
        "dropped": stats["remote"].get("dropped_chunks", 0),
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
