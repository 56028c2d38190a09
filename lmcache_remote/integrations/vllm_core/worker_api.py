"""`KVWorker`: the one interface of a rank's worker side, whatever the model.

Two classes implement it: `worker.WorkerSide` (one full-attention or MLA group, the common
case) and `worker_groups.GroupedWorker` (several KV cache groups, or one sliding-window group:
one `WorkerSide` per group). The vLLM adapter (`integrations.vllm.sides.ServedWorker`) is
written against this protocol alone, so it never asks which of the two it holds.

Each method below states its contract; the hook order that calls them is vLLM's (see
`integrations.vllm.connector`). Nothing here raises into vLLM for a cache or Redis failure:
a failure is logged, counted and reported as data (`report`, `finished_loads`,
`take_load_errors`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch

from lmcache_remote.connectors.layout_proof import CacheWriter
from lmcache_remote.engine import CacheEngine
from lmcache_remote.integrations.vllm_core.plans import RequestPlan

__all__ = ["KVWorker", "WriterFor"]

WriterFor = Callable[[str, torch.Tensor, bool], "CacheWriter | None"]
"""`writer_for(layer_name, tensor, use_mla)`: the attention backend's own cache-write op of
that layer (None: none known), with which a worker side proves how it reads the caches."""


class KVWorker(Protocol):
    """A rank's loads and stores, in plain values; see the module docstring."""

    @property
    def registered(self) -> bool:
        """True once every layer's cache is taken (`register_caches`), even on a rank whose
        connector turned itself off."""

    @property
    def disabled(self) -> str | None:
        """Why the connector is off on this rank (the caches could not be read or their
        layout not proven), None while it serves. Off: nothing is stored or loaded, every
        planned load is reported failed, and the scheduler is told (`report`)."""

    @property
    def engines(self) -> list[CacheEngine]:
        """The rank's cache engines (one per KV cache group), empty before `register_caches`;
        their metrics are the rank's figures."""

    def register_caches(self, kv_caches: Mapping[str, torch.Tensor],
                        writer_for: WriterFor) -> None:
        """Take the per-layer paged caches (in layer order) and prove how they are read,
        with each group's first layer's write op (`writer_for`). Called again with new
        caches: starts over. A layout the op does not confirm turns the rank off
        (`disabled`), never raises for it."""

    def rename_model(self, model_name: str) -> None:
        """Keys name `model_name` from now on: the scheduler moved to it (`reset_cache`)."""

    def begin_step(self, plans: Sequence[RequestPlan],
                   step: tuple[int, float] | None = None) -> None:
        """The step's plans, as vLLM binds the metadata before the forward. The last step's
        transfers end here (its loads finished, unstarted stores dropped). `step`: the
        step's computed tokens and their summed context, which the forward is timed
        against (`report`)."""

    def start_load(self) -> None:
        """Start this step's loads, once (later calls do nothing): before the forward in a
        step with a synchronous load, after it otherwise; background loads are handed to
        their thread."""

    def wait_for_layer(self, layer_name: str) -> None:
        """Before that attention layer runs: when this returns, its loaded KV (of every
        load within the step) is in the cache. A layer not registered is ignored."""

    def save_layer(self, layer_name: str) -> None:
        """After that attention layer ran: copy its KV of every store planned this step
        (layer-wise transfer; otherwise nothing until `wait_for_save`)."""

    def wait_for_save(self) -> None:
        """After the forward: every store of the step is copied out of the cache (or handed
        to the background with `async_save`), and every load within the step is over."""

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests vLLM finished: nothing is kept for them (background stores still report
        through `finished_stores` once done)."""

    def finished_stores(self) -> set[str]:
        """Finished requests whose background stores are all done: vLLM may free their
        blocks now (a failed store counts as done: it is dropped). Each is reported once."""

    def wait_for_stores(self, req_ids: Iterable[str]) -> None:
        """Block until these requests' background stores are done: vLLM preempted them and
        is about to reuse their blocks."""

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose background load is over (loaded, short or failed), and those of
        them vLLM must recompute whole (a model of several groups: vLLM cannot take a
        failed block of it). A side that reports missing blocks instead returns them through
        `take_load_errors` in the same step and an empty second set. Each once."""

    def take_load_errors(self) -> set[int]:
        """The block ids whose planned KV did not arrive (a miss, a corrupt chunk, Redis
        down, a timeout), so that vLLM recomputes from the first; each reported once."""

    def report(self) -> dict[str, object]:
        """What the scheduler must learn from this rank this step: `failed_loads` (requests),
        `link_down`, `throughput` (bytes/s, None: nothing new) and `step` (tokens, work,
        seconds of the forward, None: not measured). Each failure and figure once."""

    def suspend(self) -> None:
        """The caches go away (vLLM's sleep): every transfer finishes now, and until
        `resume` nothing touches them (planned loads are reported failed, nothing stored).
        Idempotent."""

    def resume(self) -> None:
        """The registered caches are back (the same tensors): transfers run again from the
        next step."""

    def close(self) -> None:
        """Finish every transfer, stop the background threads and close the engines; no
        access to the caches after this returns."""
