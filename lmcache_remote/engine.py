"""CacheEngine: the library's front door for inference engines.

Who calls what, and what each call promises:

- `store(tokens, kv, mask=None, *, cache_salt=None) -> int`: cut the masked tokens into chunks,
  skip those already held (one Redis round trip to ask), copy the rest out of `kv` in one
  batch into CPU memory objects, keep them in the local tier and hand them to Redis (through
  the write-behind queue with `store_async`). Returns the number of tokens, in the masked
  range, whose chunks the cache now holds or has queued: a prefix, cut where memory ran out.
  Never raises for a remote failure (a dropped write, counted); raises `ValueError` for bad
  input (tokens, mask, a KV view that does not match the metadata).
- `retrieve(tokens, kv, mask=None, *, cache_salt=None) -> torch.Tensor`: a bool tensor of
  `len(tokens)`, True where KV was written into `kv`: always a prefix of the masked range,
  ending at the first chunk that is missing or fails a check. Tokens not reported as hits are
  never written. A remote failure is a miss.
- `lookup(tokens, *, cache_salt=None) -> int`: leading tokens retrievable now.
- `flush()`: wait (bounded) until queued Redis writes landed or were dropped.
- `freeze(True)`: no stores (each `store` returns 0) while reads go on; `freeze(False)` ends it.
- `stats()`: counters and gauges as plain dicts.
- `close()` (or leaving the `with` block): flush, stop the writer thread, free memory.

Thread safety: every method may be called from several threads at once; the tiers, the pool
and the counters are locked internally and a store and a retrieve of the same chunk never see
half a chunk (a chunk's buffer is filled before it is published to any tier).

The engine starts while Redis is down: redis-py connects lazily, and a failed call only opens
the health gate's back-off, after which the next call probes Redis again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from types import TracebackType
from typing import Any

import torch

from lmcache_remote.config import CacheConfig
from lmcache_remote.connectors import KVView
from lmcache_remote.hashing import ChunkSpec, KeyNamespace, TokenDatabase, tokens_to_array
from lmcache_remote.memory import ChunkLayout, MemoryObj
from lmcache_remote.metrics import Metrics
from lmcache_remote.serde import dtype_name
from lmcache_remote.storage.manager import StorageManager

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineMetadata:
    """What the engine is: its model, its rank, and its KV geometry."""

    model_name: str
    world_size: int
    worker_id: int
    kv_dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_size: int
    use_mla: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kv_dtype, torch.dtype):
            raise ValueError(f"kv_dtype must be a torch.dtype, got {self.kv_dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_size", "world_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.worker_id < self.world_size:
            raise ValueError("need 0 <= worker_id < world_size")

    @property
    def layout(self) -> ChunkLayout:
        planes = 1 if self.use_mla else 2
        heads = 1 if self.use_mla else self.num_kv_heads
        return ChunkLayout(self.num_layers, heads, self.head_size, self.kv_dtype, planes)

    @property
    def namespace(self) -> KeyNamespace:
        return KeyNamespace(
            self.model_name, self.world_size, self.worker_id, dtype_name(self.kv_dtype)
        )


class CacheEngine:
    """Stores and retrieves chunks of KV for one engine rank. Thread-safe."""

    def __init__(self, config: CacheConfig, metadata: EngineMetadata) -> None:
        self.config = config
        self.metadata = metadata
        self.layout = metadata.layout
        self.metrics = Metrics()
        self.token_db = TokenDatabase(
            metadata.namespace, config.chunk_size, config.save_unfull_chunk
        )
        self.storage = StorageManager(config, self.layout, self.metrics)
        self._frozen = False
        self._closed = False
        self._close_lock = threading.Lock()

    # -- context manager --------------------------------------------------------------------

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- public API -------------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        return self._frozen

    def freeze(self, enabled: bool = True) -> None:
        """While frozen, `store` stores nothing (returns 0); reads are served as usual."""
        self._frozen = enabled

    def lookup(self, tokens: Any, *, cache_salt: str | None = None) -> int:
        start = time.perf_counter()
        specs = self.token_db.prefix_keys(tokens, cache_salt)
        hits = self.storage.lookup(specs)
        hit_tokens = specs[hits - 1].end if hits else 0
        self.metrics.inc("engine.lookup_requests")
        self.metrics.inc("engine.lookup_tokens", specs[-1].end if specs else 0)
        self.metrics.inc("engine.lookup_hit_tokens", hit_tokens)
        self.metrics.inc("engine.lookup_seconds", time.perf_counter() - start)
        return hit_tokens

    def store(
        self, tokens: Any, kv: KVView, mask: Any = None, *, cache_salt: str | None = None
    ) -> int:
        start = time.perf_counter()
        specs = self.token_db.chunks(tokens, mask, cache_salt, for_store=True)
        self.metrics.inc("engine.store_requests")
        if not specs:
            return 0
        if self._frozen:
            self.metrics.inc("engine.frozen_skipped_tokens", specs[-1].end - specs[0].start)
            return 0
        self._check_view(kv)
        accepted = self._store_specs(specs, kv)
        self.metrics.inc("engine.store_tokens", specs[-1].end - specs[0].start)
        self.metrics.inc("engine.stored_tokens", accepted)
        self.metrics.inc("engine.store_seconds", time.perf_counter() - start)
        return accepted

    def retrieve(
        self, tokens: Any, kv: KVView, mask: Any = None, *, cache_salt: str | None = None
    ) -> torch.Tensor:
        start = time.perf_counter()
        arr = tokens_to_array(tokens)
        specs = self.token_db.chunks(arr, mask, cache_salt, for_store=False)
        ret = torch.zeros(len(arr), dtype=torch.bool)
        self.metrics.inc("engine.retrieve_requests")
        if not specs:
            return ret
        self._check_view(kv)
        objs = self.storage.fetch(specs)
        try:
            hit = specs[: len(objs)]
            if hit:
                kv.scatter([(s.start, s.end) for s in hit], [o.tensor for o in objs])
                ret[hit[0].start: hit[-1].end] = True
        finally:
            for obj in objs:
                obj.release()
        hit_tokens = hit[-1].end - hit[0].start if hit else 0
        self.metrics.inc("engine.retrieve_tokens", specs[-1].end - specs[0].start)
        self.metrics.inc("engine.retrieved_tokens", hit_tokens)
        self.metrics.inc("engine.retrieve_seconds", time.perf_counter() - start)
        return ret

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued Redis writes landed or were dropped; False if the bound ran out."""
        return self.storage.flush(timeout)

    def stats(self) -> dict[str, Any]:
        snap = self.metrics.snapshot()
        for scope, values in self.storage.gauges().items():
            snap.setdefault(scope, {}).update(values)
        snap.setdefault("engine", {})["frozen"] = self._frozen
        return snap

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.storage.close()

    # -- internals --------------------------------------------------------------------------

    def _check_view(self, kv: KVView) -> None:
        if not isinstance(kv, KVView):
            raise ValueError(f"kv must be a PagedKV or DenseKV, got {type(kv).__name__}")
        want = self.layout
        got = (kv.num_layers, kv.kv_planes, kv.num_kv_heads, kv.head_size, kv.dtype)
        expected = (want.num_layers, want.kv_planes, want.num_kv_heads, want.head_size, want.dtype)
        if got != expected:
            raise ValueError(
                "KV view does not match the engine metadata: (layers, planes, heads, head_size,"
                f" dtype) {got} != {expected}"
            )

    def _store_specs(self, specs: list[ChunkSpec], kv: KVView) -> int:
        plan = self.storage.plan_store(specs)
        sources: list[MemoryObj | None] = []
        copies: list[int] = []
        try:
            for i, spec in enumerate(specs):
                src = plan.local_objs[i]
                plan.local_objs[i] = None  # ownership moves to `sources`
                if src is None and plan.needs_write(i):
                    src = self.storage.allocate(spec.num_tokens)
                    if src is None:
                        self.metrics.inc("engine.store_out_of_memory_chunks", len(specs) - i)
                        break
                    copies.append(i)
                sources.append(src)
            if copies:
                kv.gather(
                    [(specs[i].start, specs[i].end) for i in copies],
                    [_tensor(sources[i]) for i in copies],
                )
            idx = [i for i, o in enumerate(sources) if o is not None]
            remote_ok = self.storage.write(
                [specs[i].key for i in idx], [_obj(sources[i]) for i in idx],
                [plan.need_local[i] for i in idx], [plan.need_remote[i] for i in idx],
            )
        finally:
            for obj in sources + plan.local_objs:
                if obj is not None:
                    obj.release()
        held = 0
        for i in range(len(sources)):
            local_held = sources[i] is not None and self.storage.local is not None
            remote_held = plan.remote_has[i] or (plan.need_remote[i] and remote_ok)
            if not (local_held or remote_held):
                break
            held = i + 1
        return specs[held - 1].end - specs[0].start if held else 0


def _obj(obj: MemoryObj | None) -> MemoryObj:
    assert obj is not None
    return obj


def _tensor(obj: MemoryObj | None) -> torch.Tensor:
    return _obj(obj).tensor
