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

_META = struct.Struct("<8sI5I")


def _raw(chunk: torch.Tensor) -> memoryview:
    return chunk.view(torch.uint8).reshape(-1).numpy().data


def lmcache_ops(url: str, chunks: Sequence[torch.Tensor]):  # type: ignore[no-untyped-def]
    """(put, get, dests, keys, client) of the LMCache pattern, for the interleaved rows."""
    client = redis.Redis.from_url(url, socket_timeout=60)
    base = [f"lmc:{i}" for i in range(len(chunks))]
    keys = [k + s for k in base for s in ("metadata", "kv_bytes")]
    dests = [torch.empty_like(c) for c in chunks]

    def put() -> None:
        for key, chunk in zip(base, chunks, strict=True):
            meta = _META.pack(str(chunk.dtype)[6:14].encode(), chunk.nbytes,
                              *(list(chunk.shape) + [0] * 5)[:5])
            client.set(key + "metadata", meta)
            client.set(key + "kv_bytes", _raw(chunk))

    def get() -> None:
        for key, dest in zip(base, dests, strict=True):
            meta = client.get(key + "metadata")
            if meta is None:
                continue
            nbytes = _META.unpack(meta)[1]
            data = client.get(key + "kv_bytes")
            if data is None or len(data) != nbytes:
                continue
            _raw(dest)[:] = data

    return put, get, dests, keys, client
