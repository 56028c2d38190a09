"""The engine layer: `CacheEngine` (`cache_engine`), the library's front door, and what it
needs above storage and connectors: `metadata` (`EngineMetadata`: model, rank, KV geometry,
the key namespace ranks share), `store_batch` (one store's CPU buffers), `promises` (what
lookups promised and retrieves delivered), `startup` (the start-up line, the native check) and
`reporting` (`EngineReporter`: engine id, fleet publisher, Prometheus).

`from lmcache_remote.engine import CacheEngine, EngineMetadata` is the documented path (as
`import lmcache_remote` is)."""

from __future__ import annotations

from lmcache_remote.engine.cache_engine import CacheEngine
from lmcache_remote.engine.metadata import EngineMetadata

__all__ = ["CacheEngine", "EngineMetadata"]
