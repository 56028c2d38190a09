"""What the write path leaves in Redis, byte for byte: a faster put must not change one byte.

- Through `RedisTier.put_each` (the native wire computes the checksums as it sends, on one
  lane or several, with and without an expiry), every value of every golden case of
  tests/test_serde.py is the golden file itself, on Redis and Valkey.
- Through `CacheEngine.store` (the copy out of a paged cache in windows, each handed to the
  write-behind queue while the next is copied, or a synchronous store, with and without an
  integrity key), every key and value written hashes to the digest pinned below, recorded
  from the write path of `5d81ffe` (before issue 47's changes to it).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import redis
import torch
from kvutil import engine, metadata, tokens, view

from lmcache_remote import CacheConfig
from lmcache_remote.engine import cache_engine
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks import writes as chunk_writes
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
from lmcache_remote.storage.wire import windows
from lmcache_remote.telemetry.metrics import Metrics
from tests.test_serde import GOLDEN_CASES, HASH, GoldenCase

#: The digest of every (key, value) `CacheEngine.store` wrote in `_engine_values`, without and
#: with an integrity key, as the write path of 5d81ffe wrote them (a synchronous store and the
#: write-behind queue alike, on Redis and on Valkey).
PINNED = {
    None: "8135088dc70959feac531095bb79bfbbd5e8137ea4285fb7f8241a38a1b136df",
    "key": "62430a220f72a81cca0240e7b9ba297b4f864e5c8344d6b8b59f59fce4bf56b4",
}
#: The environment variable the integrity-key cases read their key from.
KEY_VARIABLE = "LMCR_GOLDEN_INTEGRITY_KEY"


def _case_chunks(case: GoldenCase, count: int) -> tuple[list[CacheEngineKey], list[Any],
                                                       MemoryPool]:
    """``count`` chunks holding the case's tensor, each under its own model name and the
    golden chunk hash."""
    pool = MemoryPool(1 << 20, pin_memory=False)
    tensor = case.tensor()
    keys, objs = [], []
    for i in range(count):
        keys.append(CacheEngineKey(f"golden/m{i}", 1, 0, str(case.dtype)[6:], HASH.hex()))
        obj = pool.allocate(tuple(tensor.shape), tensor.dtype)
        assert obj is not None
        obj.tensor.copy_(tensor)
        objs.append(obj)
    return keys, objs, pool


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("lanes", [1, 4])
@pytest.mark.parametrize("ttl", [None, 3600.0])
def test_a_put_leaves_the_golden_bytes(case: GoldenCase, lanes: int, ttl: float | None,
                                       backend_url: str, key_prefix: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a window per chunk, over every lane (`lanes_for`: one chunk a lane, `lanes` of them)
    monkeypatch.setattr(chunk_writes, "LANE_CHUNKS", 1)
    monkeypatch.setattr(windows, "WINDOW_BYTES", lanes * case.tensor().nbytes)
    golden = [p.read_bytes() for p in case.files()]
    keys, objs, pool = _case_chunks(case, 5)
    shape = case.shape
    config = CacheConfig(remote_url=backend_url, key_prefix=key_prefix, serde=case.codec,
                         remote_write_lanes=lanes, remote_ttl=ttl, remote_timeout=5.0)
    tier = RedisTier(config, ChunkLayout(shape[0], shape[3], shape[4], case.dtype), pool,
                     Metrics())
    tier.serde = tier.values.serde = case.serde()  # the golden case's part size
    client = redis.Redis.from_url(backend_url)
    try:
        assert tier.writes.lanes_for(objs) == lanes
        assert tier.put_each(keys, objs) == [True] * len(keys)
        for key in keys:
            names = key.part_keys(key_prefix, len(golden))
            assert client.get(f"{names[0]}#{len(golden)}") is None  # no part beyond
            assert client.mget(names) == golden, key
            for name in names:
                expiry = client.pttl(name)
                assert (expiry == -1) if ttl is None else (0 < expiry <= ttl * 1000)
    finally:
        client.close()
        tier.close()


def _engine_values(url: str, prefix: str, mode: str, integrity: str | None) -> str:
    """Stores 3 whole chunks and a partial one of a seeded paged cache (4 KiB parts, so a
    chunk is several values) and returns the digest of every key and value written."""
    kv, _ = view("kv_split", torch.bfloat16, 3 * 256 + 100, seed=3, slot_seed=4)
    toks = tokens(3 * 256 + 100, seed=5)
    options: dict[str, Any] = {"store_async": mode == "async", "local_cpu": False,
                               "remote_part_size": 4096, "save_unfull_chunk": True}
    if integrity is not None:
        options["integrity_key"] = f"env:{KEY_VARIABLE}"
    client = redis.Redis.from_url(url)
    stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if stale:
        client.delete(*stale)  # the keys are pinned: another case's values would be found
    with engine(url, prefix, metadata(model="golden/engine"), **options) as e:
        assert e.store(toks, kv) == len(toks)
        assert e.flush()
    try:
        names = sorted(name for name in client.scan_iter(match=f"{prefix}:*", count=1000)
                       if client.type(name) == b"string")  # values, not the fleet's counts
        digest = hashlib.sha256()
        for name in names:
            value = client.get(name)
            assert value is not None
            digest.update(len(name).to_bytes(4, "little") + name)
            digest.update(len(value).to_bytes(8, "little") + value)
        assert len(names) > 4 * 3  # several values per chunk
        return digest.hexdigest()
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("integrity", [None, "key"])
def test_a_store_leaves_the_pinned_bytes(mode: str, integrity: str | None, backend_url: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(windows, "WINDOW_BYTES", 8192)  # several windows per put
    monkeypatch.setattr(cache_engine, "STORE_WINDOW_BYTES", 1)  # a store window per chunk
    monkeypatch.setenv(KEY_VARIABLE, "golden-integrity-key-" + "7" * 32)
    got = _engine_values(backend_url, "golden", mode, integrity)
    assert got == PINNED[integrity]
