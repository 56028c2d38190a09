"""Closing under a write that cannot finish: after `close` returns no thread does any I/O.

The write-behind queue gives a write in flight `timeout` to land; past it, the old `close`
returned with the writer thread still inside a send or receive on a raw descriptor of the
client it then closed (a descriptor number the process may reuse for anything). Now the
tier's connections in use are shut down (`RedisTier.stop_io`), the write fails at once, what
is left queued is dropped, and the threads have ended when `close` returns. The server is
paused (SIGSTOP) and the client's socket timeout is an hour, so only that can end the write.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from kvutil import tier_chunks

from lmcache_remote import CacheConfig
from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
from lmcache_remote.storage.manager.write_behind import PendingWrites, WriteBehindQueue
from lmcache_remote.telemetry.metrics import Metrics

LAYOUT = ChunkLayout(2, 2, 8, torch.bfloat16)
DB = TokenDatabase(KeyNamespace("shutdown/model", 1, 0, "bfloat16"), 64, save_unfull_chunk=False)


def _lmcr_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lmcr")]


def test_close_under_a_paused_server_leaves_no_thread_doing_io(private_redis: Any,
                                                               key_prefix: str) -> None:
    before = set(_lmcr_threads())
    pool = MemoryPool(16 << 20, pin_memory=False)
    config = CacheConfig(remote_url=private_redis.url, key_prefix=key_prefix,
                         remote_timeout=3600.0, remote_part_size=4096)
    tier = RedisTier(config, LAYOUT, pool, Metrics())
    queue = WriteBehindQueue(tier, 8 << 20, Metrics(), PendingWrites())
    specs, objs = tier_chunks(DB, LAYOUT, pool, 64 * 8, seed=1)
    private_redis.pause()
    try:
        assert queue.submit([s.key for s in specs], objs) == len(specs)
        deadline = time.monotonic() + 30
        while not queue.pending_items or not tier.sockets_busy():  # the write is in flight
            assert time.monotonic() < deadline
            time.sleep(0.01)
        queue.close(timeout=0.2)
        assert not queue._thread.is_alive()  # it was stuck in I/O: cut off, not left behind
        tier.close()
        assert set(_lmcr_threads()) <= before  # no lane thread either
        assert not tier.sockets_busy()
    finally:
        private_redis.resume()
    for obj in objs:
        obj.release()
