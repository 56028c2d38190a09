"""PageStore: fixed-size pages of KV bytes in Redis/Valkey, keyed by an engine's page hashes.

What SGLang's HiCache asks of an L3 store (`lmcache_remote.integrations.sglang`), kept here
apart from any engine: every page of one store has the same geometry (a `PageKey` geometry
string, a shape and a dtype), so its part count, and so every key, is known before any round
trip.

- Values: the project's value format (`lmcache_remote.values.serde`): a page is one tensor of shape
  ``page_shape`` (regions x elements), encoded by the configured codec, checksummed, cut into
  parts like a chunk (`remote_part_size`, planned to Redis's size classes), written by one
  atomic command (`chunk_write_command`): whole or absent. The header's chunk-hash field holds
  `PageKey.hash_bytes` (a digest of the key without its prefix), its token count the page size.
  With an `integrity_key` every value carries a MAC bound to that key, and only values whose
  MAC verifies are served.

The store is put together from three parts, each with its contract: `base` (the state,
`present`, `delete`, `clear`, `close`, windows over lanes, staging, bounds and errors),
`reads` (`read`) and `writes` (`write`).
"""

from __future__ import annotations

from lmcache_remote.storage.pages.base import WINDOW_BYTES, PageCopy, PagePlaces
from lmcache_remote.storage.pages.reads import PageReads
from lmcache_remote.storage.pages.writes import PageWrites

__all__ = ["WINDOW_BYTES", "PageCopy", "PagePlaces", "PageStore"]


class PageStore(PageWrites, PageReads):
    """Pages of one geometry (``page_shape``, ``dtype``, ``page_tokens``) under page keys."""
