"""The reads of `RedisTier` (`ChunkReads`): chunks out of Redis/Valkey, whole, checked, or not
at all.

- `get`: pipelined GETs in windows of about `wire.commands.WINDOW_BYTES` (with several
  `read_lanes`, that over the lanes, each window over its own connection, taken in order);
  each value is decoded and checked against the key (hash, dtype, shape, token count, every
  part's checksum). The first missing or bad chunk ends the run; a bad one is counted and
  deleted so nobody trips on it again. With an `integrity_key` a value is served only when
  its MAC verifies for the key it was read from (`value.path.ValuePath`, the check and
  decode pages use too); one without a MAC, or with one that does not verify, is a miss left
  in place
  (`remote.unauthenticated_chunks`). Such a window arrives in runs of about
  `VERIFY_RUN_BYTES`, one run's MACs checked while the next run is received.
- GET replies are received through the tier's channel (`bulk.BulkPipeline`; a cluster's:
  per node) into the chunk's own memory when the value is stored raw,
  otherwise into a reused arena; a reply is used only after the whole batch arrived, and a
  broken batch is an error, never a partial chunk. The whole read ends within
  `remote_timeout` (`deadline.call_deadline`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from lmcache_remote.errors import (
    CorruptEntryError,
    ForeignEntryError,
)
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.local.memory import MemoryObj
from lmcache_remote.storage.session.channel import failed
from lmcache_remote.storage.value.path import ValuePath, Verdicts
from lmcache_remote.storage.wire import windows as wire_windows
from lmcache_remote.storage.wire.arena import ArenaPool
from lmcache_remote.storage.wire.commands import regroup
from lmcache_remote.storage.wire.deadline import call_deadline
from lmcache_remote.storage.wire.lanes import LaneThreads
from lmcache_remote.storage.wire.resp import Reply
from lmcache_remote.storage.wire.windows import byte_windows, read_ahead
from lmcache_remote.values.value_format import header_nbytes

logger = logging.getLogger(__name__)
#: Raw bytes per run of a window read with an `integrity_key` (`ChunkReads._get_window`).
VERIFY_RUN_BYTES = 4 * 1024 * 1024
#: Gives a read its chunk buffer of so many tokens, or None when there is no room.
Allocator = Callable[[int], MemoryObj | None]


class ChunkReads:
    """The reads of `RedisTier` (see the module doc), a part it is built from: over the
    tier's lookup (``lookup``: its keys, layout, serde, metrics and channel), its value path
    and verdicts, the buffers ``allocate`` gives, the tier's ``lanes`` and its ``delete`` (a
    damaged chunk is deleted). ``read_lanes``: connections one read uses at once."""

    def __init__(self, lookup: RemoteLookup, values: ValuePath, verdicts: Verdicts,
                 allocate: Allocator, lanes: LaneThreads,
                 delete: Callable[[Sequence[CacheEngineKey]], int], read_lanes: int) -> None:
        self.lookup = lookup
        self.values = values
        self.verdicts = verdicts
        self.allocate = allocate
        self.read_lanes = read_lanes
        self._lanes = lanes
        self._delete = delete
        self._arenas = ArenaPool()

    def get(self, specs: Sequence[ChunkSpec]) -> list[MemoryObj]:
        """The leading run of good chunks; the whole read, every window on every lane, ends
        within `remote_timeout` (`deadline.call_deadline`): a read cut short there raises."""
        out: list[MemoryObj] = []
        try:
            with call_deadline(self.lookup.config.remote_timeout):
                self._get_wire(specs, out)
            return out
        except BaseException:  # a later window failed: the earlier ones' buffers go back
            for obj in out:
                obj.release()
            raise

    def _get_wire(self, specs: Sequence[ChunkSpec], out: list[MemoryObj]) -> None:
        """Appends the leading run of good chunks to ``out``, window by window; with several
        `read_lanes`, windows of `WINDOW_BYTES / lanes` are fetched at once, each over its own
        connection, and taken in order (what follows a short window is released)."""
        lanes = self.read_lanes
        windows = self._windows(specs, wire_windows.WINDOW_BYTES // max(1, lanes))
        if lanes <= 1 or len(windows) <= 1:
            for window in windows:
                got, complete = self._get_window(window)
                out.extend(got)
                if not complete:
                    break
            return
        executor = self._lanes.get("lmcr_reader", lanes, step_first=True)
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
        """The leading run of good chunks of one window, and whether the whole window was.

        With an `integrity_key` the window is received in runs of about `VERIFY_RUN_BYTES`,
        each run's MACs checked on this thread while the next run is received on a receiver
        thread (BLAKE3 and the receive loop both run without the GIL): the lanes' windows
        arrive together, so checking only after a whole window would add every byte's MAC to
        the read instead of hiding it behind the transfer."""
        objs: list[MemoryObj] = []
        for spec in window:
            obj = self.allocate(spec.num_tokens)
            if obj is None:
                self.lookup.metrics.inc("remote.pool_full")
                break
            objs.append(obj)
        arena = self._arenas.acquire()
        good: list[MemoryObj] = []
        pending: Future[Any] | None = None
        try:
            specs = window[: len(objs)]
            runs = (self._verify_runs(specs) if self.values.integrity is not None
                    else [range(len(specs))])
            receive = lambda run: self._receive(  # noqa: E731
                [specs[i] for i in run], [objs[i] for i in run], arena)
            received = receive(runs[0]) if runs else ([], [])
            for n, run in enumerate(runs):
                if pending is not None:
                    received, pending = pending.result(), None
                if n + 1 < len(runs):  # the next run comes in while this one is checked
                    pending = self._lanes.get("lmcr_receiver", self.read_lanes).submit(
                        contextvars.copy_context().run, receive, runs[n + 1])
                replies, digests = received
                for i, values, known in zip(run, replies, digests, strict=True):
                    if not self._decode_received(specs[i], objs[i], values, known):
                        return good, False
                    good.append(objs[i])
        except BaseException:  # a later run failed: the window fails whole, as one batch
            good.clear()
            raise
        finally:
            if pending is not None:  # a run still coming into chunks about to be released
                with contextlib.suppress(BaseException):
                    pending.result()
            self._arenas.release(arena)
            for obj in objs[len(good):]:
                obj.release()
        return good, len(good) == len(window)

    def _verify_runs(self, specs: Sequence[ChunkSpec]) -> list[range]:
        """Consecutive runs of the window's chunks, each about `VERIFY_RUN_BYTES` (at least
        one chunk)."""
        sizes = [self.lookup.layout.nbytes(spec.num_tokens) for spec in specs]
        return byte_windows(sizes, VERIFY_RUN_BYTES)

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
        key_lists = [self.lookup.chunk_keys(s) for s in specs]
        places = []  # per value: its chunk, part index, and raw byte range in the chunk
        # raw bytes per chunk
        totals = [self.lookup.layout.nbytes(spec.num_tokens) for spec in specs]
        for c, (total, keys) in enumerate(zip(totals, key_lists, strict=True)):
            size = self.lookup.serde.part_size_for(total)
            places += [(c, p, p * size, min(total, (p + 1) * size)) for p in range(len(keys))]
        sink: Any
        if self.lookup.serde.codec.codec_id == 0:
            # the values this reader serves are authenticated
            mac = self.values.integrity is not None
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
        """Each GET's reply, received where ``sink`` says; None for a missing value or one
        whose node failed (a cluster's). ``sizes``: each reply's expected bytes; ``ahead``:
        the bytes to keep asked for (`read_ahead`); ``digests``: filled where the receive
        loop hashed a reply (`BulkPipeline.execute`)."""
        replies = self.lookup.channel.run(commands, "get", receive=(sink, sizes, ahead, digests))
        return [None if failed(r) else r for r in replies]

    def _decode_received(self, spec: ChunkSpec, obj: MemoryObj, values: list[Reply],
                         digests: list[int | None]) -> bool:
        """Checks and decodes one chunk's replies into ``obj`` (`value.path.ValuePath`); False
        for a miss or a bad one. ``digests``: each reply's part checksum as the receive loop
        computed it, or None."""
        if values[0] is None:
            self.lookup.metrics.inc("remote.miss_chunks")
            return False
        try:
            nbytes = self.values.check_and_decode(
                values, digests, name=spec.key.to_string(), hash_bytes=spec.key.hash_bytes,
                num_tokens=spec.num_tokens, shape=self.lookup.layout.shape(spec.num_tokens),
                dtype=self.lookup.layout.dtype, out=obj,
                refetch=lambda parts: self._fetch(
                    [spec.key.part_keys(self.lookup.prefix, parts)])[0])
        except (ForeignEntryError, CorruptEntryError) as exc:
            if self.verdicts.settle(spec.key.chunk_hash, exc, lambda: self._delete([spec.key])):
                self.lookup.note_foreign(spec.key)
            return False
        self.lookup.metrics.inc("remote.hit_chunks")
        self.lookup.metrics.inc("remote.read_bytes", nbytes)
        return True

    def _fetch(self, key_lists: Sequence[Sequence[str]]) -> list[list[bytes | None]]:
        """Every value of these key lists, as bytes (None: missing, or its node failed)."""
        flat = self.lookup.channel.run([("GET", key) for keys in key_lists for key in keys], "get",
                                bulk=False)
        return regroup([v if isinstance(v, bytes) else None for v in flat], key_lists)

    def _windows(self, specs: Sequence[ChunkSpec], window_bytes: int
                 ) -> list[Sequence[ChunkSpec]]:
        """The specs cut into windows of about ``window_bytes``."""
        sizes = [self.lookup.layout.nbytes(spec.num_tokens) for spec in specs]
        return [specs[w.start:w.stop] for w in byte_windows(sizes, window_bytes)]
