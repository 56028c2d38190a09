"""End-to-end behaviour of CacheEngine against real Redis and Valkey servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from kvutil import SENTINEL, engine, metadata, reference_keys, tokens, view

from lmcache_remote import CacheEngineKey

HERE = Path(__file__).parent
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = ["kv_split", "packed", "dense"]


def chunk_heads(client: redis.Redis, prefix: str) -> set[str]:
    return {k.decode() for k in client.scan_iter(match=f"{prefix}:v1:*", count=1000)
            if b"#" not in k}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_store_then_retrieve_is_bit_exact(backend_url: str, key_prefix: str, dtype: torch.dtype,
                                          src_kind: str, dst_kind: str) -> None:
    n = 700
    toks = tokens(n)
    meta = metadata(dtype)
    src, read_src = view(src_kind, dtype, n, seed=1, slot_seed=11)
    with engine(backend_url, key_prefix, meta, store_async=False) as a:
        assert a.store(toks, src) == 512
    dst, read_dst = view(dst_kind, dtype, n, seed=None, slot_seed=22)
    with engine(backend_url, key_prefix, meta, local_cpu=False) as b:
        hit = b.retrieve(toks, dst)
    assert hit.tolist() == [True] * 512 + [False] * (n - 512)
    assert torch.equal(read_dst(0, 512), read_src(0, 512))
    untouched = read_dst(512, n)
    assert torch.equal(untouched, torch.full_like(untouched, SENTINEL))


def test_keys_in_redis_follow_the_hash_spec(redis_url: str, redis_client: redis.Redis,
                                            key_prefix: str) -> None:
    toks = tokens(1000, seed=5)
    src, _ = view("kv_split", torch.bfloat16, 1000, seed=1)
    with engine(redis_url, key_prefix) as e:
        e.store(toks, src)
        e.flush()
    assert chunk_heads(redis_client, key_prefix) == set(reference_keys(toks, key_prefix))


def run_worker(*args: str, seed: str = "0") -> dict:
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, str(HERE / "engine_worker.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_hits_from_redis_alone(redis_url: str, key_prefix: str) -> None:
    stored = run_worker("store", redis_url, key_prefix, "1000", seed="1")
    fetched = run_worker("retrieve", redis_url, key_prefix, "1000", seed="12345")
    assert stored["keys"] == fetched["keys"]  # same keys whatever PYTHONHASHSEED is
    assert stored["stored"] == 768
    assert fetched["hits"] == 768 and fetched["exact"] is True
    assert fetched["lookup"] == 768
    assert fetched["stats"]["remote"]["hit_chunks"] == 3


def test_1000_tokens_store_768_lookup_and_mask_agree(backend_url: str, key_prefix: str) -> None:
    toks = tokens(1000)
    src, _ = view("packed", torch.bfloat16, 1000, seed=3)
    with engine(backend_url, key_prefix) as e:
        assert e.store(toks, src) == 768
        e.flush()
        assert e.lookup(toks) == 768
    with engine(backend_url, key_prefix, local_cpu=False) as e2:
        assert e2.lookup(toks) == 768
        dst, _ = view("packed", torch.bfloat16, 1000, seed=None)
        assert int(e2.retrieve(toks, dst).sum()) == 768


def test_deleted_or_damaged_chunk_cuts_the_hit(redis_url: str, redis_client: redis.Redis,
                                               key_prefix: str) -> None:
    toks = tokens(1024)
    src, read_src = view("kv_split", torch.float16, 1024, seed=4)
    meta = metadata(torch.float16)
    with engine(redis_url, key_prefix, meta, store_async=False, serde="raw") as e:
        assert e.store(toks, src) == 1024
    keys = reference_keys(toks, key_prefix, dtype="float16")
    # damage chunk 2 in place (same length), delete chunk 3
    value = bytearray(redis_client.get(keys[2]))
    value[-5] ^= 0x40
    redis_client.set(keys[2], bytes(value))
    redis_client.delete(keys[3])
    with engine(redis_url, key_prefix, meta, local_cpu=False) as e:
        assert e.lookup(toks) == 768  # lookup sees presence: chunk 3 is gone
        dst, read_dst = view("kv_split", torch.float16, 1024, seed=None, slot_seed=9)
        hit = e.retrieve(toks, dst)
        assert hit.tolist() == [True] * 512 + [False] * 512
        assert torch.equal(read_dst(0, 512), read_src(0, 512))
        rest = read_dst(512, 1024)
        assert torch.equal(rest, torch.full_like(rest, SENTINEL))
        assert e.stats()["remote"]["corrupt_chunks"] == 1
    assert redis_client.exists(keys[2]) == 0  # the damaged value was deleted
    assert redis_client.exists(keys[1]) == 1


@pytest.mark.parametrize("change", ["model", "worker", "dtype", "salt"])
def test_other_namespace_never_hits(redis_url: str, key_prefix: str, change: str) -> None:
    toks = tokens(512)
    src, _ = view("kv_split", torch.bfloat16, 512, seed=1)
    with engine(redis_url, key_prefix, store_async=False) as e:
        assert e.store(toks, src, cache_salt="tenant-a") == 512
    meta = {
        "model": metadata(model="other/model"),
        "worker": metadata(worker=1, world=2),
        "dtype": metadata(torch.float16),
        "salt": metadata(),
    }[change]
    salt = "tenant-b" if change == "salt" else "tenant-a"
    dtype = meta.kv_dtype
    with engine(redis_url, key_prefix, meta, local_cpu=False) as other:
        assert other.lookup(toks, cache_salt=salt) == 0
        dst, _ = view("kv_split", dtype, 512, seed=None)
        assert not other.retrieve(toks, dst, cache_salt=salt).any()


def test_mask_stores_and_loads_only_the_true_part(redis_url: str, redis_client: redis.Redis,
                                                  key_prefix: str) -> None:
    toks = tokens(1024)
    src, read_src = view("kv_split", torch.bfloat16, 1024, seed=2)
    mask = torch.ones(1024, dtype=torch.bool)
    mask[:512] = False
    with engine(redis_url, key_prefix, store_async=False) as e:
        assert e.store(toks, src, mask) == 512
    keys = reference_keys(toks, key_prefix)
    assert chunk_heads(redis_client, key_prefix) == set(keys[2:])
    with engine(redis_url, key_prefix, local_cpu=False) as e:
        dst, read_dst = view("kv_split", torch.bfloat16, 1024, seed=None, slot_seed=3)
        hit = e.retrieve(toks, dst, mask)
        assert hit.tolist() == [False] * 512 + [True] * 512
        assert torch.equal(read_dst(512, 1024), read_src(512, 1024))
        head = read_dst(0, 512)
        assert torch.equal(head, torch.full_like(head, SENTINEL))
        assert e.lookup(toks) == 0  # the first two chunks were never stored


def test_chunks_redis_has_are_not_sent_again(redis_url: str, key_prefix: str) -> None:
    toks = tokens(1024)
    src, _ = view("kv_split", torch.bfloat16, 1024, seed=2)
    with engine(redis_url, key_prefix, store_async=False) as a:
        a.store(toks[:512], src)
        assert a.stats()["remote"]["written_chunks"] == 2
    with engine(redis_url, key_prefix, store_async=False) as b:
        assert b.store(toks, src) == 1024
        assert b.stats()["remote"]["written_chunks"] == 2  # only the two new ones


def test_write_behind_flush_and_freeze(redis_url: str, redis_client: redis.Redis,
                                       key_prefix: str) -> None:
    toks = tokens(1024)
    src, _ = view("kv_split", torch.bfloat16, 1024, seed=2)
    with engine(redis_url, key_prefix, store_async=True) as e:
        e.freeze()
        assert e.store(toks, src) == 0
        assert e.flush() is True
        assert chunk_heads(redis_client, key_prefix) == set()
        e.freeze(False)
        assert e.store(toks, src) == 1024
        assert e.flush() is True
        assert len(chunk_heads(redis_client, key_prefix)) == 4
        e.freeze()
        dst, _ = view("kv_split", torch.bfloat16, 1024, seed=None)
        assert bool(e.retrieve(toks, dst).all())  # reads still served while frozen


def test_full_pool_keeps_the_prefix_that_fits(redis_url: str, key_prefix: str) -> None:
    meta = metadata(torch.float32)
    chunk_bytes = 2 * 2 * 256 * 2 * 8 * 4  # layers * kv * tokens * heads * head * 4 bytes
    toks = tokens(2048)
    src, _ = view("kv_split", torch.float32, 2048, seed=1)
    limit = (3 * chunk_bytes + 100) / 1024**3
    # 3 chunk buffers fit in the budget; the write-behind queue may hold half of it (1.5
    # chunks), so the first chunk is queued and the other two are dropped, counted
    with engine(redis_url, key_prefix, meta, local_cpu=False, max_local_cpu_size=limit,
                store_queue_size=1.0) as e:
        stored = e.store(toks, src)
        assert stored == 256
        stats = e.stats()
        assert stats["engine"]["store_out_of_memory_chunks"] == 5
        assert stats["remote"]["queue_full_drops"] == 2
        e.flush()
        assert e.lookup(toks) == 256
    with engine(redis_url, key_prefix + "s", meta, local_cpu=False, max_local_cpu_size=limit,
                store_async=False) as e:
        assert e.store(toks, src) == 3 * 256  # no queue: the whole budget serves the copies
        assert e.lookup(toks) == 768


def test_lz4_and_raw_read_each_other(redis_url: str, key_prefix: str) -> None:
    toks = tokens(512)
    src, read_src = view("kv_split", torch.bfloat16, 512, seed=8)
    with engine(redis_url, key_prefix, serde="lz4", store_async=False) as e:
        e.store(toks, src)
    with engine(redis_url, key_prefix, serde="raw", local_cpu=False) as e:
        dst, read_dst = view("dense", torch.bfloat16, 512, seed=None)
        assert bool(e.retrieve(toks, dst).all())
        assert torch.equal(read_dst(0, 512), read_src(0, 512))


def test_multi_part_values_round_trip_and_missing_part_cuts(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    toks = tokens(768)
    src, read_src = view("kv_split", torch.float32, 768, seed=8)
    meta = metadata(torch.float32)
    with engine(redis_url, key_prefix, meta, store_async=False, remote_part_size=8192) as e:
        assert e.store(toks, src) == 768
    keys = reference_keys(toks, key_prefix, dtype="float32")
    assert redis_client.exists(keys[0] + "#1", keys[0] + "#3") == 2
    redis_client.delete(keys[1] + "#2")
    with engine(redis_url, key_prefix, meta, local_cpu=False, remote_part_size=8192) as e:
        assert e.lookup(toks) == 256
        dst, read_dst = view("kv_split", torch.float32, 768, seed=None)
        assert e.retrieve(toks, dst).tolist() == [True] * 256 + [False] * 512
        assert torch.equal(read_dst(0, 256), read_src(0, 256))
        remote = e.stats()["remote"]
        assert remote["incomplete_chunks"] == 1 and "corrupt_chunks" not in remote
    assert redis_client.exists(keys[1], keys[1] + "#1") == 0  # the rest of it was deleted


@pytest.mark.parametrize("serde", ["raw", "lz4"])
def test_ttl_reaches_every_part_in_one_write(redis_url: str, redis_client: redis.Redis,
                                             key_prefix: str, serde: str) -> None:
    toks = tokens(512)
    src, read_src = view("kv_split", torch.float32, 512, seed=8)
    meta = metadata(torch.float32)
    with engine(redis_url, key_prefix, meta, store_async=False, remote_part_size=8192,
                remote_ttl=600, serde=serde) as e:
        assert e.store(toks, src) == 512
    for head in reference_keys(toks, key_prefix, dtype="float32"):
        parts = [head] + [f"{head}#{i}" for i in range(1, 4)]
        ttls = [redis_client.pttl(k) for k in parts]
        assert all(590_000 < t <= 600_000 for t in ttls), ttls
    with engine(redis_url, key_prefix, meta, local_cpu=False, remote_part_size=8192) as e:
        dst, read_dst = view("dense", torch.float32, 512, seed=None)
        assert bool(e.retrieve(toks, dst).all())
        assert torch.equal(read_dst(0, 512), read_src(0, 512))


def test_retrieve_rejects_mismatched_view(redis_url: str, key_prefix: str) -> None:
    src, _ = view("kv_split", torch.float16, 256, seed=1)
    with engine(redis_url, key_prefix) as e, pytest.raises(ValueError, match="metadata"):
        e.store(tokens(256), src)


def test_key_string_round_trip_matches_redis_key(redis_url: str, key_prefix: str) -> None:
    keys = reference_keys(tokens(256), key_prefix)
    key = CacheEngineKey.from_redis_key(key_prefix, keys[0])
    assert key.redis_key(key_prefix) == keys[0]
