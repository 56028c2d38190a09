"""RemoteLookup: a remote tier's chunk keys, and which chunks Redis/Valkey holds now.

Layout (DESIGN.md, docs/value-format.md): a chunk is one value under its chunk key, or, when
its bytes pass `remote_part_size`, several values under the chunk key and `#1`, `#2`, ...,
written together by one command (atomic, and on one Cluster slot thanks to the hash tag). The
part count follows from the chunk's raw size, so every key of a chunk is known before any
round trip (`_keys`; the keys and packed `EXISTS` of the hot prefixes are kept built).

- `contains`: one pipeline of `EXISTS key part1 ...` per chunk; present = all parts there.
  A chunk with only some of its planned keys there may have been cut another way by another
  writer: for those chunks alone, its header's part count decides (two more round trips), so
  `contains` counts what `get` reads (one limit: a chunk cut into more parts than planned is
  counted by its planned keys; a later part of it evicted is found, and the chunk deleted, by
  the `get`; docs/value-format.md). A chunk a read found foreign is reported absent for a
  while, so that this process's lookups stop promising what its reads will not serve.
- `touch_later`: the LRU refresh of chunks a lookup promised (`toucher.Toucher`), and, with
  `keep_policy: learned`, the keep policy's note of the hit (`keep.book.KeepBook`, queued:
  no round trip on the lookup's path).
- Every batch goes through the tier's `session.channel.Channel`, chosen when the lookup is
  built (`open_channel`): on a single server `bulk.BulkPipeline` on redis-py's own pooled
  connections (the `EXISTS` commands packed once), on a cluster one pipeline per node, a
  failed node's chunks unknown (absent) while the others answer. Every call goes through
  `RemoteCaller`: bounded by `remote_timeout`, one immediate retry on a broken connection,
  skipped at once while the health gate backs off.

This is all the vLLM scheduler's lookup needs (`factory.make_remote_lookup`); `RedisTier` adds
the reads (`reads`) and the writes (`writes`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import (
    BackendError,
    BackendPermissionError,
    BackendTimeoutError,
    BackendUnavailableError,
)
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey, probe_key
from lmcache_remote.storage.chunks.toucher import Toucher
from lmcache_remote.storage.keep.book import KeepBook
from lmcache_remote.storage.local.cpus import available_cpus
from lmcache_remote.storage.local.memory import ChunkLayout
from lmcache_remote.storage.session.channel import Channel, failed, open_channel
from lmcache_remote.storage.wire.bulk import BulkPipeline
from lmcache_remote.storage.wire.commands import listed_part_count
from lmcache_remote.storage.wire.resp import pack_command
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger
from lmcache_remote.values.serde import Serde
from lmcache_remote.values.sizing import longest_value
from lmcache_remote.values.value_format import HEADER_FIXED

logger = logging.getLogger(__name__)
#: Chunks whose keys (and packed EXISTS) are kept built: the hot prefixes of a million tokens.
#: Each costs about 1-2 KiB outside the memory budget (more parts, longer model names cost
#: more), so this bounds the caches to a few MiB; a full cache is cleared and rebuilt on use.
_KEY_CACHE_SIZE = 4096
#: Chunks found foreign (another release's value, left in place) that `contains` reports
#: absent, so that this process's lookups stop promising what its reads will not serve; for
#: `_FOREIGN_SECONDS` (the other release may delete or replace the value), at most this many.
_FOREIGN_KEPT = 4096
_FOREIGN_SECONDS = 300.0
#: Admission (`store_after`, docs/key-schema.md "Admission counts"), per chunk in one step on
#: its slot: EXISTS of its planned keys (KEYS but the last); when not all are there, INCR of its
#: count (the last key), which expires ARGV[1] ms after the first try. One integer back:
#: `count * 65536 + keys present` (count 0: every key was there, nothing counted).
ADMIT_SCRIPT = (
    "local n = #KEYS - 1 "
    "local present = redis.call('EXISTS', unpack(KEYS, 1, n)) "
    "if present == n then return present end "
    "local c = redis.call('INCR', KEYS[#KEYS]) "
    "if c == 1 then redis.call('PEXPIRE', KEYS[#KEYS], ARGV[1]) end "
    "return c * 65536 + present"
)


class RemoteLookup:
    """Which chunks Redis/Valkey (one server or a cluster) holds; see the module doc.
    Thread-safe. ``client``: a redis-py client to use instead of the configured URL's (a
    `RedisCluster` makes it a cluster's)."""

    def __init__(
        self,
        config: CacheConfig,
        layout: ChunkLayout,
        metrics: Metrics,
        client: Any = None,
    ) -> None:
        self.config = config
        self.prefix = config.key_prefix
        self.layout = layout
        self.metrics = metrics
        threads = config.serde_threads or available_cpus()
        self.serde = Serde(config.serde, config.remote_part_size, threads, fit_size_classes=True)
        self._key_cache: dict[tuple[CacheEngineKey, int], list[str]] = {}
        self._nparts_cache: dict[int, int] = {}
        self._exists_cache: dict[tuple[CacheEngineKey, int], bytes] = {}
        self.log = RateLimitedLogger(logger)
        #: The longest reply a chunk read accepts (`sizing.longest_value`).
        self._longest = longest_value(layout.nbytes(config.chunk_size))
        #: Every batch's way to Redis: one server's or a cluster's, chosen here, once.
        self.channel: Channel = open_channel(config, metrics, self.log, self._longest,
                                             client=client)
        self.gate = self.channel.gate
        self.caller = self.channel.caller
        # None with `remote_lru_touch` off: nothing is noted, no thread starts, no TOUCH is sent
        self.toucher: Toucher | None = (
            Toucher(self._send_touches, metrics, self.log) if config.remote_lru_touch else None)
        #: the keep policy's state in Redis (None with `keep_policy: redis`)
        self.keep: KeepBook | None = (
            KeepBook(config, self.channel, metrics, self.log, self.serde.part_count,
                     layout.nbytes(config.chunk_size))
            if config.keep_policy == "learned" else None)
        self._foreign: dict[CacheEngineKey, float] = {}  # key -> when found foreign
        self._foreign_lock = threading.Lock()

    # -- keys ----------------------------------------------------------------------------

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

    def chunk_keys(self, spec: ChunkSpec) -> list[str]:
        """The keys of the chunk's values as this tier writes it (value 0 first)."""
        return self._keys(spec)

    @property
    def client(self) -> Any:
        """The redis-py client as it is now (a cluster's: a placeholder until it answers)."""
        return self.channel.client

    @property
    def wire(self) -> BulkPipeline | None:
        """A single server's bulk pipeline (None on a cluster)."""
        return self.channel.bulk

    def redis_client(self) -> Any:
        """The redis-py client for plain commands (a cluster's, once it answers)."""
        return self.channel.redis_client()

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

    # -- lookups -------------------------------------------------------------------------

    def contains(self, specs: Sequence[ChunkSpec]) -> list[bool]:
        if not specs:
            return []
        key_lists = [self._keys(s) for s in specs]
        commands: list[Any] = ([self._exists_command(s) for s in specs]
                               if self.channel.takes_packed
                               else [("EXISTS", *keys) for keys in key_lists])
        counts = [None if failed(r) else int(r) for r in self.channel.run(commands, "lookup")]
        return self._not_known_foreign(specs, self._present(specs, key_lists, counts))

    def admit(self, specs: Sequence[ChunkSpec], window_ms: int) -> tuple[list[bool], list[int]]:
        """`contains` for a store under `store_after`, in the same one round trip: per chunk
        whether Redis holds it, and for each one it lacks the fleet's count of tries to store
        it, this one included (0 where it is held: nothing is counted)."""
        if not specs:
            return [], []
        key_lists = [self._keys(s) for s in specs]
        replies = self._lookup_batch([
            ("EVAL", ADMIT_SCRIPT, len(keys) + 1, *keys, s.key.store_count_key(self.prefix),
             window_ms) for s, keys in zip(specs, key_lists, strict=True)])
        counts = [None if r is None else int(r) % 65536 for r in replies]
        tries = [0 if r is None else int(r) // 65536 for r in replies]
        present = self._not_known_foreign(specs, self._present(specs, key_lists, counts))
        return present, tries

    def _lookup_batch(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """One pipeline of small lookup commands through the bulk path; their replies (None
        where a cluster's node failed)."""
        return [None if failed(r) else r for r in self.channel.run(commands, "lookup")]

    def _not_known_foreign(self, specs: Sequence[ChunkSpec], present: list[bool]) -> list[bool]:
        """``present`` less the chunks this process found foreign a moment ago (a value it
        would not serve: another release's, or unauthenticated): never promised again until
        the note expires."""
        if not self._foreign:
            return present
        return [p and not self._known_foreign(s.key) for p, s in zip(present, specs,
                                                                     strict=True)]

    def check_bulk(self) -> None:
        """One `EXISTS` of a probe key through the bulk path (the native loop or its Python
        twin over redis-py's pool), which every chunk read and write takes and the access check
        (plain redis-py) does not: a `BackendError` naming the cause when it cannot talk to the
        server (a redis-py this path does not support), so that a broken cache is loud at
        start-up instead of silently missing."""
        wire = self.channel.bulk
        if wire is None:  # a cluster's: every node's batch goes through it, checked per node
            return
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

    def _known_foreign(self, key: CacheEngineKey) -> bool:
        with self._foreign_lock:
            seen = self._foreign.get(key)
            if seen is None:
                return False
            if time.monotonic() - seen < _FOREIGN_SECONDS:
                return True
            del self._foreign[key]
            return False

    def note_foreign(self, key: CacheEngineKey) -> None:
        """A read found ``key``'s value foreign: `contains` reports it absent for
        `_FOREIGN_SECONDS` (at most `_FOREIGN_KEPT` such keys, the oldest forgotten first)."""
        with self._foreign_lock:
            if len(self._foreign) >= _FOREIGN_KEPT:
                self._foreign.pop(next(iter(self._foreign)))
            self._foreign[key] = time.monotonic()

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
        """The replies of a few lookup commands (one pipeline); an error answer is its reply
        (`FAILED` where a cluster's node failed)."""
        return self.channel.run(commands, "lookup", bulk=False, raise_on_error=False)

    # -- LRU refreshes, life cycle -------------------------------------------------------

    def touch_later(self, specs: Sequence[ChunkSpec], full_chunks: int | None = None) -> None:
        """Refresh these chunks' LRU clocks in Redis soon (`toucher.Toucher`): chunks a lookup
        promised or the local tier served, which Redis does not see read (nothing with
        `remote_lru_touch` off); and note them to the keep policy as hits of a request of
        ``full_chunks`` full chunks (None: as many as the hits reach)."""
        if self.toucher is not None:
            self.toucher.note([key for spec in specs for key in self._keys(spec)])
        if self.keep is not None:  # None: note_hits counts as far as the hits reach
            self.keep.note_hits(specs, full_chunks or 0)

    def stop_touching(self) -> None:
        """No more LRU refreshes (the ACL user may not TOUCH): the toucher closes, nothing
        more is noted."""
        toucher, self.toucher = self.toucher, None
        if toucher is not None:
            toucher.close()

    def _send_touches(self, commands: list[tuple[Any, ...]]) -> None:
        self.channel.run(commands, "touch")

    def stop_io(self) -> None:
        """No new remote call starts (the health gate closes for good), and every call in
        flight fails now: each connection in use is shut down (`socket.shutdown`: a send or
        receive blocked on a paused or slow server returns at once, in redis-py or in the
        native loop). The sockets stay open, so their descriptors cannot be reused under a
        thread that still holds one; `close` closes them once every thread is done (a
        cluster's: every node's)."""
        self.channel.stop_io()

    def sockets_busy(self) -> bool:
        """Whether some thread holds one of the client's connections now (is doing I/O)."""
        return self.channel.sockets_busy()

    def close(self) -> None:
        """Stops all I/O (`stop_io`), waits for the tier's threads (`_join_threads`), then
        closes the client: after this returns no thread of the tier does any I/O."""
        if self.toucher is not None:
            self.toucher.close()
        if self.keep is not None:
            self.keep.close()
        self.stop_io()
        self._join_threads()
        self.serde.close()
        self.channel.close()

    def _join_threads(self) -> None:
        """Waits for the threads a subclass started (the lookup itself starts none but the
        toucher's, which `close` closes)."""

    def ping(self) -> bool:
        """True if the server (every primary of a cluster) answers now (honours the health
        gate's back-off)."""
        return self.channel.ping()
