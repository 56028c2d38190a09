"""StorageTier: the contract every storage tier (local CPU, Redis) fulfils.

Keys are `CacheEngineKey`s; values are `MemoryObj`s in the canonical chunk layout.

- `contains(keys)` answers per key whether the tier holds the whole chunk now.
- `delete(keys)` removes chunks and returns how many were there.
- Reading and writing are each tier's own, shaped by how the manager uses it: the local tier
  answers per chunk (`LocalCPUTier.get_each`, `put`), the remote tier returns the leading run
  of chunks it holds (`RedisTier.get`: it stops at the first missing or bad chunk) and says per
  chunk whether its write landed (`RedisTier.put_each`). Either way each chunk handed out is a
  `MemoryObj` the caller owns (one reference, to release), a tier never returns a value that
  failed a check, a tier takes its own references on what it stores, and a chunk is whole or
  absent, never partly written.

Remote tiers raise `BackendError` subclasses for remote failures; the manager decides what a
failure means (a miss, a dropped write), the tier never hides one.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey


class StorageTier(abc.ABC):
    """A place chunks live. Implementations are thread-safe."""

    name: str = "tier"

    @abc.abstractmethod
    def contains(self, specs: Sequence[ChunkSpec]) -> list[bool]: ...

    @abc.abstractmethod
    def delete(self, keys: Sequence[CacheEngineKey]) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the tier holds; later calls may fail."""
