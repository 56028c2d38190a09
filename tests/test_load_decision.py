"""The load decision (`engine.decision`, `telemetry.figures`): its arithmetic on stated figures,
and `CacheEngine` deciding on a real Redis behind a throttling proxy (`tests/throttle.py`)."""

from __future__ import annotations

import pytest
import torch
from faultkit import Clock
from servers import RedisServer
from throttle import Throttle

from lmcache_remote import CacheEngine, DenseKV, EngineMetadata, load_config
from lmcache_remote.config import ConfigError
from lmcache_remote.engine.decision import (
    MIN_PROBE_BUDGET,
    PRIOR_PREFILL_TOKENS_PER_S,
    PRIOR_RTT,
    PRIOR_THROUGHPUT,
    LoadDecision,
)
from lmcache_remote.telemetry.figures import BANDS, LinkFigures, PrefillFigures

MIB = 1024 * 1024


def test_link_figures_follow_samples() -> None:
    link = LinkFigures()
    assert link.snapshot().throughput is None and link.snapshot().rtt is None
    link.round_trip(0.002)
    link.transfer(100 * MIB, 1.002)  # 100 MiB in 1 s past the round trip
    snap = link.snapshot()
    assert snap.rtt == pytest.approx(0.002)
    assert snap.throughput == pytest.approx(100 * MIB, rel=1e-3)
    for _ in range(3):  # the link slows to 10 MiB/s: followed within a few samples
        link.transfer(10 * MIB, 1.002)
    assert link.snapshot().throughput < 12 * MIB
    link.transfer(1000, 0.5)  # a small read: mostly a round trip, it underrates the link
    assert link.snapshot().throughput < 10 * MIB


def test_a_stalled_read_bounds_the_throughput() -> None:
    link = LinkFigures()
    link.transfer(100 * MIB, 0.1)  # 1 GiB/s
    link.stalled(8 * MIB, 1.0)  # 8 MiB did not arrive in 1 s
    assert link.snapshot().throughput <= 4 * MIB


def test_prefill_figures_by_context() -> None:
    prefill = PrefillFigures()
    assert prefill.seconds_for(0, 1000) is None
    prefill.observe(1000, 1000 * 500, 0.1)  # 0.1 ms a token at context ~500
    prefill.observe(1000, 1000 * 10_000, 0.4)  # 0.4 ms a token at context ~10k
    prefill.observe(8, 8 * 100, 9.0)  # a decode step: ignored
    assert prefill.per_token(100) == pytest.approx(1e-4)
    assert prefill.per_token(9000) == pytest.approx(4e-4)
    assert prefill.per_token(3000) in (pytest.approx(1e-4), pytest.approx(4e-4))
    assert prefill.seconds_for(0, 1000) == pytest.approx(0.1)
    assert prefill.seconds_for(8192, 9192) == pytest.approx(0.4)
    assert prefill.seconds_for(BANDS[-1], BANDS[-1] + 10) == pytest.approx(10 * 4e-4)


def test_priors_until_figures_exist() -> None:
    decision = LoadDecision()
    figures = decision.figures()
    assert (figures.throughput, figures.rtt, figures.prefill_tokens_per_s) == (
        PRIOR_THROUGHPUT, PRIOR_RTT, PRIOR_PREFILL_TOKENS_PER_S)
    assert {figures.throughput_source, figures.rtt_source, figures.prefill_source} == {"prior"}
    # 8 MiB of a 2,048-token hit: 7 ms at 10 Gbit/s against 0.5 s of prefill at the prior
    verdict = decision.decide(0, 2048, 4096)
    assert verdict.load_end == 2048 and verdict.declined == 0 and not verdict.probe
    assert verdict.load_s == pytest.approx(PRIOR_RTT + 8 * MIB / PRIOR_THROUGHPUT)
    assert verdict.compute_s == pytest.approx(2048 / PRIOR_PREFILL_TOKENS_PER_S)


