"""A hybrid (sliding-window) model's HiCache stack, built by SGLang's own assembler, over the
Redis backend: what SGLang 0.5.23 does with a backend that implements only the KV-pool calls
(`batch_exists`, `batch_get_v1`, `batch_set_v1`) and leaves the v2 calls for sidecar pools
(`batch_exists_v2`, `batch_get_v2`, `batch_set_v2`) to `HiCacheStorage`'s
`raise NotImplementedError()`.

The stack is SGLang's `build_hybrid_swa_stack` (what its `_SwaStrategy` builds for a model with
sliding-window layers: a real `SWAKVPool` and `SWATokenToKVPoolAllocator`, a `HostPoolGroup`
of the full-attention KV host pool (the anchor) and the SWA host pool, and the
`HybridCacheController` with the `dynamic` backend). The only change is SGLang's own test
kit's: host pools with `pin_memory=False` (its `cudaHostRegister` needs CUDA). The storage
transfers are the ones SGLang's radix cache hands the controller for the SWA component
(`unified_cache/components/swa.py`, `build_hicache_transfers`): a backup carries the node's
SWA pages as a `TRAILING_PAGES` sidecar; a prefetch from the root carries a placeholder SWA
window, one "mid-tree" shorter than the window carries none.

What SGLang does, as these tests show:
- backup with the SWA sidecar: `batch_set_v2` raises before the KV pages are written; SGLang
  logs it and reports 0 tokens backed up: nothing reaches Redis, not even the KV pages;
- prefetch with the SWA sidecar: the hit query goes to `batch_exists_v2` instead of
  `batch_exists`; it raises, SGLang logs it and counts a hit of 0 for the whole request, the
  KV pages included, even when every KV page is in Redis;
- without a sidecar (a node with no SWA pages on the host; a prefetch shorter than the window
  below a cached prefix) the KV pages go through the v1 calls as for any model: written, found
  and loaded byte for byte;
- no exception escapes: SGLang's storage threads keep running and later operations work.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
import torch
import torch.distributed as dist
from rig import BACKEND, PAGE, WAIT, tokens_for
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_storage_hash_str

from lmcache_remote.naming.keys import PageKey, page_scan_pattern, split_page_part_key

WINDOW_PAGES = 2  # the SWA window, in pages
DTYPE = torch.bfloat16


class HybridEngine:
    """SGLang's hybrid full + SWA HiCache stack (see the module docstring) on this test's
    Redis and key prefix."""

    def __init__(self, model_dir: Path, extra: dict[str, Any]) -> None:
        import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as assembler
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        # three layers: 0 and 2 sliding-window, 1 full attention
        self.kvcache = SWAKVPool(size=1024, size_swa=512, page_size=PAGE, dtype=DTYPE,
                                 head_num=2, head_dim=8, swa_attention_layer_ids=[0, 2],
                                 full_attention_layer_ids=[1], device="cpu",
                                 enable_memory_saver=False)
        allocator = SWATokenToKVPoolAllocator(1024, 512, PAGE, DTYPE, "cpu", self.kvcache,
                                              need_sort=False)
        self.tp_group = dist.new_group([0], backend="gloo")
        params = CacheInitParams(disable=False, req_to_token_pool=None,
                                 token_to_kv_pool_allocator=allocator, page_size=PAGE,
                                 tp_cache_group=self.tp_group)
        full_layers, swa_layers = assembler._swa_layer_mappings(self.kvcache)
        extra_config = {**BACKEND, "interface_v1": 1, **extra}
        real_host_cls = assembler.get_mha_host_pool_cls

        def unpinned_host_cls(buffer_info: Any) -> Any:  # SGLang's test kit, verbatim
            cls = real_host_cls(buffer_info)

            def make(*args: Any, **kwargs: Any) -> Any:
                kwargs["pin_memory"] = False
                return cls(*args, **kwargs)
            return make

        with mock.patch.object(assembler, "get_mha_host_pool_cls", unpinned_host_cls):
            self.group, self.controller = assembler.build_hybrid_swa_stack(
                params=params, full_kv_pool=self.kvcache.full_kv_pool,
                swa_kv_pool=self.kvcache.swa_kv_pool, full_layer_mapping=full_layers,
                swa_layer_mapping=swa_layers, load_cache_event=threading.Event(),
                storage_backend="dynamic", use_mla=False, prefetch_threshold=PAGE,
                model_name=str(model_dir), storage_backend_extra_config=extra_config)
        self.kv_host = self.group.get_pool(PoolName.KV)
        self.swa_host = self.group.get_pool(PoolName.SWA)

    @staticmethod
    def fill(pool: Any, pages: int, seed: int) -> torch.Tensor:
        slots = pool.alloc(pages * PAGE)
        assert slots is not None
        gen = torch.Generator().manual_seed(seed)
        for i in range(pages):
            index = int(slots[i * PAGE])
            page = pool.get_data_page(index, flat=True)
            pool.set_from_flat_data_page(index, torch.randn(page.shape, generator=gen).to(DTYPE))
        return slots

    @staticmethod
    def page_bytes(pool: Any, slots: torch.Tensor, pages: int) -> list[bytes]:
        return [pool.get_data_page(int(slots[i * PAGE]), flat=True).contiguous()
                .view(torch.uint8).numpy().tobytes() for i in range(pages)]

    def backup(self, tokens: list[int], kv_slots: torch.Tensor,
               swa_slots: torch.Tensor | None) -> int:
        """`UnifiedRadixCache.write_backup_storage` of one node: its KV pages, and its SWA
        pages as the trailing-pages sidecar when it has them on the host."""
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        extra = None
        if swa_slots is not None:
            pages = len(swa_slots) // PAGE
            extra = [PoolTransfer(name=PoolName.SWA, host_indices=swa_slots,
                                  keys=hashes[-pages:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        op_id = self.controller.write_storage(kv_slots, tokens, hashes, None, extra_pools=extra)
        while True:
            op = self.controller.ack_backup_queue.get(timeout=WAIT)
            if op.id == op_id:
                return int(op.completed_tokens)

    def hit(self, tokens: list[int], with_swa: bool) -> Any:
        """SGLang's hit query for a prefetch of `tokens`; the operation it hands the scheduler
        (its `storage_hit_count` is the hit, in tokens)."""
        extra = ([PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * WINDOW_PAGES,
                               hit_policy=PoolHitPolicy.TRAILING_PAGES)] if with_swa else None)
        self.controller.prefetch(CacheRequestHandle(rid=uuid.uuid4().hex, attempt_id=0),
                                 tokens, None, None, extra_pools=extra)
        return self.controller.prefetch_hit_queue.get(timeout=WAIT)

    def load(self, op: Any) -> tuple[int, torch.Tensor]:
        """The scheduler's side of a KV-only hit: host slots, the transfer, its acks."""
        op.host_indices = self.kv_host.alloc(op.storage_hit_count)
        self.controller.prefetch_buffer.put(op)
        loaded = 0
        while True:
            ack = self.controller.ack_prefetch_queue.get(timeout=WAIT)
            loaded = max(loaded, int(ack.completed_tokens or 0))
            if ack.completed_req:
                return max(loaded, int(op.completed_tokens)), op.host_indices

    def threads_alive(self) -> bool:
        c = self.controller
        return all(t.is_alive() for t in (c.prefetch_thread, c.prefetch_io_aux_thread,
                                          c.prefetch_sync_thread, c.backup_thread))

    def close(self) -> None:
        try:
            self.controller.detach_storage_backend()
        finally:
            self.controller.storage_stop_event.set()


