"""What the cache holds: entries and bytes per (model, world size, worker, dtype) group.

Counting is key-wise: every key matching the chunk pattern under the prefix is parsed with
`split_part_key` (keys that do not parse are not counted); a key with part index 0 is one
entry of its group, and the length of every value (`STRLEN`, pipelined per SCAN page) is added
to its group's bytes. Memory stays constant: one SCAN page at a time, plus one small dict per
group. Keys outside the prefix, and the engines' published-counter hashes, never match.

`page_stats` counts the SGLang backend's pages (`{prefix}:hc1:...`, `keys.PageKey`) the same
way, per (model, geometry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lmcache_remote.admin.filters import EntryFilter
from lmcache_remote.admin.notouch import ReadPipeline
from lmcache_remote.errors import KeyFormatError
from lmcache_remote.naming.keys import (
    KEEP_PARTS,
    keep_key,
    page_scan_pattern,
    split_page_part_key,
)
from lmcache_remote.storage.session.scan import DEFAULT_COUNT, scan_batches, scan_nodes

GroupKey = tuple[str, int, int, str]


@dataclasses.dataclass
class GroupStats:
    model_name: str
    world_size: int
    worker_id: int
    dtype: str
    entries: int = 0
    bytes: int = 0


def group_stats(client: Any, prefix: str, flt: EntryFilter | None = None,
                progress: Callable[[int], None] | None = None,
                count: int = DEFAULT_COUNT) -> list[GroupStats]:
    """One `GroupStats` per group with at least one value, sorted by group."""
    flt = flt or EntryFilter()
    groups: dict[GroupKey, GroupStats] = {}
    for node, raw_keys in scan_batches(client, flt.pattern(prefix), count):
        parsed = flt.matching_values(prefix, raw_keys)
        reads = ReadPipeline(node)  # STRLEN would refresh every key's LRU clock
        for raw, _, _ in parsed:
            reads.pipe.strlen(raw)
        for (_, key, index), length in zip(parsed, reads.execute(), strict=True):
            gk = (key.model_name, key.world_size, key.worker_id, key.dtype)
            group = groups.get(gk) or groups.setdefault(gk, GroupStats(*gk))
            group.entries += int(index == 0 and int(length) > 0)
            group.bytes += int(length)
        if progress is not None:
            progress(len(raw_keys))
    return [groups[k] for k in sorted(groups)]


@dataclasses.dataclass
class PageGroupStats:
    model_name: str
    geometry: str
    entries: int = 0
    bytes: int = 0


def page_stats(client: Any, prefix: str, progress: Callable[[int], None] | None = None,
               count: int = DEFAULT_COUNT) -> list[PageGroupStats]:
    """One `PageGroupStats` per (model, geometry) of the SGLang backend's pages under the
    prefix: pages (their first values) and the bytes of all their values; sorted."""
    groups: dict[tuple[str, str], PageGroupStats] = {}
    for node, raw_keys in scan_batches(client, page_scan_pattern(prefix), count):
        parsed = []
        for raw in raw_keys:
            try:
                key, index = split_page_part_key(prefix, raw)
            except KeyFormatError:
                continue
            parsed.append((raw, key, index))
        reads = ReadPipeline(node)  # STRLEN would refresh every key's LRU clock
        for raw, _, _ in parsed:
            reads.pipe.strlen(raw)
        for (_, key, index), length in zip(parsed, reads.execute(), strict=True):
            gk = (key.model_name, key.geometry)
            group = groups.get(gk) or groups.setdefault(gk, PageGroupStats(*gk))
            group.entries += int(index == 0 and int(length) > 0)
            group.bytes += int(length)
        if progress is not None:
            progress(len(raw_keys))
    return [groups[k] for k in sorted(groups)]


def keep_state(client: Any, prefix: str) -> dict[str, Any]:
    """The keep policy's state under ``prefix`` (docs/keep.md): the chunks it holds, their
    bytes, the ghosts it remembers, the accesses it learned from; zeros where it never ran."""
    index, _, ghosts, figures = (keep_key(prefix, part) for part in KEEP_PARTS)
    fields = client.hgetall(figures)
    accesses = sum(int(v) for k, v in fields.items()
                   if (k.decode() if isinstance(k, bytes) else str(k)).startswith("n:"))
    held = fields.get(b"bytes", fields.get("bytes", 0))
    return {"chunks": int(client.zcard(index)), "bytes": int(held or 0),
            "ghosts": int(client.zcard(ghosts)), "accesses": accesses}


def memory_info(client: Any) -> dict[str, Any]:
    """Redis memory summed over the server (or every cluster primary)."""
    used = maxmem = evicted = 0
    policy = None
    for node in scan_nodes(client):
        mem = node.info("memory")
        used += int(mem.get("used_memory", 0))
        maxmem += int(mem.get("maxmemory", 0))
        policy = policy or mem.get("maxmemory_policy")
        evicted += int(node.info("stats").get("evicted_keys", 0))
    return {
        "used_memory": used,
        "maxmemory": maxmem,
        "maxmemory_policy": policy,
        "evicted_keys": evicted,
        "nodes": len(scan_nodes(client)),
    }
