"""One contract suite for every storage tier: the local CPU tier, Redis 7, Valkey and a
three-master Redis Cluster. Each runs the same tests through the same calls (`StorageTier`:
`contains`, `put_each`, `delete`; reads through the manager's `fetch`), and every remote one
the `RemoteTier` tests (`get`, a leading run; `ping`): no test asks which tier it holds. The
cluster is a `RedisTier` whose channel is a cluster's (chosen when it is built from the
URL), the same code as one server's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kvutil import tier_chunks

from lmcache_remote import CacheConfig
from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.storage.manager.storage_manager import StorageManager
from lmcache_remote.storage.tier import RemoteTier, StorageTier
from lmcache_remote.telemetry.metrics import Metrics
from tests.cluster_servers import ClusterServers
from tests.servers import RedisServer
from tests.test_cluster import _start as start_cluster

LAYOUT = ChunkLayout(2, 2, 8, torch.bfloat16)
DB = TokenDatabase(KeyNamespace("contract/model", 1, 0, "bfloat16"), 64, save_unfull_chunk=True)
REMOTES = ["redis", "valkey", "cluster"]


@pytest.fixture(scope="module")
def cluster_server() -> Iterator[ClusterServers]:
    servers = start_cluster(RedisServer)
    try:
        yield servers
    finally:
        servers.stop()


def _manager(kind: str, request: pytest.FixtureRequest, key_prefix: str) -> StorageManager:
    if kind == "local":
        cfg = CacheConfig(remote_url=None, local_cpu=True, max_local_cpu_size=0.0625)
    else:
        url = request.getfixturevalue(f"{kind}_server").url
        cfg = CacheConfig(remote_url=url, key_prefix=key_prefix, remote_part_size=8192,
                          local_cpu=False, store_async=False, max_local_cpu_size=0.0625)
    return StorageManager(cfg, LAYOUT, Metrics())


@pytest.fixture(params=["local", *REMOTES])
def tier(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[StorageTier]:
    """The tier, inside the storage manager that uses it (`manager` reaches it the real way)."""
    manager = _manager(request.param, request, key_prefix)
    t = manager.local if manager.local is not None else manager.remote
    assert t is not None
    _MANAGERS[id(t)] = manager
    yield t
    del _MANAGERS[id(t)]
    manager.close()


@pytest.fixture(params=REMOTES)
def remote(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[RemoteTier]:
    """A remote tier, built as the manager builds it."""
    manager = _manager(request.param, request, key_prefix)
    assert manager.remote is not None
    yield manager.remote
    manager.close()


_MANAGERS: dict[int, StorageManager] = {}


def put(tier: StorageTier, keys: list, objs: list[MemoryObj]) -> int:
    """How many chunks the tier holds after its own write (as the manager writes to it)."""
    return sum(tier.put_each(keys, objs))


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


def test_a_remote_tier_reads_the_leading_run_itself(remote: RemoteTier) -> None:
    """`RemoteTier.get`: the chunks before the first missing one, each bit-exact and owned by
    the caller; `ping` answers."""
    specs, objs = chunks(64 * 4, seed=4)
    assert remote.put_each([s.key for s in specs], objs) == [True] * 4
    assert remote.delete([specs[1].key]) == 1
    got = remote.get(specs)
    assert len(got) == 1 and torch.equal(got[0].tensor, objs[0].tensor)
    got[0].release()
    rest = remote.get(specs[2:])
    assert [torch.equal(o.tensor, w.tensor) for o, w in zip(rest, objs[2:], strict=True)] == [
        True, True]
    for obj in rest:
        obj.release()
    assert remote.ping()
