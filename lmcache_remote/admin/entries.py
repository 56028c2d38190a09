"""Chunk entries as the admin tools see them: one `Entry` per chunk key (part index 0).

`iter_entry_batches` streams SCAN pages (`storage.scan.scan_batches`) and turns the chunk keys
of each page into entries with one pipeline per page (`notouch.ReadPipeline`: the keys' LRU
clocks are left alone): `OBJECT IDLETIME` and `PTTL` of every key first, then `GETRANGE key 0
4095` (the header; a longer header is read again in full) and `STRLEN`. Part keys (`#1`,
`#2`, ...) are not entries of their own: the chunk's header names how many there are and how
long each is, so an entry knows all its keys and its exact size without reading the payload.

A chunk whose header does not decode is still an entry (`error` set, one value assumed, size
= the length of value 0), so it can be listed and evicted. A key that vanished between SCAN and
the pipeline is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from lmcache_remote.admin.filters import EntryFilter
from lmcache_remote.admin.notouch import ReadPipeline
from lmcache_remote.errors import CorruptEntryError, ForeignEntryError, KeyFormatError
from lmcache_remote.naming.keys import (
    CacheEngineKey,
    PageKey,
    page_scan_pattern,
    split_page_part_key,
)
from lmcache_remote.storage.session.scan import DEFAULT_COUNT, scan_batches
from lmcache_remote.values.serde import (
    AUTHENTICATED,
    HEADER_FIXED,
    Serde,
    ValueHeader,
    header_nbytes,
)

HEADER_READ = 4096
_SERDE = Serde("raw")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored chunk: its key, its values' keys and sizes, and what its header says."""

    key: CacheEngineKey
    redis_key: str
    part_count: int
    nbytes: int
    """Sum of the lengths of all the chunk's values (header included)."""
    idle_seconds: int | None
    """Seconds since last access (None when the server does not track it, e.g. LFU)."""
    ttl_ms: int | None
    """Remaining time to live in milliseconds; None = no expiry."""
    header: ValueHeader | None
    error: str | None = None

    @property
    def keys(self) -> list[str]:
        """Every value key of the chunk: the chunk key, then `#1`, `#2`, ..."""
        return [self.redis_key] + [f"{self.redis_key}#{i}" for i in range(1, self.part_count)]

    @property
    def num_tokens(self) -> int | None:
        return self.header.num_tokens if self.header is not None else None


def iter_entry_batches(
    client: Any, prefix: str, flt: EntryFilter, count: int = DEFAULT_COUNT
) -> Iterator[tuple[redis.Redis, list[bytes], list[Entry]]]:
    """Per SCAN page: (node client, every key of the page, the page's matching entries)."""
    for node, keys in scan_batches(client, flt.pattern(prefix), count):
        heads = [(raw, k) for raw, k, index in flt.matching_values(prefix, keys) if index == 0]
        entries = load_entries(node, prefix, heads) if heads else []
        yield node, keys, [e for e in entries if flt.matches_idle(e.idle_seconds)]


def iter_entries(client: Any, prefix: str, flt: EntryFilter,
                 count: int = DEFAULT_COUNT) -> Iterator[Entry]:
    for _node, _keys, entries in iter_entry_batches(client, prefix, flt, count):
        yield from entries


def load_entries(node: Any, prefix: str,
                 heads: Sequence[tuple[bytes, CacheEngineKey]]) -> list[Entry]:
    """Entries for chunk keys, one pipeline (plus one per over-long header)."""
    reads = ReadPipeline(node, heads[0][0])  # a cluster's client: inspect's one chunk
    pipe = reads.pipe
    for raw, _ in heads:  # idle times before any read (servers without CLIENT NO-TOUCH)
        pipe.object("idletime", raw)
        pipe.pttl(raw)
    for raw, _ in heads:
        pipe.getrange(raw, 0, HEADER_READ - 1)
        pipe.strlen(raw)
    replies = reads.execute(raise_on_error=False)
    n = len(heads)
    out = []
    for i, (raw, key) in enumerate(heads):
        idle, pttl = replies[2 * i: 2 * i + 2]
        head, strlen = replies[2 * n + 2 * i: 2 * n + 2 * i + 2]
        if isinstance(pttl, Exception):
            raise pttl
        if int(pttl) == -2 or isinstance(strlen, Exception) or int(strlen) == 0:
            continue  # gone since SCAN
        if isinstance(head, Exception):
            raise head
        out.append(_entry(node, raw, key, bytes(head), int(strlen), idle, int(pttl)))
    return out


