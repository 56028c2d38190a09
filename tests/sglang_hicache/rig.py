"""SGLang's own HiCache machinery on the CPU, driving the Redis backend through its `dynamic`
factory: no stand-in of SGLang anywhere.

`start_sglang(model_dir, workdir)` (once per process) joins a one-rank gloo group and publishes
SGLang's `ServerArgs` (the controller reads its parallel layout from there). `Engine(...)` then
builds what SGLang's scheduler builds for HiCache: a real device KV pool (MHA or MLA) on the CPU,
a real host pool of the chosen layout (`pin_memory=False`, as SGLang's own test kit does on
machines without CUDA), a paged allocator, and SGLang's `HybridCacheController` with
`storage_backend="dynamic"` and the backend's extra config. `backup(pages)` fills host pages
with random values and hands them to `write_storage` with SGLang's own page hashes;
`prefetch(tokens)` runs the hit query and the page transfer exactly as the scheduler does
(hit queue, host allocation, prefetch buffer, acks) and returns the tokens loaded and the host
slots they went to.
"""

from __future__ import annotations

import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 16
BACKEND = {"backend_name": "lmcache-remote", "module_path": "lmcache_remote.integrations.sglang",
           "class_name": "RedisHiCacheStorage"}
WAIT = 60.0
_started = threading.Lock()
_STATE: dict[str, Any] = {}


def save_model_dir(path: Path) -> Path:
    """A tiny Llama config folder (SGLang's `ServerArgs` needs one; no weights are loaded)."""
    import json
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16"}))
    return path


def start_sglang(model_dir: Path, workdir: Path, *, rank: int = 0, world: int = 1,
                 init_file: Path | None = None) -> None:
    """Joins the gloo group (`world` ranks meeting at `init_file`) and publishes SGLang's
    `ServerArgs` with tensor parallelism `world` for this rank; once per process."""
    with _started:
        if _STATE:
            return
        from sglang.srt.server_args import ServerArgs
        from sglang.test.parallel_groups import SpawnRanks, publish
        init = init_file or workdir / f"pg-{uuid.uuid4().hex}"
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world)
        publish(ServerArgs(model_path=str(model_dir), device="cpu", load_format="dummy",
                           page_size=PAGE, tp_size=world), role="scheduler",
                ranks=SpawnRanks(world_rank=rank))
        _STATE["model_dir"] = model_dir
        _STATE["world"] = world


