"""StorageManager: the local CPU tier in front of Redis, and the write-behind queue.

What it promises the engine:

- `lookup`/`fetch`: local tier first, then Redis for the chunks the local tier lacks, in one
  remote round trip (per window for fetch); a remote failure is a miss, counted. A Redis hit
  is kept in the local tier.
- `plan_store`: which chunks need writing where: local (absent locally) and remote (absent in
  Redis: one round trip to ask, so nothing Redis has is sent again).
- `write`: local tier now; Redis through the write-behind queue (`store_async`) or at once.
  The queue is bounded in bytes; when full, new writes are dropped and counted, never waited
  for. `flush()` drains it within a bounded time.
- `allocate`: a chunk buffer from the pool, evicting least recently used local chunks to make
  room; None when even that cannot.

Remote failures never leave this class as exceptions: they become misses and dropped writes,
counted in `remote.errors`, `remote.dropped_chunks` and logged (rate-limited); permission
errors also in `remote.permission_errors`, logged as errors (`note_remote_failure`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendError, BackendPermissionError
from lmcache_remote.hashing import ChunkSpec
from lmcache_remote.keys import CacheEngineKey
from lmcache_remote.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.metrics import Metrics, RateLimitedLogger
from lmcache_remote.storage.access import check_access
from lmcache_remote.storage.cluster_tier import make_remote_tier
from lmcache_remote.storage.local_cpu import LocalCPUTier
from lmcache_remote.storage.redis_tier import RedisTier

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass
class StorePlan:
    """For each chunk of a store: whether the local tier and Redis need it."""

    need_local: list[bool]
    need_remote: list[bool]
    remote_has: list[bool]
    local_objs: list[MemoryObj | None]

    def needs_write(self, i: int) -> bool:
        return self.need_local[i] or self.need_remote[i]


class WriteBehindQueue:
    """A bounded (bytes) queue of chunk writes, drained into Redis by one daemon thread."""

    def __init__(self, remote: RedisTier, max_bytes: int, metrics: Metrics) -> None:
        self._remote = remote
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._items: deque[tuple[list[CacheEngineKey], list[MemoryObj], int]] = deque()
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._log = RateLimitedLogger(logger)
        self._thread = threading.Thread(target=self._run, name="lmcr-write-behind", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def submit(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> bool:
        """Queue the writes (taking references); False (dropped, counted) when full or closed."""
        nbytes = sum(o.nbytes for o in objs)
        with self._cond:
            if self._closed or self._bytes + nbytes > self._max_bytes:
                self._metrics.inc("remote.dropped_chunks", len(keys))
                self._metrics.inc("remote.queue_full_drops", len(keys))
                return False
            self._items.append((keys, [o.retain() for o in objs], nbytes))
            self._bytes += nbytes
            self._cond.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write reached Redis or was dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._items or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    @property
    def pending_items(self) -> int:
        return len(self._items) + int(self._busy)

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                keys, objs, nbytes = self._items.popleft()
                self._busy = True
            try:
                self._write(keys, objs)
            finally:
                for obj in objs:
                    obj.release()
                with self._cond:
                    self._bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> None:
        try:
            put_remote(self._remote, self._metrics, self._log, keys, objs)
        except Exception:  # the thread must survive anything one batch does
            self._metrics.inc("remote.errors")
            self._metrics.inc("remote.dropped_chunks", len(keys))
            logger.exception("unexpected error in the write-behind thread")


class StorageManager:
    """Local tier + Redis tier + write-behind queue, behind one small API for the engine."""

    def __init__(self, config: CacheConfig, layout: ChunkLayout, metrics: Metrics) -> None:
        self.config = config
        self.layout = layout
        self.metrics = metrics
        self.pool = MemoryPool(config.max_local_cpu_bytes)
        self.local = LocalCPUTier(metrics) if config.local_cpu else None
        self.remote = (
            make_remote_tier(config, layout, self.pool, metrics)
            if config.remote_url is not None
            else None
        )
        self.queue = (
            WriteBehindQueue(self.remote, config.store_queue_bytes, metrics)
            if self.remote is not None and config.store_async
            else None
        )
        self._log = RateLimitedLogger(logger)

    # -- memory -------------------------------------------------------------------------------

    def allocate(self, num_tokens: int) -> MemoryObj | None:
        shape = self.layout.shape(num_tokens)
        while True:
            obj = self.pool.allocate(shape, self.layout.dtype)
            if obj is not None or self.local is None or not self.local.evict_lru():
                return obj

    # -- reads --------------------------------------------------------------------------------

    def _remote_failed(self, what: str, exc: BackendError) -> None:
        note_remote_failure(self.metrics, self._log, what, exc,
                            "remote %s failed, treated as a miss: %s", what, exc)

    def lookup(self, specs: Sequence[ChunkSpec]) -> int:
        """How many leading chunks are retrievable now (local or remote)."""
        present = self.local.contains(specs) if self.local is not None else [False] * len(specs)
        first_missing = next((i for i, p in enumerate(present) if not p), len(specs))
        if first_missing < len(specs) and self.remote is not None:
            tail = zip(specs[first_missing:], present[first_missing:], strict=True)
            rest = [s for s, p in tail if not p]
            try:
                found = iter(_timed(self.metrics, "remote.contains_seconds",
                                    self.remote.contains, rest))
            except BackendError as exc:
                self._remote_failed("lookup", exc)
                found = iter(())
            local_present = list(present)
            present[first_missing:] = [p or next(found, False) for p in present[first_missing:]]
        else:
            local_present = present
        hits = next((i for i, p in enumerate(present) if not p), len(specs))
        for spec, is_local in zip(specs[:hits], local_present, strict=False):
            tier = "local" if is_local else "remote"
            self.metrics.inc(f"{tier}.lookup_hit_tokens", spec.num_tokens)
        return hits

    def fetch(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj]:
        """The leading run of present, valid chunks; the caller releases each."""
        local = self.local.get_each(specs) if self.local is not None else [None] * len(specs)
        first_missing = next((i for i, o in enumerate(local) if o is None), len(specs))
        remote: list[MemoryObj] = []
        tail = zip(specs[first_missing:], local[first_missing:], strict=True)
        missing = [s for s, o in tail if o is None]
        if missing and self.remote is not None:
            try:
                remote = _timed(self.metrics, "remote.get_seconds", self.remote.get, missing)
            except BackendError as exc:
                self._remote_failed("get", exc)
            if remote and self.local is not None:
                self.local.put([s.key for s in missing[: len(remote)]], remote)
        from_local = [o is not None for o in local]
        out = _merge_prefix(local, remote)
        self._count_hits(specs[: len(out)], from_local, out)
        return out

    def _count_hits(self, specs: Sequence[ChunkSpec], from_local: Sequence[bool],
                    objs: Sequence[MemoryObj]) -> None:
        """Per tier: `<tier>.hit_tokens` and `<tier>.hit_bytes` of the chunks a fetch served."""
        for spec, is_local, obj in zip(specs, from_local, objs, strict=False):
            tier = "local" if is_local else "remote"
            self.metrics.inc(f"{tier}.hit_tokens", spec.num_tokens)
            self.metrics.inc(f"{tier}.hit_bytes", obj.nbytes)

    # -- writes -------------------------------------------------------------------------------

    def plan_store(self, specs: Sequence[ChunkSpec]) -> StorePlan:
        n = len(specs)
        local_objs: list[MemoryObj | None] = (
            self.local.get_each(specs) if self.local is not None else [None] * n
        )
        need_local = [self.local is not None and o is None for o in local_objs]
        need_remote = [False] * n
        remote_has = [False] * n
        if self.remote is not None and n:
            try:
                remote_has = _timed(self.metrics, "remote.contains_seconds",
                                    self.remote.contains, specs)
                need_remote = [not p for p in remote_has]
            except BackendError as exc:
                self.metrics.inc("remote.dropped_chunks", n)
                note_remote_failure(self.metrics, self._log, "plan", exc,
                                    "remote unavailable, writes dropped: %s", exc)
        return StorePlan(need_local, need_remote, remote_has, local_objs)

    def write(
        self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj],
        to_local: Sequence[bool], to_remote: Sequence[bool],
    ) -> bool:
        """Store chunks where asked: local at once, Redis queued (or at once if synchronous).

        Returns whether the Redis writes were accepted (queued or written); False when they
        were dropped (queue full, Redis failing).
        """
        if self.local is not None:
            picked = [(k, o) for k, o, w in zip(keys, objs, to_local, strict=True) if w]
            if picked:
                stored = self.local.put([k for k, _ in picked], [o for _, o in picked])
                self.metrics.inc("local.stored_chunks", stored)
                self.metrics.inc("local.stored_tokens", sum(_num_tokens(o) for _, o in picked))
                self.metrics.inc("local.stored_bytes", sum(o.nbytes for _, o in picked))
        remote = [(k, o) for k, o, w in zip(keys, objs, to_remote, strict=True) if w]
        if not remote or self.remote is None:
            return True
        rkeys, robjs = [k for k, _ in remote], [o for _, o in remote]
        if self.queue is not None:
            return self.queue.submit(rkeys, robjs)
        return put_remote(self.remote, self.metrics, self._log, rkeys, robjs)

    def check_remote(self) -> None:
        """`storage.access.check_access` on the configured Redis (nothing without one); on
        success the tier's health gate forgets past failures."""
        if self.remote is None:
            return
        check_access(self.config)
        self.remote.gate.reset()

    def flush(self, timeout: float | None = None) -> bool:
        if self.queue is None:
            return True
        if timeout is None:
            timeout = self.config.remote_timeout * (self.queue.pending_items + 2)
        return self.queue.flush(timeout)

    # -- state --------------------------------------------------------------------------------

    def gauges(self) -> dict[str, dict[str, object]]:
        local: dict[str, object] = {
            "entries": len(self.local) if self.local is not None else 0,
            "bytes": self.local.nbytes if self.local is not None else 0,
        }
        remote: dict[str, object] = {
            "enabled": self.remote is not None,
            "healthy": self.remote is not None and self.remote.gate.healthy,
            "queued_bytes": self.queue.queued_bytes if self.queue is not None else 0,
        }
        pool: dict[str, object] = {
            "used_bytes": self.pool.used_bytes,
            "held_bytes": self.pool.held_bytes,
            "max_bytes": self.pool.max_bytes,
            "failed_allocations": self.pool.failed_allocations,
        }
        return {"local": local, "remote": remote, "pool": pool}

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close(self.config.remote_timeout * 4)
        if self.local is not None:
            self.local.close()
        if self.remote is not None:
            self.remote.close()
        self.pool.trim()


