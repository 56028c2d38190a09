"""Export chunks into a snapshot file, import them back (into any Redis, under any prefix).

- `export_snapshot`: streams the matching entries (`iter_entry_batches`), reads their values
  and remaining TTLs (`GET` + `PTTL` per value, pipelined in windows of about `WINDOW_BYTES`)
  and appends one record per chunk. A chunk that vanished or changed shape meanwhile is
  skipped and counted, never written half.
- `verify_snapshot`: reads the whole file once and checks every checksum and key; raises
  `SnapshotError` (with the byte offset) at the first damage.
- `import_snapshot`: verifies the whole file first, so a damaged file imports nothing; then
  writes every chunk in windows, each chunk in one atomic command (`chunk_write_command`: SET,
  MSET, or an EVAL of `SET ... PX` per value when the chunk had a TTL). Values are written byte
  for byte as exported; the chunk gets the remaining TTL it had at export time (the shortest
  of its values', which a chunk written by the engine shares anyway). With `skip_existing`
  (what `warm` does) a chunk whose values all exist already is left alone.
- `export_pages`: the SGLang backend's pages (all, or one model namespace's) the same way,
  one record per page under its page key; `verify_snapshot` and `import_snapshot` take page
  records as they take chunk records (a page's values and keys follow the same rules).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lmcache_remote.admin.entries import Entry, iter_entry_batches, iter_page_entries
from lmcache_remote.admin.filters import EntryFilter
from lmcache_remote.admin.notouch import ReadPipeline
from lmcache_remote.admin.snapshot import (
    SnapshotError,
    SnapshotInfo,
    SnapshotReader,
    SnapshotRecord,
    SnapshotWriter,
)
from lmcache_remote.errors import KeyFormatError
from lmcache_remote.naming.keys import (
    absolute_key,
    relative_key,
    split_page_part_key,
    split_part_key,
)
from lmcache_remote.storage.wire.commands import chunk_write_command
from lmcache_remote.storage.wire.windows import WINDOW_BYTES, iter_windows

Progress = Callable[[int], None] | None


@dataclasses.dataclass(frozen=True)
class TransferResult:
    chunks: int
    """Chunks exported or imported."""
    bytes: int
    """Sum of the lengths of their values."""
    skipped: int = 0
    """Chunks left out: vanished during export, or already present on a warm import."""


def _windows(entries: Iterable[Entry]) -> Iterator[list[Entry]]:
    return iter_windows(entries, lambda entry: entry.nbytes, WINDOW_BYTES)


def export_snapshot(client: Any, prefix: str, path: str | os.PathLike[str],
                    flt: EntryFilter | None = None, progress: Progress = None) -> TransferResult:
    flt = flt or EntryFilter()
    chunks = nbytes = skipped = 0
    with SnapshotWriter(path, prefix) as writer:
        for node, _keys, entries in iter_entry_batches(client, prefix, flt):
            for window in _windows(entries):
                reads = ReadPipeline(node)  # GET would refresh every key's LRU clock
                for entry in window:
                    for key in entry.keys:
                        reads.pipe.get(key)
                        reads.pipe.pttl(key)
                replies = iter(reads.execute())
                for entry in window:
                    got = [(next(replies), next(replies)) for _ in entry.keys]
                    if any(v is None or int(t) == -2 for v, t in got):
                        skipped += 1
                        continue
                    values = [bytes(v) for v, _ in got]
                    ttls = [None if int(t) < 0 else int(t) for _, t in got]
                    writer.add(relative_key(prefix, entry.redis_key), values, ttls)
                    chunks += 1
                    nbytes += sum(len(v) for v in values)
                if progress is not None:
                    progress(len(window))
    return TransferResult(chunks, nbytes, skipped)


def export_pages(client: Any, prefix: str, path: str | os.PathLike[str],
                 model_name: str | None = None, progress: Progress = None) -> TransferResult:
    """The SGLang backend's pages under `prefix` (one model namespace's with `model_name`)
    into a snapshot file: one record per page, its values byte for byte and their TTLs."""
    pages = nbytes = skipped = 0
    with SnapshotWriter(path, prefix) as writer:
        for row in iter_page_entries(client, prefix, model_name):
            if row["error"] is not None:
                skipped += 1
                continue
            base = row["redis_key"]
            keys = [base] + [f"{base}#{i}" for i in range(1, int(row["parts"]))]
            reads = ReadPipeline(client, base)  # GET would refresh every key's LRU clock
            for key in keys:
                reads.pipe.get(key)
                reads.pipe.pttl(key)
            replies = reads.execute()
            got = list(zip(replies[::2], replies[1::2], strict=True))
            if any(v is None or int(t) == -2 for v, t in got):
                skipped += 1
                continue
            values = [bytes(v) for v, _ in got]
            writer.add(relative_key(prefix, base), values,
                       [None if int(t) < 0 else int(t) for _, t in got])
            pages += 1
            nbytes += sum(len(v) for v in values)
            if progress is not None:
                progress(1)
    return TransferResult(pages, nbytes, skipped)


def verify_snapshot(path: str | os.PathLike[str], prefix: str,
                    progress: Progress = None) -> SnapshotInfo:
    """Read the whole file, checking every checksum and key; the info with record counts."""
    with SnapshotReader(path) as reader:
        for record in reader.records():
            _chunk_key(reader, prefix, record)
            if progress is not None:
                progress(record.nbytes)
        return reader.info


def _chunk_key(reader: SnapshotReader, prefix: str, record: SnapshotRecord) -> str:
    key = absolute_key(prefix, record.key)
    try:
        try:
            _, index = split_part_key(prefix, key)
        except KeyFormatError:  # an SGLang page's record
            _, index = split_page_part_key(prefix, key)
    except ValueError as exc:  # KeyFormatError, or a malformed number
        raise SnapshotError(
            reader.path, record.offset, f"record key is not a chunk or page key: {exc}"
        ) from None
    if index != 0:
        raise SnapshotError(reader.path, record.offset, "record key is a part key")
    return key


def import_snapshot(client: Any, prefix: str, path: str | os.PathLike[str], *,
                    skip_existing: bool = False, verify: bool = True,
                    progress: Progress = None, default_ttl_ms: int | None = None,
                    handled: list[tuple[str, int, int]] | None = None) -> TransferResult:
    """Import every chunk of the file under `prefix`; nothing at all if the file is damaged.

    `progress` is called with the bytes of each chunk handled (imported or skipped). A chunk
    the file holds without an expiry gets `default_ttl_ms` (the importer's `remote_ttl`: under
    a `volatile-*` policy a value without one would never be evicted). `handled` receives
    (value-0 key, values, bytes) of every chunk imported or skipped (`warm --pin`).
    """
    if verify:
        verify_snapshot(path, prefix)
    chunks = nbytes = skipped = 0
    with SnapshotReader(path) as reader:
        for window in iter_windows(_keyed(reader, prefix), lambda kr: kr[1].nbytes,
                                   WINDOW_BYTES):
            done, left = _write_window(client, window, skip_existing, progress, default_ttl_ms)
            chunks, nbytes, skipped = chunks + done[0], nbytes + done[1], skipped + left
            if handled is not None:
                handled.extend((keys[0], len(keys), r.nbytes) for keys, r in window)
    return TransferResult(chunks, nbytes, skipped)


def _keyed(reader: SnapshotReader, prefix: str
           ) -> Iterator[tuple[list[str], SnapshotRecord]]:
    """Each record of the file with the value keys it goes under."""
    for record in reader.records():
        base = _chunk_key(reader, prefix, record)
        yield [base] + [f"{base}#{i}" for i in range(1, len(record.values))], record


def _write_window(client: Any, window: list[tuple[list[str], SnapshotRecord]],
                  skip_existing: bool, progress: Progress, default_ttl_ms: int | None = None
                  ) -> tuple[tuple[int, int], int]:
    todo = window
    if skip_existing:
        pipe = client.pipeline(transaction=False)
        for keys, _ in window:
            pipe.exists(*keys)
        present = pipe.execute()
        todo = [w for w, n in zip(window, present, strict=True) if int(n) != len(w[0])]
    pipe = client.pipeline(transaction=False)
    for keys, record in todo:
        px = _chunk_px(record.ttls_ms)
        pipe.execute_command(*chunk_write_command(keys, record.values,
                                                  default_ttl_ms if px is None else px))
    if todo:
        pipe.execute()
    if progress is not None:
        progress(sum(r.nbytes for _, r in window))
    return (len(todo), sum(r.nbytes for _, r in todo)), len(window) - len(todo)


def _chunk_px(ttls_ms: list[int | None]) -> int | None:
    """One PX for all of a chunk's values: the shortest remaining TTL among them (None if none
    has one); 0 (about to expire) becomes 1 ms, not 'forever'."""
    present = [t for t in ttls_ms if t is not None]
    return max(1, min(present)) if present else None