def test_a_slow_link_is_declined_and_probed() -> None:
    clock = Clock()
    decision = LoadDecision(clock=clock, probe_interval=10.0)
    decision.link.transfer(8 * MIB, 4.0)  # 2 MiB/s
    decision.prefill.observe(2048, 2048 * 1024, 0.4)  # 2,048 tokens in 0.4 s
    loaded = decision.decide(0, 2048, 4096)
    assert loaded.probe and loaded.load_end == 256  # no load for a while: a one-chunk probe
    # a probe may cost what computing its chunk would: 256 tokens at 0.2 ms
    assert loaded.load_budget == pytest.approx(max(MIN_PROBE_BUDGET, 256 * 0.4 / 2048))
    declined = decision.decide(0, 2048, 4096)
    assert declined.load_end == 0 and declined.declined == 2048 and not declined.probe
    assert declined.load_s > 3 * declined.compute_s
    clock.advance(10.0)
    assert decision.decide(0, 2048, 4096).probe  # probed again after the interval
    assert decision.probe_wait == 20.0  # the link stayed declined: the next waits longer
    clock.advance(10.0)
    assert not decision.decide(0, 2048, 4096).probe
    clock.advance(10.0)
    assert decision.decide(0, 2048, 4096).probe
    for _ in range(3):
        decision.link.transfer(100 * MIB, 0.1)  # the probes found it fast again
    assert decision.decide(0, 2048, 4096).load_end == 2048
    assert decision.probe_wait == 10.0  # a load that pays ends the back-off


def test_the_paying_prefix_is_loaded() -> None:
    """A fixed round trip of 50 ms: the first chunks do not pay it back, the whole hit
    does; the verdict loads the prefix that saves the most time."""
    decision = LoadDecision(rtt=0.05, throughput=1e9, prefill_tokens_per_s=10_000)
    assert decision.decide(0, 2048, 1000).load_end == 2048
    assert decision.decide(0, 256, 1000).load_end == 0  # 25.6 ms to compute, 50 to load
    # what vLLM's prefix cache holds is not weighed: only [start, end) is saved
    assert decision.decide(1792, 2048, 1000).load_end == 1792


def test_no_prefix_that_remote_timeout_would_cut() -> None:
    """4 MiB/s, 8 MiB of a 2,048-token hit: 2 s, longer than 0.8 of a 2 s `remote_timeout`;
    the verdict loads the longest prefix expected to finish in time (6 chunks, 1.5 s)."""
    decision = LoadDecision.from_config(load_config(remote_timeout=2.0, link_gbps=4 * 8 * MIB
                                                    / 1e9, link_rtt_ms=1,
                                                    prefill_tokens_per_s=400))
    verdict = decision.decide(0, 2048, 4096)
    assert verdict.load_end == 1536
    assert decision.load_seconds(1536 * 4096) <= 1.6 < decision.load_seconds(1792 * 4096)


def test_link_down_loads_nothing_but_probes() -> None:
    clock = Clock()
    decision = LoadDecision("always", clock=clock, probe_interval=5.0)
    assert decision.decide(0, 2048, 4096).load_end == 2048
    assert decision.decide(0, 2048, 4096, link_down=True).load_end == 0
    clock.advance(5.0)
    probe = decision.decide(0, 2048, 4096, link_down=True)
    assert probe.probe and probe.load_end == 256


def test_settings() -> None:
    config = load_config(load_policy="always", link_gbps=25, link_rtt_ms=0.2,
                         prefill_tokens_per_s=12_000, load_probe_interval=3)
    decision = LoadDecision.from_config(config)
    figures = decision.figures()
    assert figures.throughput == pytest.approx(25e9 / 8) and figures.rtt == pytest.approx(2e-4)
    assert figures.prefill_tokens_per_s == 12_000
    assert {figures.throughput_source, figures.rtt_source, figures.prefill_source} == {"set"}
    assert decision.policy == "always" and decision.probe_interval == 3
    with pytest.raises(ConfigError, match="load_policy"):
        load_config(load_policy="sometimes")
    with pytest.raises(ConfigError, match="link_gbps"):
        load_config(link_gbps=0)


META = EngineMetadata("decision-model", 1, 0, torch.bfloat16, 4, 4, 64)  # 4 KiB a token


def kv(num_tokens: int, fill: float | None) -> tuple[DenseKV, list[torch.Tensor]]:
    """A dense KV view of `num_tokens` tokens (random when `fill` is None) and its tensors."""
    gen = torch.Generator().manual_seed(1)
    shape = (1, META.num_kv_heads, num_tokens, META.head_size)
    tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16) if fill is None
               else torch.full(shape, fill, dtype=torch.bfloat16)
               for _ in range(2 * META.num_layers)]
    return DenseKV(tensors[:META.num_layers], tensors[META.num_layers:]), tensors


def engine_on(url: str, prefix: str, **overrides: object) -> CacheEngine:
    config = load_config(remote_url=url, key_prefix=prefix, local_cpu=False, store_async=False,
                         stats_publish_interval=None, chunk_size=256, **overrides)
    return CacheEngine(config, META)


