"""KV cache groups of hybrid models (`vllm_core.groups`), without vLLM: the group tags in the
keys (golden vectors, computed here a second time from docs/key-schema.md's words), the chunk
size of a model with sliding windows, the scheduler's `GroupLookup` against a real Redis
(vLLM's hit rule: full groups every chunk below the hit, SWA groups only their window), and the
scheduler side's per-group plans (loads only into the blocks vLLM keeps, stores only from
blocks it holds, no promise after two failed loads).

What this cannot show: that vLLM hands these block ids (tests/vllm_real/test_hybrid.py runs
vLLM 0.33's own scheduler) or that the loaded KV gives vLLM's own outputs
(tests/vllm_cpu/test_hybrid_models.py)."""

from __future__ import annotations

import hashlib

import pytest
import redis
import torch

from lmcache_remote import CacheConfig, CacheEngine, DenseKV
from lmcache_remote.integrations.vllm_core import (
    KVGeometry,
    NewRequest,
    SchedulerSide,
    Span,
)
from lmcache_remote.integrations.vllm_core.groups import (
    FULL,
    MAMBA,
    SWA,
    KVGroup,
    group_namespace,
    group_tag,
    model_chunk_size,
    plain,
)
from lmcache_remote.integrations.vllm_core.lookup import GroupLookup
from lmcache_remote.naming.hashing import TokenDatabase

C, B = 256, 128
GEOMETRY = KVGeometry(2, 2, 8, torch.bfloat16, False)
SWA_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
FULL_LAYERS = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")


def swa(index: int = 0, window: int = 256, block: int = B) -> KVGroup:
    return KVGroup(index, SWA, SWA_LAYERS, block, GEOMETRY, window=window)


def full(index: int = 1, block: int = B) -> KVGroup:
    return KVGroup(index, FULL, FULL_LAYERS, block, GEOMETRY)


STATE = KVGeometry(2, 1, 280, torch.uint8, True)  # 35,840 bytes of state: 128 rows of 280


def mamba(index: int = 0, block: int = B) -> KVGroup:
    return KVGroup(index, MAMBA, SWA_LAYERS, block, STATE, state_bytes=35840)


def test_group_tags_match_the_documented_golden_vectors() -> None:
    def independent(kind: str, window: int, names: tuple[str, ...]) -> str:
        h = hashlib.blake2b(digest_size=4, person=b"lmcr-kv-group1")
        h.update("\n".join(names).encode("utf-8"))
        return f"{kind}{window if kind == 'swa' else ''}-{h.hexdigest()}"

    assert group_tag(SWA, 256, SWA_LAYERS) == "swa256-585bda79"  # docs/key-schema.md
    assert group_tag(FULL, 0, FULL_LAYERS) == "full-0c4a64d1"
    assert group_tag(SWA, 256, SWA_LAYERS) == independent("swa", 256, SWA_LAYERS)
    assert group_tag(FULL, 0, FULL_LAYERS) == independent("full", 0, FULL_LAYERS)
    groups = [swa(), full()]
    assert group_namespace("m@f1-00", groups[0], groups) == "m@f1-00~swa256-585bda79"
    one = [KVGroup(0, FULL, SWA_LAYERS + FULL_LAYERS, B, GEOMETRY)]
    assert plain(one) and group_namespace("m@f1-00", one[0], one) == "m@f1-00"  # as before
    assert not plain([swa(0)])  # an all-SWA model is named apart from the old keys


@pytest.mark.parametrize(("window", "block", "chunk", "expected"), [
    (256, 128, 256, 256),  # retained 256: windows start on 256-token boundaries
    (4096, 16, 256, 256),
    (128, 16, 256, 128),  # gpt-oss's window: chunks of 128
    (1024, 16, 256, 256),  # Gemma 3
    (100, 16, 256, 16),  # retained 112: gcd 16
])
def test_chunk_size_fits_every_window(window: int, block: int, chunk: int,
                                      expected: int) -> None:
    groups = [swa(0, window, block), full(1, block)]
    size = model_chunk_size(groups, chunk)
    assert size == expected
    for hit in range(size, 8192, size):  # every window starts on a chunk boundary
        assert groups[0].first_kept(hit) % size == 0


def test_chunk_size_that_cannot_tile_a_block_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of group 1's block size 64"):
        model_chunk_size([swa(0, 256, 16), full(1, 64)], 32)


def test_a_recurrent_state_makes_the_chunk_its_block() -> None:
    assert model_chunk_size([mamba(0, 256), full(1, 256)], 256) == 256
    assert model_chunk_size([mamba(0, 128), full(1, 128)], 256) == 128  # a state per block
    assert model_chunk_size([mamba(0, 512), full(1, 256)], 256) == 512
    with pytest.raises(ValueError, match="Mamba block boundary"):  # windows of 64 tokens
        model_chunk_size([mamba(0, 128), swa(1, 65, 64), full(2, 128)], 256)
    # vLLM keeps the state after n tokens in the block of token n - 1
    assert [mamba(0, 128).first_kept(n) for n in (128, 1536, 1600)] == [0, 1408, 1536]


