"""The memory budget's shares: what the write-behind queue may hold, what one read can hold,
and the cap every lookup applies so that it never promises more than a read can load.

`max_local_cpu_size` (one `MemoryPool`) is shared by the write-behind queue (at most
`store_queue_size`, and never more than half the budget: `queue_share_bytes`), the buffers of
reads in flight, and the local tier (whatever the other two leave). So one read can always
hold `read_share_bytes` (the budget less the queue's share), and a lookup, the engine's
(`StorageManager.leading_chunks`) or the vLLM scheduler's (`PrefixLookup`), reports no more
leading chunks than fit there (`within_read_share`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lmcache_remote.config import CacheConfig
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.storage.local.memory import ChunkLayout, leading_fit
from lmcache_remote.telemetry.metrics import Metrics


def queue_share_bytes(config: CacheConfig) -> int:
    """The write-behind queue's share of `max_local_cpu_size`: `store_queue_size`, at most half
    (see the module doc)."""
    return min(config.store_queue_bytes, config.max_local_cpu_bytes // 2)


def read_share_bytes(config: CacheConfig) -> int:
    """The bytes of chunks one read can always hold under `config`: the budget less the write-
    behind queue's share (none without a queue). A lookup never promises more; the vLLM
    scheduler's lookup caps its answer the same way."""
    queued = config.remote_url is not None and config.store_async
    return config.max_local_cpu_bytes - (queue_share_bytes(config) if queued else 0)


def fetchable_chunks(specs: Sequence[ChunkSpec], hits: int, layout: ChunkLayout,
                     read_share: int) -> int:
    """Of the first `hits` chunks, how many leading ones one read can hold in `read_share`
    bytes (`read_share_bytes`): the most a lookup may promise."""
    return leading_fit((layout.nbytes(s.num_tokens) for s in specs[:hits]), read_share)


def within_read_share(specs: Sequence[ChunkSpec], hits: int, layout: ChunkLayout,
                      read_share: int, metrics: Metrics, counter: str) -> int:
    """`hits`, or fewer: the leading chunks one read can hold in `read_share` bytes
    (`fetchable_chunks`); the tokens left out are counted in `counter`."""
    fit = fetchable_chunks(specs, hits, layout, read_share)
    if fit < hits:
        metrics.inc(counter, specs[hits - 1].end - specs[fit].start)
    return fit
