"""The worker's reading of vLLM's KV cache, proven with the backend's own write op.

`proven_layout(layers, layout, writer)` runs once when the caches are registered:

1. `layer_view` gave a layout from the tensors' shape (a guess: the CPU backend's shape says
   nothing of its tiled blocks). Its `block_map` is where that guess reads each element.
2. `layout_proof.find_block_map` asks the engine's op where it really puts them, on a
   scratch block (the last one, its bytes restored).
3. Where the two agree, the guess stands (its fast row copies). Otherwise the layers are read
   through the op's map (`mapped`: any layout the op places each element of exactly once,
   tiled or not, converts to the canonical chunk, so every reader gets per-token K/V).
4. `layout_proof.prove` then checks the chosen reading both ways on random values, whole
   blocks and parts of blocks, on two scratch blocks.

Any failure raises `LayoutUnproven`: the caller turns the connector off (nothing stored or
loaded) and inference goes on without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lmcache_remote.connectors import BlockMap, PagedKV
from lmcache_remote.connectors.layout_proof import (
    CacheWriter,
    LayoutUnproven,
    find_block_map,
    prove,
)

__all__ = ["ProvenLayout", "proven_layout"]


@dataclasses.dataclass(frozen=True)
class ProvenLayout:
    """How the worker reads its layers: `PagedKV(layers, slots, layout=layout,
    block_map=block_map)`; `tiled` when that differs from what the shape suggested."""

    layers: list[torch.Tensor]
    layout: str
    block_map: BlockMap | None
    tiled: bool

    def view(self, slots: torch.Tensor | Sequence[int]) -> PagedKV:
        return PagedKV(self.layers, slots, layout=self.layout, block_map=self.block_map)


def proven_layout(layers: list[torch.Tensor], layout: str, writer: CacheWriter | None
                  ) -> ProvenLayout:
    """See the module docstring. `layers` as `layer_view` gives them, `layout` its name,
    `writer` the engine's op writing into `layers[0]` (None: nothing to prove with)."""
    if writer is None:
        raise LayoutUnproven("no cache-write op of the attention backend was found to prove "
                             "the KV cache layout with")
    guess = PagedKV(layers, [], layout=layout)
    if guess.num_blocks < 3:
        raise LayoutUnproven(f"{guess.num_blocks} KV cache blocks: the proof needs 3")
    blocks = guess.blocks(0)
    shape = (guess.kv_planes, guess.block_size, guess.num_kv_heads, guess.head_size)
    last = guess.num_blocks - 1
    found = find_block_map(blocks, writer, shape=shape, in_dtype=guess.dtype, scratch=last)
    if torch.equal(found.cpu(), guess.block_map):
        chosen = ProvenLayout(layers, layout, None, tiled=False)
    else:
        block_first = [guess.blocks(i) for i in range(len(layers))]
        chosen = ProvenLayout(block_first, "mapped", BlockMap(found, block_first[0]),
                              tiled=True)
    first = chosen.layers[0]
    prove(blocks, writer, lambda slots: PagedKV([first], slots, layout=chosen.layout,
                                                block_map=chosen.block_map),
          shape=shape, in_dtype=guess.dtype, scratch=(last, last - 1))
    return chosen
