"""Delete chunks: `plan_eviction` counts what a filter matches, `evict` deletes it.

Only keys under the prefix are ever touched: candidates come from SCAN with the chunk
pattern under the prefix, and each is parsed as a chunk key before anything happens to it.
A matching chunk is deleted whole: `UNLINK` of its key and every part key its header names,
one command per chunk (one hash slot), pipelined per SCAN page. Without an idle-time filter,
stray part keys whose chunk key matches the filter are unlinked too (left-overs of a chunk
whose value 0 is gone), so nothing of a matching chunk survives.

`evict_pages` / `plan_page_eviction` do the same for the SGLang backend's pages
(`{prefix}:hc1:...`, all of them or one model namespace's): every value key of a matching
page, its part keys included, pipelined per SCAN page; their lengths are read under
`CLIENT NO-TOUCH`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lmcache_remote.admin.entries import iter_entry_batches
from lmcache_remote.admin.filters import EntryFilter
from lmcache_remote.admin.notouch import ReadPipeline
from lmcache_remote.errors import KeyFormatError
from lmcache_remote.naming.keys import page_scan_pattern, split_page_part_key
from lmcache_remote.storage.session.scan import scan_batches


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


def _page_values(client: Any, prefix: str, model_name: str | None) -> Any:
    """(node, every page value key of the model's pages in one SCAN page, their part
    indexes, their lengths) per SCAN page."""
    for node, raw_keys in scan_batches(client, page_scan_pattern(prefix, model_name)):
        found = []
        for raw in raw_keys:
            try:
                key, index = split_page_part_key(prefix, raw)
            except KeyFormatError:
                continue
            if model_name is None or key.model_name == model_name:
                found.append((raw, index))
        reads = ReadPipeline(node)  # STRLEN would refresh every key's LRU clock
        for raw, _ in found:
            reads.pipe.strlen(raw)
        lengths = [int(n) for n in reads.execute()] if found else []
        yield node, raw_keys, found, lengths


def plan_page_eviction(client: Any, prefix: str, model_name: str | None = None,
                       progress: Callable[[int], None] | None = None) -> EvictResult:
    """What `evict_pages` would delete now: pages (their first values) and bytes."""
    matched = nbytes = 0
    for _node, raw_keys, found, lengths in _page_values(client, prefix, model_name):
        matched += sum(1 for (_, index), n in zip(found, lengths, strict=True)
                       if index == 0 and n > 0)
        nbytes += sum(lengths)
        if progress is not None:
            progress(len(raw_keys))
    return EvictResult(matched, 0, nbytes)


def evict_pages(client: Any, prefix: str, model_name: str | None = None,
                progress: Callable[[int], None] | None = None) -> EvictResult:
    """Deletes every value of the SGLang pages under the prefix (of one model namespace
    when `model_name` is given)."""
    matched = deleted = nbytes = 0
    for node, raw_keys, found, lengths in _page_values(client, prefix, model_name):
        if found:
            pipe = node.pipeline(transaction=False)
            for raw, _ in found:
                pipe.unlink(raw)
            results = pipe.execute()
            heads = [i for i, (_, index) in enumerate(found) if index == 0]
            matched += sum(1 for i in heads if lengths[i] > 0)
            deleted += sum(1 for i in heads if int(results[i]) > 0)
            nbytes += sum(lengths)
        if progress is not None:
            progress(len(raw_keys))
    return EvictResult(matched, deleted, nbytes)
