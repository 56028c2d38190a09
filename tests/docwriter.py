"""A writer of chunks built from docs/key-schema.md and docs/value-format.md alone, as a client in
another language would write one: it imports nothing from lmcache_remote. Tests use it to check
that what such a writer stores, cut into parts however it likes, is what the project's `lookup`
counts and `retrieve` reads.

- `chunk_hashes(tokens, chunk_size, salt)`: the chained BLAKE2b-128 hashes ("Chunk hash").
- `chunk_key(prefix, model, world_size, worker_id, dtype, chunk_hash)`: "Chunk keys", the model
  name percent-escaped.
- `chunk_values(kv, dtype_code, chunk_hash, part_size, codec)`: the Redis values of one chunk
  ("Values of a chunk", "Header"): value 0 = header + stored part 0, then parts 1.. .
  `kv` is the chunk's canonical tensor `[num_layers, 2, num_tokens, num_kv_heads, head_size]`.
- `write_chunk(client, key, values)`: one MSET (one SET for one value), as the docs ask: all
  values of a chunk in one atomic step.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import lz4.block
import torch
import xxhash

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}  # "dtype codes"
CODEC_IDS = {"raw": 0, "lz4": 1}  # "Codecs"


def chunk_hashes(tokens: Sequence[int], chunk_size: int, salt: str | None = None) -> list[str]:
    prev = bytes(16) if salt is None else hashlib.blake2b(salt.encode("utf-8"),
                                                          digest_size=16).digest()
    out = []
    for i in range(0, len(tokens), chunk_size):
        data = b"".join(int(t).to_bytes(4, "little") for t in tokens[i:i + chunk_size])
        prev = hashlib.blake2b(prev + data, digest_size=16).digest()
        out.append(prev.hex())
    return out


def chunk_key(prefix: str, model: str, world_size: int, worker_id: int, dtype: str,
              chunk_hash: str) -> str:
    escaped = (model.replace("%", "%25").replace(":", "%3A").replace("{", "%7B")
               .replace("}", "%7D"))
    return f"{prefix}:v1:{escaped}:{world_size}:{worker_id}:{dtype}:{{{chunk_hash}}}"


def _stored(segment: bytes, codec: str) -> bytes:
    return segment if codec == "raw" else lz4.block.compress(segment, store_size=False)


def chunk_values(kv: torch.Tensor, dtype: torch.dtype, chunk_hash: str, part_size: int,
                 codec: str = "raw") -> list[bytes]:
    raw = kv.contiguous().view(torch.uint8).numpy().tobytes()
    count = max(1, -(-len(raw) // part_size))
    stored = [_stored(raw[i * part_size:(i + 1) * part_size], codec) for i in range(count)]
    shape = list(kv.shape) + [0] * (8 - kv.dim())
    header = bytearray()
    header += b"LMCR"                                             # 0: magic
    header += struct.pack("<BBBB", 1, CODEC_IDS[codec], DTYPE_CODES[dtype], kv.dim())
    header += struct.pack("<8I", *shape)                          # 8: shape
    header += struct.pack("<I", kv.shape[2])                      # 40: num_tokens
    header += bytes.fromhex(chunk_hash)                           # 44: chunk_hash
    header += struct.pack("<QQI", len(raw), part_size, count)     # 60, 68, 76
    for part in stored:                                           # 80 + 16 i
        header += struct.pack("<QQ", len(part), xxhash.xxh3_64_intdigest(part))
    header += struct.pack("<I", xxhash.xxh3_64_intdigest(bytes(header)) & 0xFFFFFFFF)
    assert len(header) == 84 + 16 * count
    return [bytes(header) + stored[0], *stored[1:]]


def write_chunk(client: Any, key: str, values: Sequence[bytes]) -> None:
    if len(values) == 1:
        client.set(key, values[0])
        return
    keys = [key] + [f"{key}#{i}" for i in range(1, len(values))]
    client.execute_command("MSET", *(x for kv in zip(keys, values, strict=True) for x in kv))