def test_first_kept_is_vllms_rule() -> None:
    group = swa(0, 256, 128)  # vLLM: skipped(n) = max(0, n - 256 + 1), floored to a block
    assert [group.first_kept(n) for n in (0, 255, 256, 384, 512, 1536)] == [0, 0, 0, 128, 256,
                                                                             1280]
    assert full().first_kept(1536) == 0


def _store(config: CacheConfig, namespace: str, tokens: list[int], chunks: list[int]) -> None:
    """Store the chunks `chunks` (indexes) of `tokens` under `namespace`."""
    n = len(tokens)
    kv = DenseKV([torch.randn(2, n, 8).to(torch.bfloat16) for _ in range(2)],
                 [torch.randn(2, n, 8).to(torch.bfloat16) for _ in range(2)])
    with CacheEngine(config, GEOMETRY.metadata(namespace, 1, 0)) as engine:
        for i in chunks:
            mask = torch.zeros(n, dtype=torch.bool)
            mask[i * C:] = True
            end = (i + 1) * C
            assert engine.store(tokens[:end], kv, mask[:end]) == C


def test_group_lookup_follows_vllms_hit_rule_in_one_round_trip(private_redis) -> None:
    config = CacheConfig(remote_url=private_redis.url, remote_timeout=0.5, chunk_size=C,
                         store_async=False, local_cpu=False, stats_publish_interval=None)
    groups = [swa(0), full(1)]
    spaces = [group_namespace("m", g, groups) for g in groups]
    tokens = list(range(1600))  # 6 whole chunks; a hit leaves one token: at most 1536
    _store(config, spaces[1], tokens, [0, 1, 2, 3, 4, 5])  # full: every chunk
    _store(config, spaces[0], tokens, [4, 5])  # SWA: only the window of a 1536 hit
    metas = [GEOMETRY.metadata(ns, 1, 0) for ns in spaces]
    lookup = GroupLookup(config, groups, [m.layout for m in metas], [[m.namespace] for m in metas])
    client = redis.Redis.from_url(private_redis.url)
    calls = client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
    assert lookup(tokens) == 1536  # SWA window of 1536: tokens 1280.. = chunks 4, 5
    after = client.info("commandstats")["cmdstat_exists"]["calls"]
    assert after - calls == 2 * 6  # every group's chunk once: one pipeline (one round trip)
    assert lookup(tokens[:1536]) == 1280  # a hit at 1280 needs SWA chunks 3, 4: 3 is missing
    assert lookup(tokens[:1537]) == 1536
    # the full group lacks chunk 2: no hit above 512, and no SWA window below 1024 is held
    key = TokenDatabase(metas[1].namespace, C, False).prefix_keys(tokens)[2].key
    assert client.unlink(key.redis_key(config.key_prefix)) == 1
    assert lookup(tokens) == 0
    _store(config, spaces[0], tokens, [0, 1])
    assert lookup(tokens) == 512
    lookup.rename_model("other")  # a connector reset: nothing is found under a new name
    assert lookup(tokens) == 0
    lookup.close()


def _hybrid_side(**kw) -> SchedulerSide:
    return SchedulerSide(lambda tokens, salt: 1536, C, B, groups=[swa(0), full(1)], **kw)


