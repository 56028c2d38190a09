"""The limits the engine is measured against, on the same bytes: a plain client socket,
`redis-benchmark`, and memcpy into a preallocated buffer."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Sequence

import torch

from benchmarks.timing import median_seconds


def split(raw: memoryview, part: int) -> list[memoryview]:
    return [raw[i:i + part] for i in range(0, len(raw), part)]


class PlainSocket:
    """The fastest client this machine allows in Python: pipelined SET/GET on one socket,
    values sent straight from memory, replies received with ``recv_into`` into reused buffers.
    No checks, no headers: what is left is Redis, the kernel and the copies they need."""

    def __init__(self, port: int, window: int = 1) -> None:
        self.window = window
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.line = bytearray(64)

    def close(self) -> None:
        self.sock.close()

    def set_many(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        for key, value in zip(keys, values, strict=True):
            head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(value))
            self.sock.sendall(head)
            self.sock.sendall(value)
            self.sock.sendall(b"\r\n")
        self._read_exact(5 * len(keys), self.line if len(keys) * 5 <= 64 else None)

    def get_many(self, keys: Sequence[bytes], into: Sequence[memoryview]) -> None:
        """GETs in windows of ``self.window`` values, the next window asked for before the
        current one is read: Redis always has work, and never queues more than two windows
        of replies (asking for everything at once makes it buffer every reply first, and
        measured slower: here one value asked ahead, the default, was the fastest)."""
        windows = [range(i, min(i + self.window, len(keys)))
                   for i in range(0, len(keys), self.window)]

        def ask(window: range) -> None:
            self.sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n"
                                       % (len(keys[i]), keys[i]) for i in window))

        if windows:
            ask(windows[0])
        for n, window in enumerate(windows):
            if n + 1 < len(windows):
                ask(windows[n + 1])
            for i in window:
                head = f"${len(into[i])}\r\n".encode()
                self._read_exact(len(head))
                self._read_into(into[i])
                self._read_exact(2)

    def _read_exact(self, n: int, buf: bytearray | None = None) -> None:
        view = memoryview(buf if buf is not None and len(buf) >= n else bytearray(n))[:n]
        self._read_into(view)

    def _read_into(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view):
            got = self.sock.recv_into(view[pos:])
            if not got:
                raise ConnectionError("closed")
            pos += got


def redis_benchmark(
    port: int, value_bytes: int, total_bytes: int, pipeline: int
) -> dict[str, float]:
    """GB/s of `redis-benchmark -t set,get -d value_bytes -P pipeline -c 1`; {} if it is not
    installed or fails three times (it exits 1 now and then on a loaded machine)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {}
    requests = max(pipeline * 2, total_bytes // value_bytes)
    for _ in range(3):
        proc = subprocess.run(
            [binary, "-p", str(port), "-t", "set,get", "-d", str(value_bytes), "-P",
             str(pipeline), "-c", "1", "-n", str(requests), "--csv"],
            capture_output=True, text=True, timeout=300,
        )
        if proc.returncode == 0:
            break
        print(f"redis-benchmark failed ({proc.returncode}): {proc.stderr.strip()[-300:]}",
              flush=True)
    else:
        return {}
    out = proc.stdout
    rates = {}
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells and cells[0] in ("SET", "GET"):
            rates[cells[0]] = float(cells[1]) * value_bytes / 1e9
    return rates


def memcpy(chunk: torch.Tensor, reps: int) -> tuple[float, float]:
    """Seconds (median) to copy one chunk into a reused buffer, and into a fresh one."""
    dest = torch.empty_like(chunk)
    reused = median_seconds(lambda: dest.copy_(chunk), reps)
    fresh = median_seconds(lambda: torch.empty_like(chunk).copy_(chunk), reps)
    return reused, fresh
