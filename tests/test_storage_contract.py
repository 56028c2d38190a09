"""One contract suite for every storage tier: local CPU, Redis 7, Valkey."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvutil import tier_chunks

from lmcache_remote import CacheConfig
from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.cpu_tier import LocalCPUTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.storage.manager.storage_manager import StorageManager
from lmcache_remote.storage.tier import StorageTier
from lmcache_remote.telemetry.metrics import Metrics

LAYOUT = ChunkLayout(2, 2, 8, torch.bfloat16)
DB = TokenDatabase(KeyNamespace("contract/model", 1, 0, "bfloat16"), 64, save_unfull_chunk=True)


@pytest.fixture(params=["local", "redis", "valkey"])
def tier(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[StorageTier]:
    """The tier, inside the storage manager that uses it (`manager` reaches it the real way)."""
    if request.param == "local":
        cfg = CacheConfig(remote_url=None, local_cpu=True, max_local_cpu_size=0.0625)
    else:
        url = request.getfixturevalue(f"{request.param}_server").url
        cfg = CacheConfig(remote_url=url, key_prefix=key_prefix, remote_part_size=8192,
                          local_cpu=False, store_async=False, max_local_cpu_size=0.0625)
    manager = StorageManager(cfg, LAYOUT, Metrics())
    t = manager.local if manager.local is not None else manager.remote
    assert t is not None
    _MANAGERS[id(t)] = manager
    yield t
    del _MANAGERS[id(t)]
    manager.close()


_MANAGERS: dict[int, StorageManager] = {}


def put(tier: StorageTier, keys: list, objs: list[MemoryObj]) -> int:
    """How many chunks the tier stored, by its own write (as the manager writes to it)."""
    if isinstance(tier, RedisTier):
        return sum(tier.put_each(keys, objs))
    assert isinstance(tier, LocalCPUTier)
    return tier.put(keys, objs)


def get(tier: StorageTier, specs: list) -> list[MemoryObj]:
    """The leading run of chunks the tier holds, read through the manager's `fetch`."""
    return _MANAGERS[id(tier)].fetch(specs)


def chunks(n_tokens: int, seed: int) -> tuple[list, list[MemoryObj]]:
    return tier_chunks(DB, LAYOUT, MemoryPool(64 * 1024 * 1024, pin_memory=False), n_tokens, seed)


def test_put_contains_get_round_trip(tier: StorageTier) -> None:
    specs, objs = chunks(64 * 3 + 10, seed=1)  # three full chunks and a partial one
    assert tier.contains(specs) == [False] * 4
    assert put(tier, [s.key for s in specs], objs) == 4
    assert tier.contains(specs) == [True] * 4
    got = get(tier, specs)
    assert len(got) == 4
    for want, have in zip(objs, got, strict=True):
        assert torch.equal(want.tensor, have.tensor)
        have.release()


def test_get_stops_at_first_missing(tier: StorageTier) -> None:
    specs, objs = chunks(64 * 4, seed=2)
    put(tier, [s.key for s in specs], objs)
    assert tier.delete([specs[2].key]) == 1
    assert tier.delete([specs[2].key]) == 0
    assert tier.contains(specs) == [True, True, False, True]
    assert _MANAGERS[id(tier)].leading_chunks(specs) == 2
    got = get(tier, specs)
    assert len(got) == 2
    for obj in got:
        obj.release()


def test_tier_keeps_its_own_reference(tier: StorageTier) -> None:
    specs, objs = chunks(64, seed=3)
    expected = objs[0].tensor.clone()
    put(tier, [specs[0].key], objs)
    objs[0].release()  # the caller lets go; the tier's copy must survive
    got = get(tier, specs)
    assert len(got) == 1 and torch.equal(got[0].tensor, expected)
    got[0].release()


def test_empty_batches(tier: StorageTier) -> None:
    assert tier.contains([]) == []
    assert get(tier, []) == []
    assert put(tier, [], []) == 0
    assert tier.delete([]) == 0
