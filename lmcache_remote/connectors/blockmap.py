"""`BlockMap`: where each K/V element of a cache block lies, for `PagedKV`'s `mapped` layout
(vLLM's CPU backend, whose blocks are tiled), worked out and checked once per cache so that
views made per request cost nothing more.

It holds the map (`offsets`, int64 `[planes, block_size, heads, head_size]`, from the block's
first element; `layout_proof.find_block_map` reads it off the engine's write op), how many
head dims move as one wider integer (`width`, `wide`, `runs`: VNNI pairs of a tiled K area,
two bfloat16 as one int32), and, where every plane is one, the map as strided views of a
block (`tiles`, `_Tiling`, found by `_fit_tiling`) with the token edge that strided copies
start and end on (`tile_tokens`). mapped.py copies through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
