"""RedisTier: chunks in Redis/Valkey, pipelined, whole-or-absent, never served unchecked.

Layout (DESIGN.md, docs/value-format.md): a chunk is one value under its chunk key, or, when
its bytes pass `remote_part_size`, several values under the chunk key and `#1`, `#2`, ...,
written together by one MSET (atomic, and on one Cluster slot thanks to the hash tag). The
part count follows from the chunk's raw size, so every key of a chunk is known before any
round trip.

- `contains`: one pipeline of `EXISTS key part1 ...` per chunk; present = all parts there.
- `get`: pipelined GETs in windows of about `_WINDOW_BYTES`; each value is decoded and checked
  against the key (hash, dtype, shape, token count, every part's checksum). The first missing
  or bad chunk ends the run; a bad one is counted and deleted so nobody trips on it again.
- `put`: SET (one part) or MSET (several) per chunk, with PEXPIRE when `remote_ttl` is set.
- Every call goes through `RemoteCaller`: bounded by `remote_timeout`, one immediate retry on
  a broken connection, skipped at once while the health gate backs off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import CorruptEntryError
from lmcache_remote.hashing import ChunkSpec
from lmcache_remote.keys import CacheEngineKey
from lmcache_remote.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.metrics import Metrics, RateLimitedLogger
from lmcache_remote.serde import Serde
from lmcache_remote.storage.base import StorageTier
from lmcache_remote.storage.client import RemoteCaller, make_client
from lmcache_remote.storage.health import HealthGate

logger = logging.getLogger(__name__)
_WINDOW_BYTES = 256 * 1024 * 1024


class RedisTier(StorageTier):
    """The remote tier over one Redis/Valkey server. Thread-safe (redis-py's pool is)."""

    name = "remote"

    def __init__(
        self,
        config: CacheConfig,
        layout: ChunkLayout,
        pool: MemoryPool,
        metrics: Metrics,
        client: redis.Redis | None = None,
    ) -> None:
        self.config = config
        self.prefix = config.key_prefix
        self.layout = layout
        self.pool = pool
        self.metrics = metrics
        self.serde = Serde(config.serde, config.remote_part_size, config.serde_threads)
        self.client = client if client is not None else make_client(config)
        self.gate = HealthGate(config.unhealthy_backoff)
        self.caller = RemoteCaller(config.remote_timeout, self.gate)
        self._ttl_ms = None if config.remote_ttl is None else int(config.remote_ttl * 1000)
        self._log = RateLimitedLogger(logger)

    # -- keys -------------------------------------------------------------------------------

    def _nparts(self, num_tokens: int) -> int:
        return self.serde.part_count(self.layout.nbytes(num_tokens))

    def _keys(self, spec: ChunkSpec) -> list[str]:
        return spec.key.part_keys(self.prefix, self._nparts(spec.num_tokens))

    # -- contract ---------------------------------------------------------------------------

    def contains(self, specs: Sequence[ChunkSpec]) -> list[bool]:
        if not specs:
            return []
        key_lists = [self._keys(s) for s in specs]

        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for keys in key_lists:
                pipe.exists(*keys)
            return pipe.execute()

        counts = self.caller.call(op)
        return [int(c) == len(k) for c, k in zip(counts, key_lists, strict=True)]

    def get(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj]:
        out: list[MemoryObj] = []
        for window in self._windows(specs):
            values = self._fetch([self._keys(s) for s in window])
            for spec, vals in zip(window, values, strict=True):
                obj = self._decode(spec, vals)
                if obj is None:
                    return out
                out.append(obj)
        return out

    def put(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> int:
        batch: list[tuple[list[str], list[Any]]] = []
        size = 0
        written = 0
        for key, obj in zip(keys, objs, strict=True):
            num_tokens = obj.tensor.shape[2]
            values = self.serde.encode(obj.tensor, key.hash_bytes, num_tokens)
            batch.append((key.part_keys(self.prefix, len(values)), values))
            size += sum(len(memoryview(v)) for v in values)
            if size >= _WINDOW_BYTES:
                written += self._write(batch)
                batch, size = [], 0
        if batch:
            written += self._write(batch)
        return written

    def delete(self, keys: Sequence[CacheEngineKey]) -> int:
        if not keys:
            return 0
        full = self._nparts(self.config.chunk_size)
        names = [k for key in keys for k in key.part_keys(self.prefix, full)]
        heads = {key.redis_key(self.prefix) for key in keys}

        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.unlink(name)
            return pipe.execute()

        results = self.caller.call(op)
        return sum(int(r) for n, r in zip(names, results, strict=True) if n in heads)

    def close(self) -> None:
        self.serde.close()
        self.client.close()

    def ping(self) -> bool:
        """True if the server answers now (honours the health gate's back-off)."""
        return bool(self.caller.call(self.client.ping))

    # -- internals --------------------------------------------------------------------------

    def _windows(self, specs: Sequence[ChunkSpec]) -> Iterator[Sequence[ChunkSpec]]:
        start, size = 0, 0
        for i, spec in enumerate(specs):
            size += self.layout.nbytes(spec.num_tokens)
            if size >= _WINDOW_BYTES:
                yield specs[start:i + 1]
                start, size = i + 1, 0
        if start < len(specs):
            yield specs[start:]

    def _fetch(self, key_lists: Sequence[Sequence[str]]) -> list[list[bytes | None]]:
        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for keys in key_lists:
                for key in keys:
                    pipe.get(key)
            return pipe.execute()

        flat = self.caller.call(op)
        out, pos = [], 0
        for keys in key_lists:
            out.append(flat[pos:pos + len(keys)])
            pos += len(keys)
        return out

    def _write(self, batch: Sequence[tuple[list[str], list[Any]]]) -> int:
        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for keys, values in batch:
                if len(keys) == 1:
                    pipe.set(keys[0], values[0], px=self._ttl_ms)
                    continue
                pipe.mset(dict(zip(keys, values, strict=True)))
                if self._ttl_ms is not None:
                    for key in keys:
                        pipe.pexpire(key, self._ttl_ms)
            return pipe.execute()

        self.caller.call(op)
        nbytes = sum(len(memoryview(v)) for _, values in batch for v in values)
        self.metrics.inc("remote.written_chunks", len(batch))
        self.metrics.inc("remote.written_bytes", nbytes)
        return len(batch)

    def _decode(self, spec: ChunkSpec, values: list[bytes | None]) -> MemoryObj | None:
        """The checked chunk, or None (missing, bad, or no memory); bad values are deleted."""
        if values[0] is None:
            self.metrics.inc("remote.miss_chunks")
            return None
        try:
            header = self.serde.read_header(values[0])
            if header.num_tokens != spec.num_tokens:
                raise CorruptEntryError(
                    f"value holds {header.num_tokens} tokens, its key names {spec.num_tokens}"
                )
            if len(header.parts) != len(values):
                values = self._fetch([spec.key.part_keys(self.prefix, len(header.parts))])[0]
            if any(v is None for v in values):
                raise CorruptEntryError("a part of the chunk is missing")
            obj = self.pool.allocate(self.layout.shape(spec.num_tokens), self.layout.dtype)
            if obj is None:
                self.metrics.inc("remote.pool_full")
                return None
            try:
                self.serde.decode_into(
                    header, values, obj.tensor, spec.key.hash_bytes,
                    expected_shape=self.layout.shape(spec.num_tokens),
                    expected_dtype=self.layout.dtype,
                )
            except BaseException:
                obj.release()
                raise
        except CorruptEntryError as exc:
            self._drop_corrupt(spec, exc)
            return None
        self.metrics.inc("remote.hit_chunks")
        self.metrics.inc("remote.read_bytes", sum(len(v) for v in values if v is not None))
        return obj

    def _drop_corrupt(self, spec: ChunkSpec, exc: CorruptEntryError) -> None:
        self.metrics.inc("remote.corrupt_chunks")
        self._log.warning("corrupt", "dropping corrupt chunk %s: %s", spec.key.chunk_hash, exc)
        try:
            self.delete([spec.key])
        except Exception as err:  # a failed clean-up must not turn a miss into an error
            self._log.warning("corrupt-delete", "could not delete corrupt chunk: %s", err)
