"""The vLLM connector, replayed in vLLM's call order against the stand-in of vLLM's base
classes in tests/vllm_stub, with real paged caches (both layouts, and MLA) and real Redis.

A `Replica` is one vLLM instance: a scheduler-side and a worker-side connector, a paged KV
cache per layer, a block allocator and a toy model whose KV for token i is a fixed function of
(layer, position, token id): any KV that is not bit-exact shows up in `check`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from kvutil import chunk_heads, token_kv_paged, tokens

from lmcache_remote import ConfigError
from tests.servers import RedisServer

STUB = Path(__file__).parent / "vllm_stub"
LAYERS, HEADS, HEAD, BLOCK, BLOCKS, CHUNK = 2, 2, 8, 16, 160, 256
DTYPE = torch.bfloat16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def vllm_stub() -> Iterator[Any]:
    """Put the stand-in vLLM on sys.path for this module only, and take it off again (also
    out of sys.modules, so that test_vllm_real.py never sees it)."""
    sys.path.insert(0, str(STUB))
    import vllm

    assert getattr(vllm, "IS_LMCR_STUB", False)
    from lmcache_remote.integrations import vllm as adapter

    yield adapter
    sys.path.remove(str(STUB))
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm.") or name.endswith("integrations.vllm"):
            del sys.modules[name]


def true_kv(prompt: list[int], layer: int, start: int, end: int, mla: bool) -> torch.Tensor:
    """The toy model's KV of tokens [start, end): [2, T, heads, head] (MLA: [T, head])."""
    pos = torch.arange(start, end, dtype=torch.float32)
    tok = torch.tensor(prompt[start:end], dtype=torch.float32)
    width = HEAD if mla else 2 * HEADS * HEAD
    grid = torch.arange(width, dtype=torch.float32)
    kv = ((pos[:, None] * 0.37 + tok[:, None] * 0.011 + grid * 0.13 + layer * 1.7) % 7.0) - 3.5
    kv = kv.to(DTYPE)
    return kv if mla else kv.reshape(-1, 2, HEADS, HEAD).transpose(0, 1)