@pytest.fixture
def hybrid(sglang: Path, redis_url: str, key_prefix: str) -> Iterator[HybridEngine]:
    engine = HybridEngine(sglang, {"remote_url": redis_url, "key_prefix": key_prefix,
                           "model_fingerprint": "test"})
    yield engine
    engine.close()


def stored(client: redis.Redis, prefix: str) -> list[PageKey]:
    """The pages under `prefix` (their first values; part keys left out)."""
    found = [split_page_part_key(prefix, k)
             for k in client.scan_iter(match=page_scan_pattern(prefix), count=1000)]
    return [key for key, part in found if part == 0]


def test_the_stack_is_sglangs_hybrid_swa_group(hybrid: HybridEngine,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's assembler gave the anchor KV pool and the SWA pool; the backend was given the
    anchor through `register_mem_pool_host` and both through `register_mem_host_pool_v2`,
    and said at start-up, once, that it serves the KV pool only."""
    said = [r.getMessage() for r in caplog.get_records("setup")
            if r.name == "lmcache_remote.integrations.sglang" and r.levelno == logging.WARNING]
    assert len(said) == 1 and "this model has a 'swa' host pool" in said[0]
    assert [e.name for e in hybrid.group.entries] == [PoolName.KV, PoolName.SWA]
    assert hybrid.group.anchor_entry.name == PoolName.KV
    backend = hybrid.controller.storage_backend
    assert type(backend).__name__ == "RedisHiCacheStorage"
    assert backend.mem_pool_host is hybrid.kv_host
    assert backend.registered_pools == {PoolName.KV: hybrid.kv_host,
                                        PoolName.SWA: hybrid.swa_host}


def test_hybrid_model_gets_no_reuse_and_no_error_escapes(
        hybrid: HybridEngine, redis_client: redis.Redis, key_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    pages = 5
    tokens = tokens_for(pages, seed=1)
    kv_slots = HybridEngine.fill(hybrid.kv_host, pages, seed=2)
    swa_slots = HybridEngine.fill(hybrid.swa_host, WINDOW_PAGES, seed=3)
    caplog.set_level(logging.ERROR)

    # a node with its SWA window on the host: batch_set_v2 raises first, nothing is written
    assert hybrid.backup(tokens, kv_slots, swa_slots) == 0
    assert stored(redis_client, key_prefix) == []
    assert "HiCache backup failed after 0 tokens" in caplog.text
    assert "NotImplementedError" in caplog.text

    # a prefetch from the root asks for the SWA window: batch_exists_v2 raises, hit 0
    caplog.clear()
    op = hybrid.hit(tokens, with_swa=True)
    assert op.storage_hit_count == 0 and op.hash_value == []
    assert "HiCache storage query failed" in caplog.text

    # the same node without SWA pages on the host: a plain KV backup, all 5 pages written
    assert hybrid.backup(tokens, kv_slots, None) == pages * PAGE
    keys = stored(redis_client, key_prefix)
    assert sorted(k.page_hash for k in keys) == sorted(get_storage_hash_str(tokens, None,
                                                                            page_size=PAGE))
    assert {k.geometry for k in keys} == {"mha.page-first.bfloat16.p16.tp0of1.r2x512"}

    # every KV page is in Redis now, yet a prefetch with the SWA window still hits nothing:
    # the query never reaches batch_exists
    caplog.clear()
    assert hybrid.hit(tokens, with_swa=True).storage_hit_count == 0
    assert "HiCache storage query failed" in caplog.text
    assert "lookup_requests" not in hybrid.controller.storage_backend.stats()["sglang"]

    # a KV-only prefetch (no SWA window asked for) finds and loads them, byte for byte
    op = hybrid.hit(tokens, with_swa=False)
    assert op.storage_hit_count == pages * PAGE
    loaded, dest = hybrid.load(op)
    assert loaded == pages * PAGE
    assert (HybridEngine.page_bytes(hybrid.kv_host, dest, pages)
            == HybridEngine.page_bytes(hybrid.kv_host, kv_slots, pages))

    # SGLang caught every NotImplementedError: its storage threads are all still running
    assert hybrid.threads_alive()
    counters = hybrid.controller.storage_backend.stats()
    assert counters["pages"]["written"] == pages
    assert counters["sglang"]["lookup_requests"] == 1  # the KV-only query, the only one
