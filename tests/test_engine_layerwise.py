"""Layer-wise store/retrieve (`store_layer` / `retrieve_layer`) against real Redis: the step
protocol, and bit-exact interoperability with the whole-request `store` / `retrieve`."""

from __future__ import annotations

import pytest
import redis
import torch
from kvutil import (
    LAYERS,
    SENTINEL,
    chunk_heads,
    engine,
    metadata,
    paged_cache,
    slots,
    token_kv_paged,
    tokens,
    view,
)

from lmcache_remote import PagedKV

DTYPE = torch.bfloat16


def drive_store(gen) -> int:
    """Run a store_layer generator by its protocol: LAYERS Nones, then the accepted count."""
    for _ in range(LAYERS):
        assert next(gen) is None
    accepted = next(gen)
    with pytest.raises(StopIteration):
        next(gen)
    return accepted


def drive_retrieve(gen) -> torch.Tensor:
    masks = [next(gen) for _ in range(LAYERS + 1)]
    with pytest.raises(StopIteration):
        next(gen)
    assert all(m is masks[0] for m in masks)
    return masks[-1]


def values(client: redis.Redis, prefix: str) -> dict[str, bytes]:
    """Every chunk value under `prefix`, keyed by the key with the prefix cut off."""
    keys = sorted(client.scan_iter(match=f"{prefix}:v1:*", count=1000))
    return {k.decode()[len(prefix):]: client.get(k) for k in keys}


@pytest.mark.parametrize("kind", ["kv_split", "packed"])
def test_layerwise_and_whole_request_write_the_same_bytes(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, kind: str
) -> None:
    toks = tokens(800)
    src, _ = view(kind, DTYPE, 800, seed=1, slot_seed=3)
    with engine(redis_url, key_prefix + "w", store_async=False) as whole:
        assert whole.store(toks, src) == 768
    with engine(redis_url, key_prefix + "l", store_async=False) as layered:
        assert drive_store(layered.store_layer(toks, src)) == 768
    by_whole = values(redis_client, key_prefix + "w")
    assert len(chunk_heads(by_whole)) == 3
    assert values(redis_client, key_prefix + "l") == by_whole


@pytest.mark.parametrize(("writer", "reader"), [("layer", "whole"), ("whole", "layer")])
@pytest.mark.parametrize("kind", ["kv_split", "packed"])
def test_each_path_reads_the_other_bit_exactly(
    redis_url: str, key_prefix: str, writer: str, reader: str, kind: str
) -> None:
    n = 700
    toks = tokens(n, seed=2)
    src, read_src = view("kv_split", DTYPE, n, seed=5, slot_seed=1)
    with engine(redis_url, key_prefix) as a:
        stored = drive_store(a.store_layer(toks, src)) if writer == "layer" else a.store(toks, src)
        assert stored == 512
        assert a.flush()
    other = "packed" if kind == "kv_split" else "kv_split"
    dst, read_dst = view(other, DTYPE, n, seed=None, slot_seed=7)
    with engine(redis_url, key_prefix, local_cpu=False) as b:
        hit = (drive_retrieve(b.retrieve_layer(toks, dst)) if reader == "layer"
               else b.retrieve(toks, dst))
    assert hit.tolist() == [True] * 512 + [False] * (n - 512)
    assert torch.equal(read_dst(0, 512), read_src(0, 512))
    rest = read_dst(512, n)
    assert torch.equal(rest, torch.full_like(rest, SENTINEL))


