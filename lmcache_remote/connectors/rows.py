"""`RowCopier`: `PagedKV`'s CPU copies of a contiguous `kv_split` or `mla` cache, as rows
straight between the cache and the chunks, no staging tensor (a fresh staging allocation and a
second copy cost ~4x on 32 MiB chunks; in all ~4x faster than staging).

A chunk's `[layer, plane]` part is `[tokens, heads * head_size]` rows; the cache's plane is
`rows` rows: blocks (whole blocks at a time, where a range covers whole blocks in order,
vLLM's usual mapping) or single slots otherwise. The copies run in the native `copy_rows`
(lmcache_remote/native/_wire_rows.c: one call per copy thread that gives the GIL up once for all of
its rows) where it is built and `NATIVE_ROWS`, else as `index_select` to gather and numpy row
assignment to scatter (~4x faster than `index_copy_`); either way split over the copy threads
(pool.py). Both give the same bytes: the torch / numpy copies are the fallback and the
reference (tests run both). The caller (`PagedKV`) has checked every range and chunk.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from lmcache_remote.connectors.pool import run_split
from lmcache_remote.connectors.slots import block_runs, slots_of, whole_blocks
from lmcache_remote.connectors.view import Range
from lmcache_remote.native import wire as _native  # its copy_rows, or None: torch / numpy

#: Whether `PagedKV`'s CPU row copies run in the native `copy_rows` (when it is built);
#: the torch / numpy copies are the fallback and the reference (tests run both).
NATIVE_ROWS = os.environ.get("LMCR_NATIVE_ROWS", "1") != "0"


class RowCopier:
    """The row copies of one `PagedKV`: its layers (contiguous, on the CPU, `kv_split` or
    `mla`), their geometry and its slot mapping (int64, CPU)."""

    def __init__(self, layers: list[torch.Tensor], layout: str, num_blocks: int,
                 block_size: int, slots: torch.Tensor) -> None:
        self._layers = layers
        self._layout = layout
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._slots = slots
        self._dtype = layers[0].dtype

    def copy(self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
             ) -> None:
        """Gathers (`to_host`) or scatters `layers` of every (range, contiguous chunk) of
        `group`: one `index_select` / row assignment per range, layer and plane, or the native
        copier's jobs."""
        if _native is not None and NATIVE_ROWS and self._copy_native(layers, group, to_host):
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
            run_split(_select_rows, reads)
        if writes:
            run_split(_assign_rows, writes)

    def _copy_native(
        self, layers: range, group: list[tuple[Range, torch.Tensor]], to_host: bool
    ) -> bool:
        """`copy`'s row copies in `lmcache_remote.native._wire.copy_rows`: the same rows, one
        call per copy thread that gives the GIL up once for all of them, where the torch /
        numpy copies gave it up per layer, plane and chunk (with another busy Python thread
        in the process each hand-off waits up to the 5 ms switch interval). Only calls that
        keep the GIL are made per chunk (`data_ptr`, `numel`). False, nothing copied, where a
        chunk's geometry does not match (the torch / numpy copies then run)."""
        itemsize = self._dtype.itemsize
        planes = 2 if self._layout == "kv_split" else 1
        plane_bytes = self._layers[0].numel() * itemsize // planes
        bases = [t.data_ptr() + p * plane_bytes for t in (self._layers[i] for i in layers)
                 for p in range(planes)]
        jobs: list[tuple[int, int, int, int, np.ndarray]] = []
        for (_, host), (rows, index) in zip(group, self._row_indexes([r for r, _ in group]),
                                            strict=True):
            row_bytes, count = plane_bytes // rows, len(index)
            layer_bytes = host.numel() // host.shape[0] * itemsize  # a chunk's layer: P planes
            if (host.dtype != self._dtype or host.shape[0] < layers.stop
                    or layer_bytes != planes * count * row_bytes):
                return False
            start = host.data_ptr() + layers.start * layer_bytes
            index = np.ascontiguousarray(index, dtype=np.int64)
            jobs += [(base, rows, start + k * count * row_bytes, row_bytes, index)
                     for k, base in enumerate(bases)]
        native = _native
        assert native is not None
        run_split(lambda part: native.copy_rows(list(part), to_host), jobs)
        return True

    def _plane_rows(self, layers: range, rows: int) -> list[torch.Tensor]:
        """Each layer's planes (K then V, or MLA's one) as ``rows`` rows, in chunk order."""
        out = []
        for layer in layers:
            cache = self._layers[layer]
            planes = (cache[0], cache[1]) if self._layout == "kv_split" else (cache,)
            out += [plane.view(rows, -1) for plane in planes]
        return out

    def _row_indexes(self, ranges: list[Range]) -> list[tuple[int, np.ndarray]]:
        """Per range, (rows per plane, row index): block ids where its slots are whole blocks
        in order (`whole_blocks`), slot ids otherwise. The block test runs once over all of
        them when every range is whole blocks long, in numpy (per range it cost ~10 small
        torch calls, as much as the copy of a 1 MiB chunk's rows)."""
        size, slots = self._block_size, self._slots.numpy()
        runs = None
        if ranges and not any((end - start) % size or end == start for start, end in ranges):
            runs = block_runs(slots_of(slots, ranges), size)
        if runs is None:
            return [self._row_index(slots[start:end]) for start, end in ranges]
        ids, whole = runs
        out, pos = [], 0
        for start, end in ranges:
            count = (end - start) // size
            if whole[pos:pos + count].all():
                out.append((self._num_blocks, ids[pos:pos + count]))
            else:
                out.append((self._num_blocks * size, slots[start:end]))
            pos += count
        return out

    def _row_index(self, slots: np.ndarray) -> tuple[int, np.ndarray]:
        ids = whole_blocks(slots, self._block_size)
        if ids is not None:
            return self._num_blocks, ids
        return self._num_blocks * self._block_size, slots


def _select_rows(reads: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """``out = src[index]`` for each read (`index_select` lets go of the GIL)."""
    for src, index, out in reads:
        torch.index_select(src, 0, index, out=out)


def _assign_rows(writes: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
    """``dst[index] = src`` for each write: numpy's row assignment, which runs ~4x faster than
    `index_copy_` here and lets go of the GIL while it copies."""
    for dst, index, src in writes:
        dst[index] = src


def _bytes(rows: torch.Tensor) -> np.ndarray:
    """A 2-D contiguous CPU tensor's memory as a uint8 numpy array of the same rows."""
    return rows.view(torch.uint8).numpy()
