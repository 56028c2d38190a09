"""LocalCPUTier: chunks kept in this process's CPU memory, least recently used evicted first.

The tier holds one reference on each `MemoryObj` it keeps; `get_each` hands the caller a
reference of its own, so an eviction never frees memory a retrieve is still copying from. Its
byte bound is the memory pool's: when an allocation (a store's or a Redis read's) finds the
pool full, the manager asks `evict_for(need)` to free that many bytes, least recently used
first.

Only an entry the tier alone holds frees memory when it goes: one that the write-behind queue or
a read in flight also holds stays (evicting it would free nothing and lose a hit). So
`evict_for` evicts nothing unless the entries it may evict free the bytes asked for, and then no
more of them than needed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.local.memory import MemoryObj
from lmcache_remote.storage.tier import StorageTier
from lmcache_remote.telemetry.metrics import Metrics


class LocalCPUTier(StorageTier):
    """An LRU map of chunk key -> MemoryObj. Thread-safe."""

    name = "local"

    def __init__(self, metrics: Metrics) -> None:
        self._entries: OrderedDict[CacheEngineKey, MemoryObj] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self._metrics = metrics

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def contains(self, specs: Sequence[ChunkSpec]) -> list[bool]:
        with self._lock:
            return [s.key in self._entries for s in specs]

    def get_each(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj | None]:
        """Per chunk, a reference the caller owns, or None; refreshes the LRU order."""
        out: list[MemoryObj | None] = []
        with self._lock:
            for spec in specs:
                obj = self._entries.get(spec.key)
                if obj is not None:
                    self._entries.move_to_end(spec.key)
                    obj = obj.retain()
                out.append(obj)
        return out

    def put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> int:
        stored = 0
        with self._lock:
            for key, obj in zip(keys, objs, strict=True):
                if key in self._entries:
                    self._entries.move_to_end(key)
                    continue
                self._entries[key] = obj.retain()
                self._bytes += obj.nbytes
                stored += 1
        return stored

    def put_each(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> list[bool]:
        """`put`, per chunk: True, the tier holds it now (stored, or held already)."""
        self.put(keys, objs)
        return [True] * len(keys)

    def delete(self, keys: Sequence[CacheEngineKey]) -> int:
        removed = []
        with self._lock:
            for key in keys:
                obj = self._entries.pop(key, None)
                if obj is not None:
                    self._bytes -= obj.nbytes
                    removed.append(obj)
        for obj in removed:
            obj.release()
        return len(removed)

    def evict_for(self, need: int) -> int:
        """Evict least recently used entries that the tier alone holds until they free `need`
        bytes; the bytes freed (>= `need`), or 0, having evicted nothing, when all such entries
        together would free less.

        The reference counts read under the tier's lock are stable for entries the tier alone
        holds: nobody else can take a reference to them but through this tier, under this lock.
        """
        victims: list[CacheEngineKey] = []
        freed = 0
        with self._lock:
            for key, obj in self._entries.items():  # least recently used first
                if freed >= need:
                    break
                if obj.ref_count == 1:
                    victims.append(key)
                    freed += obj.nbytes
            if freed < need:
                return 0
            objs = [self._entries.pop(key) for key in victims]
            self._bytes -= freed
        self._metrics.inc("local.evicted_chunks", len(objs))
        self._metrics.inc("local.evicted_bytes", freed)
        for obj in objs:
            obj.release()
        return freed

    def clear(self) -> None:
        with self._lock:
            objs = list(self._entries.values())
            self._entries.clear()
            self._bytes = 0
        for obj in objs:
            obj.release()

    def close(self) -> None:
        self.clear()
