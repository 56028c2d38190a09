"""StorageTier: the contract every storage tier (local CPU, Redis) fulfils; RemoteTier: a
tier away from the engine (Redis, Valkey, a Cluster), which reads in leading runs.

Keys are `CacheEngineKey`s; values are `MemoryObj`s in the canonical chunk layout.

- `contains(keys)` answers per key whether the tier holds the whole chunk now.
- `put_each(keys, objs)` stores the chunks and says per chunk whether the tier holds it now
  (written, or held already).
- `delete(keys)` removes chunks and returns how many were there.
- Reading is each tier's own, shaped by how the manager uses it: the local tier answers per
  chunk (`LocalCPUTier.get_each`), a `RemoteTier` returns the leading run of chunks it holds
  (`get`: it stops at the first missing or bad chunk). Either way each chunk handed out is a
  `MemoryObj` the caller owns (one reference, to release), a tier never returns a value that
  failed a check, a tier takes its own references on what it stores, and a chunk is whole or
  absent, never partly written.

Remote tiers raise `BackendError` subclasses for remote failures; the manager decides what a
failure means (a miss, a dropped write), the tier never hides one.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey


class StorageTier(abc.ABC):
    """A place chunks live. Implementations are thread-safe."""

    name: str = "tier"

    @abc.abstractmethod
    def contains(self, specs: Sequence[ChunkSpec]) -> list[bool]: ...

    @abc.abstractmethod
    def put_each(self, keys: Sequence[CacheEngineKey], objs: Sequence[Any]) -> list[bool]:
        """``objs``: `local.memory.MemoryObj`s (not imported here: `local` stands on this)."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[CacheEngineKey]) -> int: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the tier holds; later calls may fail."""


class RemoteTier(StorageTier):
    """A tier away from the engine: `get` reads the leading run of chunks it holds (each
    checked; the first missing or bad chunk ends it), `ping` says whether it answers now.
    `tests/test_storage_contract.py` runs one suite over the local tier and every remote one
    (Redis, Valkey, a Cluster)."""

    @abc.abstractmethod
    def get(self, specs: Sequence[ChunkSpec]) -> list[Any]:
        """The leading run of chunks held, as `MemoryObj`s the caller owns."""

    @abc.abstractmethod
    def ping(self) -> bool: ...
