"""Local memory: the bytes a process holds chunks in, and the tier kept there.

- `memory`: `MemoryObj` (one chunk's buffer, reference-counted), `MemoryPool` (the one memory
  budget, bounded in bytes), `ChunkLayout` (a chunk's shape, dtype and size);
- `cpus`: how many CPUs this process may use (the codec threads follow it);
- `cpu_tier`: `LocalCPUTier`, the local tier, LRU by bytes (`storage.tier.StorageTier`).

Nothing here talks to Redis; everything above may use it.
"""
