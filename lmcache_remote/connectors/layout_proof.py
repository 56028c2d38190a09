"""Proof of where an engine's paged KV cache keeps each token's K and V, by its own write op.

A cache tensor's shape does not say where a token's K and V lie in it. vLLM's CPU backend
hands over `[blocks, heads, block_size, 2 * head_size]`, yet its kernel stores each block as a
K area then a V area, tiled by instruction set; reading that shape as "row t = K|V of token t"
put tiled bytes in chunks that every other reader loaded as wrong KV, silently. So the
connector never trusts a shape: it asks the engine's own cache-write operation.

Contract:

- `CacheWriter`: `write(kv, slots)` writes per-token values into one layer of the engine's
  cache exactly as the engine's attention layer does (vLLM: the backend's
  `do_kv_cache_update`). `kv` is `[planes, tokens, heads, head_size]` in the canonical
  order (plane 0 K, plane 1 V; MLA one plane, one head: the latent), in the dtype the engine
  feeds its op; `slots[i] = block * block_size + offset` of token i.
- `find_block_map(blocks, writer, ...)`: writes digit-coded values through the op into one
  scratch block and reads where each canonical element (plane, offset in block, head, dim)
  landed: an int64 tensor `[planes, block_size, heads, head_size]` of storage offsets from
  the block's first element (`blocks[b]`'s storage offset). The op must place every element
  exactly once, with its value intact; otherwise `LayoutUnproven`.
- `prove(blocks, writer, view, ...)`: the view's reading and writing against the op, on
  random values and scratch slots out of order (whole blocks and parts of blocks): what the op
  wrote, the view must read bit for bit; what the view writes must leave the bytes the op
  leaves for the same values. `LayoutUnproven` says which failed.
- Both only touch the scratch blocks they are given (of one layer), and restore their bytes
  before returning, whatever happens. `blocks` is one layer's cache with the block axis
  first (any strides); nothing here is specific to a device: the same code runs on CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from lmcache_remote.errors import LmcrError

__all__ = ["CacheWriter", "LayoutUnproven", "find_block_map", "prove"]

#: Digits of the element codes written per pass: 1..8 are exact in every float dtype a KV
#: cache uses, fp8 e4m3 and e5m2 included (0 marks an element the op did not write).
_BASE = 8


class CacheWriter(Protocol):
    def __call__(self, kv: torch.Tensor, slots: torch.Tensor) -> None: ...


class LayoutUnproven(LmcrError):
    """The engine's own write op does not confirm how the cache is read."""


@contextmanager
def _scratch(blocks: torch.Tensor, ids: Sequence[int]) -> Iterator[None]:
    """The scratch blocks' bytes, put back on exit."""
    saved = [blocks[b].clone() for b in ids]
    try:
        yield
    finally:
        for b, data in zip(ids, saved, strict=True):
            blocks[b].copy_(data)


def _element_offsets(block: torch.Tensor) -> torch.Tensor:
    """Storage offset (from the block's first element) of each element of `block`, flat in its
    logical order."""
    offsets = torch.zeros((), dtype=torch.int64, device=block.device)
    for size, stride in zip(block.shape, block.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, device=block.device) * stride
    return offsets.reshape(-1)


def _values(block: torch.Tensor) -> torch.Tensor:
    """The block's elements as float64, flat in logical order (fp8 held as uint8 excepted:
    the caller views it in its float8 dtype first)."""
    return block.reshape(-1).to(torch.float64)