@dataclass
class Engine:
    """One engine's HiCache stack with the Redis backend (see the module docstring)."""

    extra: dict[str, Any]
    layout: str = "page_first"
    mla: bool = False
    dtype: torch.dtype = torch.bfloat16
    layers: int = 3
    heads: int = 2
    head_dim: int = 8
    size: int = 1024
    page: int = PAGE
    zero_copy: bool = True
    storage: str = "dynamic"  # or one of SGLang's own backends ("file"), configured by `extra`
    controller: Any = field(init=False)
    host: Any = field(init=False)

    def __post_init__(self) -> None:
        if self.mla:
            device = MLATokenToKVPool(size=self.size, page_size=self.page, dtype=self.dtype,
                                      kv_lora_rank=16, qk_rope_head_dim=8,
                                      layer_num=self.layers, device="cpu",
                                      enable_memory_saver=False)
            info = device.get_device_pool_infos()[0].buffer_info
            self.host = MLATokenToKVPoolHost(
                info, 2.0, 0, self.page, self.layout, pin_memory=False, device="cpu",
                device_capacity_tokens=self.size, start_layer=0, end_layer=self.layers,
                target_layer_num=self.layers)
        else:
            device = MHATokenToKVPool(size=self.size, page_size=self.page, dtype=self.dtype,
                                      head_num=self.heads, head_dim=self.head_dim,
                                      layer_num=self.layers, device="cpu",
                                      enable_memory_saver=False)
            info = device.get_device_pool_infos()[0].buffer_info
            self.host = MHATokenToKVPoolHost(
                info, 2.0, 0, self.page, self.layout, pin_memory=False, device="cpu",
                device_capacity_tokens=self.size, start_layer=0, end_layer=self.layers)
        allocator = PagedTokenToKVPoolAllocator(self.size, self.page, self.dtype, "cpu", device,
                                                need_sort=False)
        group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=self.host,
                                         device_pool=device, layer_mapper=lambda i: i,
                                         is_primary_index_anchor=True)])
        # one rank: a group per engine (engines of one process must not share collectives);
        # several: the world is the tensor-parallel group
        world = _STATE["world"]
        self.tp_group = (dist.new_group([0], backend="gloo") if world == 1
                         else dist.group.WORLD)
        self.controller = HybridCacheController(
            allocator, group, self.page, self.tp_group, threading.Event(),
            storage_backend=self.storage, model_name=str(_STATE["model_dir"]),
            storage_backend_extra_config=self.extra_config(), prefetch_threshold=self.page)

    def extra_config(self) -> dict[str, Any]:
        if self.storage != "dynamic":
            return dict(self.extra)
        return {**BACKEND, "interface_v1": int(self.zero_copy), **self.extra}

    def reattach(self) -> None:
        """SGLang's runtime detach, then attach of a new backend instance (PUT/DELETE
        /hicache/storage-backend)."""
        self.controller.detach_storage_backend()
        self.controller.attach_storage_backend(
            self.storage, prefetch_threshold=self.page, model_name=str(_STATE["model_dir"]),
            storage_backend_extra_config=self.extra_config(),
            host_pools=list(self.controller.mem_pool_host.entries))

    @property
    def backend(self) -> Any:
        backend = self.controller.storage_backend
        return getattr(backend, "_backend", backend)  # under SGLang's failure injector

    def fill(self, pages: int, seed: int) -> torch.Tensor:
        """Host slots of `pages` new pages holding random values (seeded)."""
        slots = self.host.alloc(pages * self.page)
        assert slots is not None, "host pool full"
        gen = torch.Generator().manual_seed(seed)
        for i in range(pages):
            page = self.host.get_data_page(int(slots[i * self.page]), flat=True)
            values = torch.randn(page.shape, generator=gen).to(self.dtype)
            self.host.set_from_flat_data_page(int(slots[i * self.page]), values)
        return slots

    def page_bytes(self, slots: torch.Tensor, pages: int) -> list[bytes]:
        out = []
        for i in range(pages):
            page = self.host.get_data_page(int(slots[i * self.page]), flat=True)
            out.append(page.contiguous().view(torch.uint8).numpy().tobytes())
        return out

    def backup(self, tokens: Any, slots: torch.Tensor) -> int:
        """SGLang's write to storage of these host pages; the tokens it reports backed up.
        `tokens`: a list of ids, or SGLang's `RadixKey` (ids with the request's namespace:
        LoRA id, salt), whose page hashes SGLang seeds with that namespace."""
        hashes = get_storage_hash_str(tokens, None, page_size=self.page)
        tokens = list(getattr(tokens, "token_ids", tokens))
        op_id = self.controller.write_storage(slots, tokens, hash_value=hashes)
        while True:
            op = self.controller.ack_backup_queue.get(timeout=WAIT)
            if op.id == op_id:
                return int(op.completed_tokens)

    def prefetch(self, tokens: Any, rid: str | None = None
                 ) -> tuple[int, torch.Tensor | None]:
        """SGLang's prefetch of `tokens` (ids or a `RadixKey`, as `backup`): (tokens loaded
        into the host pool, their slots)."""
        rid = rid or uuid.uuid4().hex
        self.controller.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), tokens, None)
        op = self.controller.prefetch_hit_queue.get(timeout=WAIT)
        hit = int(op.storage_hit_count)
        if hit == 0:
            return 0, None
        op.host_indices = self.host.alloc(hit)
        self.controller.prefetch_buffer.put(op)
        loaded = 0
        while True:
            try:
                ack = self.controller.ack_prefetch_queue.get(timeout=WAIT)
            except Empty as exc:
                raise AssertionError("no prefetch ack") from exc
            if ack.completed_tokens:  # progress so far, not an increment
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.completed_req:
                break
        loaded = max(loaded, int(op.completed_tokens))
        return loaded, op.host_indices

    def hashes(self, tokens: list[int]) -> list[str]:
        return list(get_storage_hash_str(tokens, None, page_size=self.page))

    def close(self) -> None:
        try:
            self.controller.detach_storage_backend()
        finally:
            self.controller.storage_stop_event.set()


def tokens_for(pages: int, seed: int, page: int = PAGE) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4000, (pages * page,), generator=gen).tolist()


os.environ.setdefault("SGLANG_ENABLE_TORCH_COMPILE", "0")
