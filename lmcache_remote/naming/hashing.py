"""Chunk hashing and the token database: tokens in, (start, end, key) per chunk out.

The hash is fixed by DESIGN.md so that other implementations compute the same keys:

- token ids are encoded as little-endian uint32 (an id outside 0..2**32-1 is a `ValueError`);
- `prev` starts as 16 zero bytes, or `blake2b(cache_salt.encode("utf-8"), digest_size=16)`;
- for each chunk in order, a last partial chunk the same way:
  `prev = blake2b(prev + chunk_tokens_as_uint32_le, digest_size=16).digest()`;
- that `prev` is the chunk's hash; its key carries it as 32 lowercase hex digits.

A request whose KV depends on more than its tokens (an adapter, multimodal items, prompt
embeddings) passes a `RequestIdentity` instead of the salt: its seed starts the chain, and a
chunk with extras is hashed as `identity` specifies (text chunks exactly as above).

Hashing works on one numpy view of the tokens: one BLAKE2b call per chunk, no per-token Python
work, so a 128k-token prompt hashes in about a millisecond.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lmcache_remote.errors import KeyFormatError
from lmcache_remote.naming.identity import (
    EXTRAS_PERSON,
    HASH_BYTES,
    RequestIdentity,
    as_identity,
    salt_seed,
)
from lmcache_remote.naming.keys import CacheEngineKey

__all__ = ["HASH_BYTES", "ChunkSpec", "KeyNamespace", "TokenDatabase", "chunk_hashes",
           "salt_seed", "skip_prefix", "tokens_to_array"]

_U32_MAX = 2**32 - 1

TokenInput = torch.Tensor | np.ndarray | Sequence[int]


_U32_CODE = "I" if array.array("I").itemsize == 4 else "L"  # the array typecode of a uint32


def tokens_to_array(tokens: Any) -> np.ndarray:
    """The token ids as a contiguous little-endian uint32 array; `ValueError` if out of range."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"tokens must be integer ids, got a {tokens.dtype} tensor")
        arr = tokens.detach().to("cpu").reshape(-1).numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens.reshape(-1)
    elif isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"tokens must be integer ids, got {type(tokens).__name__}")
    else:
        try:  # C unsigned ints: the range check comes with the packing, ~4x numpy's speed
            packed = array.array(_U32_CODE, tokens)
        except OverflowError:
            raise ValueError("token id outside 0..2**32-1") from None
        except TypeError as exc:
            raise ValueError(f"tokens must be integer ids: {exc}") from None
        return np.frombuffer(packed, dtype=np.uint32).astype("<u4", copy=False)
    if isinstance(tokens, (torch.Tensor, np.ndarray)) and tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _U32_MAX):
        raise ValueError("token id outside 0..2**32-1")
    return np.ascontiguousarray(arr, dtype="<u4")


def chunk_hashes(
    tokens: np.ndarray, chunk_size: int, cache_salt: str | RequestIdentity | None = None, *,
    partial: bool = True,
) -> list[bytes]:
    """The chained hash of every chunk of `tokens` (uint32 LE); the last partial one if asked.
    `cache_salt` is the salt, or the request's whole `RequestIdentity`."""
    view = memoryview(tokens).cast("B")  # type: ignore[arg-type]
    step = chunk_size * 4
    end = len(view) if partial else len(view) - len(view) % step
    identity = as_identity(cache_salt)
    prev = salt_seed(None) if identity is None else identity.seed()
    if identity is not None and not identity.plain:
        return _hashes_with_extras(view, chunk_size, end, prev, identity)
    out: list[bytes] = []
    blake = hashlib.blake2b
    for offset in range(0, end, step):
        h = blake(prev, digest_size=HASH_BYTES)
        h.update(view[offset:offset + step])
        prev = h.digest()
        out.append(prev)
    return out


