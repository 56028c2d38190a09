"""KV views: batched copies between an engine's KV cache and canonical chunk tensors.

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
On the CPU the staging tensor is skipped: `DenseKV` makes one 2-D copy per range, layer, K/V
plane and head straight between the cache and the chunk (the staging copy cost ~20x on 32 MiB
chunks); a contiguous `kv_split` or `mla` `PagedKV` copies rows per range, layer and plane, whole
blocks at a time where the range covers whole blocks in order (vLLM's usual mapping), single
slots otherwise: `index_select` to gather, numpy row assignment to scatter (~4x faster than
`index_copy_`), the copies split over as many threads as torch's intra-op count (~1.5x faster
than torch's own threading of each copy; in all ~4x faster than staging on 32 MiB chunks).
`packed` caches and strided caches take the staging path. A `mapped` cache on the CPU (vLLM's
CPU backend: tiled blocks) copies each run of consecutive slots in a block as strided views of
its K and V areas where the block map is such a tiling (`BlockMap.tiles`), through element
indexes otherwise.
"""

from __future__ import annotations

import math
import operator
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Generic, TypeVar

import numpy as np
import torch

from lmcache_remote.native import wire as _native  # its copy_rows, or None: torch / numpy

__all__ = ["DEFAULT_STAGING_BYTES", "PAGED_LAYOUTS", "BlockMap", "DenseKV", "KVView",
           "PagedKV"]

DEFAULT_STAGING_BYTES = 256 << 20
PAGED_LAYOUTS = ("kv_split", "packed", "mla", "mapped")

Range = tuple[int, int]
_Index = TypeVar("_Index")
_Item = TypeVar("_Item")

# Per paged layout: the axis of block ids and the axis of in-block offsets in one layer's
# tensor, then the token axis of advanced indexing on those two (adjacent index axes keep their
# place, separated ones move to the front).
_PAGED_AXES = {"kv_split": (1, 2, 1), "packed": (0, 2, 0), "mla": (0, 1, 0),
               "mapped": (0, 1, 1)}


@dataclass(frozen=True)
class _Geometry:
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

    _geometry: _Geometry  # set by every subclass's __init__
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