class Replica:
    """One vLLM instance replaying the scheduler's and the worker's connector calls."""

    def __init__(self, adapter: Any, url: str, prefix: str, layout: str, *, perm_seed: int,
                 rank: int = 0, world: int = 1, **extra: Any) -> None:
        from vllm.config import (
            CacheConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            MLAAttentionSpec,
        )

        self.layout, self.mla = layout, layout == "mla"
        extra_config = {"remote_url": url, "key_prefix": prefix, "chunk_size": CHUNK,
                        "max_local_cpu_size": 0.05, "remote_timeout": 1.0, **extra}
        config = VllmConfig(
            ModelConfig(model="meta/toy", dtype=DTYPE, num_layers=LAYERS,
                        num_kv_heads=1 if self.mla else HEADS, head_size=HEAD,
                        use_mla=self.mla),
            CacheConfig(block_size=BLOCK),
            ParallelConfig(tensor_parallel_size=world, world_size=world, rank=rank),
            KVTransferConfig("LmcrConnector", "kv_both", extra_config,
                             "lmcache_remote.integrations.vllm"),
        )
        spec_cls = MLAAttentionSpec if self.mla else FullAttentionSpec
        spec = spec_cls(block_size=BLOCK, num_kv_heads=1 if self.mla else HEADS, head_size=HEAD,
                        dtype=DTYPE)
        kv_cache_config = KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(NAMES, spec)])
        cls = adapter.LmcrConnector
        self.sched = cls(config, KVConnectorRole.SCHEDULER, kv_cache_config)
        self.worker = cls(config, KVConnectorRole.WORKER, kv_cache_config)
        shape = {"kv_split": (2, BLOCKS, BLOCK, HEADS, HEAD),
                 "flashinfer": (BLOCKS, 2, BLOCK, HEADS, HEAD),
                 "packed": (BLOCKS, HEADS, BLOCK, 2 * HEAD), "mla": (BLOCKS, BLOCK, HEAD)}[layout]
        self.caches = {name: torch.full(shape, 9.0, dtype=DTYPE) for name in NAMES}
        self.worker.register_kv_caches(self.caches)
        gen = torch.Generator().manual_seed(perm_seed)
        self.free = torch.randperm(BLOCKS, generator=gen).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.seen_at_attention: dict[tuple[str, int], torch.Tensor] = {}
        self.errors: set[int] = set()

    # -- vLLM's scheduler -------------------------------------------------------------------

    def schedule_new(self, req_id: str, prompt: list[int], local_hit: int = 0,
                     salt: str | None = None, **fields: Any) -> Any:
        from vllm.v1.request import Request

        request = Request(req_id, prompt, cache_salt=salt, **fields)
        self.prompts[req_id] = prompt
        num_ext, is_async = self.sched.get_num_new_matched_tokens(request, local_hit)
        assert is_async is False
        assert local_hit + num_ext < len(prompt)  # vLLM always computes a token
        self.blocks[req_id] = [self.free.pop() for _ in range(-(-len(prompt) // BLOCK))]
        self.sched.update_state_after_alloc(request, (self.blocks[req_id],), num_ext)
        return request, num_ext

    def step(self, new: list[tuple[Any, int, int]],
             cached: tuple[tuple[str, int, int], ...] = ()) -> Any:
        """One engine step. `new`: (request, num_computed incl. hits, num_scheduled);
        `cached`: (req_id, num_computed, num_scheduled). Runs the worker and returns the
        connector metadata."""
        from vllm.forward_context import ForwardContext
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        new_data = [NewRequestData(r.request_id, r.prompt_token_ids, (self.blocks[r.request_id],),
                                   done, r.mm_features, r.lora_request) for r, done, _ in new]
        cached_data = CachedRequestData(
            req_ids=[c[0] for c in cached], new_block_ids=[None for _ in cached],
            num_computed_tokens=[c[1] for c in cached])
        scheduled = {r.request_id: n for r, _, n in new} | {c[0]: c[2] for c in cached}
        out = SchedulerOutput(new_data, cached_data, scheduled, sum(scheduled.values()))
        meta = self.sched.build_connector_meta(out)
        work = {r.request_id: (done, done + n) for r, done, n in new}
        work |= {c[0]: (c[1], c[1] + c[2]) for c in cached}
        self._run_worker(meta, ForwardContext(attn_metadata={n: object() for n in NAMES}), work)
        return meta

    # -- vLLM's worker ----------------------------------------------------------------------

    def _run_worker(self, meta: Any, ctx: Any, work: dict[str, tuple[int, int]]) -> None:
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(ctx)
        for layer, name in enumerate(NAMES):
            self.worker.wait_for_layer_load(name)
            for plan in meta.requests:  # what this layer's attention would read
                if plan.load is not None:
                    got = self.read(plan.req_id, plan.load.start, plan.load.end)[layer]
                    self.seen_at_attention[(plan.req_id, layer)] = got.clone()
            for req_id, (start, end) in work.items():  # the attention layer writes new KV
                self.write(req_id, layer, start, end)
            self.worker.save_kv_layer(name, self.caches[name], ctx.attn_metadata[name])
        self.worker.wait_for_save()
        assert self.worker.get_finished(set()) == (None, None)
        self.errors |= self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()

    def slots(self, req_id: str, start: int, end: int) -> torch.Tensor:
        blocks = torch.tensor(self.blocks[req_id])
        pos = torch.arange(start, end)
        return blocks[pos // BLOCK] * BLOCK + pos % BLOCK

    def write(self, req_id: str, layer: int, start: int, end: int) -> None:
        s = self.slots(req_id, start, end)
        b, o = s // BLOCK, s % BLOCK
        kv = true_kv(self.prompts[req_id], layer, start, end, self.mla)
        cache = self.caches[NAMES[layer]]
        if self.layout == "kv_split":
            cache[0, b, o], cache[1, b, o] = kv[0], kv[1]
        elif self.layout == "flashinfer":
            cache[b, 0, o], cache[b, 1, o] = kv[0], kv[1]
        elif self.layout == "packed":
            cache[b, :, o, :HEAD], cache[b, :, o, HEAD:] = kv[0], kv[1]
        else:
            cache[b, o] = kv

    def read(self, req_id: str, start: int, end: int) -> list[torch.Tensor]:
        s = self.slots(req_id, start, end)
        if self.mla:
            return [c.reshape(-1, HEAD)[s] for c in self.caches.values()]
        if self.layout == "flashinfer":
            as_split = [c.transpose(0, 1) for c in self.caches.values()]
            return list(token_kv_paged(as_split, "kv_split", s))
        return list(token_kv_paged(list(self.caches.values()), self.layout, s))

    def check(self, req_id: str, end: int) -> None:
        """Every token's KV in [0, end) is the toy model's, bit for bit."""
        got = self.read(req_id, 0, end)
        for layer in range(LAYERS):
            want = true_kv(self.prompts[req_id], layer, 0, end, self.mla)
            assert torch.equal(got[layer], want), f"layer {layer} differs"

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


@pytest.fixture
def replicas(vllm_stub: Any, redis_url: str, key_prefix: str) -> Iterator[Any]:
    made: list[Replica] = []

    def make(layout: str, perm_seed: int, url: str = redis_url, **extra: Any) -> Replica:
        made.append(Replica(vllm_stub, url, key_prefix, layout, perm_seed=perm_seed, **extra))
        return made[-1]

    yield make
    for replica in made:
        replica.close()


def prefill(replica: Replica, req_id: str, prompt: list[int], local_hit: int = 0) -> int:
    """Schedule a new request and run its whole prefill in one step; the hit it got."""
    request, num_ext = replica.schedule_new(req_id, prompt, local_hit)
    done = local_hit + num_ext
    replica.step([(request, done, len(prompt) - done)])
    return num_ext


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
@pytest.mark.parametrize(("writer", "reader"), [("kv_split", "packed"), ("packed", "kv_split"),
                                               ("flashinfer", "packed")])
def test_second_instance_loads_the_prefix_bit_exactly(replicas: Any, writer: str, reader: str,
                                                      layerwise: bool) -> None:
    prompt = tokens(700, seed=1)
    a = replicas(writer, perm_seed=1, layerwise=layerwise, store_async=False)
    assert prefill(a, "r1", prompt) == 0
    a.check("r1", 700)
    b = replicas(reader, perm_seed=2, layerwise=layerwise, local_cpu=False)
    assert prefill(b, "r2", prompt) == 512
    b.check("r2", 700)  # [0, 512) came from Redis, the rest from the toy model
    for layer in range(LAYERS):  # each layer was in place before its attention ran
        want = true_kv(prompt, layer, 0, 512, False)
        assert torch.equal(b.seen_at_attention[("r2", layer)], want)
    assert b.errors == set()
    stats = b.worker._worker.engine.stats()["engine"]
    assert stats["retrieved_tokens"] == 512


def test_whole_prompt_hit_leaves_tokens_to_compute(replicas: Any) -> None:
    prompt = tokens(512, seed=2)
    a = replicas("kv_split", perm_seed=1, store_async=False)
    prefill(a, "r1", prompt)
    b = replicas("packed", perm_seed=3, local_cpu=False)
    assert prefill(b, "r2", prompt) == 256  # not 512: the last token must be computed
    b.check("r2", 512)


def test_vllm_prefix_cache_hit_is_kept_and_the_rest_loaded(replicas: Any) -> None:
    prompt = tokens(800, seed=3)
    a = replicas("kv_split", perm_seed=1, store_async=False)
    prefill(a, "r1", prompt)
    b = replicas("kv_split", perm_seed=4, local_cpu=False)
    request, num_ext = b.schedule_new("r2", prompt, local_hit=272)  # 17 blocks local
    assert num_ext == 768 - 272
    for layer in range(LAYERS):  # vLLM's own prefix cache holds the first 272 tokens
        b.write("r2", layer, 0, 272)
    meta = b.step([(request, 768, 32)])
    (plan,) = meta.requests
    assert (plan.load.skip, plan.load.start, plan.load.end) == (256, 272, 768)
    assert plan.save is None  # everything up to 768 is stored already
    b.check("r2", 800)


def test_chunked_prefill_stores_each_chunk_once_it_is_complete(
    replicas: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    prompt = tokens(700, seed=4)
    a = replicas("packed", perm_seed=5, store_async=False)
    request, _ = a.schedule_new("r1", prompt)
    spans = []
    meta = a.step([(request, 0, 300)])
    spans.append([(p.save.start, p.save.end) for p in meta.requests])
    meta = a.step([], cached=(("r1", 300, 300),))
    spans.append([(p.save.start, p.save.end) for p in meta.requests])
    meta = a.step([], cached=(("r1", 600, 100),))
    spans.append([(p.save.start, p.save.end) for p in meta.requests if p.save])
    assert spans == [[(0, 256)], [(256, 512)], []]
    a.check("r1", 700)
    keys = chunk_heads(redis_client.scan_iter(match=f"{key_prefix}:v1:*"))
    assert len(keys) == 2
    b = replicas("kv_split", perm_seed=6, local_cpu=False)
    assert prefill(b, "r2", prompt) == 512
    b.check("r2", 700)


def test_redis_outage_during_load_is_reported_as_block_errors(
    replicas: Any, private_redis: RedisServer
) -> None:
    prompt = tokens(600, seed=5)
    a = replicas("kv_split", perm_seed=1, url=private_redis.url, store_async=False)
    prefill(a, "r1", prompt)
    b = replicas("packed", perm_seed=7, url=private_redis.url, local_cpu=False)
    request, num_ext = b.schedule_new("r2", prompt)
    assert num_ext == 512
    private_redis.kill()  # Redis dies between the scheduler's lookup and the worker's load
    b.step([(request, 512, 88)])  # no exception reaches vLLM
    assert b.errors == set((b.slots("r2", 0, 512) // BLOCK).tolist())


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_corrupt_chunk_fails_only_its_blocks_and_later_ones(
    replicas: Any, redis_client: redis.Redis, key_prefix: str, layerwise: bool
) -> None:
    prompt = tokens(800, seed=6)
    a = replicas("kv_split", perm_seed=1, store_async=False, serde="raw", layerwise=layerwise)
    prefill(a, "r1", prompt)
    b = replicas("packed", perm_seed=8, local_cpu=False, layerwise=layerwise)
    keys = b.sched._lookup_engines[0].token_db.chunks(prompt)
    damaged = keys[1].key.redis_key(key_prefix)
    value = bytearray(redis_client.get(damaged))
    value[-3] ^= 0x10
    redis_client.set(damaged, bytes(value))
    request, num_ext = b.schedule_new("r2", prompt)
    assert num_ext == 768  # lookup sees the value; only the load can tell it is bad
    b.step([(request, 768, 32)])
    assert b.errors == set((b.slots("r2", 256, 768) // BLOCK).tolist())
    got, want = b.read("r2", 0, 256), [true_kv(prompt, i, 0, 256, False) for i in range(LAYERS)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_mla_ranks_share_one_copy_through_the_connector(
    replicas: Any, redis_client: redis.Redis, key_prefix: str
) -> None:
    prompt = tokens(600, seed=7)
    rank0 = replicas("mla", perm_seed=1, rank=0, world=2, save_only_first_rank=True,
                     store_async=False)
    rank1 = replicas("mla", perm_seed=2, rank=1, world=2, save_only_first_rank=True,
                     store_async=False)
    prefill(rank0, "r1", prompt)
    prefill(rank1, "r1", prompt)
    keys = {k.decode() for k in redis_client.scan_iter(match=f"{key_prefix}:v1:*")}
    assert len(chunk_heads(keys)) == 2 and all(":meta/toy:1:0:bfloat16:{" in k for k in keys)
    for rank in (0, 1):
        other = replicas("mla", perm_seed=10 + rank, rank=rank, world=2,
                         save_only_first_rank=True, local_cpu=False)
        assert prefill(other, "r2", prompt) == 512
        other.check("r2", 600)


def test_extra_config_is_validated(vllm_stub: Any, redis_url: str) -> None:
    with pytest.raises(ConfigError, match="chunk_sise"):
        Replica(vllm_stub, redis_url, "p", "kv_split", perm_seed=0, chunk_sise=256)
    with pytest.raises(ConfigError, match="layerwise"):
        Replica(vllm_stub, redis_url, "p", "kv_split", perm_seed=0, layerwise="yes")


def test_config_file_and_overrides(vllm_stub: Any, redis_url: str, key_prefix: str,
                                   tmp_path: Path) -> None:
    path = tmp_path / "lmcr.yaml"
    path.write_text(f"remote_url: {redis_url}\nchunk_size: 512\nkey_prefix: {key_prefix}\n")
    from lmcache_remote.integrations.vllm_core import load_settings

    settings = load_settings({"config_file": str(path), "chunk_size": 256, "layerwise": False})
    assert settings.config.chunk_size == 256 and settings.layerwise is False
    assert settings.config.remote_url == redis_url


@pytest.mark.parametrize("field", ["mm_features", "lora_request"])
def test_requests_not_named_by_their_tokens_pass_through(
    replicas: Any, redis_client: redis.Redis, key_prefix: str, field: str
) -> None:
    prompt = tokens(600, seed=8)
    a = replicas("kv_split", perm_seed=1, store_async=False)
    prefill(a, "plain", prompt)
    value = ["image-0"] if field == "mm_features" else object()
    request, num_ext = a.schedule_new("special", prompt, **{field: value})
    assert num_ext == 0  # a hit exists for these tokens, but not for this request's KV
    meta = a.step([(request, 0, 600)])
    assert meta.requests == []
    a.check("special", 600)
    assert len(chunk_heads(redis_client.scan_iter(match=f"{key_prefix}:v1:*"))) == 2
