"""A TCP proxy whose replies crawl: a slow link rather than a dead one, for tests.

`Throttle(target_port, rate)` listens on a free loopback port; every connection to it is
joined to the target, requests pass at once and replies are forwarded at about `rate` bytes a
second (16 KiB at a time, then a pause; 256 KiB at a time when the rate is high). `rate` may
be changed while it runs. `delay` (seconds, default 0) holds each reply burst (the first
piece after the reply side was quiet) that long: a long round trip, whatever the rate.
`cut_after(nbytes)` closes every connection once that many more reply bytes have passed: a
link cut in the middle of a reply (new connections are taken as before). `close()` stops
it and its pumps (each loop ends when a socket closes or the proxy is closed).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

_PIECE = 16 * 1024
_FREE_PIECE = 256 * 1024
_FREE_ABOVE = 1e9  # bytes a second: above this, no pause at all
_BURST_GAP = 0.001  # seconds of quiet after which a reply piece starts a new burst (`delay`)

class Throttle:
    def __init__(self, target_port: int, rate: float, delay: float = 0.0) -> None:
        self.rate = rate
        self.delay = delay
        self._cut_left: int | None = None  # reply bytes still to pass before a cut
        self._lock = threading.Lock()
        self._target = target_port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name="throttle-accept").start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self._target))
            with self._lock:
                self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True),
                             daemon=True).start()

    def cut_after(self, nbytes: int) -> None:
        """Close every connection once `nbytes` more reply bytes have passed."""
        with self._lock:
            self._cut_left = nbytes

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool | None) -> None:
        last = 0.0
        with contextlib.suppress(OSError):
            while not self._closed.is_set():
                free = not slow or self.rate > _FREE_ABOVE
                data = src.recv(_FREE_PIECE if free else _PIECE)
                if not data:
                    break
                if slow and self.delay and time.monotonic() - last > _BURST_GAP:
                    time.sleep(self.delay)
                if not free:
                    time.sleep(len(data) / self.rate)
                if slow and self._cut(len(data)):
                    break
                dst.sendall(data)
                last = time.monotonic()
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _cut(self, nbytes: int) -> bool:
        """Whether passing `nbytes` more reply bytes reaches an armed cut (then every
        connection is closed and the cut disarmed)."""
        with self._lock:
            if self._cut_left is None:
                return False
            self._cut_left -= nbytes
            if self._cut_left > 0:
                return False
            self._cut_left = None
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
        return True

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
