"""The peers, on the same chunks: plain redis-py with whole chunks, and LMCache's Redis wire
pattern.

LMCache's Redis connector (as its documentation and source describe it) keeps every chunk
under two keys, ``<key>metadata`` (a small header: shape, dtype, length) and ``<key>kv_bytes``
(the chunk's bytes), and moves each with its own command and round trip, no pipelining: a put
is SET metadata then SET kv_bytes; a get is GET metadata, then GET kv_bytes, then a copy of
the bytes into a memory object. Written here from that description, with redis-py (hiredis).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import redis
import torch

from benchmarks.timing import median_seconds

_META = struct.Struct("<8sI5I")


def _raw(chunk: torch.Tensor) -> memoryview:
    return chunk.view(torch.uint8).reshape(-1).numpy().data


def redis_py_whole(url: str, chunks: Sequence[torch.Tensor], reps: int) -> tuple[float, float]:
    """Seconds (median) to SET and GET every chunk as one value, one command each, and copy
    each reply into a reused chunk buffer."""
    client = redis.Redis.from_url(url, socket_timeout=60)
    keys = [f"rp:{i}" for i in range(len(chunks))]
    dests = [torch.empty_like(c) for c in chunks]

    def put() -> None:
        for key, chunk in zip(keys, chunks, strict=True):
            client.set(key, _raw(chunk))

    def get() -> None:
        for key, dest in zip(keys, dests, strict=True):
            data = client.get(key)
            _raw(dest)[:] = data

    try:
        t_put = median_seconds(put, reps)
        t_get = median_seconds(get, reps)
        assert all(torch.equal(a, b) for a, b in zip(chunks, dests, strict=True))
        client.unlink(*keys)
    finally:
        client.close()
    return t_put, t_get


def lmcache_pattern(url: str, chunks: Sequence[torch.Tensor], reps: int) -> tuple[float, float]:
    """Seconds (median) to put and get every chunk the way LMCache's Redis connector does."""
    client = redis.Redis.from_url(url, socket_timeout=60)
    keys = [f"lmc:{i}" for i in range(len(chunks))]
    dests = [torch.empty_like(c) for c in chunks]

    def put() -> None:
        for key, chunk in zip(keys, chunks, strict=True):
            meta = _META.pack(str(chunk.dtype)[6:14].encode(), chunk.nbytes,
                              *(list(chunk.shape) + [0] * 5)[:5])
            client.set(key + "metadata", meta)
            client.set(key + "kv_bytes", _raw(chunk))

    def get() -> None:
        for key, dest in zip(keys, dests, strict=True):
            meta = client.get(key + "metadata")
            if meta is None:
                continue
            nbytes = _META.unpack(meta)[1]
            data = client.get(key + "kv_bytes")
            if data is None or len(data) != nbytes:
                continue
            _raw(dest)[:] = data

    try:
        t_put = median_seconds(put, reps)
        t_get = median_seconds(get, reps)
        assert all(torch.equal(a, b) for a, b in zip(chunks, dests, strict=True))
        client.unlink(*(k + s for k in keys for s in ("metadata", "kv_bytes")))
    finally:
        client.close()
    return t_put, t_get
