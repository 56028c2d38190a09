"""StorageTier: the contract every storage tier (local CPU, Redis) fulfils.

Keys are `CacheEngineKey`s; values are `MemoryObj`s in the canonical chunk layout.

- `contains(keys)` answers per key whether the tier holds the whole chunk now.
- `get(specs)` returns the leading run of chunks the tier holds, each a `MemoryObj` the caller
  owns (one reference, to release): it stops at the first missing or bad chunk. A tier never
  returns a value that failed a check.
- `put(keys, objs)` stores the chunks (a tier takes its own references) and returns how many it
  stored; a chunk is whole or absent, never partly written.
- `delete(keys)` removes chunks and returns how many were there.

Remote tiers raise `BackendError` subclasses for remote failures; the manager decides what a
failure means (a miss, a dropped write), the tier never hides one.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from lmcache_remote.hashing import ChunkSpec
from lmcache_remote.keys import CacheEngineKey
from lmcache_remote.memory import MemoryObj


class StorageTier(abc.ABC):
    """A place chunks live. Implementations are thread-safe."""

    name: str = "tier"

    @abc.abstractmethod
    def contains(self, specs: Sequence[ChunkSpec]) -> list[bool]: ...

    @abc.abstractmethod
    def get(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj]: ...

    @abc.abstractmethod
    def put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> int: ...

    @abc.abstractmethod
    def delete(self, keys: Sequence[CacheEngineKey]) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the tier holds; later calls may fail."""

    def leading_hits(self, specs: Sequence[ChunkSpec]) -> int:
        """How many leading chunks the tier holds (stops at the first absent one)."""
        count = 0
        for present in self.contains(specs):
            if not present:
                break
            count += 1
        return count
