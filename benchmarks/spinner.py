"""A Python thread that spins while it is on: what the rest of an engine process (a
scheduler loop, request handling, a model runner launching kernels) does to the GIL while a
cache reads or writes beside it. It holds the GIL for whole switch intervals (5 ms), so
every call of the cache's that gives the GIL up waits that long to get it back.

Imported by the project's benchmark process and by the LMCache peer (`lmcache_peer`): it
imports nothing of either."""

from __future__ import annotations

import threading


class Spinner:
    def __init__(self) -> None:
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def set(self, on: bool) -> None:
        """Starts the spinning thread (on) or stops and joins it (off); idempotent."""
        if on and self._thread is None:
            stop = self._stop = threading.Event()
            self._thread = threading.Thread(target=_spin, args=(stop,), daemon=True,
                                            name="bench-spinner")
            self._thread.start()
        elif not on and self._thread is not None:
            assert self._stop is not None
            self._stop.set()
            self._thread.join()
            self._thread = self._stop = None


def _spin(stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1