def find_block_map(blocks: torch.Tensor, writer: CacheWriter, *, shape: tuple[int, ...],
                   in_dtype: torch.dtype, scratch: int) -> torch.Tensor:
    """Where the op puts each canonical element of a block; see the module docstring.

    `shape` is `(planes, block_size, heads, head_size)`; `in_dtype` the dtype the op is fed;
    `scratch` the block written (restored after)."""
    planes, block_size, heads, head_size = shape
    count = math.prod(shape)
    device = blocks.device
    codes = torch.arange(count, dtype=torch.int64, device=device)
    passes = 1
    while _BASE**passes < count:
        passes += 1
    found = torch.zeros(blocks[scratch].numel(), dtype=torch.int64, device=device)
    slots = scratch * block_size + torch.arange(block_size, dtype=torch.int64, device=device)
    written: torch.Tensor | None = None
    with _scratch(blocks, [scratch]):
        for p in range(passes):
            digits = (codes // _BASE**p) % _BASE + 1
            blocks[scratch].zero_()
            writer(digits.to(in_dtype).view(shape), slots)
            got = _values(blocks[scratch])
            here = got != 0
            if written is None:
                written = here
            elif not torch.equal(written, here):
                raise LayoutUnproven("the write op touched other elements in another pass")
            digit = got[here] - 1
            out_of_range = bool(((digit < 0) | (digit >= _BASE)).any())
            if out_of_range or not torch.equal(digit, digit.round()):
                raise LayoutUnproven("the write op changed the values it stored "
                                     "(a scale or a conversion): its placement cannot be read")
            found[here] += digit.to(torch.int64) * _BASE**p
    assert written is not None
    if int(written.sum()) != count:
        raise LayoutUnproven(f"the write op wrote {int(written.sum())} elements of a block "
                             f"for {count} K/V values")
    positions = torch.nonzero(written).reshape(-1)
    code_at = found[positions]
    order = torch.sort(code_at)
    if not torch.equal(order.values, codes):
        raise LayoutUnproven("the write op stored some K/V values twice and others not at all")
    offsets = _element_offsets(blocks[scratch])[positions[order.indices]]
    return offsets.view(planes, block_size, heads, head_size)


def prove(blocks: torch.Tensor, writer: CacheWriter,
          view: Callable[[torch.Tensor], _View], *, shape: tuple[int, ...],
          in_dtype: torch.dtype, scratch: tuple[int, int], seed: int = 0) -> None:
    """Check `view` (slots -> a one-layer KV view of `blocks`' cache) against the op; see the
    module docstring. Raises `LayoutUnproven` naming the first disagreement."""
    block_size = shape[1]
    a, b = scratch
    device = blocks.device
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(block_size, generator=gen).to(device)
    values = _random(shape, in_dtype, gen).to(device)
    cache_dtype = blocks.dtype
    part = slice(block_size // 4, block_size - block_size // 8)  # a run inside a block
    with _scratch(blocks, [a, b]):
        # read: what the op wrote, the view reads
        blocks[a].zero_()
        writer(values, a * block_size + order)
        got = _gather(view(a * block_size + order), block_size, cache_dtype)
        want = values.to(cache_dtype)
        if not _same_bytes(got, want):
            raise LayoutUnproven("K/V written by the engine's op read back different")
        inner = _gather(view((a * block_size + order)[part]), len(range(block_size)[part]),
                        cache_dtype)
        if not _same_bytes(inner, want[:, part]):
            raise LayoutUnproven("K/V of tokens inside a block read back different")
        # write: what the view writes, the op would have written
        for tokens in (slice(None), part):
            blocks[a].zero_()
            blocks[b].zero_()
            picked = values[:, tokens]
            writer(picked, a * block_size + order[tokens])
            kv_view = view(b * block_size + order[tokens])
            chunk = picked.to(cache_dtype).unsqueeze(0).contiguous()
            kv_view.scatter([(0, chunk.shape[2])], [chunk.cpu() if chunk.is_cuda else chunk])
            if not _same_bytes(blocks[a], blocks[b]):
                raise LayoutUnproven("K/V written through the connector left other bytes "
                                     "than the engine's op")


class _View(Protocol):
    def gather(self, ranges: Sequence[tuple[int, int]], dsts: Sequence[torch.Tensor]
               ) -> None: ...

    def scatter(self, ranges: Sequence[tuple[int, int]], srcs: Sequence[torch.Tensor]
                ) -> None: ...

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]: ...


def _gather(view: _View, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(view.chunk_shape(tokens), dtype=dtype)
    view.gather([(0, tokens)], [out])
    return out[0]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random K/V values: normal for the float dtypes an op is fed, small integers (exact in
    fp8 at scale 1) otherwise."""
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape:
        return False
    return torch.equal(x.contiguous().view(torch.uint8).cpu(),
                       y.contiguous().view(torch.uint8).cpu())
