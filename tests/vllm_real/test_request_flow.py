"""What vLLM 0.34 changed in a request's flow, run on 0.33.0 and 0.34.0 alike (`rig`), each
case saying where the releases differ: a preempted request coming back (0.34: as a new request
with its whole block table), `may_load_async` with `max_num_inflight_kv_loads` (0.34 only),
the caches unregistered and restored zeroed (0.34's KV memory release and weight updates),
prompt-logprobs requests (vLLM discards connector hits for them after asking) and the
`TokenBuffer` prompt (0.34).

As everywhere in tests/vllm_real, the fake attention checks at every layer of every step that
each scheduled request's context KV is in the cache bit for bit (`bad_reads`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import rig
from rig import CHUNK, Instance, prompt
from vllm.v1.engine import FinishReason

from lmcache_remote.integrations.vllm_core import slot_mapping

Engines = Callable[..., Instance]
ONLY_034 = pytest.mark.skipif(not rig.MRV2, reason="a vLLM 0.34 feature: not in 0.33")


def prefill(engine: Instance, req_id: str, tokens: list[int], max_tokens: int = 2,
            **sampling: object) -> None:
    engine.add(req_id, tokens, max_tokens=max_tokens, sampling=sampling or None)
    engine.run([req_id])
    assert engine.finished[req_id] == FinishReason.LENGTH
    assert engine.bad_reads == []
    assert engine.outputs[req_id] == [rig.sampled_token(req_id, len(tokens) + i)
                                      for i in range(max_tokens)]


def retrieved(engine: Instance) -> int:
    return int(engine.worker_engine().stats()["engine"].get("retrieved_tokens", 0))


def chunk_count(client: redis.Redis, prefix: str) -> int:
    return sum(1 for k in client.scan_iter(match=f"{prefix}:v1:*") if b"}#" not in k)


def test_a_preempted_request_resumes_with_its_whole_block_table(engines: Engines) -> None:
    """0.34 sends a preempted request back as a new request (0.33: a cached request flagged
    resumed); either way its plan loads its stored chunks into the blocks it got back, and its
    attention reads every token bit for bit."""
    first, second = prompt(600, seed=61), prompt(600, seed=62)
    engine = engines(num_blocks=81, store_async=False, local_cpu=False)
    engine.add("a", first, max_tokens=90)
    engine.add("b", second, max_tokens=90)
    outs = engine.run(["a", "b"])
    (victim,) = [r for r in ("a", "b") if engine.preemptions.get(r)]
    back = []  # (step output, num_computed, block ids) of each time it was scheduled anew
    for out in outs:
        resumed = getattr(out.scheduled_cached_reqs, "resumed_req_ids", set())
        if rig.MRV2:
            assert not resumed
            back += [(out, n.num_computed_tokens, n.block_ids[0])
                     for n in out.scheduled_new_reqs if n.req_id == victim]
        elif victim in resumed:
            i = out.scheduled_cached_reqs.req_ids.index(victim)
            back.append((out, out.scheduled_cached_reqs.num_computed_tokens[i],
                         out.scheduled_cached_reqs.new_block_ids[i][0]))
    if rig.MRV2:
        back = back[1:]  # its first scheduling, before the preemption
    assert back, f"{victim} was preempted but never came back"
    out, computed, block_ids = back[0]
    assert computed == 2 * CHUNK  # its two stored chunks, from Redis
    (plan,) = [p for p in out.kv_connector_metadata.requests if p.req_id == victim]
    assert (plan.load.skip, plan.load.end) == (0, 2 * CHUNK)
    n = len(plan.slot_mapping)
    assert plan.slot_mapping.tolist() == slot_mapping(block_ids, rig.BLOCK, n).tolist()
    assert engine.bad_reads == [] and retrieved(engine) >= 2 * CHUNK
    assert all(engine.finished[r] == FinishReason.LENGTH for r in ("a", "b"))


@ONLY_034
def test_a_background_load_starts_while_the_batch_is_full_within_the_cap(
        engines: Engines) -> None:
    """`--max-num-inflight-kv-loads 1`, one running slot: `may_load_async` puts the long
    requests in vLLM's async queue, so one starts its background load while another request
    holds the only slot; the cap keeps the second waiting until the first is in."""
    long_a, long_b, short = prompt(1400, seed=63), prompt(1400, seed=64), prompt(300, seed=65)
    writer = engines(store_async=False)
    prefill(writer, "wa", long_a)
    prefill(writer, "wb", long_b)
    b = engines(local_cpu=False, async_load_min_tokens=1024,
                scheduling={"max_num_seqs": 1, "max_num_inflight_kv_loads": 1})
    busy = b.add("busy", short, max_tokens=40)
    b.step()  # busy holds the only running slot from here on
    ra = b.add("ra", long_a, max_tokens=2)
    rb = b.add("rb", long_b, max_tokens=2)
    connector = b.scheduler_connector
    assert connector.may_load_async(ra) and connector.may_load_async(rb)
    assert not connector.may_load_async(busy)  # 300 tokens: at most 256, within the step
    assert list(b.scheduler.async_kv_waiting) == [ra, rb]
    out = b.step()
    assert list(out.num_scheduled_tokens) == ["busy"]
    planned = [p.req_id for p in out.kv_connector_metadata.requests if p.async_load]
    assert planned == ["ra"]  # started while the batch is full; rb held by the cap
    outs = b.run(["busy", "ra", "rb"])
    assert all(len([p for p in o.kv_connector_metadata.requests if p.async_load]) <= 1
               for o in outs)
    assert b.bad_reads == [] and retrieved(b) == 2 * 1280


def test_caches_restored_zeroed_serve_loads_and_stores_again(
        engines: Engines, redis_client: redis.Redis, key_prefix: str) -> None:
    """0.34 unregisters the caches for a KV memory release or a weight update and restores
    them zeroed at the same addresses: nothing is read from or written to them in between,
    and afterwards loads write the stored KV into the zeroed blocks bit for bit."""
    tokens = prompt(800, seed=66)
    prefill(engines(store_async=False), "r1", tokens)
    b = engines(local_cpu=False, store_async=False)
    prefill(b, "before", prompt(300, seed=67))
    stored = chunk_count(redis_client, key_prefix)
    rank = b.ranks[0]
    rank.connector.unregister_kv_caches()
    for cache in rank.caches.values():
        cache.zero_()  # what vLLM 0.34's restore hands back
    assert chunk_count(redis_client, key_prefix) == stored
    rank.connector.restore_kv_caches()
    assert rank.connector._worker.side.disabled is None  # the proven layout still holds
    prefill(b, "after", tokens)
    assert retrieved(b) == 3 * CHUNK
    prefill(b, "after-new", prompt(600, seed=68))
    assert chunk_count(redis_client, key_prefix) == stored + 2


def test_a_prompt_logprobs_request_loads_no_hit_and_still_stores(
        engines: Engines, redis_client: redis.Redis, key_prefix: str) -> None:
    """vLLM (0.32 to 0.34) discards a connector hit for a prompt-logprobs request after asking
    for it: the connector promises nothing for it (no lookup), its attention reads only KV it
    computed, and its prompt's chunks are stored for others."""
    tokens = prompt(800, seed=69)
    prefill(engines(store_async=False), "r1", tokens)
    stored = chunk_count(redis_client, key_prefix)
    b = engines(local_cpu=False, store_async=False)
    request = b.add("logprobs", tokens, max_tokens=2, sampling={"prompt_logprobs": 1})
    assert b.scheduler_connector.get_num_new_matched_tokens(request, 0) == (0, False)
    out = b.scheduler.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert not [p for p in out.kv_connector_metadata.requests if p.load is not None]
    b.execute(out)
    b.run(["logprobs"])
    assert b.bad_reads == [] and retrieved(b) == 0
    assert b.outputs["logprobs"] == [rig.sampled_token("logprobs", 800 + i) for i in range(2)]
    side = b.scheduler_connector._scheduler.side
    assert side._hits == {} and side._loads == {} and side._load_blocks == {}
    fresh = prompt(600, seed=70)
    prefill(b, "logprobs-new", fresh, prompt_logprobs=1)
    assert chunk_count(redis_client, key_prefix) == stored + 2
    c = engines(local_cpu=False)
    prefill(c, "plain", fresh)
    assert retrieved(c) == 2 * CHUNK


def test_the_prompt_is_named_by_its_token_ids_whatever_vllm_holds_them_in(
        engines: Engines) -> None:
    """0.34 holds `Request.prompt_token_ids` in a `TokenBuffer` (an `array('i')`): the
    connector names the same ints, so a request hits what a list prompt stored."""
    tokens = prompt(700, seed=71)
    prefill(engines(store_async=False), "r1", tokens)
    b = engines(local_cpu=False)
    request = b.add("r2", tokens, max_tokens=2)
    held = type(request.prompt_token_ids).__name__
    assert held == ("TokenBuffer" if rig.MRV2 else "list")
    named, identity = b.scheduler_connector._scheduler.names.name(request)
    assert named == tokens and {type(t) for t in named} == {int} and identity is None
    assert b.scheduler_connector.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False)
    b.run(["r2"])
    assert b.bad_reads == [] and retrieved(b) == 2 * CHUNK