def _hashes_with_extras(view: memoryview, chunk_size: int, end: int, prev: bytes,
                        identity: RequestIdentity) -> list[bytes]:
    """`chunk_hashes` of a request some of whose chunks have extras (`identity` module)."""
    out: list[bytes] = []
    step = chunk_size * 4
    for offset in range(0, end, step):
        data = view[offset:offset + step]
        start = offset // 4
        extras = identity.extras(start, start + len(data) // 4, chunk_size)
        if extras:
            h = hashlib.blake2b(prev, digest_size=HASH_BYTES, person=EXTRAS_PERSON)
            h.update(struct.pack("<Q", len(data) // 4))
            h.update(data)
            h.update(extras)
        else:
            h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
            h.update(data)
        prev = h.digest()
        out.append(prev)
    return out


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """One chunk of a request: tokens `[start, end)` and the key that names them."""

    start: int
    end: int
    key: CacheEngineKey

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class KeyNamespace:
    """The key fields shared by every chunk of one engine: model, world size, worker, dtype."""

    model_name: str
    world_size: int
    worker_id: int
    dtype: str

    def __post_init__(self) -> None:  # the checks every key of the namespace would repeat
        CacheEngineKey(self.model_name, self.world_size, self.worker_id, self.dtype, "0" * 32)

    def key(self, chunk_hash: bytes) -> CacheEngineKey:
        if len(chunk_hash) != HASH_BYTES:
            raise KeyFormatError(f"a chunk hash is {HASH_BYTES} bytes, got {len(chunk_hash)}")
        return CacheEngineKey.of_valid(
            self.model_name, self.world_size, self.worker_id, self.dtype, chunk_hash.hex()
        )


def skip_prefix(mask: Any, num_tokens: int, chunk_size: int) -> int:
    """How many leading tokens `mask` excludes (its False prefix); validates the mask."""
    if mask is None:
        return 0
    m = torch.as_tensor(mask).detach().to("cpu")
    if m.dtype != torch.bool or m.ndim != 1 or m.numel() != num_tokens:
        raise ValueError(
            f"mask must be a 1-D bool tensor of {num_tokens} entries, got "
            f"{m.dtype} {tuple(m.shape)}"
        )
    true_idx = torch.nonzero(m)
    skip = int(true_idx[0]) if true_idx.numel() else num_tokens
    if not bool(m[skip:].all()):
        raise ValueError("mask must be False for a prefix and True after it")
    if skip % chunk_size:
        raise ValueError(f"mask's False prefix ({skip}) must be a multiple of chunk_size")
    return skip


class TokenDatabase:
    """Cuts a request into chunks and names each one (one engine's namespace)."""

    def __init__(self, namespace: KeyNamespace, chunk_size: int, save_unfull_chunk: bool) -> None:
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk

    def chunks(
        self,
        tokens: Any,
        mask: Any = None,
        cache_salt: str | RequestIdentity | None = None,
        *,
        for_store: bool = False,
    ) -> list[ChunkSpec]:
        """The chunks inside the mask's True part, in order.

        For a store the last partial chunk is included only with `save_unfull_chunk`; for a
        retrieve or lookup it always is (another engine may have saved it).
        """
        arr = tokens_to_array(tokens)
        n = len(arr)
        skip = skip_prefix(mask, n, self.chunk_size)
        partial = self.save_unfull_chunk or not for_store
        hashes = chunk_hashes(arr, self.chunk_size, cache_salt, partial=partial)
        specs = []
        for i, digest in enumerate(hashes):
            start = i * self.chunk_size
            if start >= skip:
                end = min(start + self.chunk_size, n)
                specs.append(ChunkSpec(start, end, self.namespace.key(digest)))
        return specs

    def prefix_keys(self, tokens: Any,
                    cache_salt: str | RequestIdentity | None = None) -> list[ChunkSpec]:
        """Every chunk of `tokens` from the start (lookup has no mask)."""
        return self.chunks(tokens, None, cache_salt, for_store=False)
