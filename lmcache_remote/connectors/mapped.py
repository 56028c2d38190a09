"""`MappedCopier`: the copies of `PagedKV`'s `mapped` layout, where a `BlockMap` (blockmap.py)
says where each K/V element of a block lies (vLLM's CPU backend: tiled blocks).

On the CPU, where the map is a tiling (`BlockMap.tiles`), a range's runs of consecutive slots
inside one block move as strided views of the block's K and V areas (`tile_copies`; ~3x
faster than element indexes: a transposed K area moves as one transposing copy per block).
Other ranges (and every range on CUDA) take one element gather (or scatter) per range and
layer through an index built once per range from the map: `block * block_stride +
map[:, offset]` for each token; elements that the map keeps in contiguous aligned runs move
as one wider integer (VNNI pairs of a tiled K area: two bfloat16 as one int32). CPU copies
are split over the copy threads (pool.py). The caller (`PagedKV`) has checked every range
and chunk, and the map against the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lmcache_remote.connectors.blockmap import BlockMap
from lmcache_remote.connectors.pool import copy_pairs, run_split
from lmcache_remote.connectors.view import Range


class MappedCopier:
    """The `mapped` copies of one `PagedKV`: its layers (block axis first), their block map,
    block geometry and slot mapping (int64, CPU)."""

    def __init__(self, layers: list[torch.Tensor], block_map: BlockMap, num_blocks: int,
                 block_size: int, slots: torch.Tensor) -> None:
        self._layers = layers
        self._map = block_map
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._slots = slots
        self._device = layers[0].device
        self._flat = [_storage_from(t, block_map.width, block_map.wide) for t in layers]
        self._tiled: list[list[torch.Tensor]] | None = None  # per layer and plane

    def copy(self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
             ) -> None:
        """Gathers (`to_host`) or scatters `layers` of every (range, chunk) of `group`."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]] = []
        for (start, end), host in group:
            tiled = self.tile_copies(layers, start, end, host, to_host)
            if tiled is not None:
                pairs += tiled
            else:
                jobs += self._element_moves(layers, start, end, host, to_host)
        if pairs:
            run_split(copy_pairs, pairs)
        if jobs:
            if self._device.type == "cpu":
                run_split(_mapped_moves, jobs)
            else:
                _mapped_moves(jobs)

    def tile_copies(
        self, layers: range, start: int, end: int, host: torch.Tensor, to_host: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(destination, source) pairs moving positions `start..end-1` of `layers` as strided
        views, one pair per run of consecutive slots in one block, plane and layer; None where
        the map is no tiling, the cache is not on the CPU (a host-to-device copy into a
        strided view stages per call) or a run does not start and end on a tile's edge."""
        tiles = self._map.tiles
        if tiles is None or self._device.type != "cpu" or not host.is_contiguous():
            return None
        size, edge = self._block_size, self._map.tile_tokens
        slots = self._slots.numpy()[start:end]
        cuts = np.flatnonzero((np.diff(slots) != 1) | (slots[1:] % size == 0)) + 1
        firsts = np.concatenate(([0], cuts))
        lasts = np.concatenate((cuts, [len(slots)]))
        if bool(((slots[firsts] % edge) != 0).any()) or bool(((lasts - firsts) % edge).any()):
            return None
        if self._tiled is None:
            self._tiled = [[torch.as_strided(t, (self._num_blocks, *tile.sizes),
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
        width, wide, base_map = self._map.width, self._map.wide, self._map.runs
        step = self._layers[0].stride(0)
        slots = self._slots[start:end].to(self._device)
        blocks = torch.div(slots, self._block_size, rounding_mode="floor")
        offsets = torch.remainder(slots, self._block_size)
        index = (base_map[:, offsets] + (blocks * (step // width)).view(1, -1, 1, 1)
                 ).reshape(-1)
        return [(self._flat[layer], index,
                 host[layer].view(wide) if width > 1 else host[layer], to_host)
                for layer in layers]


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


def _storage_from(t: torch.Tensor, width: int, wide: torch.dtype) -> torch.Tensor:
    """The storage of `t` from its first element on, as a 1-D view of runs of `width`
    elements, each one element of `wide` (`t`'s own dtype for runs of 1)."""
    total = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    flat = torch.as_strided(t, (total - total % width,), (1,), t.storage_offset())
    return flat.view(wide) if width > 1 else flat
