"""Codecs per dtype and data: compression ratio, and encode/decode speed on all cores."""

from __future__ import annotations

import os

import torch

from benchmarks.timing import median_seconds
from lmcache_remote.values.serde import Serde

HASH = bytes(16)


def codec_case(codec: str, tensor: torch.Tensor, reps: int) -> dict[str, float]:
    """Ratio (raw / stored bytes), and GB/s of raw KV for encode and decode of ``tensor``
    as one chunk (parts of the default size, one thread per core)."""
    threads = os.cpu_count() or 1
    with Serde(codec, threads=threads) as serde:
        values = serde.encode(tensor, HASH, tensor.shape[2])
        stored = sum(len(memoryview(v)) for v in values)
        out = torch.empty_like(tensor)
        header = serde.read_header(values[0])

        def decode() -> None:
            serde.decode_into(header, values, out, HASH)

        t_enc = median_seconds(lambda: serde.encode(tensor, HASH, tensor.shape[2]), reps)
        t_dec = median_seconds(decode, reps)
        assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))
    return {"ratio": tensor.nbytes / stored, "encode": tensor.nbytes / t_enc / 1e9,
            "decode": tensor.nbytes / t_dec / 1e9}


def synthetic(dtype: torch.dtype, scale: float, nbytes: int, seed: int = 0) -> torch.Tensor:
    """Normal KV with std ``scale`` in the canonical layout of the Llama-8B-like shape."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    tokens = max(1, nbytes // (32 * 2 * 8 * 128 * itemsize))
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(32, 2, tokens, 8, 128, generator=gen) * scale).to(dtype)
