"""LmcrConnector inside vLLM 0.33.0 and 0.34.0: the factory, the Scheduler, the worker
plumbing (`rig`; on 0.34 the worker hooks are driven by vLLM's `ActiveKVConnector`).

Every engine here is `rig.Instance`: vLLM's real scheduler and connector plumbing around a fake
forward whose attention checks, at every layer of every step, that each scheduled request's
context KV is in the cache bit for bit (`bad_reads`). A load that is late, short, in the
wrong slots or of the wrong bytes shows up there. Redis is real: the session's server, or a
private one where a test counts its commands or kills it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import rig
import torch
from kvutil import chunk_heads
from rig import CHUNK, LAYOUTS, NAMES, Instance, prompt
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.engine import FinishReason

from lmcache_remote import ConfigError
from lmcache_remote.integrations.vllm import LmcrConnector, LmcrConnectorMetadata
from lmcache_remote.integrations.vllm.sides import ServedScheduler, ServedWorker, WrongRole
from lmcache_remote.integrations.vllm_core import KVGeometry

Engines = Callable[..., Instance]


def chunk_keys(client: redis.Redis, prefix: str) -> set[str]:
    return {k.decode() for k in chunk_heads(client.scan_iter(match=f"{prefix}:v1:*"))}


def prefill(engine: Instance, req_id: str, tokens: list[int], max_tokens: int = 2) -> None:
    engine.add(req_id, tokens, max_tokens=max_tokens)
    engine.run([req_id])
    assert engine.finished[req_id] == FinishReason.LENGTH
    assert engine.bad_reads == []


def retrieved(engine: Instance, rank: int = 0) -> int:
    return int(engine.worker_engine(rank).stats()["engine"].get("retrieved_tokens", 0))


# -- the factory and the hooks ----------------------------------------------------------------

def test_vllm_builds_both_roles_through_its_factory(engines: Engines) -> None:
    engine = engines()
    sched, worker = engine.scheduler_connector, engine.ranks[0].connector
    assert type(sched) is LmcrConnector and type(worker) is LmcrConnector
    assert type(sched._scheduler) is ServedScheduler and type(sched._worker) is WrongRole
    assert type(worker._worker) is ServedWorker and type(worker._scheduler) is WrongRole
    assert not getattr(LmcrConnector, "__abstractmethods__", set())
    for name, base in inspect.getmembers(KVConnectorBase_V1, inspect.isfunction):
        ours = getattr(LmcrConnector, name)
        if ours is not base and not name.startswith("_"):  # every override keeps vLLM's params
            assert (list(inspect.signature(ours).parameters)
                    == list(inspect.signature(base).parameters)), name


def test_bad_extra_config_stops_vllm_at_start_up(engines: Engines) -> None:
    with pytest.raises(ConfigError, match="chunk_sise"):
        engines(chunk_sise=256)
    with pytest.raises(ConfigError, match="layerwise"):
        engines(layerwise="yes")


def test_the_keys_name_the_weights_vllm_loads(engines: Engines, redis_url: str,
                                              key_prefix: str, tmp_path: Any) -> None:
    """The model field of the keys is `{folder name}@{fingerprint}` by default, the same on
    the scheduler and the workers, the fingerprint the transformers integration computes for
    the folder (`model_fingerprint`); vLLM's `hf_overrides` and a load-time quantization
    change it; `off` and an explicit string are honoured; a model whose files cannot be found
    stops vLLM at start-up with an error that says what to set."""
    import copy

    from lmcache_remote.integrations.vllm import model_namespace
    from lmcache_remote.integrations.vllm_core import load_settings
    from lmcache_remote.naming.fingerprint import FingerprintError, model_fingerprint

    engine = engines()
    prefill(engine, "a", prompt(CHUNK + 10, seed=1))
    assert engine.worker_engine().flush(5.0)
    folder = engine.config.model_config.model
    want = f"{rig.MODEL_NAME}@{model_fingerprint(folder, kv_dtype='bfloat16')}"
    with redis.Redis.from_url(redis_url) as client:
        keys = chunk_keys(client, key_prefix)
    assert keys and {k.split(":")[2] for k in keys} == {want}
    settings = load_settings({})
    assert model_namespace(settings, engine.config) == want
    changed = copy.deepcopy(engine.config)
    changed.model_config.hf_overrides = {"rope_theta": 1e6}
    assert model_namespace(settings, changed) not in (want, None)
    changed = copy.deepcopy(engine.config)
    changed.model_config.quantization = "fp8"
    assert model_namespace(settings, changed) != want
    assert model_namespace(load_settings({"model_fingerprint": "off"}), engine.config
                           ) == rig.MODEL_NAME
    assert model_namespace(load_settings({"model_fingerprint": "run-7", "model_name": "m"}),
                           engine.config) == "m@run-7"
    with pytest.raises(ConfigError, match="model_fingerprint"):
        load_settings({"model_fingerprint": "two words"})
    gone = copy.deepcopy(engine.config)
    gone.model_config.model = str(tmp_path / "nowhere")
    with pytest.raises(FingerprintError, match="model_fingerprint"):
        model_namespace(settings, gone)


def test_a_connector_reset_moves_the_engine_to_a_namespace_of_its_own(
        engines: Engines, redis_url: str, key_prefix: str) -> None:
    """vLLM's `reset_prefix_cache(reset_connector=True)` (the weight-update path: the weights
    may have changed): the engine serves nothing stored before, neither the scheduler's
    lookups nor the workers' loads; what it stores after lands under `{namespace}+{hex}`;
    another engine on the old weights still hits the old chunks."""
    tokens = prompt(2 * CHUNK + 10, seed=5)
    a = engines()
    prefill(a, "before", tokens)
    assert a.worker_engine().flush(5.0)
    old = a.worker_engine().metadata.model_name
    assert a.scheduler.reset_prefix_cache(reset_connector=True)
    prefill(a, "after", tokens)
    assert retrieved(a) == 0  # not loaded: computed again with the (new) weights
    assert a.worker_engine().flush(5.0)
    new = a.worker_engine().metadata.model_name
    assert new.startswith(old + "+") and len(new) == len(old) + 9
    with redis.Redis.from_url(redis_url) as client:
        spaces = {k.split(":")[2] for k in chunk_keys(client, key_prefix)}
    assert spaces == {old, new}
    b = engines()  # started on the old weights: the old namespace, its chunks
    prefill(b, "b", tokens)
    assert retrieved(b) == 2 * CHUNK


def test_the_connector_figures_reach_vllms_metrics_summed_over_ranks(
        engines: Engines) -> None:
    """vLLM's connector stats interface, through vLLM's own code: each rank's and the
    scheduler's `get_kv_connector_stats` every step, summed by vLLM (its output aggregator
    over 2 ranks, its scheduler), in `SchedulerStats`; then recorded by the connector's
    Prometheus metrics (vLLM's labels) as the API server does, read back from the registry."""
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    tokens = prompt(2 * CHUNK + 30, seed=8)
    writer = engines(tp=2)
    prefill(writer, "w", tokens)
    assert writer.worker_engine(0).flush(5.0) and writer.worker_engine(1).flush(5.0)
    reader = engines(tp=2, log_stats=True)
    prefill(reader, "r", tokens)
    payloads = [s.kv_connector_stats for s in reader.scheduler_stats if s.kv_connector_stats]
    assert payloads
    total = LmcrConnector.build_kv_connector_stats(payloads[0])
    for data in payloads[1:]:
        total = total.aggregate(LmcrConnector.build_kv_connector_stats(data))
    counters = total.data["counters"]
    assert counters["prompt_tokens"] == len(tokens)
    assert counters["promised_tokens"] == 2 * CHUNK and counters["lookup_requests"] >= 1
    assert counters["retrieved_tokens"] == 2 * 2 * CHUNK  # each rank loads its heads
    assert counters["remote_hit_tokens"] == 2 * 2 * CHUNK
    assert counters["remote_read_bytes"] > 0
    assert "promise_broken_tokens" not in counters
    assert sum(total.data["latency"]["retrieve_seconds"]) >= 2
    assert total.reduce()["cache_hit_rate"] == round(2 * CHUNK / len(tokens), 4)
    gauges = total.data["gauges"]  # the scheduler's load decision, its figures now
    assert gauges["link_rtt_seconds"] > 0 and gauges["link_bytes_per_s"] > 0
    assert gauges["prefill_tokens_per_s"] > 0

    registry = CollectorRegistry()

    def kind(cls: Any) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    prom = LmcrConnector.build_prom_metrics(
        reader.config, {Gauge: kind(Gauge), Counter: kind(Counter),
                        Histogram: kind(Histogram)},
        ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom is not None
    for data in payloads:
        prom.observe(data, 0)
    text = prometheus_client.generate_latest(registry).decode()
    labels = '{engine="0",model_name="tiny"}'
    assert f"vllm:lmcache_remote_promised_tokens_total{labels} {2 * CHUNK}.0" in text
    assert f"vllm:lmcache_remote_retrieved_tokens_total{labels} {4 * CHUNK}.0" in text
    assert "vllm:lmcache_remote_retrieve_seconds_count" in text
    for gauge in ("link_bytes_per_s", "link_rtt_seconds", "prefill_tokens_per_s"):
        assert f"vllm:lmcache_remote_{gauge}{labels}" in text


def test_the_fleet_view_says_where_a_vllm_engines_prompt_tokens_came_from(
        engines: Engines, redis_client: redis.Redis, key_prefix: str) -> None:
    """The schedulers publish the prompt tokens vLLM was sent, what its own prefix cache held
    and what this cache promised; the workers what they loaded by tier; `fleet_stats` puts
    them together per model namespace (a worker's tokens over its world size: each rank
    loads its share of the heads)."""
    from lmcache_remote.admin.fleet import fleet_stats

    tokens = prompt(2 * CHUNK + 30, seed=9)
    writer = engines(tp=2, stats_publish_interval=0.05)
    prefill(writer, "w", tokens)
    assert writer.worker_engine(0).flush(5.0) and writer.worker_engine(1).flush(5.0)
    reader = engines(tp=2, stats_publish_interval=0.05)
    prefill(reader, "r", tokens)
    assert reader.worker_engine(0).flush(5.0) and reader.worker_engine(1).flush(5.0)
    space = reader.worker_engine().metadata.model_name
    deadline = time.monotonic() + 20
    while True:  # the schedulers publish on their steps, at most every interval
        view = fleet_stats(redis_client, key_prefix)["by_model"].get(space, {})
        if view.get("promised_tokens") == 2 * CHUNK and view.get("prompt_tokens") == 2 * len(
                tokens):
            break
        assert time.monotonic() < deadline, view
        time.sleep(0.05)
    assert (view["schedulers"], view["engines"]) == (2, 4)
    assert view["remote_hit_tokens"] == 2 * CHUNK  # the reader's 2 ranks x 512 / 2
    assert view["local_hit_tokens"] == 0 and view["device_cached_tokens"] == 0
    assert view["computed_tokens"] == 2 * len(tokens) - 2 * CHUNK
    assert view["cache_hit_rate"] == round(2 * CHUNK / (2 * len(tokens)), 6)


# -- loads across engines, every layout -------------------------------------------------------

@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
@pytest.mark.parametrize("reader", LAYOUTS)
def test_second_engine_loads_the_prefix_bit_exactly(engines: Engines, reader: str,
                                                    layerwise: bool) -> None:
    tokens = prompt(700, seed=1)
    writer = "BLHNC" if reader == "LBNHC" else "LBNHC"
    a = engines(layout=writer, layerwise=layerwise, store_async=False)
    prefill(a, "r1", tokens)
    assert retrieved(a) == 0
    b = engines(layout=reader, layerwise=layerwise, local_cpu=False)
    prefill(b, "r2", tokens)  # attention saw [0, 512) from Redis, the rest computed
    assert retrieved(b) == 2 * CHUNK
    assert b.invalid_blocks and not any(b.invalid_blocks)


def test_async_stores_reach_the_second_engine(engines: Engines) -> None:
    tokens = prompt(900, seed=2)
    a = engines(store_async=True)
    prefill(a, "r1", tokens)
    assert a.worker_engine().flush(5.0)
    b = engines(layout="BLNHC", local_cpu=False)
    prefill(b, "r2", tokens)
    assert retrieved(b) == 3 * CHUNK


def test_whole_prompt_hit_leaves_the_last_chunk_to_compute(engines: Engines) -> None:
    tokens = prompt(512, seed=3)
    prefill(engines(store_async=False), "r1", tokens)
    b = engines(local_cpu=False)
    prefill(b, "r2", tokens)
    assert retrieved(b) == CHUNK  # not 512: vLLM must compute at least one token


def test_vllm_prefix_cache_hit_is_kept_and_the_rest_loaded(engines: Engines) -> None:
    tokens = prompt(800, seed=4)
    prefill(engines(store_async=False), "r1", tokens)
    b = engines(local_cpu=False, prefix_caching=True)
    prefill(b, "short", tokens[:300])  # vLLM caches 18 full blocks (288 tokens) itself
    b.add("r2", tokens, max_tokens=2)
    out = b.scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 768  # 288 from vLLM's cache, 480 from Redis
    (plan,) = out.kv_connector_metadata.requests
    assert (plan.load.skip, plan.load.start, plan.load.end) == (256, 288, 768)
    b.execute(out)
    b.run(["r2"])
    assert b.bad_reads == [] and b.finished["r2"] == FinishReason.LENGTH


# -- the scheduler's request life: chunked prefill, preemption, abort -----------------------

def test_chunked_prefill_stores_each_chunk_in_the_step_that_completes_it(
    engines: Engines, redis_client: redis.Redis, key_prefix: str
) -> None:
    tokens = prompt(700, seed=5)
    a = engines(max_batched_tokens=300, store_async=False)
    a.add("r1", tokens, max_tokens=2)
    counts = []
    for _ in range(3):  # 300 + 300 + 100 prompt tokens
        a.step()
        counts.append(len(chunk_keys(redis_client, key_prefix)))
    assert counts == [1, 2, 2]
    a.run(["r1"])
    assert a.bad_reads == []
    b = engines(layout="LHBNC", local_cpu=False)
    prefill(b, "r2", tokens)
    assert retrieved(b) == 2 * CHUNK


@pytest.mark.parametrize(("async_min", "async_save"), [(None, False), (256, False), (256, True)],
                         ids=["sync", "async_load", "async_load_and_save"])
def test_preempted_request_resumes_from_redis(engines: Engines, async_min: int | None,
                                              async_save: bool) -> None:
    first, second = prompt(600, seed=6), prompt(600, seed=7)
    # 80 usable blocks: both prompts fit (2 x 38), their decodes do not: one is preempted
    engine = engines(num_blocks=81, store_async=False, local_cpu=False,
                     async_load_min_tokens=async_min, async_save=async_save)
    engine.add("a", first, max_tokens=90)
    engine.add("b", second, max_tokens=90)
    engine.run(["a", "b"])
    preempted = [r for r in ("a", "b") if engine.preemptions.get(r)]
    assert preempted, "the scheduler never preempted: the test did not test resume"
    assert engine.bad_reads == []
    assert retrieved(engine) >= 2 * CHUNK  # the resumed request loaded its stored chunks
    assert all(engine.finished[r] == FinishReason.LENGTH for r in ("a", "b"))


def test_aborted_request_is_forgotten_and_the_engine_goes_on(
    engines: Engines, redis_client: redis.Redis, key_prefix: str
) -> None:
    tokens = prompt(900, seed=8)
    engine = engines(max_batched_tokens=300, store_async=False)
    engine.add("gone", tokens, max_tokens=4)
    engine.step()
    engine.step()  # 600 of 900 prompt tokens computed, 2 chunks stored
    engine.abort("gone")
    out = engine.step()
    assert "gone" in out.finished_req_ids and out.kv_connector_metadata.requests == []
    assert engine.scheduler_connector._scheduler.side._trackers == {}
    assert len(chunk_keys(redis_client, key_prefix)) == 2
    prefill(engine, "next", tokens)
    assert retrieved(engine) == 2 * CHUNK  # its own worker tier, from the aborted prefill


# -- stores inside save_kv_layer (layer-wise) -------------------------------------------------

@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_layerwise_stores_copy_each_layer_inside_save_kv_layer(engines: Engines,
                                                               layerwise: bool) -> None:
    """After the forward (every save_kv_layer done) and before wait_for_save, the stored
    tokens' KV is overwritten in the cache. Layer-wise stores copied it inside save_kv_layer
    already and store the true KV; whole stores run in wait_for_save and store the garbage."""
    tokens = prompt(600, seed=9)
    a = engines(layerwise=layerwise, store_async=False)

    def scribble(rank: rig.Rank, out: Any) -> None:
        for name in NAMES:
            for req_id, (start, end) in rank.work.items():
                s = rank.slots(req_id, start, end)
                rank.caches[name][s // rig.BLOCK, :, s % rig.BLOCK, :] = 1.0

    a.after_forward = scribble
    a.add("r1", tokens, max_tokens=1)
    a.step()
    a.after_forward = None
    b = engines(local_cpu=False, layerwise=layerwise)
    b.add("r2", tokens, max_tokens=1)
    b.run(["r2"])
    assert retrieved(b) == 2 * CHUNK
    if layerwise:
        assert b.bad_reads == []
    else:
        assert {(r, pos) for r, _, _, pos in b.bad_reads} == {("r2", 0)}


# -- a failed load: recompute, and the chunks stored again -------------------------------------

def _delete_chunk(client: redis.Redis, key_prefix: str, engine: Instance, tokens: list[int],
                  index: int) -> None:
    lookup = engine.scheduler_connector._scheduler.lookup
    ns = lookup.namespaces[0]
    from lmcache_remote.naming.hashing import TokenDatabase

    spec = TokenDatabase(ns, CHUNK, False).prefix_keys(tokens)[index]
    keys = [k.decode() for k in client.scan_iter(match=spec.key.redis_key(key_prefix) + "*")]
    assert keys and client.unlink(*keys) == len(keys)


def test_chunk_evicted_between_lookup_and_load_is_recomputed_and_stored_again(
    engines: Engines, redis_client: redis.Redis, key_prefix: str
) -> None:
    tokens = prompt(1300, seed=10)
    prefill(engines(store_async=False), "r1", tokens[:800])  # chunks 0-2 (768 tokens)
    assert len(chunk_keys(redis_client, key_prefix)) == 3
    b = engines(local_cpu=False, store_async=False)
    b.add("r2", tokens, max_tokens=3)
    out = b.scheduler.schedule()  # lookup and allocation: 768 tokens promised
    assert out.scheduled_new_reqs[0].num_computed_tokens == 768
    _delete_chunk(redis_client, key_prefix, b, tokens, 1)  # evicted before the load
    b.execute(out)
    assert b.invalid_blocks[-1] == set(b.ranks[0].block_ids["r2"][16:48])  # tokens 256-768
    assert b.bad_reads and all(r == "r2" and pos == 256 for r, _, _, pos in b.bad_reads)
    # the step also completed chunks 3 and 4, over the gap: they were not stored
    assert len(chunk_keys(redis_client, key_prefix)) == 2
    failing_step_reads = len(b.bad_reads)
    b.run(["r2"])
    assert len(b.bad_reads) == failing_step_reads  # the recompute filled the gap
    assert b.finished["r2"] == FinishReason.LENGTH  # not ERROR
    assert len(chunk_keys(redis_client, key_prefix)) == 5  # the lost chunk is back, and 3-4
    c = engines(local_cpu=False)
    prefill(c, "r3", tokens)
    assert retrieved(c) == 5 * CHUNK


def test_with_vllm_default_policy_a_failed_load_fails_the_request_and_start_up_warns(
    engines: Engines, redis_client: redis.Redis, key_prefix: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    tokens = prompt(700, seed=11)
    prefill(engines(store_async=False), "r1", tokens)
    with caplog.at_level(logging.WARNING, logger="lmcache_remote.integrations.vllm"):
        b = engines(local_cpu=False, policy="fail")
    assert any("kv_load_failure_policy" in r.getMessage() for r in caplog.records)
    b.add("r2", tokens, max_tokens=2)
    out = b.scheduler.schedule()
    _delete_chunk(redis_client, key_prefix, b, tokens, 0)
    b.execute(out)
    assert b.finished["r2"] == FinishReason.ERROR  # why every example sets "recompute"


def test_redis_dying_between_lookup_and_load_is_a_recompute(engines: Engines,
                                                            private_redis: Any) -> None:
    tokens = prompt(600, seed=12)
    prefill(engines(url=private_redis.url, store_async=False), "r1", tokens)
    b = engines(url=private_redis.url, local_cpu=False)
    b.add("r2", tokens, max_tokens=2)
    out = b.scheduler.schedule()
    private_redis.kill()
    b.execute(out)  # no exception reaches vLLM
    assert b.invalid_blocks[-1] == set(b.ranks[0].block_ids["r2"][:32])
    b.run(["r2"])
    assert b.finished["r2"] == FinishReason.LENGTH


def test_corrupt_chunk_fails_only_its_blocks_and_later_ones(
    engines: Engines, redis_client: redis.Redis, key_prefix: str
) -> None:
    tokens = prompt(800, seed=13)
    prefill(engines(store_async=False, serde="raw"), "r1", tokens)
    b = engines(local_cpu=False)
    ns = b.scheduler_connector._scheduler.lookup.namespaces[0]
    from lmcache_remote.naming.hashing import TokenDatabase

    key = TokenDatabase(ns, CHUNK, False).prefix_keys(tokens)[1].key.redis_key(key_prefix)
    value = bytearray(redis_client.get(key))
    value[-3] ^= 0x10
    redis_client.set(key, bytes(value))
    b.add("r2", tokens, max_tokens=2)
    b.step()
    assert b.invalid_blocks[-1] == set(b.ranks[0].block_ids["r2"][16:48])
    b.run(["r2"])
    assert b.finished["r2"] == FinishReason.LENGTH


# -- MLA -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_is_detected_from_the_kv_cache_spec(engines: Engines, layout: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    tokens = prompt(600, seed=14)
    with caplog.at_level(logging.WARNING, logger="lmcache_remote.integrations"):
        a = engines(mla=True, layout="LBNHC", store_async=False)
        b = engines(mla=True, layout=layout, local_cpu=False)
    assert not any("lookups will miss" in r.getMessage() for r in caplog.records)
    cache = b.ranks[0].caches[NAMES[0]]
    assert cache.dim() == 4 and cache.shape[1] == 1 and cache.shape[3] == rig.MLA_DIM
    want = KVGeometry(rig.LAYERS, 1, rig.MLA_DIM, torch.bfloat16, True)
    assert b.ranks[0].connector._worker.side.geometry == want
    assert b.scheduler_connector._scheduler.geometry == want
    prefill(a, "r1", tokens)
    prefill(b, "r2", tokens)
    assert retrieved(b) == 2 * CHUNK
    assert b.worker_engine().layout.kv_planes == 1  # one latent plane, not two halves


@pytest.mark.parametrize("shared", [True, False], ids=["save_only_first_rank", "per_rank"])
def test_mla_with_tensor_parallelism_uses_the_workers_namespaces(
    engines: Engines, redis_client: redis.Redis, key_prefix: str, shared: bool
) -> None:
    tokens = prompt(600, seed=15)
    a = engines(mla=True, tp=2, save_only_first_rank=shared, store_async=False)
    prefill(a, "r1", tokens)
    keys = chunk_keys(redis_client, key_prefix)
    namespaces = {":".join(k.split(":")[3:5]) for k in keys}  # world_size:worker_id
    assert namespaces == ({"1:0"} if shared else {"2:0", "2:1"})
    assert len(keys) == (2 if shared else 4)
    b = engines(mla=True, tp=2, save_only_first_rank=shared, local_cpu=False)
    prefill(b, "r2", tokens)  # the scheduler found what the workers stored, both ranks load
    assert retrieved(b, 0) == retrieved(b, 1) == 2 * CHUNK


# -- fp8 -------------------------------------------------------------------------------------

def test_fp8_variants_are_named_apart(engines: Engines, redis_client: redis.Redis,
                                      key_prefix: str) -> None:
    tokens = prompt(600, seed=16)
    e4m3 = engines(cache_dtype="fp8_e4m3", store_async=False)
    prefill(e4m3, "r1", tokens)
    keys = chunk_keys(redis_client, key_prefix)
    assert keys and all(":float8_e4m3fn:" in k for k in keys)
    e5m2 = engines(cache_dtype="fp8_e5m2", local_cpu=False, store_async=False)
    prefill(e5m2, "r2", tokens)
    assert retrieved(e5m2) == 0  # e4m3 bytes are not e5m2 values
    assert {k.split(":")[5] for k in chunk_keys(redis_client, key_prefix)} == {
        "float8_e4m3fn", "float8_e5m2"}
    again = engines(cache_dtype="fp8", layout="BHLNC", local_cpu=False)  # fp8 is e4m3
    prefill(again, "r3", tokens)
    assert retrieved(again) == 2 * CHUNK


def test_packed_quantized_cache_dtype_is_refused_at_start_up(engines: Engines) -> None:
    with pytest.raises(ConfigError, match="cache_dtype"):
        engines(cache_dtype="int8_per_token_head")


# -- the scheduler side: one round trip per lookup, and light ----------------------------------

def _reads(client: redis.Redis) -> int:
    return int(client.info("stats")["total_reads_processed"])


def _exists_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


@pytest.mark.parametrize("tp", [1, 4])
def test_one_round_trip_per_scheduler_lookup_whatever_the_tp_size(
    engines: Engines, private_redis: Any, tp: int
) -> None:
    tokens = prompt(1100, seed=17)
    # only the scheduler's lookups talk to Redis; loads within the step, to see them scheduled
    quiet = {"stats_publish_interval": None, "async_load_min_tokens": None}
    a = engines(url=private_redis.url, tp=tp, store_async=False, **quiet)
    prefill(a, "r1", tokens)
    b = engines(url=private_redis.url, tp=tp, local_cpu=False, **quiet)
    probe = redis.Redis.from_url(private_redis.url)
    connector = b.scheduler_connector
    request = b.add("r2", tokens, max_tokens=2)
    connector.get_num_new_matched_tokens(request, 0)  # connections open before counting
    _reads(probe)
    exists = _exists_calls(probe)
    reads = _reads(probe)
    assert _reads(probe) - reads == 1  # counting itself costs the INFO's own read
    reads = _reads(probe)
    for _ in range(3):  # vLLM asks again while a request waits
        assert connector.get_num_new_matched_tokens(request, 0) == (4 * CHUNK, False)
    assert _reads(probe) - reads - 1 == 3  # one read event per lookup, any TP size
    assert _exists_calls(probe) - exists == 3 * tp * 5  # yet every rank's 5 chunks checked
    reads = _reads(probe)
    out = b.scheduler.schedule()  # vLLM's own call
    assert _reads(probe) - reads - 1 == 1
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * CHUNK
    b.execute(out)
    assert b.bad_reads == []


def test_a_token_counts_only_when_every_rank_holds_it(
    engines: Engines, redis_client: redis.Redis, key_prefix: str
) -> None:
    tokens = prompt(800, seed=18)
    prefill(engines(tp=2, store_async=False), "r1", tokens)
    b = engines(tp=2, local_cpu=False)
    rank1 = [k for k in chunk_keys(redis_client, key_prefix) if ":2:1:" in k]
    lookup = b.scheduler_connector._scheduler.lookup
    from lmcache_remote.naming.hashing import TokenDatabase

    second = TokenDatabase(lookup.namespaces[1], CHUNK, False).prefix_keys(tokens)[1]
    assert second.key.redis_key(key_prefix) in rank1
    redis_client.unlink(second.key.redis_key(key_prefix))
    request = b.add("r2", tokens, max_tokens=2)
    assert b.scheduler_connector.get_num_new_matched_tokens(request, 0) == (CHUNK, False)


def test_scheduler_side_is_no_engine(engines: Engines, redis_client: redis.Redis,
                                     key_prefix: str) -> None:
    import threading

    from lmcache_remote.telemetry import metrics

    def lmcr_threads() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("lmcr")}

    before_threads, before_sources = lmcr_threads(), len(metrics._SOURCES)
    engine = engines(stats_publish_interval=0.05)
    sched = engine.scheduler_connector
    request = engine.add("r1", prompt(700, seed=19), max_tokens=1)
    sched.get_num_new_matched_tokens(request, 0)
    worker_threads = {n for n in lmcr_threads() - before_threads}
    assert not hasattr(sched, "_lookup_engines")
    assert "lmcr-stats-publisher" in worker_threads  # the worker is an engine ...
    engine.run(["r1"])
    assert engine.worker_engine().flush(5.0)
    engines_keys = list(redis_client.scan_iter(match=f"{key_prefix}:engines:*"))
    roles = sorted(redis_client.hget(k, "role") or b"engine" for k in engines_keys)
    assert roles == [b"engine", b"scheduler"]  # ... the scheduler publishes its own figures
    assert len(metrics._SOURCES) - before_sources == 1
    assert sched._scheduler.lookup.metrics.counters()["lookup.requests"] >= 1
    # built alone, as vLLM's Scheduler builds it, and asked: not one thread of its own
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    threads = lmcr_threads()
    alone = KVConnectorFactory.create_connector(engine.config, KVConnectorRole.SCHEDULER,
                                                engine.kv_cache_config)
    assert alone.get_num_new_matched_tokens(request, 0)[0] == 2 * CHUNK
    assert lmcr_threads() == threads
    alone.shutdown()


# -- CUDA graphs and other requests ------------------------------------------------------------

def test_layerwise_asks_vllm_for_piecewise_cuda_graphs(engines: Engines) -> None:
    """Asked as VllmConfig asks it (the class from the factory, the extra config). VllmConfig's
    own override cannot run here: the CPU platform turns CUDA graphs off before it;
    scripts/gpu_check_vllm.sh looks for vLLM's override message on a GPU."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for layerwise, piecewise in ((True, True), (False, False)):
        transfer = engines(layerwise=layerwise).config.kv_transfer_config
        cls = KVConnectorFactory.get_connector_class(transfer)
        assert cls.requires_piecewise_for_cudagraph(
            transfer.kv_connector_extra_config) is piecewise
    assert LmcrConnector.requires_piecewise_for_cudagraph({}) is True  # the default


def write_adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_requests_named_by_more_than_their_tokens(engines: Engines, tmp_path: Path) -> None:
    """Through vLLM's scheduler: a LoRA request's chunks are stored and found under its
    adapter's fingerprint (scheduler and worker derive the same keys), never the base model's
    or another adapter's; an adapter whose files change under the engine passes its requests
    through until a request reloads it (`load_inplace`), then is named anew; prompt
    embeddings are named by their rows. What this rig cannot show (its forward is a stand-in
    that ignores adapters and embeddings): that the KV itself differs; tests/vllm_cpu does."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    tokens = prompt(600, seed=20)
    engine = engines(store_async=False)
    sched = engine.scheduler_connector
    side = sched._scheduler.side

    def ask(req_id: str, ids: list[int] | None = tokens, **more: object) -> object:
        return sched.get_num_new_matched_tokens(
            Request(req_id, ids, SamplingParams(max_tokens=1), None, **more), 0)

    path = write_adapter(tmp_path / "a", b"adapter one")
    lora = LoRARequest("a", 1, str(path))
    engine.add("lora", tokens, max_tokens=2, lora_request=lora)
    engine.run(["lora"])
    assert ask("base") == (0, False)  # the adapter's chunks are not the base model's
    before = retrieved(engine)
    engine.add("lora-again", tokens, max_tokens=2, lora_request=lora)
    engine.run(["lora-again"])
    assert retrieved(engine) - before == 2 * CHUNK  # the worker read what the scheduler found
    assert ask("same-files-other-id", lora_request=LoRARequest("z", 7, str(path))) == (
        2 * CHUNK, False)  # named by its files, not its name or int id
    other = LoRARequest("b", 2, str(write_adapter(tmp_path / "b", b"adapter two")))
    assert ask("other", lora_request=other) == (0, False)

    (path / "adapter_model.safetensors").write_bytes(b"adapter three")  # replaced in place
    unnamed = side.metrics.get("vllm.unnamed_requests")
    assert ask("stale", lora_request=lora) == (0, False)
    assert side.metrics.get("vllm.unnamed_requests") == unnamed + 1  # passed through
    reload = LoRARequest("a", 1, str(path), load_inplace=True)
    assert ask("reloaded", lora_request=reload) == (0, False)  # named anew: nothing stored
    assert side.metrics.get("vllm.unnamed_requests") == unnamed + 1
    assert ask("missing", lora_request=LoRARequest("m", 3, str(tmp_path / "none"))) == (0, False)
    assert side.metrics.get("vllm.unnamed_requests") == unnamed + 2

    prefill(engine, "plain", tokens)
    assert ask("again") == (2 * CHUNK, False)
    embeds = torch.zeros(600, 64)
    assert ask("embeds", None, prompt_embeds=embeds) == (0, False)  # not the zero ids' text
    assert side.metrics.get("vllm.unnamed_requests") == unnamed + 2

def test_a_model_it_cannot_serve_passes_through(engines: Engines,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A KV cache group of vLLM's `MambaSpec` with no state kept (`mamba_cache_mode` none), and
    one whose K and V head sizes differ: the connector is built in both roles (never a
    refusal to start), says why at start-up, claims no hit for a prefix Redis holds, plans
    nothing and takes no block. The whole engine on such a model:
    tests/vllm_cpu/test_hybrid_models.py."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec
    from vllm.v1.request import Request

    tokens = prompt(600, seed=21)
    engine = engines(store_async=False)
    prefill(engine, "plain", tokens)  # the prefix is in Redis
    again = Request("again", tokens, SamplingParams(max_tokens=1), None)
    assert engine.scheduler_connector.get_num_new_matched_tokens(again, 0) == (2 * CHUNK, False)
    group = engine.kv_cache_config.kv_cache_groups[0]
    full = group.kv_cache_spec
    unserved = {
        "a MambaSpec KV cache group over 2 layers: mamba_cache_mode 'none'": MambaSpec(
            block_size=full.block_size, shapes=((3, 64),), dtypes=(full.dtype,)),
        "a FullAttentionSpec KV cache group over 2 layers: K head size 16 != V head size 32":
            dataclasses.replace(full, head_size_v=2 * full.head_size),
    }
    for said, spec in unserved.items():
        config = dataclasses.replace(engine.kv_cache_config, kv_cache_groups=[
            KVCacheGroupSpec(list(group.layer_names), spec)])
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            check_pass_through(engine, config, role, said, again, caplog)


def check_pass_through(engine: Instance, config: Any, role: Any, said: str, again: Any,
                       caplog: pytest.LogCaptureFixture) -> None:
    """The connector built by vLLM's factory for `config` in `role` says `said` at start-up
    and does nothing."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        connector = KVConnectorFactory.create_connector(engine.config, role, config)
    assert f"LmcrConnector passes this model through: {said}" in caplog.text
    if role == KVConnectorRole.SCHEDULER:
        assert connector.get_num_new_matched_tokens(again, 0) == (0, False)
        assert connector.may_load_async(again) is False
        assert connector.request_finished(again, [1, 2, 3]) == (False, None)
        assert connector.request_finished_all_groups(again, ([1, 2, 3],)) == (False, None)
        assert connector.reset_cache() is None
    else:
        connector.register_kv_caches(engine.ranks[0].caches)
        connector.bind_connector_metadata(LmcrConnectorMetadata([], {"again"}, "m"))
        connector.handle_preemptions(LmcrConnectorMetadata([], {"again"}, "m"))
        connector.start_load_kv(None)
        for name in engine.ranks[0].caches:
            connector.wait_for_layer_load(name)
            connector.save_kv_layer(name, engine.ranks[0].caches[name], None)
        connector.wait_for_save()
        assert connector.build_connector_worker_meta() is None
        assert connector.get_finished({"again"}) == (None, None)
        results = connector.get_transfer_results({"again"})
        assert not (results.finished_sending or results.finished_recving
                    or results.failed_recving)
        assert connector.get_block_ids_with_load_errors() == set()
    assert connector.get_kv_connector_stats() is None
    connector.shutdown()


def test_each_hook_has_its_contract_and_a_wrong_role_raises(engines: Engines) -> None:
    """Every hook of the two sides' protocols states its contract (`sides`), and each is a
    method of `LmcrConnector`; a worker hook called on the scheduler's connector, or a
    scheduler hook on a worker's, raises RuntimeError (a caller's bug), never answers."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from lmcache_remote.integrations.vllm.sides import SchedulerHooks, WorkerHooks

    for protocol in (SchedulerHooks, WorkerHooks):
        for name, member in vars(protocol).items():
            if not name.startswith("_") and callable(member):
                assert inspect.getdoc(member), name
                own = {"stats_sources": "get_kv_connector_stats", "close": "shutdown",
                       "transfers": "get_transfer_results"}.get(name, name)
                assert callable(getattr(LmcrConnector, own, None)), name
    engine = engines(store_async=False)
    with pytest.raises(RuntimeError, match="worker hook called on the scheduler"):
        engine.scheduler_connector.wait_for_save()
    with pytest.raises(RuntimeError, match="worker hook called on the scheduler"):
        engine.scheduler_connector.get_finished(set())
    worker = engine.ranks[0].connector
    request = Request("r", prompt(300, seed=3), SamplingParams(max_tokens=1), None)
    with pytest.raises(RuntimeError, match="scheduler hook called on the worker"):
        worker.get_num_new_matched_tokens(request, 0)
    assert worker.reset_cache() is None  # vLLM may ask any connector; a worker resets nothing


# -- asynchronous loads ------------------------------------------------------------------------

def _pool_used(engine: Instance) -> list[int]:
    return [rank.connector._worker.side.engine.storage.pool.used_bytes for rank in engine.ranks]


@pytest.mark.parametrize("tp", [1, 2])
def test_large_hit_loads_in_the_background_while_others_run(engines: Engines, tp: int) -> None:
    tokens, other = prompt(1400, seed=21), prompt(300, seed=22)
    prefill(engines(tp=tp, store_async=False), "r1", tokens)
    b = engines(tp=tp, local_cpu=False, async_load_min_tokens=1024)
    request = b.add("r2", tokens, max_tokens=2)
    assert b.scheduler_connector.get_num_new_matched_tokens(request, 0) == (1280, True)
    b.add("r3", other, max_tokens=2)
    out = b.scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["r3"]  # r2 waits for its KV, r3 runs
    (plan,) = [p for p in out.kv_connector_metadata.requests if p.req_id == "r2"]
    assert plan.async_load and plan.load.end == 1280
    assert out.has_sync_kv_loads is False  # so vLLM starts loads after the forward
    b.execute(out)
    b.run(["r2", "r3"])
    assert b.bad_reads == []  # r2's attention saw the loaded 1280 tokens, bit for bit
    assert all(retrieved(b, r) == 1280 for r in range(tp))
    assert _pool_used(b) == [0] * tp


def test_abort_while_a_background_load_is_pending_keeps_the_blocks_until_it_is_over(
    engines: Engines, private_redis: Any
) -> None:
    tokens = prompt(1400, seed=23)
    prefill(engines(url=private_redis.url, store_async=False), "r1", tokens)
    b = engines(url=private_redis.url, local_cpu=False, async_load_min_tokens=1024,
                remote_timeout=30.0, stats_publish_interval=None)
    pool = b.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    b.add("r2", tokens, max_tokens=2)
    out = b.scheduler.schedule()
    private_redis.pause()  # the load cannot finish while Redis is stopped
    try:
        b.execute(out)
        b.abort("r2")
        b.step()  # no forward; the load is still running
        assert "r2" in b.scheduler.requests  # vLLM holds its blocks ...
        assert pool.get_num_free_blocks() < free_before
    finally:
        private_redis.resume()
    b.wait_for_background(time.monotonic() + 30)
    b.step()  # ... until the worker reports the load over
    assert "r2" not in b.scheduler.requests
    assert pool.get_num_free_blocks() == free_before
    assert _pool_used(b) == [0]


def test_background_load_that_comes_back_short_is_recomputed_and_stored_again(
    engines: Engines, redis_client: redis.Redis, key_prefix: str
) -> None:
    tokens = prompt(1400, seed=24)
    prefill(engines(store_async=False), "r1", tokens)
    assert len(chunk_keys(redis_client, key_prefix)) == 5
    b = engines(local_cpu=False, store_async=False, async_load_min_tokens=1024)
    b.add("r2", tokens, max_tokens=2)
    out = b.scheduler.schedule()
    (plan,) = out.kv_connector_metadata.requests
    assert plan.async_load
    _delete_chunk(redis_client, key_prefix, b, tokens, 2)
    b.execute(out)
    b.run(["r2"])
    lost = set((plan.slot_mapping[512:1280] // rig.BLOCK).tolist())
    assert lost in b.invalid_blocks  # reported with the finished load, in one step
    assert b.bad_reads == []  # vLLM recomputed [512, 1280) before any attention read it
    assert b.finished["r2"] == FinishReason.LENGTH
    assert len(chunk_keys(redis_client, key_prefix)) == 5  # the lost chunk is back
    assert _pool_used(b) == [0]


@pytest.mark.parametrize("async_min", [None, 1024], ids=["in-step", "background"])
def test_a_load_that_always_fails_is_promised_at_most_twice(
    engines: Engines, redis_client: redis.Redis, key_prefix: str, async_min: int | None
) -> None:
    """Chunk 0's value is of another format version: a lookup sees it, a load never serves
    it and leaves it in place (a rolling upgrade's rule). Each load of the request fails
    whole, so vLLM puts the request back with nothing computed and asks the connector again;
    vLLM learns of the failure by failed blocks, and the workers tell the scheduler which
    request failed (worker metadata): it is promised the hit at most `MAX_LOAD_FAILURES`
    times, then computed, and it finishes (before, a background load looped for ever)."""
    from lmcache_remote.integrations.vllm_core.scheduler import MAX_LOAD_FAILURES
    from lmcache_remote.naming.hashing import TokenDatabase

    tokens = prompt(1400, seed=61)
    prefill(engines(store_async=False), "r1", tokens)
    b = engines(local_cpu=False, store_async=False, async_load_min_tokens=async_min)
    ns = b.scheduler_connector._scheduler.lookup.namespaces[0]
    key = TokenDatabase(ns, CHUNK, False).prefix_keys(tokens)[0].key.redis_key(key_prefix)
    redis_client.setrange(key, 4, b"\x02")
    b.add("r2", tokens, max_tokens=2)
    b.run(["r2"], max_steps=100)
    assert b.finished["r2"] == FinishReason.LENGTH
    failures = [blocks for blocks in b.invalid_blocks if blocks]
    assert 1 <= len(failures) <= MAX_LOAD_FAILURES
    if async_min is not None:  # a background load: nothing read before vLLM recomputed it
        assert b.bad_reads == []
    else:  # within the step: only the failing step's forward read over the gap, then redone
        assert {(r, pos) for r, _, _, pos in b.bad_reads} == {("r2", 0)}
    assert redis_client.exists(key)  # left in place: another release may read it


# -- asynchronous saves ------------------------------------------------------------------------

def test_async_saves_run_past_a_stopped_redis_and_hold_blocks_until_done(
    engines: Engines, private_redis: Any
) -> None:
    tokens = prompt(700, seed=25)
    a = engines(url=private_redis.url, async_save=True, store_async=False, local_cpu=False,
                remote_timeout=30.0, stats_publish_interval=None)
    pool = a.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    a.add("r1", tokens, max_tokens=4)
    out = a.scheduler.schedule()  # its lookup is done; Redis stops now
    private_redis.pause()
    try:
        a.execute(out)
        a.run(["r1"])  # prefill and decode go on: the store waits in the background
        assert a.finished["r1"] == FinishReason.LENGTH and a.bad_reads == []
        a.step()
        assert "r1" in a.scheduler.requests  # finished, its blocks kept for the store
        assert pool.get_num_free_blocks() < free_before
    finally:
        private_redis.resume()
    a.drain()
    assert pool.get_num_free_blocks() == free_before and _pool_used(a) == [0]
    b = engines(url=private_redis.url, local_cpu=False)
    prefill(b, "r2", tokens)
    assert retrieved(b) == 2 * CHUNK  # the bytes were copied after the forward, intact


def test_async_save_that_fails_still_frees_the_blocks(engines: Engines,
                                                      private_redis: Any) -> None:
    a = engines(url=private_redis.url, async_save=True, store_async=False, local_cpu=False,
                stats_publish_interval=None)
    pool = a.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    a.add("r1", prompt(700, seed=26), max_tokens=2)
    out = a.scheduler.schedule()
    private_redis.kill()
    a.execute(out)
    a.run(["r1"])
    a.drain()
    assert pool.get_num_free_blocks() == free_before and _pool_used(a) == [0]
    assert a.worker_engine().stats()["engine"].get("stored_tokens", 0) == 0


def test_abort_while_an_async_save_is_pending(engines: Engines, private_redis: Any) -> None:
    tokens = prompt(900, seed=27)
    a = engines(url=private_redis.url, async_save=True, store_async=False, local_cpu=False,
                max_batched_tokens=300, remote_timeout=30.0, stats_publish_interval=None)
    pool = a.scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    a.add("gone", tokens, max_tokens=4)
    out = a.scheduler.schedule()
    private_redis.pause()
    try:
        a.execute(out)  # 300 tokens: chunk 0's store waits for Redis
        a.abort("gone")
        a.step()
        assert "gone" in a.scheduler.requests
    finally:
        private_redis.resume()
    a.drain()
    assert pool.get_num_free_blocks() == free_before and _pool_used(a) == [0]


def test_background_lookup_keeps_the_scheduler_going_while_redis_is_stopped(
    engines: Engines, private_redis: Any
) -> None:
    tokens = prompt(700, seed=28)
    prefill(engines(url=private_redis.url, store_async=False), "r1", tokens)
    b = engines(url=private_redis.url, local_cpu=False, lookup_wait_ms=20, remote_timeout=30.0,
                stats_publish_interval=None)
    private_redis.pause()
    try:
        b.add("r2", tokens, max_tokens=2)
        out = b.scheduler.schedule()  # would wait for remote_timeout, then miss, in-thread
        assert out.num_scheduled_tokens == {}  # r2 waits for its answer; vLLM does not
        b.execute(out)
    finally:
        private_redis.resume()
    b.run(["r2"])
    assert retrieved(b) == 2 * CHUNK and b.bad_reads == []


# -- the layout proof, sleep mode, the version check ---------------------------------------------

def test_an_unproven_layout_turns_the_connector_off_and_inference_goes_on(
        engines: Engines, redis_client: redis.Redis, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The backend's write op (the rig's stand-in) stores values other than it was given:
    the worker cannot prove its reading, logs an ERROR, loads nothing (the hit claimed
    before the scheduler knew is reported failed and recomputed, bit for bit), stores
    nothing, and the scheduler stops claiming hits after the first step's worker output."""
    tokens = prompt(800, seed=40)
    prefill(engines(store_async=False), "r1", tokens)
    stored = chunk_keys(redis_client, key_prefix)
    right = rig._FakeCacheWrite.do_kv_cache_update

    def scaled(self: Any, *args: Any) -> None:
        args = list(args)
        args[1] = args[1] * 2  # the key of MHA's (layer, key, value, cache, slots)
        right(self, *args)

    monkeypatch.setattr(rig._FakeCacheWrite, "do_kv_cache_update", scaled)
    with caplog.at_level(logging.ERROR):
        b = engines(local_cpu=False)
    assert any("connector OFF" in r.getMessage() for r in caplog.records)
    assert b.ranks[0].connector._worker.side.disabled is not None
    _failed_then_recomputed(b, "r2", tokens)  # the hit claimed in step 1 fails
    assert b.worker_engine() is None
    assert b.scheduler_connector._scheduler.side.can_load is False
    prefill(b, "r3", tokens)  # no claim now: a plain prefill
    assert chunk_keys(redis_client, key_prefix) == stored  # nothing stored by b


def test_sleep_mode_leaves_the_caches_alone_until_restored(
        engines: Engines, redis_client: redis.Redis, key_prefix: str) -> None:
    """vLLM's sleep (0.33 and 0.34) calls `unregister_kv_caches` (as its GPU worker does) and
    `restore_kv_caches` on wake-up. Asleep, a planned load is reported failed (vLLM
    recomputes) and nothing is stored; awake, loads and stores run again."""
    tokens = prompt(800, seed=42)
    prefill(engines(store_async=False), "r1", tokens)
    stored = chunk_keys(redis_client, key_prefix)
    b = engines(local_cpu=False, store_async=False)
    connector = b.ranks[0].connector
    connector.unregister_kv_caches()
    connector.unregister_kv_caches()  # idempotent
    _failed_then_recomputed(b, "asleep", tokens)
    prefill(b, "asleep-new", prompt(600, seed=43))
    assert retrieved(b) == 0
    assert chunk_keys(redis_client, key_prefix) == stored
    connector.restore_kv_caches()
    prefill(b, "awake", tokens)
    assert retrieved(b) == 3 * CHUNK
    prefill(b, "awake-new", prompt(600, seed=44))
    assert len(chunk_keys(redis_client, key_prefix)) == len(stored) + 2


def _failed_then_recomputed(engine: Instance, req_id: str, tokens: list[int]) -> None:
    """A hit claimed and not loaded: every claimed block reported failed in that step (its
    fake attention sees the missing KV there, as a real forward would compute over it), then
    vLLM recomputes and the request ends normally with no further bad read."""
    engine.add(req_id, tokens, max_tokens=2)
    out = engine.scheduler.schedule()
    claimed = out.scheduled_new_reqs[0].num_computed_tokens
    assert claimed == 3 * CHUNK
    engine.execute(out)
    assert engine.invalid_blocks[-1] == set(engine.ranks[0].block_ids[req_id][:claimed // 16])
    failing = len(engine.bad_reads)
    engine.run([req_id])
    assert len(engine.bad_reads) == failing and engine.finished[req_id] == FinishReason.LENGTH
    engine.bad_reads.clear()


def test_a_vllm_outside_the_tested_releases_warns(caplog: pytest.LogCaptureFixture) -> None:
    from lmcache_remote.integrations.vllm import config as adapter

    with caplog.at_level(logging.WARNING):
        adapter.check_version("0.33.0")
        adapter.check_version("0.32.1+cpu")
        adapter.check_version("0.34.0")
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        adapter.check_version("0.35.0")
    assert "outside the releases" in caplog.text


def test_images_are_named_by_content_by_default(engines: Engines) -> None:
    """vLLM's own multimodal objects through the scheduler-side connector: by default an image
    is named by its processed inputs (a client's uuid, which vLLM takes as the identifier,
    changes nothing); with `mm_items: identifier` by vLLM's identifier; an item held in
    shared memory passes its request through. What this cannot show (the rig's model is not
    multimodal): the KV; tests/vllm_cpu/test_request_identity.py runs a LLaVA."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from lmcache_remote.integrations.vllm.requests import UnnamedRequest

    def request(req_id: str, identifier: str, fill: float, field: str = "pixel_values"
                ) -> Request:
        data = MultiModalKwargsItem({field: MultiModalFieldElem(
            data=torch.full((3, 4, 4), fill), field=MultiModalSharedField(batch_size=1))})
        feature = MultiModalFeatureSpec(data=data, modality="image", identifier=identifier,
                                        mm_position=PlaceholderRange(offset=300, length=16))
        return Request(req_id, prompt(600, seed=23), SamplingParams(max_tokens=1), None,
                       mm_features=[feature])

    def names(engine: Instance, *reqs: Request) -> list[object]:
        return [engine.scheduler_connector._scheduler.names.name(r)[1] for r in reqs]

    content = engines(store_async=False)
    x, forged, same_pixels = names(content, request("x", "uuid-1", 1.0),
                                   request("forged", "uuid-1", 2.0),
                                   request("same", "uuid-2", 1.0))
    assert x != forged and x == same_pixels
    by_id = engines(store_async=False, mm_items="identifier")
    x, forged, same_pixels = names(by_id, request("x", "uuid-1", 1.0),
                                   request("forged", "uuid-1", 2.0),
                                   request("same", "uuid-2", 1.0))
    assert x == forged and x != same_pixels
    with pytest.raises(UnnamedRequest, match="shared memory"):
        names(content, request("shm", "uuid-3", 1.0, field="address"))
    assert content.scheduler_connector.get_num_new_matched_tokens(
        request("shm2", "uuid-3", 1.0, field="address"), 0) == (0, False)
    with pytest.raises(ConfigError, match="mm_items"):
        engines(mm_items="pixels")