def _entry(node: Any, raw: bytes, key: CacheEngineKey, head: bytes, strlen: int, idle: Any,
           pttl: int) -> Entry:
    idle_s = None if isinstance(idle, Exception) or idle is None else int(idle)
    ttl = None if pttl < 0 else pttl
    redis_key = raw.decode("utf-8", "surrogateescape")
    try:
        header = read_header(node, raw, head, strlen)
    except (CorruptEntryError, ForeignEntryError) as exc:
        return Entry(key, redis_key, 1, strlen, idle_s, ttl, None, str(exc))
    nbytes = strlen + sum(stored for stored, _ in header.parts[1:])
    return Entry(key, redis_key, header.part_count, nbytes, idle_s, ttl, header)


def read_header(node: Any, raw: bytes, head: bytes, strlen: int) -> ValueHeader:
    """Decode a chunk's header from the first bytes of value 0, reading more if needed."""
    if len(head) >= HEADER_FIXED.size and len(head) < strlen:
        fields = HEADER_FIXED.unpack_from(head)
        need = header_nbytes(fields[-1], bool(fields[1] & AUTHENTICATED))
        if need > len(head):
            reads = ReadPipeline(node, raw)
            reads.pipe.getrange(raw, 0, need - 1)
            head = bytes(reads.execute()[0])
    return _SERDE.read_header(head)


def iter_page_entries(client: Any, prefix: str, model_name: str | None = None,
                      count: int = DEFAULT_COUNT) -> Iterator[dict[str, Any]]:
    """The SGLang backend's pages under the prefix (one model namespace's with `model_name`),
    in SCAN order, as JSON-ready rows: key fields, parts, bytes of all values, tokens, idle
    time, TTL; read like chunk entries (the header's first bytes, under `CLIENT NO-TOUCH`)."""
    for node, keys in scan_batches(client, page_scan_pattern(prefix, model_name), count):
        heads = []
        for raw in keys:
            try:
                key, index = split_page_part_key(prefix, raw)
            except KeyFormatError:
                continue
            if index == 0 and (model_name is None or key.model_name == model_name):
                heads.append((raw, key))
        if heads:
            yield from _page_rows(node, heads)


def _page_rows(node: Any, heads: Sequence[tuple[bytes, PageKey]]) -> Iterator[dict[str, Any]]:
    reads = ReadPipeline(node, heads[0][0])
    for raw, _ in heads:
        reads.pipe.object("idletime", raw)
        reads.pipe.pttl(raw)
    for raw, _ in heads:
        reads.pipe.getrange(raw, 0, HEADER_READ - 1)
        reads.pipe.strlen(raw)
    replies = reads.execute(raise_on_error=False)
    n = len(heads)
    for i, (raw, key) in enumerate(heads):
        idle, pttl = replies[2 * i: 2 * i + 2]
        head, strlen = replies[2 * n + 2 * i: 2 * n + 2 * i + 2]
        if isinstance(pttl, Exception) or isinstance(strlen, Exception) or isinstance(
                head, Exception) or int(pttl) == -2 or int(strlen) == 0:
            continue  # gone since SCAN (or unreadable: not listed)
        row: dict[str, Any] = {
            "redis_key": raw.decode("utf-8", "surrogateescape"), "model_name": key.model_name,
            "geometry": key.geometry, "page_hash": key.page_hash, "parts": 1,
            "bytes": int(strlen), "num_tokens": None,
            "idle_seconds": None if isinstance(idle, Exception) or idle is None else int(idle),
            "ttl_seconds": None if int(pttl) < 0 else int(pttl) / 1000, "error": None}
        try:
            header = read_header(node, raw, bytes(head), int(strlen))
        except (CorruptEntryError, ForeignEntryError) as exc:
            row["error"] = str(exc)
        else:
            row.update(parts=header.part_count, num_tokens=header.num_tokens,
                       bytes=int(strlen) + sum(stored for stored, _ in header.parts[1:]))
        yield row
