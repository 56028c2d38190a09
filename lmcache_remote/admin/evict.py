"""Delete chunks: `plan_eviction` counts what a filter matches, `evict` deletes it.

Only keys under the prefix are ever touched: candidates come from SCAN with the chunk
pattern under the prefix, and each is parsed as a chunk key before anything happens to it.
A matching chunk is deleted whole: `UNLINK` of its key and every part key its header names,
one command per chunk (one hash slot), pipelined per SCAN page. Without an idle-time filter,
stray part keys whose chunk key matches the filter are unlinked too (left-overs of a chunk
whose value 0 is gone), so nothing of a matching chunk survives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lmcache_remote.admin.entries import iter_entry_batches
from lmcache_remote.admin.filters import EntryFilter


@dataclasses.dataclass(frozen=True)
class EvictResult:
    matched: int
    """Chunks that matched the filter."""
    deleted: int
    """Chunks deleted (0 for a plan or a dry run)."""
    bytes: int
    """Sum of the value lengths of the matched chunks."""


def plan_eviction(client: Any, prefix: str, flt: EntryFilter,
                  progress: Callable[[int], None] | None = None) -> EvictResult:
    """What `evict` would delete now: matched chunks and their bytes; nothing is deleted."""
    matched = nbytes = 0
    for _node, keys, entries in iter_entry_batches(client, prefix, flt):
        matched += len(entries)
        nbytes += sum(e.nbytes for e in entries)
        if progress is not None:
            progress(len(keys))
    return EvictResult(matched, 0, nbytes)


def _stray_parts(prefix: str, keys: list[bytes], flt: EntryFilter) -> list[bytes]:
    """Part keys of matching chunks (their head may already be gone)."""
    return [raw for raw, _, index in flt.matching_values(prefix, keys) if index > 0]


def evict(client: Any, prefix: str, flt: EntryFilter,
          progress: Callable[[int], None] | None = None) -> EvictResult:
    """Delete every chunk `flt` matches; counts what was matched and deleted."""
    matched = deleted = nbytes = 0
    for node, keys, entries in iter_entry_batches(client, prefix, flt):
        strays = [] if flt.needs_idle else _stray_parts(prefix, keys, flt)
        if entries or strays:
            pipe = node.pipeline(transaction=False)
            for entry in entries:
                pipe.unlink(*entry.keys)
            for raw in strays:
                pipe.unlink(raw)
            results = pipe.execute()
            deleted += sum(1 for r in results[: len(entries)] if int(r) > 0)
        matched += len(entries)
        nbytes += sum(e.nbytes for e in entries)
        if progress is not None:
            progress(len(keys))
    return EvictResult(matched, deleted, nbytes)
