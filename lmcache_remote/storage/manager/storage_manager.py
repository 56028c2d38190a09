"""StorageManager: the local CPU tier in front of Redis, and the write-behind queue.

What it promises the engine:

- `leading_chunks`/`fetch`: local tier first, then Redis for the chunks the local tier lacks,
  in one remote round trip (per window for fetch); a remote failure is a miss, counted. A
  Redis hit is kept in the local tier.
- `plan_store`: which chunks need writing where: local (absent locally) and remote (absent in
  Redis: one round trip to ask, so nothing Redis has is sent again). Under `store_after` > 1
  that round trip also counts the fleet's tries to store each chunk Redis lacks, and a chunk
  goes to neither tier until its count reaches `store_after` (docs/pins.md).
- `write`: local tier now; Redis through the write-behind queue (`store_async`,
  `write_behind.WriteBehindQueue`) or at once. The queue is bounded in bytes; when full, new
  writes are dropped and counted, never waited for. `flush()` drains it within a bounded time.
  A chunk already queued or being written is not queued (or written) again:
  `remote.duplicate_writes_skipped` counts those.
- `allocate`: a chunk buffer from the one memory budget (below), for a store's copy or a Redis
  read alike; None when the budget has no room even after eviction.

The memory budget (`max_local_cpu_size`, one `MemoryPool`) is shared by three holders:

- the write-behind queue: at most `store_queue_size`, and never more than half the budget
  (`queue_bytes`), so at least the other half is always left to reads and the local tier;
- buffers of reads in flight (a retrieve's chunks until they are copied into the engine's KV);
- the local tier: whatever the other two leave. It never refuses a load: an allocation that
  finds the pool full evicts local entries, least recently used first, exactly as many as the
  allocation needs (`LocalCPUTier.evict_for`), and only entries the tier alone holds (evicting
  one the queue or a read also holds frees nothing). When even that cannot make room, because
  the queue and reads in flight hold the rest, nothing is evicted, the load or store is cut
  short there, counted (`memory.no_room_chunks`) and logged (WARNING, rate-limited).

So `leading_chunks` can promise what `fetch` delivers: it never reports more leading chunks
than fit in the read share (`budget.read_share_bytes`: the budget less the queue's half), and
a full local tier never stops a read. The remote tier is the one `chunks.factory.make_remote_tier`
chooses for the configured URL.

Remote failures never leave this class as exceptions: they become misses and dropped writes,
counted in `remote.errors`, `remote.dropped_chunks` and logged (rate-limited); permission
errors also in `remote.permission_errors`, logged as errors (`note_remote_failure`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendError, BackendTimeoutError
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks.factory import make_remote_tier
from lmcache_remote.storage.local.cpu_tier import LocalCPUTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.storage.manager.budget import (
    queue_share_bytes,
    read_share_bytes,
    within_read_share,
)
from lmcache_remote.storage.manager.write_behind import (
    PendingWrites,
    WriteBehindQueue,
    note_remote_failure,
    num_tokens,
    put_remote,
    timed,
)
from lmcache_remote.storage.session.access import check_access
from lmcache_remote.storage.session.pins import PinRefused, Pins, PinTarget
from lmcache_remote.storage.wire.commands import ttl_ms
from lmcache_remote.telemetry.figures import LinkFigures
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

logger = logging.getLogger(__name__)
#: An allocation that finds the pool full evicts and tries again at most this often (another
#: thread may take the room an eviction made).
_ALLOCATE_TRIES = 3
#: Admission counts kept in this process at most (`AdmissionCounts`): about 100 bytes each.
_LOCAL_COUNTS = 65536


@dataclasses.dataclass
class StorePlan:
    """For each chunk of a store: whether the local tier and Redis need it."""

    need_local: list[bool]
    need_remote: list[bool]
    remote_has: list[bool]
    local_objs: list[MemoryObj | None]

    def needs_write(self, i: int) -> bool:
        return self.need_local[i] or self.need_remote[i]


def full_chunks(specs: Sequence[ChunkSpec], chunk_size: int) -> int:
    """The full chunks of the request these chunks are of (as far as they reach)."""
    return max((s.end for s in specs), default=0) // chunk_size


class StorageManager:
    """Local tier + Redis tier + write-behind queue, behind one small API for the engine."""

    def __init__(self, config: CacheConfig, layout: ChunkLayout, metrics: Metrics) -> None:
        self.config = config
        self.layout = layout
        self.metrics = metrics
        self.pool = MemoryPool(config.max_local_cpu_bytes)
        self.local = LocalCPUTier(metrics) if config.local_cpu else None
        self.remote = (
            make_remote_tier(config, layout, self.pool, metrics, allocate=self.allocate)
            if config.remote_url is not None
            else None
        )
        self.pending = PendingWrites()
        self.queue = (
            WriteBehindQueue(self.remote, self.queue_bytes, metrics, self.pending)
            if self.remote is not None and config.store_async
            else None
        )
        #: the link to Redis as this process measures it: round trips from lookups, throughput
        #: from reads (`telemetry.figures`; the load decision reads it)
        self.link = LinkFigures()
        self._log = RateLimitedLogger(logger)
        #: the fleet's pin registry (`storage.pins`): requests' retention, and sweeps
        self.pins = (Pins(self.remote.redis_client, config.key_prefix, config.pin_budget_bytes,
                          ttl_ms(config),
                          call=self.remote.caller.call)
                     if self.remote is not None else None)
        self._count_window_ms = int(config.store_after_window * 1000)
        self._counts = AdmissionCounts(config.store_after_window)

    # -- memory -------------------------------------------------------------------------------

    @property
    def queue_bytes(self) -> int:
        """The write-behind queue's share of the budget: `store_queue_size`, at most half."""
        return queue_share_bytes(self.config)

    @property
    def read_share_bytes(self) -> int:
        """What reads in flight can always get: the budget less the queue's share."""
        return read_share_bytes(self.config)

    def allocate(self, num_tokens: int) -> MemoryObj | None:
        """A chunk buffer of `num_tokens` tokens, evicting local entries if the pool is full
        (no more than needed, see the module doc); None, counted and logged, when the queue and
        reads in flight hold the room."""
        shape, size = self.layout.shape(num_tokens), self.layout.nbytes(num_tokens)
        for _ in range(_ALLOCATE_TRIES):
            obj = self.pool.allocate(shape, self.layout.dtype)
            if obj is not None:
                return obj
            need = self.pool.shortfall(size)
            if need > 0 and (self.local is None or self.local.evict_for(need) == 0):
                break
        self.metrics.inc("memory.no_room_chunks")
        self._log.warning(
            "no-room", "no memory for a %d-byte chunk: a load or store is cut short here "
            "(budget %d bytes: %d in use, %d held by the local tier, %d by the write-behind "
            "queue; the rest by reads in flight)", size, self.pool.max_bytes,
            self.pool.used_bytes, self.local.nbytes if self.local is not None else 0,
            self.queue.queued_bytes if self.queue is not None else 0)
        return None

    # -- reads --------------------------------------------------------------------------------

    def _remote_failed(self, what: str, exc: BackendError) -> None:
        note_remote_failure(self.metrics, self._log, what, exc,
                            "remote %s failed, treated as a miss: %s", what, exc)

    def local_prefix(self, specs: Sequence[ChunkSpec]) -> int:
        """How many leading chunks of `specs` the local tier holds now (no remote call)."""
        if self.local is None:
            return 0
        present = self.local.contains(specs)
        return next((i for i, p in enumerate(present) if not p), len(specs))

    def leading_chunks(self, specs: Sequence[ChunkSpec]) -> int:
        """How many leading chunks are retrievable now (local or remote)."""
        present = self.local.contains(specs) if self.local is not None else [False] * len(specs)
        first_missing = next((i for i, p in enumerate(present) if not p), len(specs))
        if first_missing < len(specs) and self.remote is not None:
            tail = zip(specs[first_missing:], present[first_missing:], strict=True)
            rest = [s for s, p in tail if not p]
            start = time.perf_counter()
            try:
                found = iter(timed(self.metrics, "remote.contains_seconds",
                                    self.remote.contains, rest))
                self.link.round_trip(time.perf_counter() - start)
            except BackendError as exc:
                self._remote_failed("lookup", exc)
                found = iter(())
            local_present = list(present)
            present[first_missing:] = [p or next(found, False) for p in present[first_missing:]]
        else:
            local_present = present
        hits = self._within_read_share(
            specs, next((i for i, p in enumerate(present) if not p), len(specs)))
        tokens = {True: 0, False: 0}  # hit tokens by tier (local or not), one count each
        for spec, is_local in zip(specs[:hits], local_present, strict=False):
            tokens[bool(is_local)] += spec.num_tokens
        for is_local, count in tokens.items():
            if count:
                self.metrics.inc(f"{'local' if is_local else 'remote'}.lookup_hit_tokens", count)
        if hits and self.remote is not None:  # promised: Redis's LRU must see them used
            self.remote.touch_later(specs[:hits], full_chunks(specs, self.config.chunk_size))
        return hits

    def _within_read_share(self, specs: Sequence[ChunkSpec], hits: int) -> int:
        """`hits`, or fewer: the leading chunks one fetch can hold at once (`read_share_bytes`);
        the tokens left out are counted in `engine.lookup_capped_tokens` and logged."""
        fit = within_read_share(specs, hits, self.layout, self.read_share_bytes, self.metrics,
                                "engine.lookup_capped_tokens")
        if fit < hits:
            self._log.warning(
                "lookup-cap", "a lookup found %d tokens but one retrieve can hold only %d "
                "of them in max_local_cpu_size (less the write-behind queue's share); "
                "raise max_local_cpu_size", specs[hits - 1].end - specs[0].start,
                specs[fit].start - specs[0].start)
        return fit

    def fetch(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj]:
        """The leading run of present, valid chunks; the caller releases each."""
        local = self.local.get_each(specs) if self.local is not None else [None] * len(specs)
        first_missing = next((i for i, o in enumerate(local) if o is None), len(specs))
        remote: list[MemoryObj] = []
        tail = zip(specs[first_missing:], local[first_missing:], strict=True)
        missing = [s for s, o in tail if o is None]
        if missing and self.remote is not None:
            start = time.perf_counter()
            try:
                remote = timed(self.metrics, "remote.get_seconds", self.remote.get, missing)
                self.link.transfer(sum(o.nbytes for o in remote), time.perf_counter() - start)
            except BackendError as exc:
                if isinstance(exc, BackendTimeoutError):
                    self.link.stalled(sum(self.layout.nbytes(s.num_tokens) for s in missing),
                                      time.perf_counter() - start)
                self._remote_failed("get", exc)
            if remote and self.local is not None:
                self.local.put([s.key for s in missing[: len(remote)]], remote)
        from_local = [o is not None for o in local]
        out = _merge_prefix(local, remote)
        self._count_hits(specs[: len(out)], from_local, out)
        if self.remote is not None:  # served here, unseen by Redis (its GETs saw the rest)
            served = [s for s, here in zip(specs[: len(out)], from_local, strict=False) if here]
            if served:
                self.remote.touch_later(served)
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
        """Which chunks need writing where (the module doc). Under `store_after` > 1 a chunk
        neither Redis nor the local tier holds is written to either only once the fleet has
        tried to store it that many times: Redis counts the tries in the same round trip that
        asks what it holds (`RemoteLookup.admit`); without Redis, or when it fails, this
        process counts them (`AdmissionCounts`). Chunks held back are counted in
        `store.not_admitted_chunks`."""
        n = len(specs)
        local_objs: list[MemoryObj | None] = (
            self.local.get_each(specs) if self.local is not None else [None] * n
        )
        need_local = [self.local is not None and o is None for o in local_objs]
        need_remote = [False] * n
        remote_has = [False] * n
        admitted: list[bool] | None = None
        after = self.config.store_after
        if self.remote is not None and n:
            try:
                if after > 1:
                    remote_has, tries = timed(self.metrics, "remote.contains_seconds",
                                              self.remote.admit, specs, self._count_window_ms)
                    admitted = [h or t >= after for h, t in zip(remote_has, tries, strict=True)]
                else:
                    remote_has = timed(self.metrics, "remote.contains_seconds",
                                       self.remote.contains, specs)
                need_remote = [not p for p in remote_has]
                if self.remote.keep is not None:  # the keep policy's admission (docs/keep.md)
                    kept = self.remote.keep.plan(specs, remote_has,
                                                 full_chunks(specs, self.config.chunk_size))
                    need_remote = [n and k for n, k in zip(need_remote, kept, strict=True)]
            except BackendError as exc:
                self.metrics.inc("remote.dropped_chunks", n)
                note_remote_failure(self.metrics, self._log, "plan", exc,
                                    "remote unavailable, writes dropped: %s", exc)
        if after > 1 and n:
            if admitted is None:  # no Redis to count with: this process counts
                admitted = [h or self._counts.tried(s.key) >= after
                            for s, h in zip(specs, remote_has, strict=True)]
            held = [i for i in range(n) if not admitted[i] and (need_local[i] or need_remote[i])]
            for i in held:
                need_local[i] = need_remote[i] = False
            if held:
                self.metrics.inc("store.not_admitted_chunks", len(held))
        return StorePlan(need_local, need_remote, remote_has, local_objs)

    def write(
        self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj],
        to_local: Sequence[bool], to_remote: Sequence[bool],
    ) -> list[bool]:
        """Store chunks where asked: local at once, Redis queued (or at once if synchronous).

        Returns, per chunk, whether its Redis write was accepted: queued, written, or already
        pending from another store; False where it was dropped (queue full, Redis failing) or
        not asked for.
        """
        if self.local is not None:
            picked = [(k, o) for k, o, w in zip(keys, objs, to_local, strict=True) if w]
            if picked:
                stored = self.local.put([k for k, _ in picked], [o for _, o in picked])
                self.metrics.inc("local.stored_chunks", stored)
                self.metrics.inc("local.stored_tokens", sum(num_tokens(o) for _, o in picked))
                self.metrics.inc("local.stored_bytes", sum(o.nbytes for _, o in picked))
        accepted = [False] * len(keys)
        if self.remote is None:
            return accepted
        wanted = [i for i, w in enumerate(to_remote) if w]
        claimed = self.pending.claim([keys[i] for i in wanted])
        mine = [i for i, c in zip(wanted, claimed, strict=True) if c]
        if len(mine) < len(wanted):
            self.metrics.inc("remote.duplicate_writes_skipped", len(wanted) - len(mine))
            for i, c in zip(wanted, claimed, strict=True):
                accepted[i] = not c  # already pending: it will land (or be dropped) once
        if not mine:
            return accepted
        rkeys, robjs = [keys[i] for i in mine], [objs[i] for i in mine]
        if self.queue is not None:
            queued = self.queue.submit(rkeys, robjs)
            landed = [n < queued for n in range(len(mine))]
        else:
            try:
                landed = put_remote(self.remote, self.metrics, self._log, rkeys, robjs)
            finally:
                self.pending.done(rkeys)
        for i, ok in zip(mine, landed, strict=True):
            accepted[i] = ok
        return accepted

    def retain(self, specs: Sequence[ChunkSpec], until: float | None) -> None:
        """Pin these chunks in Redis until the wall-clock time `until` (None: no end), after
        the writes queued before (on the writer thread with `store_async`, else now). A pin
        past the budget is refused, counted (`pins.refused_chunks`) and logged; nothing
        raises."""
        if self.pins is None or not specs:
            return
        remote, pins = self.remote, self.pins
        assert remote is not None
        targets = [PinTarget(remote.chunk_keys(s)[0], len(remote.chunk_keys(s)),
                             self.layout.nbytes(s.num_tokens)) for s in specs]

        def job() -> None:
            try:
                pins.pin(targets, until)
                self.metrics.inc("pins.pinned_chunks", len(targets))
            except PinRefused as exc:
                self.metrics.inc("pins.refused_chunks", len(targets))
                self._log.warning("pin-refused", "a pin was refused: %s", exc)
            except BackendError as exc:
                note_remote_failure(self.metrics, self._log, "pin", exc,
                                    "a pin failed: %s", exc)

        if self.queue is None or not self.queue.submit_job(job):
            job()

    def sweep_pins(self) -> int:
        """End the pins whose time has passed (`Pins.sweep`); how many ended (0 on failure,
        counted)."""
        if self.pins is None:
            return 0
        try:
            return self.pins.sweep()
        except BackendError as exc:
            note_remote_failure(self.metrics, self._log, "pin-sweep", exc,
                                "ending past pins failed: %s", exc)
            return 0

    def check_remote(self) -> None:
        """`storage.access.check_access` on the configured Redis (nothing without one), then
        the tier's own bulk path (`RedisTier.check_bulk`); on success the tier's health gate
        forgets past failures."""
        if self.remote is None:
            return
        if "touch" in check_access(self.config) and self.remote.toucher is not None:
            self.remote.stop_touching()
            self._log.warning(
                "acl-touch", "Redis refuses TOUCH to this user: the LRU refresh of chunks a "
                "lookup promises or the local tier serves is off (Redis may evict the hottest "
                "prefixes first); add +touch to the ACL user (docs/reliability.md), or set "
                "remote_lru_touch: false to say so")
        self.remote.check_bulk()
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


class AdmissionCounts:
    """Tries to store each chunk, counted in this process: `store_after` without Redis to
    count with (no remote tier, or one that failed the round trip). Each count lives
    `window` seconds from its first try, as Redis's do; at most `_LOCAL_COUNTS` are kept (the
    oldest forgotten first). Thread-safe."""

    def __init__(self, window: float) -> None:
        self._window = window
        self._first: collections.OrderedDict[CacheEngineKey, tuple[float, int]] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def tried(self, key: CacheEngineKey) -> int:
        """Counts one more try of `key`; the tries within the window, this one included."""
        now = time.monotonic()
        with self._lock:
            first, count = self._first.get(key, (now, 0))
            if now - first >= self._window:
                first, count = now, 0
            self._first[key] = (first, count + 1)
            self._first.move_to_end(key)
            while len(self._first) > _LOCAL_COUNTS:
                self._first.popitem(last=False)
            return count + 1


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