def test_retrieve_layer_writes_one_layer_per_step(redis_url: str, key_prefix: str) -> None:
    toks = tokens(512, seed=4)
    src, read_src = view("kv_split", DTYPE, 512, seed=6)
    with engine(redis_url, key_prefix, store_async=False) as a:
        assert a.store(toks, src) == 512
    dst, read_dst = view("packed", DTYPE, 512, seed=None, slot_seed=8)
    with engine(redis_url, key_prefix, local_cpu=False) as b:
        gen = b.retrieve_layer(toks, dst)
        mask = next(gen)  # fetched: the hit is known, nothing written yet
        assert bool(mask.all())
        untouched = read_dst(0, 512)
        assert torch.equal(untouched, torch.full_like(untouched, SENTINEL))
        for layer in range(LAYERS):
            assert next(gen) is mask
            got = read_dst(0, 512)
            assert torch.equal(got[: layer + 1], read_src(0, 512)[: layer + 1])
            later = got[layer + 1:]
            assert torch.equal(later, torch.full_like(later, SENTINEL))
        with pytest.raises(StopIteration):
            next(gen)
        assert b.stats()["engine"]["retrieved_tokens"] == 512


def test_store_layer_copies_layer_by_layer(redis_url: str, key_prefix: str) -> None:
    """Layer l is read from the cache at step l: a layer changed after its step keeps the old
    value in the stored chunk, one changed before it is stored as changed."""
    toks = tokens(256, seed=9)
    caches, sm = paged_cache("kv_split", DTYPE, seed=3), slots(256, 0)
    with engine(redis_url, key_prefix, store_async=False) as a:
        gen = a.store_layer(toks, PagedKV(caches, sm))
        assert next(gen) is None  # layer 0 copied
        original = token_kv_paged(caches, "kv_split", sm)
        caches[0].zero_()  # too late: layer 0 was taken
        caches[1].add_(1.0)  # in time: layer 1 is taken at the next step
        expected = token_kv_paged(caches, "kv_split", sm)
        expected[0] = original[0]
        assert not torch.equal(expected[1], original[1])
        assert next(gen) is None
        assert next(gen) == 256
    dst, read_dst = view("kv_split", DTYPE, 256, seed=None, slot_seed=4)
    with engine(redis_url, key_prefix, local_cpu=False) as b:
        assert bool(b.retrieve(toks, dst).all())
    assert torch.equal(read_dst(0, 256), expected)


def test_store_layer_closed_early_stores_nothing(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    toks = tokens(512)
    src, _ = view("kv_split", DTYPE, 512, seed=1)
    with engine(redis_url, key_prefix, store_async=False) as e:
        gen = e.store_layer(toks, src)
        next(gen)
        gen.close()
        assert e.lookup(toks) == 0
        assert e.stats()["pool"]["used_bytes"] == 0
    assert values(redis_client, key_prefix) == {}


def test_layerwise_validation_is_eager_and_idle_cases_follow_the_protocol(
    redis_url: str, key_prefix: str
) -> None:
    src, _ = view("kv_split", DTYPE, 300, seed=1)
    with engine(redis_url, key_prefix) as e:
        with pytest.raises(ValueError):
            e.store_layer([-1] * 300, src)
        with pytest.raises(ValueError):
            e.retrieve_layer(tokens(300), view("kv_split", torch.float16, 300, seed=1)[0])
        assert drive_store(e.store_layer(tokens(100), src)) == 0  # no full chunk
        e.freeze()
        assert drive_store(e.store_layer(tokens(300), src)) == 0
        e.freeze(False)
        assert not drive_retrieve(e.retrieve_layer(tokens(300), src)).any()


def test_partial_hit_writes_only_the_hit_chunks(redis_url: str, key_prefix: str) -> None:
    toks = tokens(1024, seed=3)
    src, read_src = view("kv_split", DTYPE, 1024, seed=2)
    with engine(redis_url, key_prefix, metadata(DTYPE), store_async=False) as a:
        assert a.store(toks[:512], src) == 512
    dst, read_dst = view("kv_split", DTYPE, 1024, seed=None, slot_seed=5)
    with engine(redis_url, key_prefix, local_cpu=False) as b:
        hit = drive_retrieve(b.retrieve_layer(toks, dst))
    assert hit.tolist() == [True] * 512 + [False] * 512
    assert torch.equal(read_dst(0, 512), read_src(0, 512))
    rest = read_dst(512, 1024)
    assert torch.equal(rest, torch.full_like(rest, SENTINEL))
