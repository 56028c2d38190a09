"""A paged cache's slot mapping: read once into CPU memory and checked (`slot_tensor`), the
slots of a list of ranges (`slots_of`), and whether runs of slots are whole blocks in order
(`block_runs`, `whole_blocks`: vLLM's usual mapping, where checks and copies then work on
block ids instead of slots); also the duplicate-slot check of a scatter and the position of a
bad slot. No tensor of the cache is touched here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lmcache_remote.connectors.view import Range


def slot_tensor(slot_mapping: torch.Tensor | Sequence[int], num_slots: int) -> torch.Tensor:
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


def slots_of(slots: np.ndarray, ranges: list[Range]) -> np.ndarray:
    """The slots of ``ranges``, concatenated, in numpy (a torch slice or op costs ~4x
    more, and a store of 256 chunks asks for 256 of them)."""
    if not ranges:
        return slots[:0]
    return np.concatenate([slots[start:end] for start, end in ranges])


def block_runs(slots: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``slots`` cut into runs of ``block_size``: per run, the block id of its first slot
    and whether the run is exactly that block's slots in order from its first offset; None
    where ``slots`` is not a positive multiple of ``block_size`` long."""
    if len(slots) % block_size or not len(slots):
        return None
    per_block = slots.reshape(-1, block_size)
    firsts = per_block[:, 0]
    whole = ((per_block - firsts[:, None] == np.arange(block_size)).all(axis=1)
             & (firsts % block_size == 0))
    return firsts // block_size, whole


def whole_blocks(slots: np.ndarray, block_size: int) -> np.ndarray | None:
    """The block ids of ``slots`` when every run of ``block_size`` of them is one whole block
    in order (`block_runs`), else None."""
    runs = block_runs(slots, block_size)
    return runs[0] if runs is not None and bool(runs[1].all()) else None


def has_duplicates(slots: np.ndarray, block_size: int) -> bool:
    """Whether two of ``slots`` are the same. When they are whole blocks (`whole_blocks`)
    only the block ids are compared, else all slots (a sort either way: `torch.unique` cost
    ~50x more)."""
    ids = whole_blocks(slots, block_size)
    ordered = np.sort(slots if ids is None else ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def first_position(ranges: list[Range], flat_index: int) -> int:
    """The token position of element `flat_index` of the concatenated ranges."""
    for start, end in ranges:
        if flat_index < end - start:
            return start + flat_index
        flat_index -= end - start
    raise AssertionError("flat index past the ranges")
