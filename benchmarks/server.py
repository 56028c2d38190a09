"""A private redis-server on a free loopback port, started and stopped by a benchmark run:
the library's private server (`lmcache_remote.admin.private_server.RedisServer`, the one
launcher the tests and the CLI use too) with what a benchmark measures of it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from lmcache_remote.admin.private_server import RedisServer

#: The keys `LocalRedis.fill_with` renames a contender's values to.
FILL_PREFIX = "fill:"
#: What `fill_with` leaves free under `maxmemory`.
FILL_MARGIN = 1 << 20
#: How many times `fill_with` writes a contender's values as filler.
FILL_TIMES = 2


class LocalRedis(RedisServer):
    """`redis-server` with no persistence, no memory limit but what ``extra_args`` set;
    ``url``, ``port``, ``pid``, ``client()`` (a 60 s socket timeout), and the figures below."""

    def __init__(self, *extra_args: str) -> None:
        super().__init__("--protected-mode", "no", *extra_args)

    @property
    def pid(self) -> int:
        """The running server's process id."""
        pid = super().pid
        if pid is None:
            raise RuntimeError("redis-server is not running")
        return pid

    def client(self, **kwargs: Any) -> redis.Redis:
        return super().client(**{"socket_timeout": 60, **kwargs})

    def version(self) -> str:
        return str(self.client().info("server")["redis_version"])

    def used_memory(self) -> int:
        return int(self.client().info("memory")["used_memory"])

    def key_bytes(self, match: str | None = None) -> int:
        """`MEMORY USAGE` summed over every key (those matching ``match``), keys included."""
        client = self.client()
        try:
            total = 0
            for key in client.scan_iter(match=match, count=1000):
                used = client.memory_usage(key, samples=0)
                if used is None:
                    raise RuntimeError(f"{key!r} vanished while its memory was counted")
                total += int(used)
            return total
        finally:
            client.close()

    def clear(self) -> None:
        """Empties the benchmark's own server (SCAN + UNLINK, as the library would)."""
        client = self.client()
        batch = []
        for key in client.scan_iter(count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
        client.close()

    def settle(self, timeout: float = 30.0) -> None:
        """Waits until Redis's background thread has freed every unlinked value, then has
        jemalloc hand the freed pages back (`MEMORY PURGE`): a timed write must not share the
        CPU with the lazy free of the previous contender's data, nor write into the pages that
        data left behind. Freed pages are reused without a page fault, so without the purge
        a write ran faster or slower by what the contender before it had allocated (a 32 MiB
        put by up to 40% in side runs, docs/benchmarks.md's reading); with it every timed
        write starts from the same allocator state."""
        self.unfill()
        client = self.client()
        deadline = time.monotonic() + timeout
        try:
            while int(client.info("memory")["lazyfree_pending_objects"]) > 0:
                if time.monotonic() > deadline:
                    raise TimeoutError("redis-server still freeing unlinked values")
                time.sleep(0.002)
            client.execute_command("MEMORY", "PURGE")
        finally:
            client.close()

    def fill_with(self, put: Callable[[], object], timeout: float = 30.0) -> None:
        """A server full of ``put``'s own values, as a Redis at `maxmemory` is in production:
        empties and settles the server, runs ``put`` (untimed), renames every key it wrote to
        a filler key with an expiry, twice (the write then has its own size of filler to
        evict and as much again for the buffers it holds while it writes), and sets
        `maxmemory` to what is used now with ``volatile-ttl``. The next write of the same
        values then evicts filler values of its own sizes and lands in the pages they held (no
        page fault); the filler's expiry (an hour) is the nearest, so what the write itself
        wrote (no expiry, or the tier's 30 days) is evicted last. A filler of other sizes
        than the write's does not do it: jemalloc reuses a freed extent of the same size
        class (a side run: 1 MiB filler values under 4 MiB ones left 75% of the page faults).
        `unfill` (or `settle`) ends it."""
        self.clear()
        self.settle(timeout)  # lifts the last fill's maxmemory first
        client = self.client()
        try:
            filled = 0
            for _ in range(FILL_TIMES):
                put()
                names = [n for n in client.scan_iter(count=1000)
                         if not n.startswith(FILL_PREFIX.encode())]
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.rename(name, f"{FILL_PREFIX}{filled}")
                    pipe.pexpire(f"{FILL_PREFIX}{filled}", 3_600_000)
                    filled += 1
                pipe.execute()
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory-policy", "volatile-ttl")
            client.config_set("maxmemory", used + FILL_MARGIN)
        finally:
            client.close()

    def unfill(self) -> None:
        """No `maxmemory` again (`fill_with` set it)."""
        client = self.client()
        try:
            client.config_set("maxmemory", 0)
        finally:
            client.close()
