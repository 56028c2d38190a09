"""A private redis-server on a free loopback port, started and stopped by a benchmark run:
the library's private server (`lmcache_remote.admin.private_server.RedisServer`, the one
launcher the tests and the CLI use too) with what a benchmark measures of it."""

from __future__ import annotations

import time
from typing import Any

import redis

from lmcache_remote.admin.private_server import RedisServer


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
