"""PromiseLedger: what recent lookups promised, so that the retrieve that follows can be held
to it.

A lookup that reports hits promises the token where its last hit chunk ends (keyed by that
chunk's key); a retrieve of the same prefix settles the promise and says how many tokens it
delivered short of it (`broken`). The ledger is bounded (`PROMISES_KEPT` entries, oldest
forgotten first) and thread-safe. `CacheEngine` counts and logs what it reports
(`engine.promise_broken_*`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey

#: Recent lookups remembered to check that the retrieve that follows keeps their promise.
PROMISES_KEPT = 4096


class PromiseLedger:
    """What recent lookups promised: the key of a lookup's last hit chunk -> the token where
    that hit ends. A retrieve of the same prefix that stops before it broke the promise.
    Bounded (oldest forgotten first) and thread-safe."""

    def __init__(self, size: int = PROMISES_KEPT) -> None:
        self._ends: OrderedDict[CacheEngineKey, int] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def promise(self, spec: ChunkSpec) -> None:
        with self._lock:
            self._ends[spec.key] = spec.end
            self._ends.move_to_end(spec.key)
            if len(self._ends) > self._size:
                self._ends.popitem(last=False)

    def broken(self, specs: list[ChunkSpec], delivered: int) -> int:
        """Tokens a retrieve of `specs` that delivered its first `delivered` chunks owed to a
        lookup (0 when none promised more); the promise is settled either way."""
        owed_end = 0
        with self._lock:
            for spec in specs:
                end = self._ends.pop(spec.key, None)
                if end is not None:
                    owed_end = max(owed_end, end)
        got_end = specs[delivered - 1].end if delivered else specs[0].start
        return max(0, owed_end - got_end)
