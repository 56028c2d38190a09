"""A private redis-server on a free loopback port, started and stopped by the benchmark run."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """`redis-server` with no persistence, no memory limit; ``url``, ``port``, ``client()``."""

    def __init__(self, binary: str = "redis-server") -> None:
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(f"{binary} is not on PATH")
        self.binary = path
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="lmcr-bench-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalRedis:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self._dir, "--protected-mode", "no"]
        log = open(f"{self._dir}/server.log", "wb")  # noqa: SIM115 - lives as long as the server
        self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start; see {self._dir}/server.log")

    @property
    def pid(self) -> int:
        """The running server's process id."""
        if self._proc is None:
            raise RuntimeError("redis-server is not running")
        return self._proc.pid

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)

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

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
