"""What the soak found in the library, each kept as a focused regression test.

`test_key_caches_stay_within_a_few_mib` (soak finding 1, fixed on main in 424cbdc): every
engine's RSS grew by about 2 MiB a minute in the 10-minute soak runs, in every role
(read-write, read-only and with no local tier), outside `max_local_cpu_size`. The cause:
`RedisTier` kept, per chunk it ever named, its part keys and its packed EXISTS command
(`_key_cache`, `_exists_cache`), about 1.3 KiB per chunk, and cleared them only at 65,536
chunks: 85 MiB per engine, where its own comment promised "a few MiB at most". The soak's RSS
criterion (budget + 48 MiB) would have failed after some 15-20 minutes. The caches are now
bounded to 4,096 chunks; this test looks up 65,536 distinct chunks and checks what the engine
holds afterwards in Python objects (tracemalloc: the caches are plain Python objects).
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import torch

from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata

CHUNK = 64
DISTINCT_CHUNKS = 65_536  # the old caches' bound in entries
FEW_MIB = 8 << 20


def test_key_caches_stay_within_a_few_mib(redis_url: str, key_prefix: str) -> None:
    config = CacheConfig(remote_url=redis_url, key_prefix=key_prefix, chunk_size=CHUNK,
                         max_local_cpu_size=0.01, remote_part_size=24 * 1024,
                         stats_publish_interval=None)
    meta = EngineMetadata("soak/tiny", 1, 0, torch.bfloat16, 2, 2, 64)
    rng = np.random.default_rng(7)
    per_lookup = 256
    with CacheEngine(config, meta) as engine:
        engine.lookup(rng.integers(0, 32_000, per_lookup * CHUNK, dtype=np.uint32))
        gc.collect()
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            for _ in range(DISTINCT_CHUNKS // per_lookup - 1):
                tokens = rng.integers(0, 32_000, per_lookup * CHUNK, dtype=np.uint32)
                assert engine.lookup(tokens) == 0  # nothing stored: every chunk is new
            gc.collect()
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    grown = held - before
    assert grown <= FEW_MIB, f"{grown / 2**20:.1f} MiB held for {DISTINCT_CHUNKS} distinct chunks"
