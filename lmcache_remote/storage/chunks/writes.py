"""The writes of `RedisTier` (`ChunkWrites`): chunks into Redis/Valkey, each whole or absent.

- `put_each`: one command per chunk, so each chunk is written in one atomic step: SET (one
  part), MSET (several parts), or, when `remote_ttl` is set and there are several parts, an
  EVAL of `SET ... PX` per part (MSET takes no expiry, and MSET then PEXPIRE could leave parts
  without one if the connection broke in between). `chunk_write_command` builds it for every
  tier. On a single server a put's chunks go out in windows over up to `write_lanes`
  connections at once, fewer for big chunks (`ChunkWrites.lanes_for`): encoding, sending
  and the server's work overlap across windows;
  encoded bytes in flight stay within one `ByteBudget`, and a window that fails fails alone:
  its chunks are not counted as written, the others' are, and the error is raised when all
  are done.
- Each chunk is encoded by `value.path.ValuePath` (the encode-and-seal pages use too).
  Through `bulk.BulkPipeline` values leave as memoryviews of the chunk buffers (no packer
  copy) and the checksums are computed as they are sent (a seal per chunk), on a cluster per
  node (`session.channel.write_values`: a script per chunk there, a node that fails loses
  only its chunks). With an `integrity_key` every value carries a MAC bound to its chunk key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_remote.errors import BackendError
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.local.memory import MemoryObj
from lmcache_remote.storage.session.channel import write_values
from lmcache_remote.storage.value.path import ValuePath
from lmcache_remote.storage.wire import windows as wire_windows
from lmcache_remote.storage.wire.bulk import Seal
from lmcache_remote.storage.wire.lanes import LaneThreads
from lmcache_remote.storage.wire.windows import ByteBudget, byte_windows, value_nbytes

#: Chunks a write lane's window should hold at least (`ChunkWrites.lanes_for`).
LANE_CHUNKS = 4


class ChunkWrites:
    """The writes of `RedisTier` (see the module doc), a part it is built from: over the
    tier's lookup (``lookup``: its serde, metrics and channel), its value path, the tier's
    ``lanes``; ``write_lanes`` connections at once, the expiry ``ttl_ms``, the encoded bytes
    in flight within one `ByteBudget` of `WINDOW_BYTES`."""

    def __init__(self, lookup: RemoteLookup, values: ValuePath, lanes: LaneThreads,
                 write_lanes: int, ttl_ms: int | None) -> None:
        self.lookup = lookup
        self.values = values
        self.write_lanes = write_lanes
        self._lanes = lanes
        self._ttl_ms = ttl_ms
        self._write_budget = ByteBudget(wire_windows.WINDOW_BYTES)

    def put_each(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> list[bool]:
        """Writes the chunks, each in one atomic command; per chunk, whether it landed.

        On a single server the chunks are cut into windows of about `WINDOW_BYTES / lanes`
        and up to `lanes_for(objs)` windows are encoded and written at once, each over its own
        pooled connection: one window's encoding overlaps another's sending, and Redis always
        has bytes to read. Encoded bytes in flight stay within `WINDOW_BYTES` (raw parts are
        views of the chunk buffers and cost nothing). If a window fails, the others still run
        to the end and only the chunks whose command was answered count as landed (and in
        `remote.written_chunks`). The first error is raised when nothing landed; otherwise it
        is counted (`remote.errors`) and logged, and the failed windows' chunks are False."""
        if not keys:
            return []
        # one lane on a cluster: its channel runs the nodes at once
        lanes = self.lanes_for(objs) if self.lookup.wire is not None else 1
        windows = self._write_windows(objs, wire_windows.WINDOW_BYTES // lanes)
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
            executor = self._lanes.get("lmcr_writer", lanes)
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
            self.lookup.metrics.inc("remote.errors")
            self.lookup.log.warning("write-window", "a write window failed after %d chunks "
                                    "landed: %s", sum(landed), error)
        return landed

    def lanes_for(self, objs: Sequence[MemoryObj]) -> int:
        """The connections a put of these chunks uses at once: enough that each lane's
        window holds `LANE_CHUNKS` of the largest chunks, at least two (one window is encoded
        while another is sent), at most `write_lanes`. Big chunks then go over few lanes:
        with 32 MiB chunks eight lanes put eight whole chunks in flight at once, and on 2
        cores the lane threads and redis-server's reads of eight sockets took more CPU per
        byte than they saved (docs/benchmarks.md, "Writes at the socket's limit")."""
        biggest = max([1, *(obj.nbytes for obj in objs)])
        fit = wire_windows.WINDOW_BYTES // (LANE_CHUNKS * biggest)
        return min(self.write_lanes, max(2, fit))

    def _write_windows(self, objs: Sequence[MemoryObj], window_bytes: int) -> list[range]:
        """Consecutive runs of chunk indexes, each about ``window_bytes`` of raw KV (at least
        one chunk)."""
        return byte_windows([obj.nbytes for obj in objs], window_bytes)

    def _encoded_cost(self, pairs: Sequence[tuple[CacheEngineKey, MemoryObj]]) -> int:
        """Bytes encoding these chunks allocates, at most: none for raw (views), else their size."""
        if self.lookup.serde.codec.codec_id == 0 and self.lookup.channel.bulk_path:
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
        seals: list[Seal | None] = []
        for key, obj in pairs:
            values, seal = self.values.encode(obj, key.to_string(), key.hash_bytes,
                                              obj.tensor.shape[2],
                                              sealed_on_wire=self.lookup.channel.bulk_path)
            seals.append(seal)
            batch.append((key.part_keys(self.lookup.prefix, len(values)), values))
        return self._write(batch, seals if self.lookup.channel.bulk_path else None)

    def _write(self, batch: Sequence[tuple[list[str], list[Any]]],
               seals: Sequence[Seal | None] | None = None) -> list[bool]:
        """Write one window of chunks (`channel.write_values`); per chunk, whether it landed
        (a single server's all or none: a failure raises; a cluster's node that failed loses
        only its own chunks). ``seals``: per chunk, the checksums the wire fills in as it
        sends."""
        landed = write_values(self.lookup.channel, batch, seals, self._ttl_ms, "write")
        nbytes = sum(value_nbytes(v) for (_, values), ok in zip(batch, landed, strict=True)
                     if ok for v in values)
        self.lookup.metrics.inc("remote.written_chunks", sum(landed))
        self.lookup.metrics.inc("remote.written_bytes", nbytes)
        return landed
