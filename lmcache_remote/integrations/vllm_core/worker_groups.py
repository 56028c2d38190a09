"""The worker side of a model of several KV cache groups, or of a sliding-window one
(`vllm_core.groups`): one `WorkerSide` per group, each over its group's layers with its own
`CacheEngine` and key namespace, fed the plans of its group.

What differs from one `WorkerSide`:

- every load runs in the background (the scheduler plans no other for such a model); a
  request's load is over when every group's is, and it failed when any group's missed a
  block: vLLM is told the request failed (`failed_recving`), never a block (vLLM cannot map
  a block id of such a model back to its request), and recomputes it;
- stores copy within the step (no `async_save`): vLLM frees an SWA group's blocks below the
  window while the request runs and hands them to other requests, so a store may only read
  them in the step that planned it;
- each group's engine gets its share of `max_local_cpu_size`, by its bytes per token;
- a Mamba group's layers are read as bytes (`state_rows`), without a layout proof: a state is
  copied as vLLM's kernels left it, into the same place of another engine's page;
- a group whose caches cannot be read (state pages of another form, layers missing, a layout
  the backend's op does not prove) turns the connector off on this rank (ERROR; its loads
  reported failed, nothing stored), never vLLM's start.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

import torch

from lmcache_remote.engine import CacheEngine
from lmcache_remote.integrations.vllm_core.groups import MAMBA, KVGroup, group_namespace
from lmcache_remote.integrations.vllm_core.plans import RequestPlan
from lmcache_remote.integrations.vllm_core.settings import ConnectorSettings
from lmcache_remote.integrations.vllm_core.worker import WorkerSide
from lmcache_remote.integrations.vllm_core.worker_api import KVWorker, WriterFor

logger = logging.getLogger(__name__)


def state_rows(tensor: torch.Tensor, group: KVGroup) -> torch.Tensor:
    """A Mamba layer's registered cache (vLLM hands `[blocks, ...]` bytes per block, each block
    one page) as `[blocks, block_size, ceil(state_bytes / block_size)]` uint8 rows over the
    start of each page: the state, seen as the rows of one chunk (a view, no copy)."""
    if tensor.element_size() != 1 or tensor.dim() < 2:
        raise ValueError(f"a Mamba layer's cache of {tensor.dtype} {tuple(tensor.shape)}: "
                         "expected bytes per block")
    flat = tensor.view(torch.uint8).reshape(tensor.shape[0], -1)
    rows = group.block_size
    width = -(-group.state_bytes // rows)
    page = flat.stride(0)
    if flat.stride(1) != 1 or rows * width > page:
        raise ValueError(f"a Mamba layer's pages of {page} bytes cannot hold {rows} rows of "
                         f"{width} bytes")
    return flat.as_strided((flat.shape[0], rows, width), (page, width, 1))


class GroupedWorker(KVWorker):
    """One rank's loads and stores over several KV cache groups (`KVWorker`, whose methods
    state their contracts); see the module docstring."""

    def __init__(self, settings: ConnectorSettings, model_name: str, world_size: int,
                 rank: int, groups: Sequence[KVGroup], chunk_size: int, *,
                 can_save: bool = True) -> None:
        self.groups = list(groups)
        weights = [g.geometry.metadata(model_name, world_size, rank).layout.nbytes(chunk_size)
                   for g in self.groups]
        total = sum(weights) or 1
        config = settings.config
        self.sides = [
            WorkerSide(dataclasses.replace(
                settings, async_save=False,
                config=dataclasses.replace(
                    config, chunk_size=chunk_size,
                    # a state is sharded over the ranks: never one copy for all (MLA's)
                    save_only_first_rank=config.save_only_first_rank and group.kind != MAMBA,
                    max_local_cpu_size=config.max_local_cpu_size * weight / total)),
                group_namespace(model_name, group, self.groups), world_size, rank,
                can_save=can_save)
            for group, weight in zip(self.groups, weights, strict=True)]
        self._pending: dict[str, set[int]] = {}  # request -> groups still loading it
        self._failed: set[str] = set()

    @property
    def registered(self) -> bool:
        return all(side.registered for side in self.sides)

    @property
    def disabled(self) -> str | None:
        return next((side.disabled for side in self.sides if side.disabled), None)

    @property
    def engines(self) -> list[CacheEngine]:
        return [engine for side in self.sides for engine in side.engines]

    def register_caches(self, kv_caches: Mapping[str, torch.Tensor],
                        writer_for: WriterFor) -> None:
        """Each group's layers to its side; `writer_for` gives the attention backend's
        cache-write op of a group's first layer, to prove the group's layout with (a Mamba
        group's state pages are bytes: nothing to prove)."""
        for group, side in zip(self.groups, self.sides, strict=True):
            caches = {name: kv_caches[name] for name in group.layer_names if name in kv_caches}
            if not caches:  # never a refusal to start: this rank goes off
                side.turn_off(f"no KV cache registered for group {group.index}'s layers",
                              group.block_size)
                continue
            if group.kind == MAMBA:
                try:
                    rows = {name: state_rows(t, group) for name, t in caches.items()}
                except ValueError as exc:  # never a refusal to start: this rank goes off
                    side.turn_off(f"group {group.index}'s state pages: {exc}",
                                  group.block_size)
                    continue
                side.register(rows, use_mla=True, dtype=torch.uint8,
                              block_size=group.block_size, opaque=True)
                continue
            first = next(iter(caches))
            side.register(caches, use_mla=group.geometry.use_mla, dtype=group.geometry.dtype,
                          block_size=group.block_size,
                          writer=writer_for(first, caches[first], group.geometry.use_mla))

    def rename_model(self, model_name: str) -> None:
        for group, side in zip(self.groups, self.sides, strict=True):
            side.rename_model(group_namespace(model_name, group, self.groups))

    def begin_step(self, plans: Sequence[RequestPlan],
                   step: tuple[int, float] | None = None) -> None:
        for plan in plans:
            if plan.async_load:
                self._pending.setdefault(plan.req_id, set()).add(plan.group)
        for index, side in enumerate(self.sides):
            side.begin_step([p for p in plans if p.group == index], step)

    def report(self) -> dict[str, object]:
        """`WorkerSide.report` over the groups: every failed request, down if any group's
        link is, the slowest link, and the forward time less the most any side spent in its
        own hooks (the shortest side's figure)."""
        reports = [side.report() for side in self.sides]
        failed: set[str] = set()
        for report in reports:
            failed |= report["failed_loads"]  # type: ignore[arg-type]
        throughputs = [r["throughput"] for r in reports if r["throughput"] is not None]
        steps = [r["step"] for r in reports if r["step"] is not None]
        return {"failed_loads": failed,
                "link_down": any(r["link_down"] for r in reports),
                "throughput": min(throughputs) if throughputs else None,  # type: ignore[type-var]
                "step": min(steps, key=lambda s: s[2]) if steps else None}  # type: ignore

    def start_load(self) -> None:
        for side in self.sides:
            side.start_load()

    def wait_for_layer(self, layer_name: str) -> None:
        for side in self.sides:
            side.wait_for_layer(layer_name)

    def save_layer(self, layer_name: str) -> None:
        for side in self.sides:
            side.save_layer(layer_name)

    def wait_for_save(self) -> None:
        for side in self.sides:
            side.wait_for_save()

    def forget(self, req_ids: Iterable[str]) -> None:
        ids = list(req_ids)
        for side in self.sides:
            side.forget(ids)

    def finished_stores(self) -> set[str]:
        return set().union(*(side.finished_stores() for side in self.sides))

    def wait_for_stores(self, req_ids: Iterable[str]) -> None:
        ids = list(req_ids)
        for side in self.sides:
            side.wait_for_stores(ids)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """Requests whose load is over in every group, and those of them that failed in
        some group (a missing block: vLLM recomputes the request)."""
        done: set[str] = set()
        for index, side in enumerate(self.sides):
            for req_id, missed in side.finished_load_misses().items():
                if missed:
                    self._failed.add(req_id)
                waiting = self._pending.get(req_id)
                if waiting is None:
                    continue
                waiting.discard(index)
                if not waiting:
                    del self._pending[req_id]
                    done.add(req_id)
        failed = done & self._failed
        self._failed -= done
        return done, failed

    def take_load_errors(self) -> set[int]:
        """Always empty: no load of such a model is reported by block (see the module
        docstring); a side's block errors, which only a load within the step makes, would be
        a planning error, logged."""
        errors = set().union(*(side.take_load_errors() for side in self.sides))
        if errors:
            logger.error("lmcache-remote: %d failed blocks of a load within the step of a "
                         "model of several KV cache groups; vLLM cannot take them",
                         len(errors))
        return set()

    def suspend(self) -> None:
        for side in self.sides:
            side.suspend()

    def resume(self) -> None:
        for side in self.sides:
            side.resume()

    def close(self) -> None:
        for side in self.sides:
            side.close()
