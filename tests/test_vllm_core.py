"""The vLLM-free decisions of the connector: hit counting, plans across steps, layouts, dtypes,
and the scheduler's `PrefixLookup` against a real Redis.

These run in the project's own environment, without vLLM. They cannot show that vLLM calls
the hooks in this order, with these values, on caches of these shapes, or that a load is in
place before attention reads it: `tests/vllm_real/` shows that inside vLLM 0.33 and 0.34
(run by scripts/test.sh in its own environment). Here the scheduler side gets a lookup function that
answers a fixed number of hit tokens, and the plans are fed hand-made requests."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import redis
import torch
from faultkit import Clock
from kvutil import chunk_heads, packed_writer

from lmcache_remote import CacheConfig, CacheEngine, ConfigError, DenseKV
from lmcache_remote.integrations.vllm_core import (
    CachedRequest,
    KVGeometry,
    NewRequest,
    PrefixLookup,
    RequestPlan,
    SchedulerSide,
    Span,
    cache_torch_dtype,
    layer_view,
    load_settings,
    slot_mapping,
)
from lmcache_remote.integrations.vllm_core.scheduler import MAX_LOAD_FAILURES
from lmcache_remote.integrations.vllm_core.worker import WorkerSide
from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase
from lmcache_remote.naming.identity import RequestIdentity

C, B = 256, 16


def side(hits: int, **kw) -> SchedulerSide:
    return SchedulerSide(lambda tokens, salt: min(hits, len(tokens)), C, B, **kw)


def blocks(n_tokens: int, first: int = 100) -> list[int]:
    return list(range(first, first + -(-n_tokens // B)))


@pytest.mark.parametrize(("hits", "prompt_len", "computed", "expected"), [
    (0, 700, 0, 0),
    (512, 700, 0, 512),
    (512, 700, 256, 256),
    (512, 700, 512, 0),
    (512, 700, 528, 0),  # vLLM's own cache already covers more
    (512, 512, 0, 256),  # a whole-prompt hit keeps the last chunk to compute
    (600, 600, 0, 512),  # a stored partial last chunk: cut at the last boundary before it
    (256, 256, 0, 0),
    (0, 1, 0, 0),
])
def test_matched_tokens(hits: int, prompt_len: int, computed: int, expected: int) -> None:
    assert side(hits).num_new_matched_tokens("r", list(range(prompt_len)), computed) == expected


def test_a_failing_lookup_is_a_miss() -> None:
    def broken(tokens, salt):
        raise RuntimeError("boom")

    s = SchedulerSide(broken, C, B)
    assert s.num_new_matched_tokens("r", list(range(600)), 0) == 0


def test_plans_over_a_request_life() -> None:
    s = side(512)
    prompt = list(range(1000))
    named = RequestIdentity(cache_salt="t")
    assert s.num_new_matched_tokens("r", prompt, 16, named) == 496
    s.after_alloc("r", 496)
    (plan,) = s.build([NewRequest("r", prompt, blocks(1000), 512)], [], {"r": 300})
    assert plan.load == Span(0, 16, 512)
    assert plan.save == Span(512, 512, 768)  # the chunk completed by this step only
    assert plan.identity == named and plan.token_ids == prompt[:768]
    assert plan.slot_mapping.tolist() == slot_mapping(blocks(1000), B, 768).tolist()
    # the prompt's rest: no new full chunk (1000 // 256 * 256 == 768), nothing to do
    assert s.build([], [CachedRequest("r", None, False, 812)], {"r": 188}) == []
    assert s.build([], [CachedRequest("r", [999], False, 1000)], {"r": 1}) == []  # decode
    s.finish("r")
    assert s.build([], [CachedRequest("r", None, False, 1001)], {"r": 1}) == []


def test_last_partial_chunk_is_stored_only_with_save_unfull_chunk() -> None:
    prompt = list(range(600))
    for unfull, end in ((False, 512), (True, 600)):
        s = side(0, save_unfull_chunk=unfull)
        s.num_new_matched_tokens("r", prompt, 0)
        s.after_alloc("r", 0)
        (plan,) = s.build([NewRequest("r", prompt, blocks(600), 0)], [], {"r": 600})
        assert plan.load is None and plan.save == Span(0, 0, end)


def test_roles_and_resumed_requests() -> None:
    prompt = list(range(600))
    consumer = side(512, can_save=False)
    assert consumer.num_new_matched_tokens("r", prompt, 0) == 512
    consumer.after_alloc("r", 512)
    (plan,) = consumer.build([NewRequest("r", prompt, blocks(600), 512)], [], {"r": 88})
    assert plan.save is None and plan.load == Span(0, 0, 512)
    producer = side(512, can_load=False)
    assert producer.num_new_matched_tokens("r", prompt, 0) == 0
    # preempted and resumed: the new block list replaces the old one, and a new hit loads
    s = side(512)
    s.num_new_matched_tokens("r", prompt, 0)
    s.after_alloc("r", 0)
    s.build([NewRequest("r", prompt, blocks(600), 0)], [], {"r": 100})
    s.num_new_matched_tokens("r", prompt, 0)
    s.after_alloc("r", 512)
    new_blocks = blocks(600, first=7)
    (plan,) = s.build([], [CachedRequest("r", new_blocks, True, 512)], {"r": 88})
    assert plan.load == Span(0, 0, 512)
    assert plan.slot_mapping.tolist() == slot_mapping(new_blocks, B, 512).tolist()


def test_a_resumed_request_sent_as_new_is_planned_from_its_whole_block_table() -> None:
    """vLLM 0.34 sends a preempted request back as a new request (its whole block table, its
    computed tokens): the known request keeps what it stored, loads its new hit into the new
    blocks and stores only what it had not."""
    prompt = list(range(900))
    s = side(256)
    s.num_new_matched_tokens("r", prompt, 0)
    s.after_alloc("r", 256)
    (first,) = s.build([NewRequest("r", prompt, blocks(900), 256)], [], {"r": 400})
    assert first.load == Span(0, 0, 256) and first.save == Span(256, 256, 512)
    # preempted after 656 tokens; the cache now holds 512 of them (256 loaded, 256 stored)
    s2 = side(512)
    s2._trackers, s2._identities = s._trackers, s._identities
    assert s2.num_new_matched_tokens("r", prompt, 0) == 512
    s2.after_alloc("r", 512, [blocks(900, first=40)])
    again = blocks(900, first=40)
    (plan,) = s2.build([NewRequest("r", prompt, again, 512)], [], {"r": 388})
    assert plan.load == Span(0, 0, 512)
    assert plan.save == Span(512, 512, 768)  # the rest of the prompt; nothing stored twice
    assert plan.slot_mapping.tolist() == slot_mapping(again, B, 768).tolist()
    assert s2._load_blocks == {} and s2._loads == {} and s2._hits == {}


def test_a_request_vllm_reads_no_external_kv_for_is_promised_nothing_and_stored() -> None:
    """Prompt logprobs: vLLM 0.34 discards a connector hit after asking. With `read=False`
    nothing is looked up or promised, and nothing stale is left for a later step; when vLLM
    calls `after_alloc` with 0 after a hit it did ask for (0.33's discarding), no load is
    planned either."""
    prompt = list(range(700))
    calls = []
    s = SchedulerSide(lambda tokens, salt: calls.append(1) or 512, C, B)
    assert s.num_new_matched_tokens("r", prompt, 0, read=False) == 0
    assert calls == []
    s.after_alloc("r", 0, [blocks(700)])
    (plan,) = s.build([NewRequest("r", prompt, blocks(700), 0)], [], {"r": 700})
    assert plan.load is None and plan.save == Span(0, 0, 512)
    assert s._hits == {} and s._loads == {} and s._load_blocks == {}
    t = side(512)
    assert t.num_new_matched_tokens("q", prompt, 0) == 512
    t.after_alloc("q", 0, [blocks(700)])  # vLLM discarded the hit it asked for
    # no load; no store either: its two chunks were found in Redis
    assert t.build([NewRequest("q", prompt, blocks(700), 0)], [], {"q": 700}) == []
    assert t._hits == {} and t._loads == {} and t._load_blocks == {}


@pytest.mark.parametrize(("async_min", "prompt_len", "can_load", "expected"), [
    (None, 5000, True, False),  # every load within the step
    (1024, 1280, True, True),  # its longest hit: (1280 - 1) // 256 * 256 == 1024
    (1024, 1024, True, False),  # 768 at most
    (256, 257, True, True),
    (256, 256, True, False),  # the last token is computed: no hit possible
    (1024, 5000, False, False),  # a producer loads nothing
])
def test_may_load_async_says_whether_a_request_could_load_in_the_background(
        async_min: int | None, prompt_len: int, can_load: bool, expected: bool) -> None:
    s = side(prompt_len, async_load_min_tokens=async_min, can_load=can_load)
    assert s.may_load_async("r", prompt_len) is expected
    if expected:  # a request whose load failed twice is not promised one again
        for _ in range(2):
            assert s.num_new_matched_tokens("r", list(range(prompt_len)), 0)
            s.load_failed(["r"])
        assert s.may_load_async("r", prompt_len) is False


def test_a_failed_load_reported_in_two_steps_counts_once() -> None:
    """The workers report a background load failed in one step and vLLM's failed request
    comes in a later one (or each rank's in its own step): one failure, until the request is
    promised a hit again."""
    s = side(1024)
    prompt = list(range(1100))
    assert s.num_new_matched_tokens("r", prompt, 0) == 1024
    s.worker_report({"r"}, False, None, None)
    s.load_failed({"r"})  # vLLM's failed_recving, a step later
    assert s.metrics.get("vllm.failed_load_requests") == 1
    assert s.num_new_matched_tokens("r", prompt, 0) == 1024  # promised again: a new load
    s.load_failed({"r"})
    assert s.metrics.get("vllm.failed_load_requests") == 2
    assert s.num_new_matched_tokens("r", prompt, 0) == 0


def test_slot_mapping_and_layouts() -> None:
    assert slot_mapping([3, 1], 4, 6).tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(ValueError):
        slot_mapping([3], 4, 5)
    flash = torch.zeros(10, 2, 16, 2, 8)
    view, layout = layer_view(flash, use_mla=False)
    assert layout == "kv_split" and view.shape == (2, 10, 16, 2, 8)
    view[1, 3, 4] = 1.0
    assert flash[3, 1, 4].eq(1.0).all()  # a view, no copy
    assert layer_view(torch.zeros(2, 10, 16, 2, 8), use_mla=False)[1] == "kv_split"
    assert layer_view(torch.zeros(10, 2, 16, 16), use_mla=False)[1] == "packed"
    # MLA: vLLM 0.33's [blocks, 1, block_size, latent] has the packed layout's rank; only the
    # spec tells them apart
    mla4 = torch.zeros(10, 1, 16, 576)
    view, layout = layer_view(mla4, use_mla=True)
    assert layout == "mla" and view.shape == (10, 16, 576)
    assert view.data_ptr() == mla4.data_ptr()
    assert layer_view(mla4, use_mla=False)[1] == "packed"
    assert layer_view(torch.zeros(10, 16, 576), use_mla=True)[1] == "mla"
    with pytest.raises(ValueError):
        layer_view(torch.zeros(10), use_mla=False)
    with pytest.raises(ValueError):
        layer_view(torch.zeros(10, 2, 16, 16), use_mla=True)


def test_fp8_caches_are_viewed_as_their_values() -> None:
    raw = torch.arange(10 * 2 * 16 * 16, dtype=torch.int64).remainder(120).to(torch.uint8)
    raw = raw.reshape(10, 2, 16, 16)
    view, _ = layer_view(raw, use_mla=False, dtype=torch.float8_e5m2)
    assert view.dtype == torch.float8_e5m2 and torch.equal(view.view(torch.uint8), raw)
    with pytest.raises(ValueError, match="cannot be viewed"):
        layer_view(raw, use_mla=False, dtype=torch.bfloat16)


def test_cache_dtypes_and_settings() -> None:
    assert cache_torch_dtype("auto", torch.float16) is torch.float16
    for name in ("fp8", "fp8_e4m3", "fp8_inc"):
        assert cache_torch_dtype(name, torch.bfloat16) is torch.float8_e4m3fn
    assert cache_torch_dtype("fp8_e5m2", torch.bfloat16) is torch.float8_e5m2
    assert cache_torch_dtype("bfloat16", torch.float16) is torch.bfloat16
    for name in ("nonsense", "fp8_ds_mla", "int8_per_token_head", "turboquant_k8v4"):
        with pytest.raises(ConfigError, match="cache_dtype"):
            cache_torch_dtype(name, torch.float16)
    settings = load_settings({"remote_url": None, "model_name": "served/name"})
    assert settings.model_name == "served/name" and settings.layerwise is True
    with pytest.raises(ConfigError, match="bogus"):
        load_settings({"bogus": 1})


def test_a_rolled_back_request_stores_its_chunks_again() -> None:
    """vLLM truncates a request's computed tokens at the first block of a short load and
    recomputes from there: what the hit had counted as stored is stored again."""
    s = side(768)
    prompt = list(range(1000))
    s.num_new_matched_tokens("r", prompt, 0)
    s.after_alloc("r", 768)
    (plan,) = s.build([NewRequest("r", prompt, blocks(1000), 768)], [], {"r": 232})
    assert plan.save is None  # [0, 768) counted as stored, no new full chunk
    (plan,) = s.build([], [CachedRequest("r", None, False, 256)], {"r": 744})
    assert plan.load is None and plan.save == Span(256, 256, 768)


def geometry() -> KVGeometry:
    return KVGeometry(2, 2, 8, torch.bfloat16, False)


def test_prefix_lookup_without_a_remote_tier_finds_nothing() -> None:
    ns = [KeyNamespace("m", 1, 0, "bfloat16")]
    lookup = PrefixLookup(CacheConfig(remote_url=None), geometry().metadata("m", 1, 0).layout,
                          ns)
    assert lookup(list(range(600))) == 0
    lookup.close()


def test_prefix_lookup_counts_what_every_rank_holds(private_redis) -> None:
    config = CacheConfig(remote_url=private_redis.url, remote_timeout=0.5, chunk_size=C,
                         store_async=False, local_cpu=False, stats_publish_interval=None)
    tokens = list(range(600))
    for rank in range(2):
        kv = DenseKV([torch.randn(2, 600, 8).to(torch.bfloat16) for _ in range(2)],
                     [torch.randn(2, 600, 8).to(torch.bfloat16) for _ in range(2)])
        with CacheEngine(config, geometry().metadata("m", 2, rank)) as engine:
            assert engine.store(tokens, kv) == 512
    ns = [geometry().metadata("m", 2, r).namespace for r in range(2)]
    lookup = PrefixLookup(config, geometry().metadata("m", 2, 0).layout, ns)
    assert lookup._remote is not None and lookup._remote.toucher.inline  # no thread of its own
    lookup._remote.toucher.interval = 0.0  # touch at once, not at most once a second
    threads = {t.name for t in threading.enumerate()}
    assert lookup(tokens) == 512
    # what it promised is TOUCHed (every rank's chunks), by the caller's thread
    promised = [spec for n in ns for spec in TokenDatabase(n, C, False).prefix_keys(tokens)[:2]]
    values = sum(len(lookup._remote._keys(spec)) for spec in promised)
    assert values >= 2 * 2 and lookup.metrics.counters()["remote.touched_keys"] == values
    assert {t.name for t in threading.enumerate()} == threads
    client = redis.Redis.from_url(private_redis.url)
    second = TokenDatabase(ns[1], C, False).prefix_keys(tokens)[1]
    assert client.unlink(second.key.redis_key(config.key_prefix)) == 1
    assert lookup(tokens) == 256  # rank 1 lacks the second chunk
    assert lookup(tokens, "other salt") == 0
    private_redis.kill()
    assert lookup(list(range(600))) == 0
    assert lookup.metrics.counters()["lookup.remote_errors"] >= 1
    lookup.close()


def test_prefix_lookup_promises_no_more_than_a_worker_can_hold(private_redis) -> None:
    config = CacheConfig(remote_url=private_redis.url, remote_timeout=0.5, chunk_size=C,
                         store_async=False, local_cpu=False, stats_publish_interval=None)
    tokens = list(range(2048))  # 8 chunks of 256
    kv = DenseKV([torch.randn(2, 2048, 8).to(torch.bfloat16) for _ in range(2)],
                 [torch.randn(2, 2048, 8).to(torch.bfloat16) for _ in range(2)])
    meta = geometry().metadata("m", 1, 0)
    with CacheEngine(config, meta) as engine:
        assert engine.store(tokens, kv) == 2048
    chunk = meta.layout.nbytes(C)
    # a worker with the write-behind queue on holds half of 10 chunks' budget for reads: 5
    small = dataclasses.replace(config, store_async=True,
                                max_local_cpu_size=10 * chunk / 1024**3)
    lookup = PrefixLookup(small, meta.layout, [meta.namespace])
    assert lookup(tokens) == 5 * C
    assert lookup.metrics.counters()["lookup.capped_tokens"] == 3 * C
    with CacheEngine(small, meta) as worker:  # the engine's own lookup caps the same way
        assert worker.lookup(tokens) == 5 * C
    lookup.close()
    lookup = PrefixLookup(config, meta.layout, [meta.namespace])  # 5 GiB: no cap
    assert lookup(tokens) == 2048
    lookup.close()


def test_stores_over_a_load_gap_wait_for_the_rollback(private_redis) -> None:
    """A short load leaves a gap; the worker drops the request's stores that start past it
    (their KV was computed over missing tokens) until a plan made after vLLM's rollback
    arrives. The second step here is what asynchronous scheduling produces: planned before the
    failure was seen. That scheduling order itself has not run inside vLLM (tests/vllm_real
    steps synchronously); here the plans are hand-made."""
    config = {"remote_url": private_redis.url, "chunk_size": C, "store_async": False,
              "local_cpu": False, "stats_publish_interval": None}
    tokens = list(range(1300))
    slots = slot_mapping(blocks(1300), B, 1300)

    def worker() -> WorkerSide:
        side = WorkerSide(load_settings(config), "m", 1, 0)
        caches = {f"l{i}": torch.randn(200, 2, B, 16).to(torch.bfloat16) for i in range(2)}
        side.register(caches, use_mla=False, dtype=torch.bfloat16, block_size=B,
                      writer=packed_writer(caches["l0"]))
        return side

    def step(side: WorkerSide, load: Span | None, save: Span | None) -> set[int]:
        side.begin_step([RequestPlan("r", tokens, slots, None, load, save)])
        side.start_load()
        for name in ("l0", "l1"):
            side.wait_for_layer(name)
            side.save_layer(name)
        side.wait_for_save()
        return side.take_load_errors()

    client = redis.Redis.from_url(private_redis.url)

    def stored() -> int:
        return len(chunk_heads(client.scan_iter(match="lmcr:v1:*")))

    first = worker()
    assert step(first, None, Span(0, 0, 768)) == set()
    assert stored() == 3
    ns = first.engine.token_db.namespace
    gone = TokenDatabase(ns, C, False).prefix_keys(tokens)[1].key.redis_key("lmcr")
    assert client.unlink(gone) == 1
    second = worker()
    errors = step(second, Span(0, 0, 768), Span(768, 768, 1024))
    assert errors == {b for b in blocks(1300)[16:48]}
    assert stored() == 2  # chunk 3 was computed over the gap: not stored
    assert step(second, None, Span(1024, 1024, 1280)) == set()
    assert stored() == 2  # planned before the rollback: dropped too
    assert step(second, None, Span(256, 256, 1280)) == set()
    assert stored() == 5  # after the rollback: chunks 1-4 stored, the lost one back
    first.close()
    second.close()


def test_a_large_hit_is_an_async_load_planned_from_the_allocated_blocks() -> None:
    s = side(1024, async_load_min_tokens=512)
    prompt = list(range(1100))
    n = s.num_new_matched_tokens("r", prompt, 0)
    assert (n, s.loads_async(n), s.loads_async(256)) == (1024, True, False)
    s.after_alloc("r", 1024, block_ids=blocks(1100))
    (plan,) = s.build([], [], {})  # vLLM does not schedule it while it waits for its KV
    assert plan.async_load and plan.load == Span(0, 0, 1024) and plan.save is None
    assert plan.slot_mapping.tolist() == slot_mapping(blocks(1100), B, 1024).tolist()
    assert s.build([], [], {}) == []  # planned once
    # loaded: vLLM schedules it as a new request; the hit counts as stored
    assert s.build([NewRequest("r", prompt, blocks(1100), 1024)], [], {"r": 76}) == []
    # loaded short: vLLM truncated it at the gap; from there it is stored again
    s.num_new_matched_tokens("q", prompt, 0)
    s.after_alloc("q", 1024, block_ids=blocks(1100))
    s.build([], [], {})
    (plan,) = s.build([NewRequest("q", prompt, blocks(1100), 512)], [], {"q": 588})
    assert plan.load is None and plan.save == Span(512, 512, 1024)


def test_async_load_min_tokens_is_validated() -> None:
    assert load_settings({}).async_load_min_tokens == 1024
    assert load_settings({"async_load_min_tokens": None}).async_load_min_tokens is None
    for bad in (0, -1, "1024", True, 1.5):
        with pytest.raises(ConfigError, match="async_load_min_tokens"):
            load_settings({"async_load_min_tokens": bad})


def test_with_async_save_a_request_that_stored_holds_its_blocks_at_finish() -> None:
    s = side(0, async_save=True)
    prompt = list(range(600))
    for req_id in ("stores", "short"):
        s.num_new_matched_tokens(req_id, prompt if req_id == "stores" else prompt[:100], 0)
        s.after_alloc(req_id, 0)
    plans = s.build([NewRequest("stores", prompt, blocks(600), 0),
                     NewRequest("short", prompt[:100], blocks(100, 300), 0)], [],
                    {"stores": 600, "short": 100})
    assert [p.req_id for p in plans] == ["stores"]
    assert s.finish("stores") is True  # vLLM waits for the workers' finished_sending
    assert s.finish("short") is False  # nothing stored: freed at once
    assert load_settings({"async_save": True}).async_save is True
    with pytest.raises(ConfigError, match="async_save"):
        load_settings({"async_save": "yes"})


def test_background_lookup_answers_none_until_its_lookup_is_done() -> None:
    import threading

    from lmcache_remote.integrations.vllm_core.lookup import BackgroundLookup

    release, calls = threading.Event(), []

    def slow(tokens, salt):
        calls.append(len(tokens))
        assert release.wait(30)
        return 512

    lookup = BackgroundLookup(slow, wait_s=0.01)
    s = SchedulerSide(slow, C, B, lookup_wait_s=5.0)
    assert lookup("r", list(range(600)), None) is None
    assert lookup("r", list(range(600)), None) is None  # the same lookup, not a second one
    release.set()
    assert lookup("r", list(range(600)), None) == 512
    assert calls == [600]
    assert s.num_new_matched_tokens("q", list(range(600)), 0) == 512  # answers within wait
    lookup.close()
    s.close()
    with pytest.raises(ConfigError, match="lookup_wait_ms"):
        load_settings({"lookup_wait_ms": -1})


# -- the load decision and failed loads on the scheduler side ---------------------------------

def test_the_scheduler_claims_what_pays_and_counts_what_it_declines() -> None:
    """1 KiB a token: a 1,024-token hit is 1 MiB. Over a link measured at 1 MiB/s it takes
    a second to load against 0.1 s to compute (the workers' step figures): declined, counted
    once; with the link back at 1 GiB/s the same hit is claimed."""
    from lmcache_remote.engine.decision import LoadDecision

    clock = Clock()
    decision = LoadDecision(clock=clock, probe_interval=5.0, chunk_size=C)
    s = side(1024, decision=decision, bytes_per_token=1024.0)
    s.worker_report(set(), False, 1024 * 1024.0, (1024, 1024 * 512, 0.1))
    prompt = list(range(1100))
    assert s.num_new_matched_tokens("r", prompt, 0) == 256  # nothing loaded yet: a probe
    assert s.loads_async(256, "r")  # a probe never holds a step
    clock.advance(1.0)
    assert s.num_new_matched_tokens("q", prompt, 0) == 0
    assert s.num_new_matched_tokens("q", prompt, 0) == 0  # asked again: the same verdict
    s.after_alloc("q", 0, prompt_tokens=1100)
    assert s.metrics.get("vllm.declined_tokens") == 1024
    s.worker_report(set(), False, 1024 ** 3, None)
    assert s.num_new_matched_tokens("p", prompt, 0) == 1024
    assert s.metrics.gauges()["decision.link_bytes_per_s"] > 100 * 1024 * 1024


def test_a_failed_load_is_promised_twice_at_most_and_a_down_link_not_at_all() -> None:
    from lmcache_remote.engine.decision import LoadDecision

    clock = Clock()
    s = side(1024, decision=LoadDecision(clock=clock, probe_interval=5.0, chunk_size=C),
             bytes_per_token=1024.0)
    prompt = list(range(1100))
    for _ in range(MAX_LOAD_FAILURES):
        assert s.num_new_matched_tokens("r", prompt, 0) == 1024
        s.worker_report({"r"}, False, None, None)  # its load failed (failed blocks)
    assert s.num_new_matched_tokens("r", prompt, 0) == 0  # computed from now on
    assert s.metrics.get("vllm.failed_load_requests") == MAX_LOAD_FAILURES
    s.worker_report(set(), True, None, None)  # a worker's link is backing off
    assert s.num_new_matched_tokens("q", prompt, 0) == 0
    clock.advance(5.0)
    assert s.num_new_matched_tokens("p", prompt, 0) == 256  # a probe, once an interval
    s.worker_report(set(), False, None, None)  # healthy again
    assert s.num_new_matched_tokens("o", prompt, 0) == 1024
    s.finish("r")
    assert s.num_new_matched_tokens("r", prompt, 0) == 1024  # a new request of that id


def test_both_worker_sides_are_one_interface(private_redis, caplog) -> None:
    """`WorkerSide` and `GroupedWorker` are both `KVWorker`s: every member of the protocol is
    implemented by each (none left to the protocol's empty body) and documented, and
    `register_caches` proves the layout with the write op `writer_for` gives for the first
    layer. Caches of another geometry than the spec's are served but said at WARNING."""
    import inspect
    import logging

    from lmcache_remote.integrations.vllm_core import KVGeometry, KVWorker
    from lmcache_remote.integrations.vllm_core.worker_groups import GroupedWorker

    members = [name for name, _ in inspect.getmembers(KVWorker) if not name.startswith("_")]
    assert {"register_caches", "finished_loads", "take_load_errors", "report"} <= set(members)
    for cls in (WorkerSide, GroupedWorker):
        assert KVWorker in cls.__mro__
        for name in members:
            assert name in {m for c in cls.__mro__[:cls.__mro__.index(KVWorker)]
                            for m in vars(c)}, (cls.__name__, name)
            assert inspect.getdoc(getattr(cls, name)), (cls.__name__, name)

    config = {"remote_url": private_redis.url, "chunk_size": C, "store_async": False,
              "local_cpu": False, "stats_publish_interval": None}
    caches = {f"l{i}": torch.randn(20, 2, B, 16).to(torch.bfloat16) for i in range(2)}
    asked: list[tuple[str, bool]] = []

    def writer_for(name: str, tensor: torch.Tensor, use_mla: bool) -> object:
        asked.append((name, use_mla))
        return packed_writer(tensor)

    spec = KVGeometry(2, 2, 8, torch.bfloat16, False)  # what the caches hold
    side = WorkerSide(load_settings(config), "m", 1, 0, spec=spec, block_size=B)
    with caplog.at_level(logging.WARNING, logger="lmcache_remote.integrations"):
        side.register_caches(caches, writer_for)
    assert asked == [("l0", False)] and side.disabled is None and side.registered
    assert side.geometry == spec and "lookups will miss" not in caplog.text
    assert side.finished_loads() == (set(), set())
    side.close()

    other = WorkerSide(load_settings(config), "m", 1, 0, block_size=B,
                       spec=KVGeometry(2, 4, 8, torch.bfloat16, False))
    with caplog.at_level(logging.WARNING, logger="lmcache_remote.integrations"):
        other.register_caches(caches, writer_for)
    assert other.registered and "lookups will miss" in caplog.text
    other.close()

    broken = WorkerSide(load_settings(config), "m", 1, 0, spec=spec, block_size=B)
    broken.register_caches(caches, lambda name, tensor, use_mla: None)  # no op: unproven
    assert broken.disabled is not None and not broken.registered
    broken.close()
