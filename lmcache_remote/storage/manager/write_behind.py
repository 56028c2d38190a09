"""The write-behind queue: chunk writes to Redis off the engine's thread, bounded in bytes.

What it promises (`StorageManager.write` uses it):

- `WriteBehindQueue.submit` queues the leading writes that fit in its byte bound (taking a
  reference to each buffer) and drops the rest at once, counted (`remote.dropped_chunks`,
  `remote.queue_full_drops`): a full queue is never waited for. One daemon thread drains it
  into Redis (`put_remote`); `flush` waits, bounded, until it is empty; `close` flushes, then
  cuts off a write still in flight (`RedisTier.stop_io`) and drops what is left.
- `submit_job` runs a job on the writer thread after the writes queued before it (a request's
  pins, once its chunks landed).
- `PendingWrites`: the chunk keys queued or being written now, so that no chunk is written
  twice at once (`remote.duplicate_writes_skipped`, counted by the manager).
- `put_remote` writes chunks now, timed (`remote.put_seconds`) and counted; a remote failure
  is a counted, logged drop, never an exception (`note_remote_failure`: `remote.errors`, and
  for an ACL or password refusal `remote.permission_errors`, logged as an ERROR).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lmcache_remote.errors import BackendError, BackendPermissionError
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import MemoryObj, leading_fit
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

logger = logging.getLogger(__name__)
T = TypeVar("T")


class PendingWrites:
    """The chunk keys queued for Redis or being written now, so none is written twice."""

    def __init__(self) -> None:
        self._keys: set[CacheEngineKey] = set()
        self._lock = threading.Lock()

    def claim(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """Per key, True when this caller now owns its write; False when one is pending."""
        with self._lock:
            out = [k not in self._keys for k in keys]
            self._keys.update(keys)
        return out

    def done(self, keys: Sequence[CacheEngineKey]) -> None:
        """The writes of `keys` landed or were dropped: the next store may write them again."""
        with self._lock:
            self._keys.difference_update(keys)


class WriteBehindQueue:
    """A bounded (bytes) queue of chunk writes, drained into Redis by one daemon thread.

    Every key it is handed must have been claimed in `pending`; the queue marks it done once its
    write landed or was dropped."""

    def __init__(self, remote: RedisTier, max_bytes: int, metrics: Metrics,
                 pending: PendingWrites) -> None:
        self._remote = remote
        self._max_bytes = max_bytes
        self._metrics = metrics
        self._pending = pending
        self._items: deque[tuple[list[CacheEngineKey], list[MemoryObj], int,
                                 Callable[[], None] | None]] = deque()
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

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def submit(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> int:
        """Queue the leading writes that fit in the bound (taking references); how many were
        queued. The others are dropped, counted, and their keys marked done."""
        with self._cond:
            room = 0 if self._closed else self._max_bytes - self._bytes
            fit = leading_fit((o.nbytes for o in objs), room)
            if fit:
                taken = objs[:fit]
                nbytes = sum(o.nbytes for o in taken)
                self._items.append((keys[:fit], [o.retain() for o in taken], nbytes, None))
                self._bytes += nbytes
                self._cond.notify_all()
        if fit < len(keys):
            self._metrics.inc("remote.dropped_chunks", len(keys) - fit)
            self._metrics.inc("remote.queue_full_drops", len(keys) - fit)
            self._pending.done(keys[fit:])
        return fit

    def submit_job(self, job: Callable[[], None]) -> bool:
        """Run `job` on the writer thread once the writes queued before it are done (a
        request's pins after its chunks landed); False when the queue is closed."""
        with self._cond:
            if self._closed:
                return False
            self._items.append(([], [], 0, job))
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
        """Flush for up to `timeout`, then stop. A write still in flight then (a paused or
        crawling server) is cut off (`RedisTier.stop_io`) and what is left queued is dropped:
        when this returns, the writer thread has ended and does no more I/O."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._remote.stop_io()  # the write in flight fails now, the rest is refused
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                keys, objs, nbytes, job = self._items.popleft()
                self._busy = True
            try:
                if job is not None:
                    self._run_job(job)
                else:
                    self._write(keys, objs)
            finally:
                self._pending.done(keys)
                for obj in objs:
                    obj.release()
                with self._cond:
                    self._bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _run_job(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # the thread must survive anything a job does
            self._metrics.inc("remote.errors")
            logger.exception("unexpected error in a write-behind job")

    def _write(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> None:
        try:
            put_remote(self._remote, self._metrics, self._log, keys, objs)
        except Exception:  # the thread must survive anything one batch does
            self._metrics.inc("remote.errors")
            self._metrics.inc("remote.dropped_chunks", len(keys))
            logger.exception("unexpected error in the write-behind thread")


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
               keys: list[CacheEngineKey], objs: list[MemoryObj]) -> list[bool]:
    """Write chunks to Redis now, timed and counted; per chunk, whether it landed. A failure
    is a counted, logged drop."""
    if remote.keep is not None:  # room under the keep budget first: no server eviction
        remote.keep.make_room(objs)
    try:
        landed = timed(metrics, "remote.put_seconds", remote.put_each, keys, objs)
    except BackendError as exc:
        metrics.inc("remote.dropped_chunks", len(keys))
        note_remote_failure(metrics, log, "write", exc, "dropped %d chunk writes: %s",
                            len(keys), exc)
        if remote.keep is not None:
            remote.keep.landed(keys, objs, [False] * len(keys))
        return [False] * len(keys)
    if not all(landed):
        metrics.inc("remote.dropped_chunks", landed.count(False))
    if remote.keep is not None:  # held from now on, or remembered; evicts past the budget
        remote.keep.landed(keys, objs, landed)
    metrics.inc("remote.stored_tokens",
                sum(num_tokens(o) for o, ok in zip(objs, landed, strict=True) if ok))
    return landed


def timed(metrics: Metrics, name: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, its latency observed in the histogram `name` (failures included)."""
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        metrics.observe(name, time.perf_counter() - start)


def num_tokens(obj: MemoryObj) -> int:
    """Tokens in a chunk buffer (canonical layout: [layers, planes, tokens, heads, head])."""
    return int(obj.tensor.shape[2])