class PagedKV(KVView[list[torch.Tensor | None]]):
    """vLLM's paged KV cache: one tensor per layer and the request's slot mapping.

    Layouts, detected from the shape unless `layout` names one:
    `kv_split` `[2, num_blocks, block_size, num_kv_heads, head_size]` (5 dims, dim 0 == 2),
    `packed` `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (4 dims; K is the first
    half of the last dim, V the second), `mla` `[num_blocks, block_size, head_size]` (3 dims).
    `mapped` (never detected: `layout="mapped"` with a `block_map`): each tensor has the block
    axis first and any other shape and strides; `block_map[plane, offset, head, dim]` is the
    storage offset, from the block's first element, of that element of the token at that
    offset of a block (`layout_proof.find_block_map` reads it off the engine's write op): the
    tiled blocks of vLLM's CPU backend. `block_map` (a property) is the same map for every
    layout: what the view reads and writes.
    `slot_mapping[i] = block_id * block_size + offset` is the slot of position i; it is read
    once, into CPU memory, at construction. Negative slots (padding) are allowed in the
    mapping but are an error for any position a call copies.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor | Sequence[int],
        *,
        layout: str | None = None,
        block_map: BlockMap | None = None,
    ) -> None:
        self._layers = list(kv_caches)
        first = _check_uniform(self._layers, "kv_caches")
        self._map: BlockMap | None = None
        if layout == "mapped" or block_map is not None:
            if layout != "mapped" or block_map is None:
                raise ValueError("a block_map goes with layout='mapped', and only with it")
            self.layout = "mapped"
            block_map.check(first)
            self._map = block_map
            planes, self.block_size, heads, head_size = block_map.offsets.shape
            self.num_blocks = first.shape[0]
            self._flat = [_storage_from(t, block_map.width, block_map.wide)
                          for t in self._layers]
            self._tiled: list[list[torch.Tensor]] | None = None  # per layer and plane
        else:
            self.layout = _detect_layout(tuple(first.shape), layout)
            self.num_blocks, self.block_size, heads, head_size = _paged_geometry(
                self.layout, tuple(first.shape)
            )
            planes = 1 if self.layout == "mla" else 2
        self._slots = _slot_tensor(slot_mapping, self.num_blocks * self.block_size)
        self._geometry = _Geometry(
            first.device, first.dtype, len(kv_caches), planes, heads, head_size, len(self._slots)
        )
        self._token_dim = _PAGED_AXES[self.layout][2]
        # the CPU row copies of `_copy_group` (else: staging, as on CUDA)
        self._rows_direct = (
            first.device.type == "cpu"
            and self.layout in ("kv_split", "mla")
            and all(t.is_contiguous() for t in self._layers)
        )

    @property
    def block_map(self) -> torch.Tensor:
        """`[planes, block_size, heads, head_size]`: the storage offset, from its block's first
        element, of each element this view reads and writes for the token at each offset of a
        block (int64, CPU). A block's first element is `blocks(t)[b]`'s, see `blocks`."""
        if self._map is not None:
            return self._map.offsets.cpu()
        t = self._layers[0]
        planes, size, heads, head = self.kv_planes, self.block_size, self.num_kv_heads, \
            self.head_size
        p = torch.arange(planes).view(-1, 1, 1, 1)
        o = torch.arange(size).view(1, -1, 1, 1)
        h = torch.arange(heads).view(1, 1, -1, 1)
        d = torch.arange(head).view(1, 1, 1, -1)
        s = t.stride()
        if self.layout == "kv_split":
            offsets = p * s[0] + o * s[2] + h * s[3] + d * s[4]
        elif self.layout == "packed":
            offsets = h * s[1] + o * s[2] + (p * head + d) * s[3]
        else:  # mla: one plane, one head
            offsets = p * 0 + o * s[1] + h * 0 + d * s[2]
        return offsets.expand(planes, size, heads, head).contiguous()

    def blocks(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s cache with the block axis first (a view): `blocks(l)[b]` is block b."""
        t = self._layers[layer]
        return t.transpose(0, 1) if self.layout == "kv_split" else t

    def _native_shape(self, num_tokens: int) -> tuple[int, ...]:
        if self.layout == "mapped":
            return (self.kv_planes, num_tokens, self.num_kv_heads, self.head_size)
        if self.layout == "kv_split":
            return (2, num_tokens, self.num_kv_heads, self.head_size)
        if self.layout == "packed":
            return (num_tokens, self.num_kv_heads, 2 * self.head_size)
        return (num_tokens, self.head_size)

    def _check_tokens(self, ranges: list[Range], write: bool) -> None:
        slots = self._slots_np(ranges)
        if bool((slots < 0).any()):
            position = _first_position(ranges, int(np.flatnonzero(slots < 0)[0]))
            raise ValueError(f"token {position} has a negative slot (padding); cannot copy it")
        if write and _has_duplicates(slots, self.block_size):
            raise ValueError("scatter ranges map two tokens to the same slot")

    def _index(self, ranges: list[Range]) -> list[torch.Tensor | None]:
        slots = self._slots_of(ranges).to(self.device)
        block_axis, offset_axis, _ = _PAGED_AXES[self.layout]
        index: list[torch.Tensor | None] = [None] * (offset_axis + 1)
        index[block_axis] = torch.div(slots, self.block_size, rounding_mode="floor")
        index[offset_axis] = torch.remainder(slots, self.block_size)
        return index

    def _take(self, layer: int, index: list[torch.Tensor | None], out: torch.Tensor) -> None:
        torch.ops.aten.index.Tensor_out(self._layers[layer], index, out=out)

    def _put(self, layer: int, index: list[torch.Tensor | None], src: torch.Tensor) -> None:
        torch.ops.aten.index_put_(self._layers[layer], index, src)

    def _copy_group(
        self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
    ) -> None:
        """On the CPU, `kv_split` and `mla` caches copy rows straight between the cache and
        the chunks, no staging tensor (a fresh staging allocation and a second copy cost ~4x
        on 32 MiB chunks): a chunk's `[layer, plane]` part is `[tokens, heads * head_size]`
        rows, one `index_select` / row assignment per range, layer and plane, whole blocks at
        a time when the range covers whole blocks in order."""
        if self._map is not None:
            self._copy_mapped(layers, group, to_host)
            return
        if not self._rows_direct or not all(host.is_contiguous() for _, host in group):
            super()._copy_group(layers, group, to_host)
            return
        if _native is not None and NATIVE_ROWS and self._copy_rows_native(layers, group, to_host):
            return
        reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        writes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        indexes = self._row_indexes([r for r, _ in group])
        cache_rows: dict[int, list[torch.Tensor]] = {}  # per row count: every layer's planes
        cache_bytes: dict[int, list[np.ndarray]] = {}
        for (_, host), (rows, index) in zip(group, indexes, strict=True):
            if rows not in cache_rows:
                cache_rows[rows] = self._plane_rows(layers, rows)
                cache_bytes[rows] = [] if to_host else [_bytes(c) for c in cache_rows[rows]]
            planes = cache_rows[rows]
            chunk = host[layers.start:layers.stop].view(len(planes), len(index), -1)
            if to_host:
                rows_index = torch.from_numpy(index)
                reads += zip(planes, [rows_index] * len(planes), chunk.unbind(0), strict=True)
            else:
                chunk_bytes = _bytes(chunk)
                writes += ((c, index, chunk_bytes[k]) for k, c in enumerate(cache_bytes[rows]))
        if reads:
            _run_split(_select_rows, reads)
        if writes:
            _run_split(_assign_rows, writes)

    def _copy_rows_native(
        self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
    ) -> bool:
        """`_copy_group`'s row copies in `lmcache_remote._wire.copy_rows`: the same rows, one
        call per copy thread that gives the GIL up once for all of them, where the torch /
        numpy copies gave it up per layer, plane and chunk (with another busy Python thread
        in the process each hand-off waits up to the 5 ms switch interval). Only calls that
        keep the GIL are made per chunk (`data_ptr`, `numel`). False, nothing copied, where a
        chunk's geometry does not match (the torch / numpy copies then run)."""
        itemsize = self.dtype.itemsize
        planes = 2 if self.layout == "kv_split" else 1
        plane_bytes = self._layers[0].numel() * itemsize // planes
        bases = [t.data_ptr() + p * plane_bytes for t in (self._layers[i] for i in layers)
                 for p in range(planes)]
        jobs: list[tuple[int, int, int, int, np.ndarray]] = []
        for (_, host), (rows, index) in zip(group, self._row_indexes([r for r, _ in group]),
                                            strict=True):
            row_bytes, count = plane_bytes // rows, len(index)
            layer_bytes = host.numel() // host.shape[0] * itemsize  # a chunk's layer: P planes
            if (host.dtype != self.dtype or host.shape[0] < layers.stop
                    or layer_bytes != planes * count * row_bytes):
                return False
            start = host.data_ptr() + layers.start * layer_bytes
            index = np.ascontiguousarray(index, dtype=np.int64)
            jobs += [(base, rows, start + k * count * row_bytes, row_bytes, index)
                     for k, base in enumerate(bases)]
        native = _native
        assert native is not None
        _run_split(lambda part: native.copy_rows(list(part), to_host), jobs)
        return True

    def _copy_mapped(
        self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
    ) -> None:
        """The `mapped` layout. On the CPU, where the map is a tiling (`BlockMap.tiles`), a
        range's runs of consecutive slots inside one block move as strided copies between the
        chunk and the block's K and V areas (`_tile_copies`; ~3x faster than element indexes:
        a transposed K area moves as one transposing copy per block). Other ranges take one
        element gather (or scatter) per range and layer through an index built once per range
        from the map: `block * block_stride + map[:, offset]` for each token; elements that
        the map keeps in contiguous aligned runs move as one wider integer (VNNI pairs of a
        tiled K area: two bfloat16 as one int32)."""
        assert self._map is not None
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
        for (start, end), host in group:
            tiled = self._tile_copies(layers, start, end, host, to_host)
            if tiled is not None:
                pairs += tiled
            else:
                jobs += self._element_moves(layers, start, end, host, to_host)
        if pairs:
            _run_split(_copy_pairs, pairs)
        if jobs:
            if self.device.type == "cpu":
                _run_split(_mapped_moves, jobs)
            else:
                _mapped_moves(jobs)

    def _tile_copies(
        self, layers: range, start: int, end: int, host: torch.Tensor, to_host: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(destination, source) pairs moving positions `start..end-1` of `layers` as strided
        views, one pair per run of consecutive slots in one block, plane and layer; None where
        the map is no tiling, the cache is not on the CPU (a host-to-device copy into a
        strided view stages per call) or a run does not start and end on a tile's edge."""
        assert self._map is not None
        tiles = self._map.tiles
        if tiles is None or self.device.type != "cpu" or not host.is_contiguous():
            return None
        size, edge = self.block_size, self._map.tile_tokens
        slots = self._slots.numpy()[start:end]
        cuts = np.flatnonzero((np.diff(slots) != 1) | (slots[1:] % size == 0)) + 1
        firsts = np.concatenate(([0], cuts))
        lasts = np.concatenate((cuts, [len(slots)]))
        if bool(((slots[firsts] % edge) != 0).any()) or bool(((lasts - firsts) % edge).any()):
            return None
        if self._tiled is None:
            self._tiled = [[torch.as_strided(t, (self.num_blocks, *tile.sizes),
                                             (t.stride(0), *tile.strides),
                                             t.storage_offset() + tile.base)
                            for tile in tiles] for t in self._layers]
        runs = [(int(slots[a]) // size, int(slots[a]) % size, int(a), int(b))
                for a, b in zip(firsts, lasts, strict=True)]
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in layers:
            for plane, (tile, view) in enumerate(zip(tiles, self._tiled[layer], strict=True)):
                low = tile.sizes[1]
                chunk = host[layer, plane]
                for block, offset, a, b in runs:
                    cache = view[block, offset // low:(offset + b - a) // low]
                    part = chunk[a:b].view(cache.shape)
                    out.append((part, cache) if to_host else (cache, part))
        return out

    def _element_moves(
        self, layers: range, start: int, end: int, host: torch.Tensor, to_host: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
        assert self._map is not None
        width, wide, base_map = self._map.width, self._map.wide, self._map.runs
        step = self._layers[0].stride(0)
        slots = self._slots[start:end].to(self.device)
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        offsets = torch.remainder(slots, self.block_size)
        index = (base_map[:, offsets] + (blocks * (step // width)).view(1, -1, 1, 1)
                 ).reshape(-1)
        return [(self._flat[layer], index,
                 host[layer].view(wide) if width > 1 else host[layer], to_host)
                for layer in layers]

    def _plane_rows(self, layers: range, rows: int) -> list[torch.Tensor]:
        """Each layer's planes (K then V, or MLA's one) as ``rows`` rows, in chunk order."""
        out = []
        for layer in layers:
            cache = self._layers[layer]
            planes = (cache[0], cache[1]) if self.layout == "kv_split" else (cache,)
            out += [plane.view(rows, -1) for plane in planes]
        return out

    def _row_indexes(self, ranges: list[Range]) -> list[tuple[int, np.ndarray]]:
        """`_row_index` of each range's slots, the block test run once over all of them when
        every range is whole blocks long, in numpy (per range it cost ~10 small torch calls,
        as much as the copy of a 1 MiB chunk's rows)."""
        size, slots = self.block_size, self._slots.numpy()
        if not ranges or any((end - start) % size or end == start for start, end in ranges):
            return [self._row_index(slots[start:end]) for start, end in ranges]
        per_block = self._slots_np(ranges).reshape(-1, size)
        firsts = per_block[:, 0]
        whole = ((per_block - firsts[:, None] == np.arange(size)).all(axis=1)
                 & (firsts % size == 0))
        ids = firsts // size
        out, pos = [], 0
        for start, end in ranges:
            count = (end - start) // size
            if whole[pos:pos + count].all():
                out.append((self.num_blocks, ids[pos:pos + count]))
            else:
                out.append((self.num_blocks * size, slots[start:end]))
            pos += count
        return out

    def _row_index(self, slots: np.ndarray) -> tuple[int, np.ndarray]:
        """(rows per plane, row index): block ids when `slots` are whole blocks, each in
        order from its first offset; slot ids otherwise."""
        size = self.block_size
        if len(slots) % size == 0 and len(slots):
            per_block = slots.reshape(-1, size)
            firsts = per_block[:, 0]
            in_order = per_block - firsts[:, None] == np.arange(size)
            if bool((firsts % size == 0).all()) and bool(in_order.all()):
                return self.num_blocks, firsts // size
        return self.num_blocks * size, slots

    def _to_canonical(self, staged: torch.Tensor) -> torch.Tensor:
        if self.layout == "kv_split":
            return staged
        if self.layout == "packed":
            return staged.unflatten(-1, (2, self.head_size)).permute(0, 3, 1, 2, 4)
        return staged.unsqueeze(1).unsqueeze(3)

    def _slots_of(self, ranges: list[Range]) -> torch.Tensor:
        return torch.from_numpy(self._slots_np(ranges))

    def _slots_np(self, ranges: list[Range]) -> np.ndarray:
        """The slots of ``ranges``, concatenated, in numpy (a torch slice or op costs ~4x
        more, and a store of 256 chunks asks for 256 of them)."""
        slots = self._slots.numpy()
        if not ranges:
            return slots[:0]
        return np.concatenate([slots[start:end] for start, end in ranges])


_Spans = list[tuple[int, int, int]]


class DenseKV(KVView[_Spans]):
    """The Hugging Face cache: per layer K and V of `[num_kv_heads, T, head_size]` or
    `[1, num_kv_heads, T, head_size]`; position i is index i of the T axis. Copies are slices
    of the sequence axis (consecutive ranges merge into one slice); no index tensors."""

    _token_dim = 2

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} key layers but {len(values)} value layers")
        self._keys = [_dense_3d(k, "keys") for k in keys]
        self._values = [_dense_3d(v, "values") for v in values]
        _check_uniform(self._keys + self._values, "keys and values")
        heads, length, head_size = self._keys[0].shape
        first = self._keys[0]
        self._geometry = _Geometry(
            first.device, first.dtype, len(self._keys), 2, heads, head_size, length
        )

    def _copy_group(
        self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
    ) -> None:
        """On the CPU the staging buffer is pure overhead (a fresh allocation and a second
        copy, ~20x slower than this for 32 MiB chunks): copy each layer's K and V slice
        straight between the cache and the chunk."""
        if self.device.type != "cpu":
            super()._copy_group(layers, group, to_host)
            return
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source)
        for (start, end), host in group:
            for layer in layers:
                for plane, cache in ((0, self._keys), (1, self._values)):
                    for head in range(self.num_kv_heads):  # 2-D copies: rows stay contiguous
                        chunk_view = host[layer, plane, :, head]  # [tokens, head_size]
                        cache_view = cache[layer][head, start:end]
                        copies.append((chunk_view, cache_view) if to_host
                                      else (cache_view, chunk_view))
        _run_split(_copy_pairs, copies)

    def _native_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (2, self.num_kv_heads, num_tokens, self.head_size)

    def _index(self, ranges: list[Range]) -> _Spans:
        """(start, end, staging offset) per run of consecutive ranges."""
        spans: _Spans = []
        offset = 0
        for start, end in ranges:
            if spans and spans[-1][1] == start:
                first, _, span_offset = spans[-1]
                spans[-1] = (first, end, span_offset)
            else:
                spans.append((start, end, offset))
            offset += end - start
        return spans

    def _take(self, layer: int, index: _Spans, out: torch.Tensor) -> None:
        for start, end, offset in index:
            out[0, :, offset : offset + end - start].copy_(self._keys[layer][:, start:end])
            out[1, :, offset : offset + end - start].copy_(self._values[layer][:, start:end])

    def _put(self, layer: int, index: _Spans, src: torch.Tensor) -> None:
        for start, end, offset in index:
            self._keys[layer][:, start:end].copy_(src[0, :, offset : offset + end - start])
            self._values[layer][:, start:end].copy_(src[1, :, offset : offset + end - start])

    def _to_canonical(self, staged: torch.Tensor) -> torch.Tensor:
        return staged.transpose(2, 3)


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


def _mapped_moves(jobs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]
                  ) -> None:
    """Per job (a layer's storage, flat; the element index; a chunk's layer; to host): the
    gather into the chunk, or the scatter from it."""
    for flat, index, chunk, to_host in jobs:
        if to_host:
            if chunk.device == flat.device and chunk.is_contiguous():
                torch.index_select(flat, 0, index, out=chunk.view(-1))
            else:
                chunk.copy_(flat.index_select(0, index).view(chunk.shape), non_blocking=True)
        else:
            src = chunk.reshape(-1).to(flat.device, non_blocking=True)
            flat.index_copy_(0, index, src)


class BlockMap:
    """Where each K/V element of a block lies, for `PagedKV`'s `mapped` layout: `offsets`
    `[planes, block_size, heads, head_size]` (int64) from the block's first element, for
    caches shaped, strided and typed like `like` (one layer, block axis first). Checked once
    here (offsets distinct and inside one block), so views made per request cost nothing
    more; also works out once how many head dims move as one integer."""

    def __init__(self, offsets: torch.Tensor, like: torch.Tensor) -> None:
        if (offsets.ndim != 4 or offsets.dtype != torch.int64
                or offsets.shape[0] not in (1, 2)):
            raise ValueError(f"block map must be int64 [planes, block_size, heads, head_size], "
                             f"got {tuple(offsets.shape)} {offsets.dtype}")
        if like.ndim < 2:
            raise ValueError("a mapped cache has the block axis first and at least 2 dims")
        flat = offsets.reshape(-1)
        span = 1 + sum((n - 1) * s for n, s in zip(like.shape[1:], like.stride()[1:],
                                                   strict=True))
        if bool(((flat < 0) | (flat >= span)).any()) or len(torch.unique(flat)) != len(flat):
            raise ValueError("block map offsets must be distinct and inside one block")
        self.offsets = offsets.to(like.device)
        self._like = (tuple(like.shape[1:]), like.stride(), like.dtype, like.device)
        self.width, self.wide = _widest_run(self.offsets, like, like.dtype)
        self.runs = self.offsets[..., ::self.width] // self.width
        tiles = [_fit_tiling(plane) for plane in offsets.cpu()]
        #: Per plane, the map as a strided view of a block, when every plane has one.
        self.tiles: list[_Tiling] | None = None if None in tiles else [
            t for t in tiles if t is not None]
        #: The token count a strided copy's runs start and end on (the tiles' token edges).
        self.tile_tokens = math.lcm(*(t.sizes[1] for t in self.tiles)) if self.tiles else 1

    def check(self, layer: torch.Tensor) -> None:
        if (tuple(layer.shape[1:]), layer.stride(), layer.dtype, layer.device) != self._like:
            raise ValueError(f"cache layer {tuple(layer.shape)} {layer.dtype} is not the "
                             "shape, strides and dtype its block map was made for")
        if layer.storage_offset() % self.width:
            raise ValueError("cache layer not aligned for its block map")


@dataclass(frozen=True)
class _Tiling:
    """One plane of a block map as a strided view of the block: the element of the token at
    offset `t` of the block, head `h`, dim `d` lies at `base + (t // T) * strides[0] + (t % T)
    * strides[1] + h * strides[2] + (d // E) * strides[3] + (d % E) * strides[4]`, with
    `sizes = (block_size // T, T, heads, head_size // E, E)`."""

    sizes: tuple[int, int, int, int, int]
    strides: tuple[int, int, int, int, int]
    base: int


def _fit_tiling(plane: torch.Tensor) -> _Tiling | None:
    """The `_Tiling` that gives exactly `plane` (`[block_size, heads, head_size]` offsets),
    the smallest tiles first; None where none does (a strided view cannot read the plane).
    Tiles: rows as they are (1, 1: a transposed or row-major area), pairs of dims per token
    (VNNI K), pairs of tokens per dim (VNNI V), and any power of two up to the axis."""
    size, heads, head = plane.shape
    base = int(plane[0, 0, 0])

    def step(t: int, h: int, d: int) -> int:
        return int(plane[t, h, d]) - base

    t_idx = torch.arange(size)
    h_idx = torch.arange(heads).view(1, -1, 1)
    d_idx = torch.arange(head)
    for tt in _powers_dividing(size):
        for ee in _powers_dividing(head):
            strides = (step(tt, 0, 0) if tt < size else 0, step(1, 0, 0) if tt > 1 else 0,
                       step(0, 1, 0) if heads > 1 else 0,
                       step(0, 0, ee) if ee < head else 0, step(0, 0, 1) if ee > 1 else 0)
            if min(strides) < 0:
                continue
            tok = (t_idx // tt) * strides[0] + (t_idx % tt) * strides[1]
            dim = (d_idx // ee) * strides[3] + (d_idx % ee) * strides[4]
            guess = base + tok.view(-1, 1, 1) + h_idx * strides[2] + dim.view(1, 1, -1)
            if torch.equal(guess, plane):
                return _Tiling((size // tt, tt, heads, head // ee, ee), strides, base)
    return None


def _powers_dividing(n: int) -> list[int]:
    """1, 2, 4, ... up to `n`, those that divide `n`."""
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]


def _storage_from(t: torch.Tensor, width: int, wide: torch.dtype) -> torch.Tensor:
    """The storage of `t` from its first element on, as a 1-D view of runs of `width`
    elements, each one element of `wide` (`t`'s own dtype for runs of 1)."""
    total = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    flat = torch.as_strided(t, (total - total % width,), (1,), t.storage_offset())
    return flat.view(wide) if width > 1 else flat


#: Integer dtypes by byte width, for moving runs of elements as one.
_WIDE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _widest_run(block_map: torch.Tensor, first: torch.Tensor, dtype: torch.dtype
                ) -> tuple[int, torch.dtype]:
    """The longest run of head dims (1, 2 or 4 elements, up to 8 bytes) that the map keeps
    contiguous and aligned in every block, and the integer dtype of that width."""
    itemsize = dtype.itemsize
    head = block_map.shape[-1]
    for width in (4, 2):
        nbytes = width * itemsize
        if nbytes not in _WIDE or head % width or first.stride(0) % width:
            continue
        if first.storage_offset() % width:
            continue
        runs = block_map.unflatten(-1, (head // width, width))
        lead = runs[..., :1]
        if bool((lead % width == 0).all()) and torch.equal(
                runs - lead, torch.arange(width, device=runs.device).expand_as(runs)):
            return width, _WIDE[nbytes]
    return 1, dtype


def _copy_pairs(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in copies:
        dst.copy_(src)


#: Whether `PagedKV`'s CPU row copies run in the native `copy_rows` (when it is built);
#: the torch / numpy copies are the fallback and the reference (tests run both).
NATIVE_ROWS = os.environ.get("LMCR_NATIVE_ROWS", "1") != "0"


def _select_rows(reads: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """``out = src[index]`` for each read (`index_select` lets go of the GIL)."""
    for src, index, out in reads:
        torch.index_select(src, 0, index, out=out)


def _assign_rows(writes: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """``dst[index] = src`` for each write: numpy's row assignment, which runs ~4x faster than
    `index_copy_` here and lets go of the GIL while it copies."""
    for dst, index, src in writes:
        dst[index] = src


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool when needed."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _run_split(work: Callable[[Sequence[_Item]], None], items: Sequence[_Item]) -> None:
    """``work`` over ``items`` cut into as many runs as torch has intra-op threads, the runs
    in parallel (a shared pool of that size), returning once all are done."""
    global _pool
    threads = max(1, min(torch.get_num_threads(), len(items)))
    if threads == 1:
        work(items)
        return
    with _pool_lock:
        if _pool is None or _pool[0] < threads:
            old, _pool = _pool, (threads, ThreadPoolExecutor(
                threads, "lmcr-copy", initializer=_single_threaded_ops))
            if old is not None:
                old[1].shutdown(wait=False)
        pool = _pool[1]
    step = -(-len(items) // threads)
    futures = [pool.submit(work, items[i:i + step]) for i in range(0, len(items), step)]
    for future in futures:
        future.result()


def _single_threaded_ops() -> None:
    """A copy thread runs its torch ops on itself alone (OpenMP's thread count is per thread,
    so the caller's is untouched): the copies are already split over the pool, and each
    `index_select` fanning out again over torch's intra-op threads doubled the CPU they cost
    for no gain in speed."""
    torch.set_num_threads(1)


def _bytes(rows: torch.Tensor) -> np.ndarray:
    """A 2-D contiguous CPU tensor's memory as a uint8 numpy array of the same rows."""
    return rows.view(torch.uint8).numpy()


def _check_disjoint(ranges: list[Range]) -> None:
    ordered = sorted(r for r in ranges if r[0] < r[1])
    for (_, end), (start, _) in pairwise(ordered):
        if start < end:
            raise ValueError("scatter ranges overlap")


def _has_duplicates(slots: np.ndarray, block_size: int) -> bool:
    """Whether two of ``slots`` are the same. When they are whole blocks (every run of
    ``block_size`` is one block's slots in order, vLLM's usual mapping) only the block ids are
    compared, else all slots (a sort either way: `torch.unique` cost ~50x more)."""
    if len(slots) % block_size == 0 and len(slots):
        per_block = slots.reshape(-1, block_size)
        firsts = per_block[:, 0]
        if bool((firsts % block_size == 0).all()) and bool(
                (per_block - firsts[:, None] == np.arange(block_size)).all()):
            slots = firsts
    ordered = np.sort(slots)
    return bool((ordered[1:] == ordered[:-1]).any())


def _first_position(ranges: list[Range], flat_index: int) -> int:
    """The token position of element `flat_index` of the concatenated ranges."""
    for start, end in ranges:
        if flat_index < end - start:
            return start + flat_index
        flat_index -= end - start
    raise AssertionError("flat index past the ranges")


def _check_uniform(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
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


def _detect_layout(shape: tuple[int, ...], layout: str | None) -> str:
    if len(shape) == 5 and shape[0] == 2:
        found = "kv_split"
    elif len(shape) == 4:
        found = "packed"
    elif len(shape) == 3:
        found = "mla"
    else:
        raise ValueError(
            f"paged KV layer of shape {shape} matches no layout: expected "
            "[2, num_blocks, block_size, num_kv_heads, head_size] (kv_split), "
            "[num_blocks, num_kv_heads, block_size, 2 * head_size] (packed) or "
            "[num_blocks, block_size, head_size] (mla)"
        )
    if layout is not None and layout != found:
        if layout not in PAGED_LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {PAGED_LAYOUTS}")
        raise ValueError(f"layout {layout!r} given, but shape {shape} is a {found} layout")
    return found


def _paged_geometry(layout: str, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, num_kv_heads, head_size) of one layer's tensor."""
    if layout == "kv_split":
        return shape[1], shape[2], shape[3], shape[4]
    if layout == "packed":
        if shape[3] % 2:
            raise ValueError(f"packed layout needs an even last dim (2 * head_size): {shape}")
        return shape[0], shape[2], shape[1], shape[3] // 2
    return shape[0], shape[1], 1, shape[2]


def _slot_tensor(slot_mapping: torch.Tensor | Sequence[int], num_slots: int) -> torch.Tensor:
    slots = torch.as_tensor(slot_mapping)
    bad_dtype = slots.is_floating_point() or slots.is_complex() or slots.dtype == torch.bool
    if slots.ndim != 1 or (slots.numel() and bad_dtype):
        raise ValueError(f"slot_mapping must be a 1-D integer sequence, got {tuple(slots.shape)}")
    slots = slots.to(device="cpu", dtype=torch.int64)
    if slots.numel() and int(slots.max()) >= num_slots:
        position = int(torch.argmax(slots))
        raise ValueError(
            f"slot_mapping[{position}] = {int(slots[position])} is past the cache's "
            f"{num_slots} slots"
        )
    return slots


def _dense_3d(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{what}: expected torch.Tensor layers, got {type(tensor).__name__}")
    if tensor.ndim == 4 and tensor.shape[0] == 1:
        return tensor[0]
    if tensor.ndim == 3:
        return tensor
    raise ValueError(
        f"{what}: layer of shape {tuple(tensor.shape)} is neither [num_kv_heads, T, head_size] "
        "nor [1, num_kv_heads, T, head_size]"
    )
