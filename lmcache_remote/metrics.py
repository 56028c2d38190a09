"""Counters behind `CacheEngine.stats()`.

`Metrics` is a thread-safe bag of monotonically increasing counters named `scope.name`
(`engine.stored_tokens`, `remote.errors`, `local.evicted_bytes`, ...). `snapshot()` nests them
by scope into plain dicts of ints and floats, safe to serialise; it never contains a URL or a
password. Gauges (bytes in use, health) are added to the snapshot by their owners.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any


class Metrics:
    """Monotonic counters, safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, float] = defaultdict(float)

    def inc(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counters[name] += value

    def get(self, name: str) -> float:
        with self._lock:
            return self._counters.get(name, 0)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            items = list(self._counters.items())
        out: dict[str, Any] = {}
        for name, value in sorted(items):
            scope, _, leaf = name.rpartition(".")
            target = out.setdefault(scope, {}) if scope else out
            target[leaf] = int(value) if float(value).is_integer() else value
        return out


class RateLimitedLogger:
    """Logs a repeated warning at most once per `interval` seconds per message key."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval:
                self._suppressed[key] += 1
                return
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.warning(msg, *args)
