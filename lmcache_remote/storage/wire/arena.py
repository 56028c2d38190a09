"""Reused receive memory for bulk replies that have no destination of their own.

- `Arena`: `take` hands out slices of one kept block, `reset` recycles it; it grows (a new,
  larger block) when a batch needs more. Not thread-safe.
- `ArenaPool`: one arena per call in flight; at most ``keep`` kept between calls.
"""

from __future__ import annotations

import threading


class Arena:
    """Reused receive memory: `take` hands out slices of one kept block, `reset` recycles it.

    Fresh multi-MiB allocations page-fault and run several times slower than reused memory,
    so replies that have no destination of their own land here. A block grows (a new, larger
    one) when a batch needs more, and stays at that size; slices from the old block stay valid.
    Not thread-safe: one arena per call in flight (`ArenaPool`).
    """

    def __init__(self, nbytes: int = 0) -> None:
        self._block = memoryview(bytearray(nbytes))
        self._used = 0

    @property
    def capacity(self) -> int:
        return len(self._block)

    def reserve(self, nbytes: int) -> None:
        """Make sure the next `nbytes` of `take` come from one block."""
        if self._used + nbytes > len(self._block):
            self._block = memoryview(bytearray(max(nbytes, len(self._block))))
            self._used = 0

    def take(self, nbytes: int) -> memoryview:
        self.reserve(nbytes)
        out = self._block[self._used:self._used + nbytes]
        self._used += nbytes
        return out

    def reset(self) -> None:
        self._used = 0


class ArenaPool:
    """A few `Arena`s, one per call in flight; at most ``keep`` are kept between calls."""

    def __init__(self, keep: int = 2) -> None:
        self._free: list[Arena] = []
        self._keep = keep
        self._lock = threading.Lock()

    def acquire(self) -> Arena:
        with self._lock:
            return self._free.pop() if self._free else Arena()

    def release(self, arena: Arena) -> None:
        arena.reset()
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(arena)