def test_engine_declines_a_slow_link_and_counts_it(private_redis: RedisServer,
                                                   key_prefix: str) -> None:
    """On a real Redis behind a proxy: a fast link loads the hit; slowed to 1 MiB/s (the
    2 MiB hit in 2 s, its prefill reported at 0.5 s) the lookup declines it, the retrieve
    loads nothing, the declined tokens are counted and still count as held; `always` loads
    whatever the figures."""
    tokens = torch.randint(0, 30_000, (512,), generator=torch.Generator().manual_seed(2))
    src, src_tensors = kv(512, None)
    with engine_on(private_redis.url, key_prefix) as writer:
        assert writer.store(tokens, src) == 512
    proxy = Throttle(private_redis.port, 2e9)
    try:
        with engine_on(proxy.url, key_prefix, remote_timeout=10.0) as reader:
            reader.record_prefill(512, 0.5)
            dst, dst_tensors = kv(512, 0.0)
            assert reader.lookup(tokens) == 512
            assert bool(reader.retrieve(tokens, dst).all())
            assert all(torch.equal(a, b) for a, b in zip(src_tensors, dst_tensors,
                                                         strict=True))
            proxy.rate = 1 * MIB
            slow, slow_tensors = kv(512, 0.0)
            assert reader.lookup(tokens, load_policy="always") == 512
            assert bool(reader.retrieve(tokens, slow, load_policy="always").all())
            assert all(torch.equal(a, b) for a, b in zip(src_tensors, slow_tensors,
                                                         strict=True))
            assert reader.lookup(tokens) == 0  # the slow load measured the link
            again, again_tensors = kv(512, 0.0)
            assert not bool(reader.retrieve(tokens, again).any())
            assert all(not bool(t.any()) for t in again_tensors)  # nothing was written
            stats = reader.stats()
            assert stats["engine"]["declined_tokens"] == 512  # the lookup's; the retrieve followed
            assert stats["engine"]["lookup_hit_tokens"] == 3 * 512  # held, each time
            assert stats["decision"]["link_bytes_per_s"] < 16 * MIB  # from GB/s, one sample
            assert stats["decision"]["link_bytes_per_s_source"] == "measured"
            assert stats["decision"]["prefill_tokens_per_s_source"] == "measured"
    finally:
        proxy.close()


def test_cached_lm_measures_its_prefill(redis_url: str, key_prefix: str) -> None:
    """The transformers integration times its prefill forward (`prefill` and `generate`)
    and reports it: the decision's prefill figure is measured, by context band."""
    from hfutil import cache_engine, prompt, tiny_model

    from lmcache_remote.integrations.huggingface import CachedLM

    model = tiny_model()
    with cache_engine(model, redis_url, key_prefix, load_policy="pays") as engine:
        lm = CachedLM(model, engine)
        assert engine.decisions.decision.prefill.samples == 0
        lm.prefill(prompt(512, seed=7))
        lm.generate(prompt(2048, seed=8), max_new_tokens=2, do_sample=False)
        figures = engine.stats()["decision"]
    assert engine.decisions.decision.prefill.samples == 2
    assert figures["prefill_tokens_per_s_source"] == "measured"
    assert set(figures["prefill_seconds_per_token"]) == {"<1024", "<2048"}


def test_cached_lm_declines_a_slow_link(private_redis: RedisServer, key_prefix: str) -> None:
    """The transformers integration on a link that slows to 1 MiB/s (2 MiB of KV in 2 s,
    against a prefill set at 20,000 tokens a second: 0.2 s): the hit is loaded while the link
    is fast, the slow load measures the link, the next hit is declined and the prompt is
    computed, with the logits of a full recompute."""
    from hfutil import CHUNK, cache_engine, full_logits, prompt, tiny_model

    from lmcache_remote.integrations.huggingface import CachedLM

    model = tiny_model()
    ids = prompt(4096 + CHUNK // 2, seed=5)
    with cache_engine(model, private_redis.url, key_prefix) as engine:
        assert CachedLM(model, engine).prefill(ids).stored_tokens == [4096]
    proxy = Throttle(private_redis.port, 2e9)
    try:
        with cache_engine(model, proxy.url, key_prefix, local_cpu=False, remote_timeout=10.0,
                          prefill_tokens_per_s=20_000, load_policy="pays") as engine:
            lm = CachedLM(model, engine)
            assert lm.prefill(ids).hit_tokens == 4096
            proxy.rate = MIB
            assert lm.prefill(ids).hit_tokens == 4096  # loaded slowly: now measured
            declined = lm.prefill(ids)
            assert declined.hit_tokens == 0
            assert (declined.logits - full_logits(model, ids)).abs().max().item() == 0.0
            assert engine.stats()["engine"]["declined_tokens"] == 4096
    finally:
        proxy.close()
