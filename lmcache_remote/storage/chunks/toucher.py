"""Keeps Redis's LRU clock honest for chunks that Redis itself never sees read.

A lookup asks `EXISTS`, which does not refresh a key's LRU clock, and the hottest chunks are
served from the engines' local tiers: under `allkeys-lru` the most used prefixes looked the
coldest to Redis and went first. So a chunk that a lookup promises, or that the local tier
serves, is noted here (`note`, a set insert under a lock: nothing on the step's path waits
for Redis), and a thread of its own sends `TOUCH` for every value key noted, in one pipeline
every `interval` seconds (or sooner when `max_keys` are waiting). `TOUCH` refreshes the clock
(and counts an access under LFU) without reading the value. A chunk read from Redis needs
none: its `GET`s refreshed it. With `inline` (the vLLM scheduler's lookup, which starts no
thread of its own) the caller of `note` sends them itself, at most once per `interval`: one
more round trip, once a second, after a lookup's answer is known. Failures are counted
(`remote.touch_errors`), never raised; keys beyond `max_keys` waiting are dropped
(`remote.touch_dropped_keys`): touching is a hint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

__all__ = ["Toucher"]

_PER_COMMAND = 512  # keys per TOUCH


class Toucher:
    """`send(commands)`: runs a list of commands in one pipeline (the tier's bulk path)."""

    def __init__(self, send: Callable[[list[tuple[Any, ...]]], Any], metrics: Metrics,
                 log: RateLimitedLogger, interval: float = 1.0, max_keys: int = 65536,
                 inline: bool = False) -> None:
        self._send = send
        self.inline = inline
        self._sent_at = time.monotonic()
        self._metrics = metrics
        self._log = log
        self.interval = interval
        self.max_keys = max_keys
        self._keys: dict[str, None] = {}  # ordered, deduplicated
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def note(self, keys: Sequence[str]) -> None:
        """Touch these value keys soon (no I/O here, but for an `inline` toucher's flush once
        per `interval`)."""
        if not keys:
            return
        due = False
        with self._cond:
            if self._closed:
                return
            room = self.max_keys - len(self._keys)
            taken = keys[:max(0, room)]
            self._keys.update(dict.fromkeys(taken))
            if len(taken) < len(keys):
                self._metrics.inc("remote.touch_dropped_keys", len(keys) - len(taken))
            if self.inline:
                due = time.monotonic() - self._sent_at >= self.interval
            elif self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmcr-toucher",
                                                daemon=True)
                self._thread.start()
            if len(self._keys) >= self.max_keys:
                self._cond.notify()
        if self.inline and due:
            self.flush()

    def flush(self) -> None:
        """Send what is noted now, in this thread."""
        with self._cond:
            keys, self._keys = list(self._keys), {}
            self._sent_at = time.monotonic()
        if not keys:
            return
        commands = [("TOUCH", *keys[i:i + _PER_COMMAND])
                    for i in range(0, len(keys), _PER_COMMAND)]
        try:
            self._send(commands)
        except Exception as exc:  # a hint: never an error for anyone
            self._metrics.inc("remote.touch_errors")
            self._log.warning("touch", "refreshing Redis's LRU clock failed: %s", exc)
            return
        self._metrics.inc("remote.touched_keys", len(keys))

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed:
                    self._cond.wait(self.interval)
                if self._closed:
                    return
            self.flush()

    def close(self) -> None:
        """Stop; what is noted and not sent is forgotten (closing touches nothing)."""
        with self._cond:
            self._closed = True
            self._keys = {}
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
