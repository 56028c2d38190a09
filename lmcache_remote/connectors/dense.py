"""`DenseKV`: the Hugging Face KV cache as a `KVView` (see view.py for the contract).

Per layer K and V of `[num_kv_heads, T, head_size]` or `[1, num_kv_heads, T, head_size]`;
position i is index i of the T axis. On CUDA a group goes through the staging tensor of
`KVView`; on the CPU the staging tensor is skipped: one 2-D copy per range, layer, K/V plane
and head straight between the cache and the chunk (the staging copy cost ~20x on 32 MiB
chunks), the copies split over the copy threads (pool.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_remote.connectors.pool import copy_pairs, run_split
from lmcache_remote.connectors.view import Geometry, KVView, Range, check_uniform

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
        check_uniform(self._keys + self._values, "keys and values")
        heads, length, head_size = self._keys[0].shape
        first = self._keys[0]
        self._geometry = Geometry(
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
        run_split(copy_pairs, copies)

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
