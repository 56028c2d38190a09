"""RedisTier: chunks in Redis/Valkey, pipelined, whole-or-absent, never served unchecked.

Layout (DESIGN.md, docs/value-format.md): a chunk is one value under its chunk key, or, when
its bytes pass `remote_part_size`, several values under the chunk key and `#1`, `#2`, ...,
written together by one command (atomic, and on one Cluster slot thanks to the hash tag). The
part count follows from the chunk's raw size, so every key of a chunk is known before any
round trip.

- `contains`: one pipeline of `EXISTS key part1 ...` per chunk; present = all parts there.
  A chunk with only some of its planned keys there may have been cut another way by another
  writer: for those chunks alone, its header's part count decides (two more round trips), so
  `contains` counts what `get` reads (one limit: a chunk cut into more parts than planned is
  counted by its planned keys; a later part of it evicted is found, and the chunk deleted, by
  the `get`; docs/value-format.md).
- `get`: pipelined GETs in windows of about `_WINDOW_BYTES`; each value is decoded and checked
  against the key (hash, dtype, shape, token count, every part's checksum). The first missing
  or bad chunk ends the run; a bad one is counted and deleted so nobody trips on it again.
  With an `integrity_key` every value is written with a MAC and a value is served only when
  its MAC verifies for the key it was read from (`_authenticate`); one without a MAC, or with
  one that does not verify, is a miss left in place (`remote.unauthenticated_chunks`).
- `put`: one command per chunk, so each chunk is written in one atomic step: SET (one part),
  MSET (several parts), or, when `remote_ttl` is set and there are several parts, an EVAL of
  `SET ... PX` per part (MSET takes no expiry, and MSET then PEXPIRE could leave parts without
  one if the connection broke in between). `chunk_write_command` builds it for every tier.
  On a single server a put's chunks go out in windows over up to `WRITE_LANES` connections
  at once (encoding, sending and the server's work overlap across windows); encoded bytes in
  flight stay within one `ByteBudget`, and a window that fails fails alone: its chunks are
  not counted as written, the others' are, and the error is raised when all are done.

Two transports carry the same commands. For a plain single-node `redis.Redis` the bulk
commands (EXISTS, GET, SET, MSET, EVAL) go through `wire.BulkPipeline` on redis-py's own
pooled connections: values leave as memoryviews of the chunk buffers (no packer copy) and GET
replies are received into the chunk's own memory when the value is stored raw, otherwise into
a reused arena. A Redis Cluster client runs the same commands per node (`cluster_tier`).
Either way a reply is used only after the whole batch arrived, and a broken batch is an error,
never a partial chunk.
- Every call goes through `RemoteCaller`: bounded by `remote_timeout`, one immediate retry on
  a broken connection, skipped at once while the health gate backs off.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from lmcache_remote.config import CacheConfig
from lmcache_remote.cpus import available_cpus
from lmcache_remote.errors import (
    BackendError,
    BackendPermissionError,
    BackendTimeoutError,
    BackendUnavailableError,
    CorruptEntryError,
    ForeignEntryError,
    UnauthenticatedEntryError,
)
from lmcache_remote.hashing import ChunkSpec
from lmcache_remote.integrity import IntegrityKey, load_integrity_key
from lmcache_remote.keys import CacheEngineKey, probe_key
from lmcache_remote.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.metrics import Metrics, RateLimitedLogger
from lmcache_remote.serde import Serde
from lmcache_remote.sizing import max_part_count
from lmcache_remote.storage.base import StorageTier
from lmcache_remote.storage.bulk import (
    ArenaPool,
    BulkPipeline,
    Reply,
    Seal,
    pack_command,
    supports,
)
from lmcache_remote.storage.client import RemoteCaller, make_client
from lmcache_remote.storage.deadline import call_deadline
from lmcache_remote.storage.health import HealthGate
from lmcache_remote.storage.lanes import LanePool
from lmcache_remote.storage.redis_commands import (
    ByteBudget,
    IncompleteChunkError,
    byte_windows,
    chunk_write_command,
    listed_part_count,
    read_ahead,
    regroup,
    value_nbytes,
)
from lmcache_remote.storage.toucher import Toucher
from lmcache_remote.value_format import (
    HEADER_FIXED,
    Signer,
    ValueHeader,
    check_identity,
    checksum,
    header_nbytes,
    header_seal,
)

logger = logging.getLogger(__name__)
#: Bytes of chunks per pipelined batch: large enough that round trips do not matter, small
#: enough that the encoded values and receive arena of one batch stay a modest memory cost.
_WINDOW_BYTES = 64 * 1024 * 1024
#: Chunks whose keys (and packed EXISTS) are kept built: the hot prefixes of a million tokens.
#: Each costs about 1-2 KiB outside the memory budget (more parts, longer model names cost
#: more), so this bounds the caches to a few MiB; a full cache is cleared and rebuilt on use.
_KEY_CACHE_SIZE = 4096
#: Chunks found foreign (another release's value, left in place) that `contains` reports
#: absent, so that this process's lookups stop promising what its reads will not serve; for
#: `_FOREIGN_SECONDS` (the other release may delete or replace the value), at most this many.
_FOREIGN_KEPT = 4096
_FOREIGN_SECONDS = 300.0
#: Gives a read its chunk buffer of so many tokens, or None when there is no room.
Allocator = Callable[[int], MemoryObj | None]
#: The default number of connections one `put` writes over at once on a single server (see
#: `RedisTier.put`; `CacheConfig.remote_write_lanes` sets it).
WRITE_LANES: int = CacheConfig.remote_write_lanes
#: The default number of connections one `get` reads over at once on a single server (see
#: `RedisTier._get_wire`; `CacheConfig.remote_read_lanes` sets it).
READ_LANES: int = CacheConfig.remote_read_lanes

def sockets_in_use(client: Any) -> list[socket.socket]:
    """The sockets of the connections of `client`'s pool that some thread holds now (every
    connection of a `BlockingConnectionPool`, which does not keep the two apart)."""
    pool = getattr(client, "connection_pool", None)
    in_use = getattr(pool, "_in_use_connections", None)
    if in_use is None:
        in_use = getattr(pool, "_connections", None) or ()
    return [sock for conn in list(in_use)
            if (sock := getattr(conn, "_sock", None)) is not None]


def shut_down_in_use(client: Any) -> None:
    """Shuts down (`socket.shutdown`, not close) every socket of `sockets_in_use`: a send or
    receive blocked on it returns at once, and its descriptor cannot be reused meanwhile."""
    for sock in sockets_in_use(client):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def longest_value(raw_nbytes: int) -> int:
    """The longest value a chunk of up to ``raw_nbytes`` raw bytes can have, whoever cut it
    (parts of at least 4 KiB): the whole chunk in one value, a compressing codec's worst-case
    growth, the header of the most parts. A read refuses a longer reply before allocating
    anything for it."""
    return 2 * raw_nbytes + header_nbytes(-(-raw_nbytes // 4096)) + (64 << 10)


class RedisTier(StorageTier):
    """The remote tier over one Redis/Valkey server. Thread-safe (redis-py's pool is).

    Read buffers come from `allocate(num_tokens)`: the storage manager's, which evicts local
    entries to make room in the shared budget; by default straight from `pool`. A read that
    gets None stops there (`remote.pool_full`)."""

    name = "remote"

    def __init__(
        self,
        config: CacheConfig,
        layout: ChunkLayout,
        pool: MemoryPool,
        metrics: Metrics,
        client: redis.Redis | None = None,
        allocate: Allocator | None = None,
    ) -> None:
        self.config = config
        self.prefix = config.key_prefix
        self.layout = layout
        self.pool = pool
        self.allocate: Allocator = allocate or (
            lambda n: pool.allocate(layout.shape(n), layout.dtype))
        self.metrics = metrics
        #: With `integrity_key`: every value written carries a MAC, and only values whose MAC
        #: verifies are served (`_authenticate`); read here, at start-up, never logged.
        self.integrity: IntegrityKey | None = load_integrity_key(config.integrity_key)
        threads = config.serde_threads or available_cpus()
        self.serde = Serde(config.serde, config.remote_part_size, threads, fit_size_classes=True)
        self.client = client if client is not None else make_client(config)
        self.wire = BulkPipeline(self.client) if supports(self.client) else None
        self._arenas = ArenaPool()
        self._key_cache: dict[tuple[CacheEngineKey, int], list[str]] = {}
        self._nparts_cache: dict[int, int] = {}
        self._exists_cache: dict[tuple[CacheEngineKey, int], bytes] = {}
        self.gate = HealthGate(config.unhealthy_backoff)
        self.caller = RemoteCaller(config.remote_timeout, self.gate)
        self._ttl_ms = None if config.remote_ttl is None else int(config.remote_ttl * 1000)
        self._log = RateLimitedLogger(logger)
        self.write_lanes = config.remote_write_lanes
        self.read_lanes = config.remote_read_lanes
        self._write_lock = threading.Lock()
        self._writers: ThreadPoolExecutor | None = None
        self._readers: LanePool | None = None  # the step's reads before background ones
        self._write_budget = ByteBudget(_WINDOW_BYTES)
        self._longest = longest_value(layout.nbytes(config.chunk_size))
        # None with `remote_lru_touch` off: nothing is noted, no thread starts, no TOUCH is sent
        self.toucher: Toucher | None = (
            Toucher(self._send_touches, metrics, self._log) if config.remote_lru_touch else None)
        self._foreign: dict[CacheEngineKey, float] = {}  # key -> when found foreign
        self._foreign_lock = threading.Lock()

    # -- keys -------------------------------------------------------------------------------

    def _nparts(self, num_tokens: int) -> int:
        count = self._nparts_cache.get(num_tokens)
        if count is None:
            count = self._nparts_cache[num_tokens] = self.serde.part_count(
                self.layout.nbytes(num_tokens)
            )
        return count

    def _keys(self, spec: ChunkSpec) -> list[str]:
        """The chunk's part keys (cached: a prompt's chunks are asked for again and again)."""
        nparts = self._nparts(spec.num_tokens)
        cached = self._key_cache.get((spec.key, nparts))
        if cached is None:
            if len(self._key_cache) >= _KEY_CACHE_SIZE:
                self._key_cache.clear()
            cached = spec.key.part_keys(self.prefix, nparts)
            self._key_cache[(spec.key, nparts)] = cached
        return cached

    def _exists_command(self, spec: ChunkSpec) -> bytes:
        """``EXISTS key part1 ...`` of the chunk, packed once and cached."""
        nparts = self._nparts(spec.num_tokens)
        packed = self._exists_cache.get((spec.key, nparts))
        if packed is None:
            if len(self._exists_cache) >= _KEY_CACHE_SIZE:
                self._exists_cache.clear()
            packed = pack_command(("EXISTS", *self._keys(spec)))
            self._exists_cache[(spec.key, nparts)] = packed
        return packed

    # -- contract ---------------------------------------------------------------------------

    def contains(self, specs: Sequence[ChunkSpec]) -> list[bool]:
        if not specs:
            return []
        key_lists = [self._keys(s) for s in specs]

        wire = self._bulk()
        counts: list[Any] = self.caller.call(
            lambda: wire.execute([self._exists_command(s) for s in specs]))
        present = self._present(specs, key_lists, [int(c) for c in counts])
        if self._foreign:
            present = [p and not self._known_foreign(s.key) for p, s in zip(present, specs,
                                                                           strict=True)]
        return present

    def check_bulk(self) -> None:
        """One `EXISTS` of a probe key through the bulk path (the native loop or its Python
        twin over redis-py's pool), which every chunk read and write takes and the access check
        (plain redis-py) does not: a `BackendError` naming the cause when it cannot talk to the
        server (a redis-py this path does not support), so that a broken cache is loud at
        start-up instead of silently missing."""
        if self.wire is None:
            return
        wire = self.wire
        key = probe_key(self.prefix, "bulk")
        try:
            reply = self.caller.call(lambda: wire.execute([("EXISTS", key)]))[0]
        except (BackendUnavailableError, BackendTimeoutError, BackendPermissionError):
            raise  # the server, not the path: as the access check reports it
        except Exception as exc:
            raise BackendError(f"the bulk path (redis-py {redis.__version__}) cannot talk to "
                               f"Redis: {type(exc).__name__}: {exc}") from exc
        if not isinstance(reply, int):
            raise BackendError(f"the bulk path got {reply!r} for EXISTS")

    def _bulk(self) -> BulkPipeline:
        """The bulk pipeline every single-server batch goes through (a `redis.Redis`, plain,
        TLS or Sentinel's master, always has one; a cluster's tier replaces each batch)."""
        if self.wire is None:
            raise BackendError(f"the bulk path cannot drive a {type(self.client).__name__}")
        return self.wire

    def _known_foreign(self, key: CacheEngineKey) -> bool:
        with self._foreign_lock:
            seen = self._foreign.get(key)
            if seen is None:
                return False
            if time.monotonic() - seen < _FOREIGN_SECONDS:
                return True
            del self._foreign[key]
            return False

    def _present(self, specs: Sequence[ChunkSpec], key_lists: Sequence[Sequence[str]],
                 counts: Sequence[int | None]) -> list[bool]:
        """Which chunks are present, from the `EXISTS` count of each one's planned keys (None:
        not known, its node failed). All planned keys there: present, no more questions. Some
        but not all: the chunk may have been cut another way by another writer (its header
        says how, and `get` follows the header), so those chunks alone cost a second round
        trip (`GETRANGE` of the fixed header: its part count) and a third (`EXISTS` of the
        keys it lists); present when all of those are there."""
        present = [c == len(k) for c, k in zip(counts, key_lists, strict=True)]
        odd = [i for i, (c, k) in enumerate(zip(counts, key_lists, strict=True))
               if c is not None and 0 < c < len(k)]
        if not odd:
            return present
        heads = self._lookup_run([("GETRANGE", key_lists[i][0], 0, HEADER_FIXED.size - 1)
                                  for i in odd])
        listed: list[tuple[int, list[str]]] = []
        for i, head in zip(odd, heads, strict=True):
            count = listed_part_count(specs[i], head)
            if count is not None and count != len(key_lists[i]):
                listed.append((i, specs[i].key.part_keys(self.prefix, count)))
        replies = self._lookup_run([("EXISTS", *keys) for _, keys in listed])
        for (i, keys), reply in zip(listed, replies, strict=True):
            present[i] = isinstance(reply, int) and reply == len(keys)
        return present

    def _lookup_run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The replies of a few lookup commands (one pipeline); an error answer is its reply."""
        if not commands:
            return []

        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute(raise_on_error=False))

        return list(self.caller.call(op))

    def get(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj]:
        """The leading run of good chunks; the whole read, every window on every lane, ends
        within `remote_timeout` (`deadline.call_deadline`): a read cut short there raises."""
        out: list[MemoryObj] = []
        try:
            with call_deadline(self.config.remote_timeout):
                self._get_wire(specs, out)
            return out
        except BaseException:  # a later window failed: the earlier ones' buffers go back
            for obj in out:
                obj.release()
            raise

    def put_each(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> list[bool]:
        """Writes the chunks, each in one atomic command; per chunk, whether it landed.

        On a single server the chunks are cut into windows of about `_WINDOW_BYTES / lanes`
        and up to `write_lanes` windows are encoded and written at once, each over its own
        pooled connection: one window's encoding overlaps another's sending, and Redis always
        has bytes to read. Encoded bytes in flight stay within `_WINDOW_BYTES` (raw parts are
        views of the chunk buffers and cost nothing). If a window fails, the others still run
        to the end and only the chunks whose command was answered count as landed (and in
        `remote.written_chunks`). The first error is raised when nothing landed; otherwise it
        is counted (`remote.errors`) and logged, and the failed windows' chunks are False."""
        if not keys:
            return []
        lanes = self.write_lanes if self.wire is not None else 1
        windows = self._write_windows(objs, _WINDOW_BYTES // lanes)
        pairs = list(zip(keys, objs, strict=True))
        landed = [False] * len(keys)
        error: BaseException | None = None
        if lanes <= 1 or len(windows) <= 1:
            for w in windows:
                try:
                    landed[w.start:w.stop] = self._encode_and_write([pairs[i] for i in w])
                except BackendError as exc:
                    error = exc
                    break  # one connection, in order: the rest would fail the same way
        else:
            executor = self._lane_pool("_writers", lanes)
            futures = [(w, executor.submit(self._budgeted_write, [pairs[i] for i in w]))
                       for w in windows]
            for w, future in futures:  # every window runs to its end before put returns
                try:
                    landed[w.start:w.stop] = future.result()
                except BaseException as exc:
                    error = error or exc
        if error is not None:
            if not isinstance(error, BackendError) or not any(landed):
                raise error
            self.metrics.inc("remote.errors")
            self._log.warning("write-window", "a write window failed after %d chunks landed: "
                              "%s", sum(landed), error)
        return landed

    def _write_windows(self, objs: Sequence[MemoryObj], window_bytes: int) -> list[range]:
        """Consecutive runs of chunk indexes, each about ``window_bytes`` of raw KV (at least
        one chunk)."""
        return byte_windows([obj.nbytes for obj in objs], window_bytes)

    def _encoded_cost(self, pairs: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> int:
        """Bytes encoding these chunks allocates, at most: none for raw (views), else their size."""
        if self.serde.codec.codec_id == 0 and self.wire is not None:
            return 0
        return sum(obj.nbytes for _, obj in pairs)

    def _budgeted_write(self, pairs: Sequence[tuple[CacheEngineKey, MemoryObj]]
                        ) -> list[bool]:
        cost = self._encoded_cost(pairs)
        self._write_budget.acquire(cost)
        try:
            return self._encode_and_write(pairs)
        finally:
            self._write_budget.release(cost)

    def _encode_and_write(self, pairs: Sequence[tuple[CacheEngineKey, MemoryObj]]
                          ) -> list[bool]:
        """Encodes one window of chunks and writes it in one pipelined batch. Over the wire
        the checksums are left to the wire (a seal per chunk), which computes them as it
        sends each chunk, so that the kernel's copy finds the bytes still in the CPU cache."""
        batch: list[tuple[list[str], list[Any]]] = []
        seals: list[Seal | None] | None = [] if self.wire is not None else None
        for key, obj in pairs:
            num_tokens = obj.tensor.shape[2]
            values: list[Any]
            signer = self._signer(key)
            if seals is not None:  # value 0 as (header, part 0): no copy of part 0
                header, parts = self.serde.encode_parts(obj, key.hash_bytes, num_tokens,
                                                        sealed=signer is not None, signer=signer)
                values = [(header, parts[0]), *parts[1:]]
                if signer is None:
                    assert isinstance(header, bytearray)
                    seals.append(header_seal(header, parts))
                else:  # the MAC covers the checksums: sealed before it, not by the wire
                    seals.append(None)
            else:
                values = list(self.serde.encode(obj, key.hash_bytes, num_tokens, signer=signer))
            batch.append((key.part_keys(self.prefix, len(values)), values))
        return self._write(batch, seals)

    def _signer(self, key: CacheEngineKey) -> Signer | None:
        """What makes the MAC of the chunk ``key``'s value (bound to the key), None without
        an `integrity_key`."""
        integrity = self.integrity
        if integrity is None:
            return None
        name = key.to_string()
        return lambda signed, parts: integrity.tag(name, signed, parts)

    def _lane_pool(self, name: str, lanes: int) -> Any:
        """The lane threads ``name``, started on first use: ``_writers`` (an executor) or
        ``_readers`` (a `lanes.LanePool`: reads inside `background_reads` yield to others)."""
        with self._write_lock:
            pool = getattr(self, name)
            if pool is None:
                pool = (LanePool(lanes, "lmcr_reader") if name == "_readers"
                        else ThreadPoolExecutor(lanes, thread_name_prefix=f"lmcr{name[:-1]}"))
                setattr(self, name, pool)
            return pool

    def delete(self, keys: Sequence[CacheEngineKey]) -> int:
        if not keys:
            return 0
        names, heads = self._delete_names(keys)

        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.unlink(name)
            return pipe.execute()

        results = self.caller.call(op)
        return sum(int(r) for n, r in zip(names, results, strict=True) if n in heads)

    def _delete_names(self, keys: Sequence[CacheEngineKey]) -> tuple[list[str], set[str]]:
        """Every value key the chunks may have (at least as many parts as any chunk of up to
        `chunk_size` tokens is cut into: `max_part_count`), and the heads (whose count is the
        number of chunks deleted)."""
        full = max_part_count(self.layout.nbytes(self.config.chunk_size), self.serde.part_size)
        names = [k for key in keys for k in key.part_keys(self.prefix, full)]
        return names, {key.redis_key(self.prefix) for key in keys}

    def stop_io(self) -> None:
        """No new remote call starts (the health gate closes for good), and every call in
        flight fails now: each connection in use is shut down (`socket.shutdown`: a send or
        receive blocked on a paused or slow server returns at once, in redis-py or in the
        native loop). The sockets stay open, so their descriptors cannot be reused under a
        thread that still holds one; `close` closes them once every thread is done."""
        self.gate.close()
        shut_down_in_use(self.client)

    def touch_later(self, specs: Sequence[ChunkSpec]) -> None:
        """Refresh these chunks' LRU clocks in Redis soon (`toucher.Toucher`): chunks a lookup
        promised or the local tier served, which Redis does not see read. Nothing with
        `remote_lru_touch` off."""
        if self.toucher is not None:
            self.toucher.note([key for spec in specs for key in self._keys(spec)])

    def stop_touching(self) -> None:
        """No more LRU refreshes (the ACL user may not TOUCH): the toucher closes, nothing
        more is noted."""
        toucher, self.toucher = self.toucher, None
        if toucher is not None:
            toucher.close()

    def _send_touches(self, commands: list[tuple[Any, ...]]) -> None:
        def op() -> list[Any]:
            if self.wire is not None:
                return self.wire.execute(commands)
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute())

        self.caller.call(op)

    def sockets_busy(self) -> bool:
        """Whether some thread holds one of the client's connections now (is doing I/O)."""
        return bool(sockets_in_use(self.client))

    def close(self) -> None:
        """Stops all I/O (`stop_io`), waits for the lane threads, then closes the client: after
        this returns no thread of the tier does any I/O."""
        if self.toucher is not None:
            self.toucher.close()
        self.stop_io()
        with self._write_lock:
            pools, self._writers, self._readers = (self._writers, self._readers), None, None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)
        self.serde.close()
        self.client.close()

    def ping(self) -> bool:
        """True if the server answers now (honours the health gate's back-off)."""
        return bool(self.caller.call(self.client.ping))

    # -- internals --------------------------------------------------------------------------

    def _windows(self, specs: Sequence[ChunkSpec], window_bytes: int
                 ) -> list[Sequence[ChunkSpec]]:
        """The specs cut into windows of about ``window_bytes``."""
        sizes = [self.layout.nbytes(spec.num_tokens) for spec in specs]
        return [specs[w.start:w.stop] for w in byte_windows(sizes, window_bytes)]

    def _fetch(self, key_lists: Sequence[Sequence[str]]) -> list[list[bytes | None]]:
        def op() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for keys in key_lists:
                for key in keys:
                    pipe.get(key)
            return pipe.execute()

        return regroup(self.caller.call(op), key_lists)

    def _write(self, batch: Sequence[tuple[list[str], list[Any]]],
               seals: Sequence[Seal | None] | None = None) -> list[bool]:
        """Write one window of chunks; per chunk, whether it landed (here all or none: a
        failure raises). ``seals``: per chunk, the checksums the wire fills in as it sends."""
        wire = self._bulk()
        self.caller.call(lambda: wire.execute(self._write_commands(batch), seals=seals))
        nbytes = sum(value_nbytes(v) for _, values in batch for v in values)
        self.metrics.inc("remote.written_chunks", len(batch))
        self.metrics.inc("remote.written_bytes", nbytes)
        return [True] * len(batch)

    def _write_commands(self, batch: Sequence[tuple[list[str], list[Any]]]
                        ) -> list[tuple[Any, ...]]:
        return [chunk_write_command(keys, values, self._ttl_ms) for keys, values in batch]

    # -- the fast read path -----------------------------------------------------------------

    def _get_wire(self, specs: Sequence[ChunkSpec], out: list[MemoryObj]) -> None:
        """Appends the leading run of good chunks to ``out``, window by window; with several
        `read_lanes`, windows of `_WINDOW_BYTES / lanes` are fetched at once, each over its own
        connection, and taken in order (what follows a short window is released)."""
        lanes = self.read_lanes
        windows = self._windows(specs, _WINDOW_BYTES // max(1, lanes))
        if lanes <= 1 or len(windows) <= 1:
            for window in windows:
                got, complete = self._get_window(window)
                out.extend(got)
                if not complete:
                    break
            return
        executor = self._lane_pool("_readers", lanes)
        futures = [executor.submit(self._get_window, w) for w in windows]
        complete, error = True, None
        for future in futures:
            if not complete or error is not None:  # past the prefix: not wanted
                if future.cancel():
                    continue
                with contextlib.suppress(BaseException):
                    for obj in future.result()[0]:
                        obj.release()
                continue
            try:
                got, complete = future.result()
            except BaseException as exc:
                error = exc
                continue
            out.extend(got)
        if error is not None:
            raise error

    def _get_window(self, window: Sequence[ChunkSpec]) -> tuple[list[MemoryObj], bool]:
        """The leading run of good chunks of one window, and whether the whole window was."""
        objs: list[MemoryObj] = []
        for spec in window:
            obj = self.allocate(spec.num_tokens)
            if obj is None:
                self.metrics.inc("remote.pool_full")
                break
            objs.append(obj)
        arena = self._arenas.acquire()
        good: list[MemoryObj] = []
        try:
            replies, digests = self._receive(window[: len(objs)], objs, arena)
            for spec, obj, values, known in zip(window, objs, replies, digests, strict=False):
                if not self._decode_received(spec, obj, values, known):
                    break
                good.append(obj)
        finally:
            self._arenas.release(arena)
            for obj in objs[len(good):]:
                obj.release()
        return good, len(good) == len(window)

    def _receive(
        self, specs: Sequence[ChunkSpec], objs: Sequence[MemoryObj], arena: Any
    ) -> tuple[list[list[Reply]], list[list[int | None]]]:
        """GETs every part of every chunk in one pipeline; raw parts land in the chunk itself.
        Returns each chunk's replies and, per reply, its part's XXH3-64 where the receive loop
        made it (else None).

        Raw: each value's place is given up front (value 0's header in the arena, then each
        part's bytes in the chunk), so the native loop reads the whole batch without the GIL
        and hashes each part as it lands (the last buffer of a place is the part's bytes); a
        value of any other size lands in a fresh buffer and fails its checks. Other codecs:
        each stored value goes into the arena as it comes."""
        key_lists = [self._keys(s) for s in specs]
        places = []  # per value: its chunk, part index, and raw byte range in the chunk
        totals = [self.layout.nbytes(spec.num_tokens) for spec in specs]  # raw bytes per chunk
        for c, (total, keys) in enumerate(zip(totals, key_lists, strict=True)):
            size = self.serde.part_size_for(total)
            places += [(c, p, p * size, min(total, (p + 1) * size)) for p in range(len(keys))]
        sink: Any
        if self.serde.codec.codec_id == 0:
            mac = self.integrity is not None  # the values this reader serves are authenticated
            heads = [header_nbytes(len(keys), mac) for keys in key_lists]
            arena.reserve(sum(heads))
            sink = [[arena.take(heads[chunk]), objs[chunk].raw_view()[start:end]] if part == 0
                    else objs[chunk].raw_view()[start:end]
                    for chunk, part, start, end in places]
        else:
            arena.reserve(sum(o.nbytes for o in objs) + 4096 * len(places))
            sink = lambda index, length: arena.take(length)  # noqa: E731
        sizes = [end - start for _, _, start, end in places]  # raw: what each GET returns
        flat = [("GET", key) for keys in key_lists for key in keys]
        digests: list[int | None] = [None] * len(flat)
        replies = self._bulk_get(flat, sink, sizes, read_ahead(totals), digests)
        return regroup(replies, key_lists), regroup(digests, key_lists)

    def _bulk_get(self, commands: list[tuple[str, str]], sink: Any, sizes: list[int],
                  ahead: int, digests: list[int | None]) -> list[Reply]:
        """Each GET's reply, received where ``sink`` says; None for a missing value. ``sizes``:
        each reply's expected bytes; ``ahead``: the bytes to keep asked for (`read_ahead`);
        ``digests``: filled where the receive loop hashed a reply (`BulkPipeline.execute`)."""

        wire = self._bulk()

        def op() -> list[Reply]:
            return wire.execute(commands, sink, reply_sizes=sizes, inflight_bytes=ahead,
                                digests=digests, max_bulk=self._longest)

        return list(self.caller.call(op))

    def _decode_received(self, spec: ChunkSpec, obj: MemoryObj, values: list[Reply],
                         digests: list[int | None]) -> bool:
        """Checks and decodes one chunk's replies into ``obj``; False for a miss or a bad one.
        ``digests``: each reply's part checksum as the receive loop computed it, or None."""
        if values[0] is None:
            self.metrics.inc("remote.miss_chunks")
            return False
        try:
            head = values[0]
            header = self._read_header(spec, head[0] if isinstance(head, list) else head)
            fetched = self._all_parts(spec, header, values)
            if fetched is not values:  # fetched again: the loop's digests are not theirs
                values, digests = fetched, [None] * len(fetched)
            stored = [self._stored_part(header, i, v) for i, v in enumerate(values)]
            if self.integrity is not None:
                self._authenticate(spec, header, stored, digests)
            self.serde.decode_parts_into(
                header, stored, obj, spec.key.hash_bytes,
                expected_shape=self.layout.shape(spec.num_tokens),
                expected_dtype=self.layout.dtype, digests=digests,
            )
        except ForeignEntryError as exc:
            self._skip_foreign(spec, exc)
            return False
        except CorruptEntryError as exc:
            self._drop_corrupt(spec, exc)
            return False
        self.metrics.inc("remote.hit_chunks")
        nbytes = sum(header.value_nbytes(i) for i in range(len(values)))
        self.metrics.inc("remote.read_bytes", nbytes)
        return True

    @staticmethod
    def _stored_part(header: ValueHeader, index: int, value: Reply) -> memoryview:
        """The stored bytes of part ``index`` (value 0 without its header), length-checked."""
        if isinstance(value, list):  # value 0 received as [header, part 0 in place]
            if len(value[0]) != header.header_nbytes:
                raise CorruptEntryError(
                    f"value 0 header is {len(value[0])} bytes, expected {header.header_nbytes}"
                )
            return value[1]
        if value is None or isinstance(value, (int, Exception)):
            raise CorruptEntryError(f"value {index} is not a bulk string")
        view = memoryview(value).cast("B")
        if len(view) != header.value_nbytes(index):
            raise CorruptEntryError(
                f"value {index} is {len(view)} bytes, expected {header.value_nbytes(index)}"
            )
        return view[header.header_nbytes:] if index == 0 else view

    def _read_header(self, spec: ChunkSpec, value0: Any) -> ValueHeader:
        """The header of value 0, checked to name this chunk before anything else is (a value
        of another chunk or geometry is foreign, whatever its parts)."""
        header = self.serde.read_header(value0)
        if header.num_tokens != spec.num_tokens:
            raise ForeignEntryError(
                f"value holds {header.num_tokens} tokens, its key names {spec.num_tokens}"
            )
        check_identity(header, spec.key.hash_bytes, self.layout.shape(spec.num_tokens),
                       self.layout.dtype)
        return header

    def _authenticate(self, spec: ChunkSpec, header: ValueHeader, stored: Sequence[memoryview],
                      digests: Sequence[int | None]) -> None:
        """With an `integrity_key`: `UnauthenticatedEntryError` unless the value carries a MAC
        that verifies under the key for this chunk key, header and parts. A failed MAC over a
        part that also fails its checksum (or length) is damage, `CorruptEntryError`, deleted
        as ever; one over intact checksums was written without this key: left in place."""
        assert self.integrity is not None
        if header.tag is None:
            raise UnauthenticatedEntryError("written without the integrity key (no MAC)")
        if self.integrity.verify(spec.key.to_string(), header.signed, stored, header.tag):
            return
        for i, view in enumerate(stored):
            length, expected = header.parts[i]
            known = digests[i] if i < len(digests) else None
            if len(view) != length or (known if known is not None else checksum(view)
                                       ) != expected:
                raise CorruptEntryError(f"part {i} fails its checksum (and the MAC)")
        raise UnauthenticatedEntryError("its MAC does not verify under this integrity key "
                                        "(forged, moved from another key, or another key's)")

    def _all_parts(self, spec: ChunkSpec, header: ValueHeader, values: list[Any]) -> list[Any]:
        """Every value the header lists: fetched again when the chunk was written with another
        part size. A part missing where the header agrees with ours was evicted or expired
        (`IncompleteChunkError`); one missing after a header that lists more is damage."""
        if len(header.parts) != len(values):
            values = list(self._fetch([spec.key.part_keys(self.prefix, len(header.parts))])[0])
            if any(v is None for v in values):
                raise CorruptEntryError("the header lists parts that are not there")
        elif any(v is None for v in values):
            raise IncompleteChunkError("a part of the chunk is missing (evicted or expired)")
        return values

    def _skip_foreign(self, spec: ChunkSpec, exc: ForeignEntryError) -> None:
        """A value of another release, or not the one its key names: a miss, left in place
        (DESIGN.md, "Redis layout": evolution), counted apart from damage. One this reader's
        `integrity_key` does not vouch for is counted apart again (`_authenticate`)."""
        kind = "unauthenticated" if isinstance(exc, UnauthenticatedEntryError) else "foreign"
        self.metrics.inc(f"remote.{kind}_chunks")
        self._log.warning(kind, "%s chunk %s left in place, not served: %s", kind,
                          spec.key.chunk_hash, exc)
        with self._foreign_lock:
            if len(self._foreign) >= _FOREIGN_KEPT:
                self._foreign.pop(next(iter(self._foreign)))
            self._foreign[spec.key] = time.monotonic()

    def _drop_corrupt(self, spec: ChunkSpec, exc: CorruptEntryError) -> None:
        """Count a bad chunk (incomplete: a part evicted; else damaged) and delete its values."""
        if isinstance(exc, IncompleteChunkError):
            self.metrics.inc("remote.incomplete_chunks")
            logger.debug("dropping incomplete chunk %s: %s", spec.key.chunk_hash, exc)
        else:
            self.metrics.inc("remote.corrupt_chunks")
            self._log.warning("corrupt", "dropping corrupt chunk %s: %s",
                              spec.key.chunk_hash, exc)
        try:
            self.delete([spec.key])
        except Exception as err:  # a failed clean-up must not turn a miss into an error
            self._log.warning("corrupt-delete", "could not delete corrupt chunk: %s", err)
