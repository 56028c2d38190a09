"""The long run in miniature: an engine whose local tier is full keeps loading from Redis.

DESIGN.md's "Memory budget and the long run": one budget for the local tier, the write-behind
queue and reads in flight; a full local tier never blocks a load (a read evicts, least recently
used first, exactly what it needs); `lookup` promises what `retrieve` delivers; a chunk already
queued or being written is not queued again. Every test checks the bytes that come back.

Geometry (tests/kvutil.py): 2 layers, 2 KV heads, head size 8, bfloat16: a 256-token chunk is
32 KiB, so a budget of a few dozen chunks fills in a few stores.
"""

from __future__ import annotations

import torch
from kvutil import engine, metadata, tokens, view

from lmcache_remote import CacheConfig
from lmcache_remote.storage.manager.storage_manager import StorageManager

CHUNK_BYTES = metadata().layout.nbytes(256)
GIB = 1024**3
PROMPT = 4096  # 16 chunks


def budget(chunks: int) -> float:
    """`max_local_cpu_size` (GiB) holding exactly `chunks` chunks."""
    return chunks * CHUNK_BYTES / GIB


def written_prompt(url: str, prefix: str, seed: int, n: int = PROMPT):
    """Store a prompt of `n` tokens from a writer engine with no local tier (synchronously);
    returns its tokens and a reader of the source KV."""
    toks = tokens(n, seed=seed)
    src, read_src = view("dense", torch.bfloat16, n, seed=seed)
    with engine(url, prefix, store_async=False, local_cpu=False) as writer:
        assert writer.store(toks, src) == n
    return toks, read_src


def load(e, toks: list[int], read_src) -> tuple[int, int]:
    """vLLM's flow on `e`: lookup, then retrieve into an empty cache; checks every byte of the
    hit against the source. Returns (lookup tokens, retrieved tokens)."""
    promised = e.lookup(toks)
    dst, read_dst = view("dense", torch.bfloat16, len(toks), seed=None)
    got = int(e.retrieve(toks, dst).sum())
    assert torch.equal(read_dst(0, got), read_src(0, got))
    return promised, got


def test_a_reader_whose_local_tier_is_full_keeps_loading(redis_url: str, key_prefix: str) -> None:
    prompts = [written_prompt(redis_url, key_prefix, seed) for seed in range(8)]
    with engine(redis_url, key_prefix, max_local_cpu_size=budget(40)) as reader:
        for _ in range(3):  # 8 prompts x 16 chunks: the 40-chunk tier is full after 3
            for toks, read_src in prompts:
                assert load(reader, toks, read_src) == (PROMPT, PROMPT)
        later = written_prompt(redis_url, key_prefix, seed=99)  # only in Redis
        assert load(reader, *later) == (PROMPT, PROMPT)
        stats = reader.stats()
    assert stats["local"]["entries"] <= 40
    assert stats["local"]["evicted_chunks"] >= 3 * 8 * 16 - 40
    assert stats["remote"]["hit_tokens"] >= 3 * 8 * PROMPT - 40 * 256
    assert stats["engine"].get("promise_broken_tokens", 0) == 0
    assert stats.get("memory", {}).get("no_room_chunks", 0) == 0


def test_a_writer_whose_local_tier_is_full_keeps_loading(redis_url: str, key_prefix: str) -> None:
    with engine(redis_url, key_prefix, max_local_cpu_size=budget(32)) as rw:
        for seed in range(100, 106):  # its own prompts fill its tier (96 chunks > 32)
            src, _ = view("dense", torch.bfloat16, PROMPT, seed=seed)
            assert rw.store(tokens(PROMPT, seed=seed), src) == PROMPT
            assert rw.flush()
        for seed in range(6):
            toks, read_src = written_prompt(redis_url, key_prefix, seed)
            assert load(rw, toks, read_src) == (PROMPT, PROMPT)
        stats = rw.stats()
    assert stats["remote"]["hit_tokens"] == 6 * PROMPT
    assert stats["engine"].get("promise_broken_tokens", 0) == 0


def test_a_load_evicts_exactly_what_it_needs(redis_url: str, key_prefix: str) -> None:
    with engine(redis_url, key_prefix, max_local_cpu_size=budget(8)) as e:
        for seed in (200, 201):  # 4 chunks each: the 8-chunk tier is exactly full
            src, _ = view("dense", torch.bfloat16, 1024, seed=seed)
            assert e.store(tokens(1024, seed=seed), src) == 1024
            assert e.flush()
        assert e.stats()["local"]["entries"] == 8
        toks, read_src = written_prompt(redis_url, key_prefix, seed=202, n=1024)
        assert load(e, toks, read_src) == (1024, 1024)
        stats = e.stats()
    assert stats["local"]["evicted_chunks"] == 4
    assert stats["local"]["entries"] == 8


