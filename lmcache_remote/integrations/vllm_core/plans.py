"""What the scheduler side tells the workers each step: one `RequestPlan` per request."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lmcache_remote.naming.identity import RequestIdentity


@dataclasses.dataclass(frozen=True)
class Span:
    """Tokens `[start, end)` of a transfer; `skip` (a chunk boundary, <= start) is where the
    chunk-aligned mask begins: tokens `[skip, start)` are moved again though vLLM has them."""

    skip: int
    start: int
    end: int


@dataclasses.dataclass
class RequestPlan:
    """One request's transfers in one step (picklable: vLLM sends it to every worker).

    A model of several KV cache groups has one plan per group with something to move.
    `async_load`: the load runs in the background, for a request vLLM keeps waiting
    (`WAITING_FOR_REMOTE_KVS`) until every worker reports it in `get_finished`."""

    req_id: str
    token_ids: list[int]
    slot_mapping: torch.Tensor
    identity: RequestIdentity | None = None
    """What names the chunks beside the tokens (salt, adapter, multimodal items, embeddings):
    the scheduler builds it, every worker hashes with it (`lmcache_remote.naming.identity`)."""
    load: Span | None = None
    save: Span | None = None
    async_load: bool = False
    group: int = 0
    """The KV cache group whose blocks `slot_mapping` addresses (`vllm_core.groups`)."""
    load_budget: float | None = None
    """Seconds the load may take (the scheduler's `decision.Verdict.load_budget`): past them
    computing would have been quicker, and the load is abandoned as failed."""
    retain: float | None = None
    """Seconds the request asked its prefix to stay pinned in Redis (its `kv_transfer_params`,
    `lmcr_retain_seconds` or `lmcr_pin`: inf); the worker's engine cuts it to
    `max_retain_seconds` and pins what it loads and stores (docs/pins.md)."""


def slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """slot[i] = block_ids[i // block_size] * block_size + i % block_size, for i < num_tokens."""
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    if num_tokens > len(blocks) * block_size:
        raise ValueError(f"{num_tokens} tokens need more than the {len(blocks)} blocks given")
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks[:, None] * block_size + offsets).reshape(-1)[:num_tokens]