def note_remote_failure(metrics: Metrics, log: RateLimitedLogger, what: str, exc: BackendError,
                        msg: str, *args: object) -> None:
    """Count a remote failure in `remote.errors` and log it (rate-limited). A permission error
    (ACL NOPERM, wrong password) is also counted in `remote.permission_errors` and logged as an
    ERROR, every time it recurs (rate-limited): a misconfiguration must not pass as misses."""
    metrics.inc("remote.errors")
    if isinstance(exc, BackendPermissionError):
        metrics.inc("remote.permission_errors")
        log.error(f"{what}-permission", "Redis refused this client's rights (%s): " + msg,
                  "check the ACL user, see docs/reliability.md", *args)
    else:
        log.warning(what, msg, *args)


def put_remote(remote: RedisTier, metrics: Metrics, log: RateLimitedLogger,
               keys: list[CacheEngineKey], objs: list[MemoryObj]) -> bool:
    """Write chunks to Redis now, timed and counted; a failure is a counted, logged drop."""
    try:
        _timed(metrics, "remote.put_seconds", remote.put, keys, objs)
    except BackendError as exc:
        metrics.inc("remote.dropped_chunks", len(keys))
        note_remote_failure(metrics, log, "write", exc, "dropped %d chunk writes: %s",
                            len(keys), exc)
        return False
    metrics.inc("remote.stored_tokens", sum(_num_tokens(o) for o in objs))
    return True


def _timed(metrics: Metrics, name: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, its latency observed in the histogram `name` (failures included)."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        metrics.observe(name, time.perf_counter() - start)


def _num_tokens(obj: MemoryObj) -> int:
    """Tokens in a chunk buffer (canonical layout: [layers, planes, tokens, heads, head])."""
    return int(obj.tensor.shape[2])


def _merge_prefix(
    local: Sequence[MemoryObj | None], remote: Sequence[MemoryObj]
) -> list[MemoryObj]:
    """Walk the chunks in order, taking local hits and filling gaps from the remote run."""
    out: list[MemoryObj] = []
    it = iter(remote)
    cut = False
    for obj in local:
        if obj is None and not cut:
            obj = next(it, None)
            cut = obj is None
        if obj is None:
            continue
        if cut:
            obj.release()
        else:
            out.append(obj)
    for extra in it:
        extra.release()
    return out