def test_no_eviction_when_it_cannot_make_room() -> None:
    """Reads in flight and the queue hold the pool: an allocation that eviction cannot help
    evicts nothing (the tier is not emptied for nothing) and is counted; once they let go, one
    allocation evicts exactly one entry."""
    cfg = CacheConfig(remote_url=None, max_local_cpu_size=budget(8), chunk_size=256)
    manager = StorageManager(cfg, metadata().layout, _metrics())
    local = manager.local
    assert local is not None
    in_flight = [manager.allocate(256) for _ in range(6)]
    cached = [manager.allocate(256) for _ in range(2)]
    assert all(o is not None for o in in_flight + cached)
    keys = [spec.key for spec in _specs(2)]
    local.put(keys, cached)  # the tier holds them, and so does their writer (the queue, say)
    assert manager.allocate(256) is None
    assert len(local) == 2
    assert manager.metrics.get("memory.no_room_chunks") == 1
    for obj in cached:
        obj.release()  # only the tier holds them now: evicting one makes room
    extra = manager.allocate(256)
    assert extra is not None
    assert len(local) == 1
    assert manager.metrics.get("local.evicted_chunks") == 1
    for obj in [*in_flight, extra]:
        obj.release()
    manager.close()


def test_lookup_never_promises_more_than_one_retrieve_can_hold(redis_url: str,
                                                               key_prefix: str) -> None:
    toks, read_src = written_prompt(redis_url, key_prefix, seed=300)  # 16 chunks
    # 20 chunks of budget, of which the write-behind queue may take half: 10 chunks for reads
    with engine(redis_url, key_prefix, max_local_cpu_size=budget(20)) as e:
        promised, got = load(e, toks, read_src)
        stats = e.stats()
    assert promised == 2560
    assert got == PROMPT  # the queue was empty, so this retrieve could hold more
    assert stats["engine"]["lookup_capped_tokens"] == PROMPT - 2560
    assert stats["engine"].get("promise_broken_tokens", 0) == 0


def test_a_broken_promise_is_counted(redis_url: str, redis_client, key_prefix: str) -> None:
    toks, read_src = written_prompt(redis_url, key_prefix, seed=400)
    with engine(redis_url, key_prefix, local_cpu=False) as e:
        assert e.lookup(toks) == PROMPT
        fifth = e.token_db.chunks(toks)[4].key.redis_key(key_prefix)
        assert redis_client.unlink(fifth) == 1  # evicted between lookup and retrieve
        dst, read_dst = view("dense", torch.bfloat16, PROMPT, seed=None)
        assert int(e.retrieve(toks, dst).sum()) == 4 * 256
        assert torch.equal(read_dst(0, 1024), read_src(0, 1024))
        stats = e.stats()
    assert stats["engine"]["promise_broken_tokens"] == PROMPT - 1024
    assert stats["engine"]["promise_broken_requests"] == 1


def test_a_chunk_queued_or_being_written_is_not_queued_again(private_redis) -> None:
    """Two stores of one prompt before the write-behind queue lands write each chunk once.
    `CLIENT PAUSE ... WRITE` holds the writer thread's SET while EXISTS still answers, so the
    second store sees the chunks absent from Redis, as it would between two requests of one
    step."""
    client = private_redis.client()
    toks = tokens(1024, seed=500)
    src, read_src = view("dense", torch.bfloat16, 1024, seed=500)
    with engine(private_redis.url, "dup", remote_timeout=30.0,
                stats_publish_interval=None) as e:
        client.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            assert e.store(toks, src) == 1024
            assert e.store(toks, src) == 1024
        finally:
            client.execute_command("CLIENT", "UNPAUSE")
        assert e.flush()
        stats = e.stats()
    assert stats["remote"]["written_chunks"] == 4
    assert stats["remote"]["duplicate_writes_skipped"] == 4
    with engine(private_redis.url, "dup", local_cpu=False) as fresh:
        assert load(fresh, toks, read_src) == (1024, 1024)


def _metrics():
    from lmcache_remote.telemetry.metrics import Metrics

    return Metrics()


def _specs(n: int):
    from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase

    db = TokenDatabase(KeyNamespace("test/model", 1, 0, "bfloat16"), 256, False)
    return db.chunks(tokens(256 * n, seed=600))
