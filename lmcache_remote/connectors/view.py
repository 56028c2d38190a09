"""KV views: batched copies between an engine's KV cache and canonical chunk tensors; here the
base class `KVView`, its checks and its one copy path through a device staging tensor.

A `KVView` wraps the KV cache of one request as the engine holds it (`PagedKV` for vLLM's
paged caches, `DenseKV` for the Hugging Face layout) and addresses it by token position:
position i is `slot_mapping[i]` in a paged cache, index i of the sequence axis in a dense one.
`num_tokens_capacity` is how many positions the view addresses.

Canonical chunk tensor (what `memory`, `serde` and Redis hold): a C-contiguous tensor of
`chunk_shape(num_tokens) == (num_layers, kv_planes, num_tokens, num_kv_heads, head_size)` in
the cache's dtype; plane 0 is K and plane 1 is V, or a single plane with one head for MLA
(one latent vector per token).

Contract:

- `gather(ranges, dsts)`: for every `(start, end)`, fills `dsts[i]` (a tensor of
  `chunk_shape(end - start)` and the view's dtype; CPU, pinned when the cache is on CUDA)
  with the K/V of positions `start..end-1` for all layers. It only reads the cache.
- `scatter(ranges, srcs)`: the reverse: writes those positions' K/V from `srcs[i]` into the
  cache and touches nothing else in it (no other slot, position or block). `srcs` are only
  read. Ranges written in one call must not overlap (nor, for a paged cache, share slots).
- `gather_layer(layer, ...)` / `scatter_layer(layer, ...)`: the same for one layer, for
  layer-by-layer transfer; `dsts` / `srcs` are still whole chunk tensors, and only their
  `[layer]` part is written / read.
- Every call validates everything before the first copy (ranges inside the view, tensor shapes
  and dtypes, slots non-negative: vLLM pads with slot -1) and raises `ValueError` on bad input,
  leaving the cache and the destinations as they were. Every call returns with its copies
  complete (on CUDA after one stream synchronize), so its tensors may be reused at once.

How: one call is one batch. Its ranges are cut into groups whose device staging tensor stays
under `staging_bytes`; per group, one indexing op per layer gathers every token of every range
into the staging tensor, tokens in range order (chunk-major), then one copy per chunk moves its
slice into the destination (device -> pinned host, non_blocking). Scatter runs the same steps
backwards (host -> device copies into staging, then one `index_put_` per layer). A single range
is never split, so one range may exceed the staging bound. No Python loop runs per token.
A subclass may copy a group another way (`_copy_group`): on the CPU the staging tensor is
skipped (dense.py, rows.py, mapped.py say how).
"""

from __future__ import annotations

import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Generic, TypeVar

import torch

DEFAULT_STAGING_BYTES = 256 << 20

Range = tuple[int, int]
_Index = TypeVar("_Index")


@dataclass(frozen=True)
class Geometry:
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    kv_planes: int
    num_kv_heads: int
    head_size: int
    num_tokens: int


