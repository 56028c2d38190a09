"""KV views: batched copies between an engine's KV cache and canonical chunk tensors (the
contract is in view.py). This package re-exports its public names; one concept a module:

- view.py: `KVView`, the base class, its checks and its copy path through device staging;
- paged.py: `PagedKV`, vLLM's paged caches (`PAGED_LAYOUTS`);
- slots.py: a paged cache's slot mapping (checks, whole blocks in order);
- rows.py: `PagedKV`'s CPU row copies (native `copy_rows`, else torch / numpy; `NATIVE_ROWS`);
- blockmap.py: `BlockMap`, the element map of the `mapped` layout, and its tilings;
- mapped.py: the copies of the `mapped` layout through a `BlockMap`;
- dense.py: `DenseKV`, the Hugging Face cache;
- pool.py: the copy threads the CPU copies are split over.
"""

from lmcache_remote.connectors.blockmap import BlockMap
from lmcache_remote.connectors.dense import DenseKV
from lmcache_remote.connectors.paged import PAGED_LAYOUTS, PagedKV
from lmcache_remote.connectors.rows import NATIVE_ROWS
from lmcache_remote.connectors.view import DEFAULT_STAGING_BYTES, KVView

__all__ = ["DEFAULT_STAGING_BYTES", "NATIVE_ROWS", "PAGED_LAYOUTS", "BlockMap", "DenseKV",
           "KVView", "PagedKV"]
