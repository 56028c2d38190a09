"""The vLLM-free decisions of the connector: hit counting, plans across steps, layouts.

The scheduler side is given a lookup function that answers a fixed number of hit tokens (the
real one asks Redis; its answers are covered by test_vllm_connector.py)."""

from __future__ import annotations

import pytest
import torch

from lmcache_remote import ConfigError
from lmcache_remote.integrations.vllm_core import (
    CachedRequest,
    NewRequest,
    SchedulerSide,
    Span,
    cache_torch_dtype,
    layer_view,
    load_settings,
    slot_mapping,
)

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
    assert s.num_new_matched_tokens("r", prompt, 16, cache_salt="t") == 496
    s.after_alloc("r", 496, cache_salt="t")
    (plan,) = s.build([NewRequest("r", prompt, blocks(1000), 512)], [], {"r": 300})
    assert plan.load == Span(0, 16, 512)
    assert plan.save == Span(512, 512, 768)  # the chunk completed by this step only
    assert plan.cache_salt == "t" and plan.token_ids == prompt[:768]
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


def test_slot_mapping_and_layouts() -> None:
    assert slot_mapping([3, 1], 4, 6).tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(ValueError):
        slot_mapping([3], 4, 5)
    flash = torch.zeros(10, 2, 16, 2, 8)
    view, layout = layer_view(flash)
    assert layout == "kv_split" and view.shape == (2, 10, 16, 2, 8)
    view[1, 3, 4] = 1.0
    assert flash[3, 1, 4].eq(1.0).all()  # a view, no copy
    assert layer_view(torch.zeros(2, 10, 16, 2, 8))[1] == "kv_split"
    assert layer_view(torch.zeros(10, 2, 16, 16))[1] == "packed"
    assert layer_view(torch.zeros(10, 16, 576))[1] == "mla"
    with pytest.raises(ValueError):
        layer_view(torch.zeros(10))


def test_cache_dtypes_and_settings() -> None:
    assert cache_torch_dtype("auto", torch.float16) is torch.float16
    assert cache_torch_dtype("fp8_e4m3", torch.bfloat16) is torch.uint8
    assert cache_torch_dtype("bfloat16", torch.float16) is torch.bfloat16
    with pytest.raises(ConfigError):
        cache_torch_dtype("nonsense", torch.float16)
    settings = load_settings({"remote_url": None, "model_name": "served/name"})
    assert settings.model_name == "served/name" and settings.layerwise is True
    with pytest.raises(ConfigError, match="bogus"):
        load_settings({"bogus": 1})