class KVView(ABC, Generic[_Index]):
    """One request's KV cache, addressed by token position; see the module docstring."""

    staging_bytes: int = DEFAULT_STAGING_BYTES

    _geometry: Geometry  # set by every subclass's __init__
    _token_dim: int  # the token axis of `_native_shape`

    @property
    def device(self) -> torch.device:
        return self._geometry.device

    @property
    def dtype(self) -> torch.dtype:
        return self._geometry.dtype

    @property
    def num_layers(self) -> int:
        return self._geometry.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._geometry.num_kv_heads

    @property
    def head_size(self) -> int:
        return self._geometry.head_size

    @property
    def kv_planes(self) -> int:
        """2 (K and V), or 1 for MLA's single latent."""
        return self._geometry.kv_planes

    @property
    def num_tokens_capacity(self) -> int:
        """How many token positions the view addresses (valid ranges lie in [0, this])."""
        return self._geometry.num_tokens

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self.num_layers, self.kv_planes, num_tokens, self.num_kv_heads, self.head_size)

    def gather(self, ranges: Sequence[Range], dsts: Sequence[torch.Tensor]) -> None:
        self._copy(range(self.num_layers), ranges, dsts, to_host=True)

    def scatter(self, ranges: Sequence[Range], srcs: Sequence[torch.Tensor]) -> None:
        self._copy(range(self.num_layers), ranges, srcs, to_host=False)

    def gather_layer(
        self, layer: int, ranges: Sequence[Range], dsts: Sequence[torch.Tensor]
    ) -> None:
        self._copy(self._one_layer(layer), ranges, dsts, to_host=True)

    def scatter_layer(
        self, layer: int, ranges: Sequence[Range], srcs: Sequence[torch.Tensor]
    ) -> None:
        self._copy(self._one_layer(layer), ranges, srcs, to_host=False)

    # Layout hooks. The staging tensor of a group is `[len(layers), *_native_shape(n)]`.

    @abstractmethod
    def _native_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of one layer's gathered tokens, in the layout the cache indexes into."""

    @abstractmethod
    def _index(self, ranges: list[Range]) -> _Index:
        """Whatever `_take` / `_put` need to address the tokens of `ranges`, in order."""

    @abstractmethod
    def _take(self, layer: int, index: _Index, out: torch.Tensor) -> None:
        """Copy the indexed tokens of `layer` into `out` (device, native shape)."""

    @abstractmethod
    def _put(self, layer: int, index: _Index, src: torch.Tensor) -> None:
        """Write `src` (device, native shape) into the indexed tokens of `layer`."""

    @abstractmethod
    def _to_canonical(self, staged: torch.Tensor) -> torch.Tensor:
        """View `[layers, *native]` as `[layers, kv_planes, tokens, heads, head_size]`."""

    def _check_tokens(self, ranges: list[Range], write: bool) -> None:
        """Layout-specific checks of the addressed tokens (none by default)."""

    # The shared batched copy.

    def _one_layer(self, layer: int) -> range:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        return range(layer, layer + 1)

    def _copy(
        self,
        layers: range,
        ranges: Sequence[Range],
        tensors: Sequence[torch.Tensor],
        to_host: bool,
    ) -> None:
        checked = self._check(ranges, tensors, write=not to_host)
        token_bytes = len(layers) * math.prod(self._native_shape(1)) * self.dtype.itemsize
        per_group = max(1, self.staging_bytes // max(1, token_bytes))
        for group in _groups(checked, list(tensors), per_group):
            self._copy_group(layers, group, to_host)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _copy_group(
        self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
    ) -> None:
        ranges = [r for r, _ in group]
        offsets = [0, *accumulate(end - start for start, end in ranges)]
        index = self._index(ranges)
        staging = torch.empty(
            (len(layers), *self._native_shape(offsets[-1])), dtype=self.dtype, device=self.device
        )
        if to_host:
            for i, layer in enumerate(layers):
                self._take(layer, index, staging[i])
        for ((start, end), host), offset in zip(group, offsets[:-1], strict=True):
            staged = staging.narrow(self._token_dim + 1, offset, end - start)
            device_view = self._to_canonical(staged)
            host_view = host[layers.start : layers.stop]
            if to_host:
                host_view.copy_(device_view, non_blocking=True)
            else:
                device_view.copy_(host_view, non_blocking=True)
        if not to_host:
            for i, layer in enumerate(layers):
                self._put(layer, index, staging[i])

    def _check(
        self, ranges: Sequence[Range], tensors: Sequence[torch.Tensor], write: bool
    ) -> list[Range]:
        if len(ranges) != len(tensors):
            raise ValueError(f"{len(ranges)} ranges but {len(tensors)} tensors")
        checked = [self._check_range(r) for r in ranges]
        for (start, end), tensor in zip(checked, tensors, strict=True):
            self._check_tensor(tensor, end - start)
        if write:
            _check_disjoint(checked)
        self._check_tokens(checked, write)
        return checked

    def _check_range(self, token_range: Range) -> Range:
        try:
            start, end = (operator.index(v) for v in token_range)
        except TypeError as exc:
            raise ValueError(f"token range {token_range!r} is not a pair of ints") from exc
        if not 0 <= start <= end <= self.num_tokens_capacity:
            raise ValueError(
                f"token range ({start}, {end}) outside [0, {self.num_tokens_capacity}]"
            )
        return start, end

    def _check_tensor(self, tensor: torch.Tensor, num_tokens: int) -> None:
        shape = self.chunk_shape(num_tokens)
        if tuple(tensor.shape) != shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"chunk tensor is {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {shape} {self.dtype}"
            )


def _groups(
    ranges: list[Range], tensors: list[torch.Tensor], max_tokens: int
) -> list[list[tuple[Range, torch.Tensor]]]:
    """Consecutive runs of (range, tensor) holding at most `max_tokens` tokens (or one range)."""
    groups: list[list[tuple[Range, torch.Tensor]]] = []
    tokens = 0
    for (start, end), tensor in zip(ranges, tensors, strict=True):
        if not groups or tokens + end - start > max_tokens:
            groups.append([])
            tokens = 0
        groups[-1].append(((start, end), tensor))
        tokens += end - start
    return groups



def _check_disjoint(ranges: list[Range]) -> None:
    ordered = sorted(r for r in ranges if r[0] < r[1])
    for (_, end), (start, _) in pairwise(ordered):
        if start < end:
            raise ValueError("scatter ranges overlap")



def check_uniform(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    """Every tensor has the first one's shape, dtype and device; returns the first."""
    if not tensors:
        raise ValueError(f"{what}: no layers given")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}[{i}] is {type(t).__name__}, not a torch.Tensor")
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise ValueError(
                f"{what}: tensor {i} is {tuple(t.shape)} {t.dtype} on {t.device}, tensor 0 "
                f"is {tuple(first.shape)} {first.dtype} on {first.device}; all must match"
            )
    return first

