"""`PagedKV`: vLLM's paged KV cache as a `KVView` (see view.py for the contract), one tensor
per layer and the request's slot mapping, in the layouts `PAGED_LAYOUTS` names.

On CUDA every layout goes through the staging tensor of `KVView` (one advanced-indexing op
per layer on block ids and in-block offsets). On the CPU a contiguous `kv_split` or `mla`
cache copies rows straight between the cache and the chunks (`RowCopier`, rows.py); a
`mapped` cache copies through its block map (`MappedCopier`, mapped.py); `packed` caches and
strided caches take the staging path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lmcache_remote.connectors.blockmap import BlockMap
from lmcache_remote.connectors.mapped import MappedCopier
from lmcache_remote.connectors.rows import RowCopier
from lmcache_remote.connectors.slots import first_position, has_duplicates, slot_tensor, slots_of
from lmcache_remote.connectors.view import Geometry, KVView, Range, check_uniform

PAGED_LAYOUTS = ("kv_split", "packed", "mla", "mapped")

# Per paged layout: the axis of block ids and the axis of in-block offsets in one layer's
# tensor, then the token axis of advanced indexing on those two (adjacent index axes keep their
# place, separated ones move to the front).
_PAGED_AXES = {"kv_split": (1, 2, 1), "packed": (0, 2, 0), "mla": (0, 1, 0),
               "mapped": (0, 1, 1)}


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
        first = check_uniform(self._layers, "kv_caches")
        self._map: BlockMap | None = None
        if layout == "mapped" or block_map is not None:
            if layout != "mapped" or block_map is None:
                raise ValueError("a block_map goes with layout='mapped', and only with it")
            self.layout = "mapped"
            block_map.check(first)
            self._map = block_map
            planes, self.block_size, heads, head_size = block_map.offsets.shape
            self.num_blocks = first.shape[0]
        else:
            self.layout = _detect_layout(tuple(first.shape), layout)
            self.num_blocks, self.block_size, heads, head_size = _paged_geometry(
                self.layout, tuple(first.shape)
            )
            planes = 1 if self.layout == "mla" else 2
        self._slots = slot_tensor(slot_mapping, self.num_blocks * self.block_size)
        self._geometry = Geometry(
            first.device, first.dtype, len(kv_caches), planes, heads, head_size, len(self._slots)
        )
        self._token_dim = _PAGED_AXES[self.layout][2]
        # how `_copy_group` copies where not through staging (as on CUDA)
        self._mapped = None if self._map is None else MappedCopier(
            self._layers, self._map, self.num_blocks, self.block_size, self._slots)
        self._rows = RowCopier(self._layers, self.layout, self.num_blocks, self.block_size,
                               self._slots) if (
            first.device.type == "cpu"
            and self.layout in ("kv_split", "mla")
            and all(t.is_contiguous() for t in self._layers)
        ) else None

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
            position = first_position(ranges, int(np.flatnonzero(slots < 0)[0]))
            raise ValueError(f"token {position} has a negative slot (padding); cannot copy it")
        if write and has_duplicates(slots, self.block_size):
            raise ValueError("scatter ranges map two tokens to the same slot")

    def _index(self, ranges: list[Range]) -> list[torch.Tensor | None]:
        slots = torch.from_numpy(self._slots_np(ranges)).to(self.device)
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
        """A `mapped` cache copies through its block map (`MappedCopier`); on the CPU,
        contiguous `kv_split` and `mla` caches copy rows straight between the cache and
        contiguous chunks (`RowCopier`); anything else goes through staging."""
        if self._mapped is not None:
            self._mapped.copy(layers, group, to_host)
            return
        if self._rows is None or not all(host.is_contiguous() for _, host in group):
            super()._copy_group(layers, group, to_host)
            return
        self._rows.copy(layers, group, to_host)

    def _to_canonical(self, staged: torch.Tensor) -> torch.Tensor:
        if self.layout == "kv_split":
            return staged
        if self.layout == "packed":
            return staged.unflatten(-1, (2, self.head_size)).permute(0, 3, 1, 2, 4)
        return staged.unsqueeze(1).unsqueeze(3)

    def _slots_np(self, ranges: list[Range]) -> np.ndarray:
        return slots_of(self._slots.numpy(), ranges)


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