def test_a_hybrid_hit_loads_in_the_background_and_only_the_window_of_swa_groups() -> None:
    side = _hybrid_side()
    prompt = list(range(1600))
    assert side.num_new_matched_tokens("r", prompt, 0) == 1536
    assert side.loads_async(1536)
    null = 0
    swa_blocks = [null] * 10 + [11, 12, 13]  # what vLLM allocates: nulls below the window
    full_blocks = list(range(20, 33))
    side.after_alloc("r", 1536, (swa_blocks, full_blocks), len(prompt))
    plans = side.build([], [], {})
    assert [(p.group, p.load, p.async_load) for p in plans] == [
        (0, Span(1280, 1280, 1536), True), (1, Span(0, 0, 1536), True)]
    swa_slots = plans[0].slot_mapping[1280:1536]
    assert (swa_slots // B).unique().tolist() == [11, 12]  # never the null block


def test_swa_stores_only_chunks_whose_blocks_vllm_holds() -> None:
    side = SchedulerSide(lambda tokens, salt: 0, C, B, groups=[swa(0), full(1)])
    prompt = list(range(1600))
    assert side.num_new_matched_tokens("r", prompt, 1536) == 0  # vLLM's own hit of 1536
    swa_blocks = [0] * 10 + [11, 12, 13]
    plans = side.build([NewRequest("r", prompt, (swa_blocks, list(range(20, 33))), 1536)],
                       [], {"r": 64})
    # chunks 0-5 are stored again from the full group; the SWA group from its window only
    assert [(p.group, p.save) for p in plans] == [(0, Span(1280, 1280, 1536)),
                                                  (1, Span(0, 0, 1536))]
    # a chunked prefill: the step that computes [1024, 1536) may not read SWA blocks freed
    # below the window of its first token (vLLM frees them before the step)
    side = SchedulerSide(lambda tokens, salt: 0, C, B, groups=[swa(0), full(1)])
    assert side.num_new_matched_tokens("q", prompt, 0) == 0
    plans = side.build([NewRequest("q", prompt, ([1, 2, 3, 4, 5, 6, 7, 8], list(range(20, 28))),
                                   0)], [], {"q": 1000})
    assert [(p.group, p.save) for p in plans] == [(0, Span(0, 0, 768)), (1, Span(0, 0, 768))]


def test_a_request_whose_load_failed_twice_is_not_promised_again() -> None:
    side = _hybrid_side()
    prompt = list(range(1600))
    for _ in range(2):
        assert side.num_new_matched_tokens("r", prompt, 0) == 1536
        side.load_failed(["r"])
    assert side.num_new_matched_tokens("r", prompt, 0) == 0
    assert side.metrics.counters()["vllm.failed_load_requests"] == 2
    side.finish("r")
    assert side.num_new_matched_tokens("r", prompt, 0) == 1536  # a new request of that id


def test_a_state_is_loaded_into_its_block_and_stored_only_where_a_step_ended() -> None:
    side = SchedulerSide(lambda tokens, salt: 1536, B, B, groups=[mamba(0), full(1)])
    prompt = list(range(1600))
    assert side.num_new_matched_tokens("r", prompt, 0) == 1536
    state_blocks = [0] * 11 + [27, 36]  # vLLM: the state at 1536 in block 27, then running
    side.after_alloc("r", 1536, (state_blocks, list(range(40, 53))), len(prompt))
    plans = side.build([], [], {})
    assert [(p.group, p.load) for p in plans] == [(0, Span(1408, 1408, 1536)),
                                                  (1, Span(0, 0, 1536))]
    assert (plans[0].slot_mapping[1408:1536] // B).unique().tolist() == [27]
    # stores: a step ending on a block boundary stores the state it ends with, from its block
    side = SchedulerSide(lambda tokens, salt: 0, B, B, groups=[mamba(0), full(1)])
    assert side.num_new_matched_tokens("q", prompt, 0) == 0
    plans = side.build([NewRequest("q", prompt, ([0] * 11 + [5], list(range(60, 72))), 0)],
                       [], {"q": 1536})
    assert [(p.group, p.save) for p in plans] == [(0, Span(1408, 1408, 1536)),
                                                  (1, Span(0, 0, 1536))]
    assert (plans[0].slot_mapping[1408:1536] // B).unique().tolist() == [5]
    # a step ending off a boundary leaves no state to store (vLLM made none there)
    side = SchedulerSide(lambda tokens, salt: 0, B, B, groups=[mamba(0), full(1)])
    assert side.num_new_matched_tokens("s", prompt, 0) == 0
    plans = side.build([NewRequest("s", prompt, ([0] * 12 + [5], list(range(60, 73))), 0)],
                       [], {"s": 1600})
    assert [p.group for p in plans] == [1]


def test_state_pages_it_cannot_read_turn_the_rank_off_not_vllm() -> None:
    """A Mamba layer's cache handed in a form the connector cannot read as bytes per block
    (here bfloat16 values): that rank's connector goes off (ERROR), vLLM is not stopped, and
    a load planned for it is reported failed, so vLLM recomputes the request."""
    from lmcache_remote.integrations.vllm_core import RequestPlan, load_settings, slot_mapping
    from lmcache_remote.integrations.vllm_core.worker_groups import GroupedWorker

    group = mamba(0)
    worker = GroupedWorker(load_settings({"remote_url": None}), "m", 1, 0, [group], B)
    worker.register_caches({name: torch.zeros(4, 128, 140, dtype=torch.bfloat16)
                            for name in group.layer_names}, lambda name, tensor, mla: None)
    assert worker.disabled and "state pages" in worker.disabled and not worker.registered
    plan = RequestPlan("r", list(range(256)), slot_mapping([0, 2], B, 256), None,
                       Span(128, 128, 256), None, async_load=True, group=0)
    worker.begin_step([plan])
    worker.start_load()
    done, failed = worker.finished_loads()
    assert done == failed == {"r"}
    worker.close()


def test_a_grouped_model_may_load_any_hit_in_the_background() -> None:
    """`may_load_async` (vLLM 0.34's `--max-num-inflight-kv-loads`): every load of a model
    of several groups runs in the background, so any prompt long enough for a hit may."""
    side = SchedulerSide(lambda tokens, salt: 0, C, B, groups=[swa(0), full(1)])
    assert side.may_load_async("r", C + 1) is True
    assert side.may_load_async("r", C) is False  # no whole chunk short of its last token
