"""KeepBook: the keep policy's state in Redis, and the calls that read and change it.

Who calls what (each engine process that talks to Redis holds one, when `keep_policy` is
`learned`):

- `note_hits(specs, full_chunks)`: a lookup promised these leading chunks (a hit). Queued,
  no I/O: sent by the book's thread (or, `inline`, by the caller at most once per interval)
  as one `scripts.ACCESS`, which learns from the hit and rescores the chunks. Nothing on the
  lookup path waits for Redis.
- `plan(specs, remote_has, full_chunks)`: a store asks which of the chunks Redis lacks to
  write (`policy.admit`). One round trip on the keep slot (each chunk's meta, the bytes held,
  now and then the figures), on the store's path, never the lookup's. The chunks refused
  are remembered (ghosts) by the next flush; the admitted ones wait for `landed`.
- `landed(keys, objs, landed)`: the writer's word on a put: the chunks that landed are held
  from now on (indexed, their bytes counted), the others remembered as ghosts; then, in the
  writer's thread, `flush`, which evicts what passed the budget.
- `flush()`: sends what is queued, then, while the bytes held pass the budget, pops the
  lowest scores (`scripts.EVICT`) and drops each chunk whole (`scripts.DROP`, one command
  per chunk on its own slot: every value at once, or none when the chunk is pinned).

The budget: `keep_budget`, or `keep_fill` of `maxmemory` measured against `used_memory`
(INFO, read again after `INFO_SECONDS`, or once the bytes held and the keep state may
have moved by `INFO_SHARE` of the line): the bytes held may grow by what the server has
free under the fill line, so what Redis spends on anything else (keys, the keep state itself,
pages) is taken off. With neither a budget nor a `maxmemory` nothing is evicted (the server
grows; `lmcache-remote ping` warns). Every failure is a counted, logged hint lost
(`keep.errors`): the policy never fails a store or a lookup.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_remote.config import GIB, CacheConfig
from lmcache_remote.errors import BackendError
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey, keep_key
from lmcache_remote.storage.keep import policy, scripts
from lmcache_remote.storage.local.memory import MemoryObj
from lmcache_remote.storage.session.channel import Channel, failed
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger
from lmcache_remote.values.sizing import ALLOC_OVERHEAD, VALUE_OVERHEAD, stored_bound

logger = logging.getLogger(__name__)

#: Seconds between reads of the learned figures (and writes of the horizons from them).
FIGURES_SECONDS = 1.0
#: Seconds between reads of the server's memory (INFO) for the budget.
INFO_SECONDS = 0.5
#: The share of the fill line the bytes held may move by before the server's memory is read
#: again, however soon.
INFO_SHARE = 1 / 64
#: What one chunk's entry in the keep state costs the server, about (its member in a sorted
#: set and in the meta hash, and the meta): what a burst of ghosts adds to its memory.
STATE_COST = 256
#: Seconds between flushes of queued hits and ghosts by the book's thread.
FLUSH_SECONDS = 0.2
#: Accesses per `scripts.ACCESS` call.
PER_CALL = 256
#: Chunks one `scripts.EVICT` call pops at most (the flush calls it again while over).
EVICT_BATCH = 256
#: Chunks admitted and not yet landed, remembered at most (the oldest forgotten).
PENDING_MAX = 65536
#: Queued accesses kept at most while Redis does not answer (the oldest dropped).
QUEUE_MAX = 65536


def chunk_cost(nbytes: int, parts: int) -> int:
    """What a chunk of ``nbytes`` raw bytes in ``parts`` values costs Redis, about."""
    return stored_bound(nbytes) + parts * (VALUE_OVERHEAD + ALLOC_OVERHEAD)


class KeepBook:
    """See the module doc. Thread-safe. ``parts``: the value count of a chunk of n raw bytes
    (the tier's part plan); ``chunk_nbytes``: a full chunk's raw bytes."""

    def __init__(self, config: CacheConfig, channel: Channel, metrics: Metrics,
                 log: RateLimitedLogger, parts: Callable[[int], int], chunk_nbytes: int,
                 inline: bool = False) -> None:
        self.config = config
        self.prefix = config.key_prefix
        self.channel = channel
        self.metrics = metrics
        self.log = log
        self.parts = parts
        self.chunk_nbytes = chunk_nbytes
        self.inline = inline
        self.keys = [keep_key(self.prefix, p) for p in ("index", "meta", "ghosts", "figures")]
        self.pins_by_expiry = config.remote_ttl is not None
        self.figures = policy.KeepFigures()
        self._figures_at = -math.inf
        self._horizons: dict[int, float] = {}
        self._horizons_due = False
        self._budget: float = math.inf if config.keep_budget is None else (
            config.keep_budget * GIB)
        self._target = self._budget
        self._info_at = -math.inf
        self._held_at_info = 0
        #: what the keep state itself may have grown by since (ghosts and meta sent)
        self._state_since_info = 0
        self._line = 0.0
        self._held = 0
        #: bytes of chunks admitted by this process's plans and not landed yet
        self._reserved = 0
        self._lock = threading.Lock()
        self._queue: list[tuple[str, str, str, int, int, str]] = []
        self._pending: collections.OrderedDict[str, tuple[int, str, int]] = (
            collections.OrderedDict())
        self._flush_lock = threading.Lock()
        self._flushed_at = time.monotonic()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- names ------------------------------------------------------------------------------

    def member(self, key: CacheEngineKey) -> str:
        """A chunk's member in the keep keys: its chunk key without the prefix."""
        return key.redis_key(self.prefix)[len(self.prefix) + 1:]

    def value_keys(self, member: str, parts: int) -> list[str]:
        base = f"{self.prefix}:{member}"
        return [base] + [f"{base}#{i}" for i in range(1, max(1, parts))]

    @property
    def ghost_max(self) -> int:
        basis = self._target if math.isfinite(self._target) else self._held
        held = max(1, int(basis // max(1, chunk_cost(self.chunk_nbytes, 1))))
        return max(policy.MIN_GHOSTS, int(policy.GHOST_FACTOR * held))

    # -- hits --------------------------------------------------------------------------------

    def note_hits(self, specs: Sequence[ChunkSpec], full_chunks: int) -> None:
        """The leading chunks a lookup promised (see the module doc); no I/O (but inline).
        ``specs`` may hold several runs (the vLLM scheduler's namespaces one after another):
        a chunk's parent is the one before it in its own run."""
        if not specs:
            return
        size = self.config.chunk_size
        depth = max(spec.end for spec in specs) // size
        entries = []
        parent, parent_end = "", -1
        for spec in specs:
            index = spec.start // size
            member = self.member(spec.key)
            klass = policy.chunk_class(index, max(full_chunks, depth), depth, True)
            entries.append((member, str(klass), "h", 0, 0,
                            parent if spec.start == parent_end else ""))
            parent, parent_end = member, spec.end
        self._enqueue(entries)
        if self.inline and time.monotonic() - self._flushed_at >= FLUSH_SECONDS:
            self.flush()

    # -- stores ------------------------------------------------------------------------------

    def plan(self, specs: Sequence[ChunkSpec], remote_has: Sequence[bool],
             full_chunks: int) -> list[bool]:
        """Per chunk, whether the store may write it to Redis (True where Redis has it). On a
        failure to ask, every chunk is admitted (what `keep_policy: redis` does)."""
        missing = [i for i, has in enumerate(remote_has) if not has]
        admitted = [True] * len(specs)
        if not missing:
            return admitted
        members = [self.member(specs[i].key) for i in missing]
        try:
            metas, room = self._read(members)
        except BackendError as exc:
            self._failed("plan", exc)
            return admitted
        size = self.config.chunk_size
        known = {i for i, has in enumerate(remote_has) if has}
        known.update(i for i, meta in zip(missing, metas, strict=True) if meta is not None)
        first = specs[0].start // size
        depth = first
        for i in range(len(specs)):
            if i not in known:
                break
            depth = first + i + 1
        classes = [policy.chunk_class(specs[i].start // size, full_chunks, depth,
                                      meta is not None)
                   for i, meta in zip(missing, metas, strict=True)]
        refused = []
        with self._lock:
            cost = chunk_cost(self.chunk_nbytes, self.parts(self.chunk_nbytes))
            free = len(missing) if not math.isfinite(room) else max(
                0, int((room - self._reserved) // max(1, cost)))
            take = policy.admit(classes, self.figures, free)
            for n, (i, member, klass) in enumerate(zip(missing, members, classes, strict=True)):
                parent = self.member(specs[i - 1].key) if i > 0 else ""
                if n < take:
                    if member not in self._pending:
                        self._reserved += cost
                    self._pending[member] = (klass, parent, cost)
                    self._pending.move_to_end(member)
                    while len(self._pending) > PENDING_MAX:
                        _, old = self._pending.popitem(last=False)
                        self._reserved -= old[2]
                else:
                    admitted[i] = False
                    refused.append((member, str(klass), "g", 0, 0, parent))
        self.metrics.inc("keep.admitted_chunks", take)
        if refused:
            self.metrics.inc("keep.refused_chunks", len(refused))
            self._enqueue(refused)
        return admitted

    def _read(self, members: Sequence[str]) -> tuple[list[str | None], float]:
        """Each member's meta (None: neither held nor remembered), and the room left under
        the budget in bytes (inf: no budget); refreshes the figures when due."""
        index, meta, _, figures = self.keys
        commands: list[tuple[Any, ...]] = [("HMGET", meta, *members) if members else ("HLEN", meta),
                                           ("HGET", figures, "bytes")]
        now = time.monotonic()
        refresh = now - self._figures_at >= FIGURES_SECONDS
        if refresh:
            commands.append(("HGETALL", figures))
        replies = self.channel.run(commands, "keep", bulk=False, raise_on_error=False)
        for reply in replies:
            if failed(reply) or isinstance(reply, BaseException):
                raise BackendError(f"the keep state did not answer: {reply!r}")
        metas = [None if m is None else (m.decode() if isinstance(m, bytes) else str(m))
                 for m in (replies[0] if members else [])]
        held = int(replies[1] or 0)
        if refresh:
            self._take_figures(replies[2])
        self._held = held
        self._refresh_target()
        return metas, self._target - held

    def _take_figures(self, fields: Any) -> None:
        if isinstance(fields, list):  # a flat reply: field, value, ...
            fields = dict(zip(fields[::2], fields[1::2], strict=False))
        decoded = {}
        for k, v in dict(fields or {}).items():
            name = k.decode() if isinstance(k, bytes) else str(k)
            try:
                decoded[name] = float(v)
            except (TypeError, ValueError):
                continue
        figures = policy.KeepFigures.from_fields(decoded)
        horizons = figures.horizons()
        overall = figures.horizon_ms(policy.ALL)
        if overall is not None:
            horizons[policy.ALL] = overall
        with self._lock:
            self.figures = figures
            self._figures_at = time.monotonic()
            changed = {c: h for c, h in horizons.items()
                       if abs(self._horizons.get(c, -1.0) - h) > 0.5}
            self._horizons.update(horizons)
            self._horizons_due = self._horizons_due or bool(changed)

    def landed(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj],
               landed: Sequence[bool]) -> None:
        """The writer's word on a put (see the module doc), then a flush in this thread."""
        entries = []
        with self._lock:
            for key, obj, ok in zip(keys, objs, landed, strict=True):
                member = self.member(key)
                planned = self._pending.pop(member, None)
                parts = self.parts(obj.nbytes)
                cost = chunk_cost(obj.nbytes, parts)
                if planned is None:
                    if ok:
                        entries.append((member, str(policy.chunk_class(0, 1, 0, False)), "A",
                                        cost, parts, ""))
                    continue
                klass, parent, reserved = planned
                self._reserved -= reserved
                entries.append((member, str(klass), "a" if ok else "g", cost if ok else 0,
                                parts if ok else 0, parent))
        self._enqueue(entries)
        self.flush()

    def make_room(self, objs: Sequence[MemoryObj]) -> None:
        """Before a put: sends what is queued (the scores it carries decide what goes), then
        evicts what the bytes held plus these chunks' would take past the budget, so that
        the put lands under it (the writer's thread; a failure is a hint lost)."""
        need = sum(chunk_cost(o.nbytes, self.parts(o.nbytes)) for o in objs)
        self.flush(need)

    def refresh(self) -> None:
        """Reads the learned figures (and the server's memory) now, not when next due."""
        with self._lock:
            self._figures_at = self._info_at = -math.inf
        try:
            self._read([])
        except BackendError as exc:
            self._failed("refresh", exc)

    # -- sending -------------------------------------------------------------------------------

    def _enqueue(self, entries: Sequence[tuple[str, str, str, int, int, str]]) -> None:
        if not entries:
            return
        with self._cond:
            if self._closed:
                return
            self._queue.extend(entries)
            if len(self._queue) > QUEUE_MAX:
                dropped = len(self._queue) - QUEUE_MAX
                del self._queue[:dropped]
                self.metrics.inc("keep.dropped_notes", dropped)
            if not self.inline and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmcr-keep",
                                                daemon=True)
                self._thread.start()

    def flush(self, need: int = 0) -> None:
        """Sends what is queued, then evicts down to the budget less ``need`` bytes (the
        module doc). A failure is counted and logged; what it carried is lost (a hint)."""
        with self._flush_lock:
            with self._lock:
                entries, self._queue = self._queue, []
                horizons = dict(self._horizons) if self._horizons_due else {}
                self._horizons_due = False
                self._flushed_at = time.monotonic()
            try:
                if entries:  # room for what the entries add to the keep state first
                    self._evict(STATE_COST * len(entries))
                self._send(entries, horizons)
                self._evict(need)
            except BackendError as exc:
                self._failed("flush", exc)

    def _send(self, entries: Sequence[tuple[str, str, str, int, int, str]],
              horizons: dict[int, float]) -> None:
        figures = self.keys[3]
        commands: list[tuple[Any, ...]] = []
        if horizons:
            commands.append(("HSET", figures, *(x for c, h in sorted(horizons.items())
                                                for x in (f"h:{c}", int(h)))))
        ghost_max = self.ghost_max
        for start in range(0, len(entries), PER_CALL):
            batch = entries[start:start + PER_CALL]
            commands.append(("EVAL", scripts.ACCESS, 4, *self.keys, ghost_max,
                             *(x for entry in batch for x in entry)))
        if not commands:
            return
        replies = self.channel.run(commands, "keep", bulk=False, raise_on_error=False)
        for reply in replies:
            if failed(reply) or isinstance(reply, BaseException):
                raise BackendError(f"the keep state did not take an update: {reply!r}")
        if entries:
            self._held = int(replies[-1] or 0)
            self._state_since_info += STATE_COST * len(entries)

    def _refresh_target(self) -> None:
        """The byte target from the budget or from the server's memory, read again when
        `INFO_SECONDS` passed or the bytes held moved by `INFO_SHARE` of the line since (a
        burst of writes outruns any clock)."""
        if self.config.keep_budget is not None:
            self._target = self._budget
            return
        now = time.monotonic()
        moved = abs(self._held - self._held_at_info) + self._state_since_info
        if now - self._info_at < INFO_SECONDS and (
                self._line <= 0 or moved < INFO_SHARE * self._line):
            return
        headroom, limit = self._memory()
        self._info_at = now
        self._held_at_info = self._held
        self._state_since_info = 0
        self._line = self.config.keep_fill * limit
        if limit <= 0:
            self._target = math.inf
            return
        self._target = self._held + headroom

    def _memory(self) -> tuple[float, int]:
        """(the bytes the chunks held may still grow by, the `maxmemory` summed over the
        server's primaries), from INFO: under `keep_fill` of `maxmemory`, on a cluster the
        tightest primary's headroom times the primaries (chunks spread evenly over them,
        the keep state sits on one); (0, 0) where some primary has no `maxmemory`."""
        client = self.channel.redis_client()
        infos: Any
        if hasattr(client, "get_primaries"):  # a cluster: every primary's
            infos = self.channel.caller.call(
                lambda: client.info("memory", target_nodes=client.PRIMARIES))
            values = list(infos.values()) if isinstance(infos, dict) and all(
                isinstance(v, dict) for v in infos.values()) else [infos]
        else:
            values = [self.channel.caller.call(lambda: client.info("memory"))]
        limits = [int(v.get("maxmemory", 0)) for v in values]
        if not limits or min(limits) <= 0:
            return 0.0, 0
        rooms = [self.config.keep_fill * limit - int(v.get("used_memory", 0))
                 for v, limit in zip(values, limits, strict=True)]
        return len(values) * min(rooms), sum(limits)

    def _evict(self, need: int = 0) -> None:
        """Pops and drops the lowest scores while the bytes held plus ``need`` pass the
        target."""
        self._refresh_target()
        rounds = 0
        while self._held + need > self._target and rounds < 64:
            rounds += 1
            index, meta, ghosts, figures = self.keys
            reply = self.channel.run([("EVAL", scripts.EVICT, 4, index, meta, ghosts, figures,
                                       int(max(0, self._target - need)), EVICT_BATCH,
                                       self.ghost_max)], "keep", bulk=False,
                                     raise_on_error=False)[0]
            if failed(reply) or isinstance(reply, BaseException):
                raise BackendError(f"the keep eviction failed: {reply!r}")
            victims = [(m.decode() if isinstance(m, bytes) else str(m), int(p))
                       for m, p in zip(reply[::2], reply[1::2], strict=False)]
            if not victims:
                self._held = 0 if self._target > 0 else self._held
                break
            drops = [("EVAL", scripts.DROP, max(1, parts), *self.value_keys(member, parts),
                      "1" if self.pins_by_expiry else "0") for member, parts in victims]
            results = self.channel.run(drops, "keep", bulk=False, raise_on_error=False)
            dropped = sum(1 for r in results if not failed(r) and r == 1)
            self.metrics.inc("keep.evicted_chunks", dropped)
            if dropped < len(victims):
                self.metrics.inc("keep.pinned_kept_chunks", len(victims) - dropped)
            held = self.channel.run([("HGET", figures, "bytes")], "keep", bulk=False,
                                    raise_on_error=False)[0]
            self._held = 0 if failed(held) or held is None else int(held)
            if len(victims) < EVICT_BATCH:
                break

    def _failed(self, what: str, exc: BaseException) -> None:
        self.metrics.inc("keep.errors")
        self.log.warning(f"keep-{what}", "the keep policy's %s failed (a hint lost): %s",
                         what, exc)

    # -- life cycle ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed:
                    self._cond.wait(FLUSH_SECONDS)
                if self._closed:
                    return
            self.flush()

    def close(self) -> None:
        """Sends what is queued (bounded by the remote timeout), then stops the thread."""
        with self._cond:
            if self._closed:
                return
            thread = self._thread
        try:
            if self._queue:
                self.flush()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if thread is not None:
                thread.join()
