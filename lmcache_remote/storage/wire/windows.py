"""Windows and bytes in flight: how a batch is cut and how much of it is asked ahead.

- `WINDOW_BYTES`: bytes of chunks per pipelined batch (`PAGE_WINDOW_BYTES`: of pages, in
  one page call's staging); `byte_windows`, `iter_windows` cut a batch (or a stream) into
  windows of about that many bytes;
- `read_ahead` (`INFLIGHT_BYTES`, `READ_AHEAD_CHUNKS`): the reply bytes a read keeps asked for
  and unread;
- `ByteBudget`: the byte count the write lanes share; `value_nbytes`: a value's bytes.

Nothing here talks to Redis.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")
#: Bytes of chunks per pipelined batch: large enough that round trips do not matter, small
#: enough that the encoded values and receive arena of one batch stay a modest memory cost.
WINDOW_BYTES = 64 * 1024 * 1024
#: Raw page bytes one call of the page store holds in staging at once (its windows over all
#: its lanes): half a chunk window, since a page call's staging is taken from the engine's
#: memory budget (`pages.base`).
PAGE_WINDOW_BYTES = WINDOW_BYTES // 2
#: Reply bytes asked for and not yet read on the fast read path, at most (`read_ahead`'s cap:
#: for 32 MiB chunks a little over two of their 3.49 MiB parts), so Redis prepares the next
#: reply while this side reads one, and never buffers a whole window.
INFLIGHT_BYTES = 8 * 1024 * 1024
#: Chunks asked for and not yet read per read connection (`read_ahead`).
READ_AHEAD_CHUNKS = 2


def read_ahead(chunk_sizes: Sequence[int]) -> int:
    """The reply bytes to keep asked for and unread while receiving chunks of these sizes
    (each the bytes of all its values): two of the largest chunks (the one being read and the
    next), at most `INFLIGHT_BYTES`. Counted in chunks, not values: a 1 MiB chunk is a
    1,044,160-byte head and a 4,416-byte tail, and two of the largest values fell 4 KiB
    short of two chunks, so only one was ever asked ahead (0.7x the speed of two, in a side
    run). More only makes Redis copy replies into its output buffers ahead of the socket,
    which costs it CPU on every byte (1 MiB chunks, 4 lanes: 8 MiB ahead read at 0.8x the
    speed of 2 MiB)."""
    return min(INFLIGHT_BYTES, READ_AHEAD_CHUNKS * max(chunk_sizes, default=0))


class ByteBudget:
    """A byte count that threads take from and give back; `acquire` waits while the budget
    would go negative, except that a request passes when nothing is taken (so one window
    larger than the whole budget still goes, alone)."""

    def __init__(self, nbytes: int) -> None:
        self._total = nbytes
        self._taken = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._cond:
            while self._taken and self._taken + nbytes > self._total:
                self._cond.wait()
            self._taken += nbytes

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._cond:
            self._taken -= nbytes
            self._cond.notify_all()


def byte_windows(sizes: Sequence[int], window_bytes: int) -> list[range]:
    """Consecutive runs of indexes into `sizes`, each closed once it holds ``window_bytes``
    (so at least one item): the windows of a put or a get."""
    return [range(w[0], w[-1] + 1)
            for w in iter_windows(range(len(sizes)), sizes.__getitem__, window_bytes)]


def iter_windows(items: Iterable[_T], size_of: Callable[[_T], int], window_bytes: int
                 ) -> Iterator[list[_T]]:
    """The items in consecutive windows, each closed once its items' ``size_of`` add up to
    ``window_bytes`` (so at least one item), the last one with what is left; lazily, for a
    stream of items (an export's scan, an import's records)."""
    window: list[_T] = []
    size = 0
    for item in items:
        window.append(item)
        size += size_of(item)
        if size >= window_bytes:
            yield window
            window, size = [], 0
    if window:
        yield window


def value_nbytes(value: Any) -> int:
    if isinstance(value, tuple):
        return sum(len(memoryview(v)) for v in value)
    return len(memoryview(value))
