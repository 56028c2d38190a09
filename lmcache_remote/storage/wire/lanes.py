"""Read lanes that serve the step before the background.

A tier fetches a read's windows over several connections at once (`RedisTier.read_lanes`),
through one pool of lane threads shared by every read of the engine. A background load (vLLM's
asynchronous loads run on a loader thread of their own) can queue dozens of windows; a load
inside the step that came after them would wait behind all of them, and every request of the
batch with it. So:

- `background_reads()`: a context manager; reads started inside it (in this thread, or in a
  task copied from its context) are background reads.
- `LanePool(lanes)`: `submit(fn, *args)` queues `fn` as the caller's kind of read; a free lane
  always takes the oldest waiting step (foreground) task first, then the oldest background
  one. A task already running is never interrupted: a step's read waits at most for the
  windows in flight, one per lane. `shutdown(wait)` as an executor's.
- `LaneThreads`: a tier's or a store's lane threads by name, each set started on first use
  (a `LanePool` or a plain executor) and all shut down together: the one way the chunk tier
  and the page store keep their lanes.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["LanePool", "LaneThreads", "background_reads", "in_background"]

_T = TypeVar("_T")
_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("lmcr_background_reads",
                                                                 default=False)


@contextlib.contextmanager
def background_reads() -> Iterator[None]:
    """Reads started inside yield their lanes to the step's reads (see the module docstring)."""
    token = _BACKGROUND.set(True)
    try:
        yield
    finally:
        _BACKGROUND.reset(token)


def in_background() -> bool:
    return _BACKGROUND.get()


class LanePool:
    """`lanes` threads taking foreground tasks before background ones; see the module doc."""

    def __init__(self, lanes: int, name: str) -> None:
        self._queues: tuple[deque[Any], deque[Any]] = (deque(), deque())  # step, background
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, lanes))]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        future: Future[_T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("lane pool is shut down")
            # run in a copy of the caller's context: its kind and its call's deadline
            task = (future, contextvars.copy_context(), fn, args)
            self._queues[1 if in_background() else 0].append(task)
            self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._queues[0] or self._queues[1]):
                    self._cond.wait()
                queue = self._queues[0] or self._queues[1]
                if not queue:  # closed and drained
                    return
                future, context, fn, args = queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = context.run(fn, *args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, wait: bool = True) -> None:
        """No more tasks; the queued ones still run (their callers wait for them)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()


class LaneThreads:
    """Named sets of lane threads, each started on first use; see the module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, Any] = {}

    def get(self, name: str, lanes: int, *, step_first: bool = False) -> Any:
        """The threads ``name`` (``lanes`` of them, named ``name_i``): a `LanePool` taking the
        step's tasks first with ``step_first``, else a `ThreadPoolExecutor`."""
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = (LanePool(lanes, name) if step_first
                        else ThreadPoolExecutor(lanes, thread_name_prefix=name))
                self._pools[name] = pool
            return pool

    def started(self, name: str) -> Any:
        """The threads ``name`` if started, else None."""
        with self._lock:
            return self._pools.get(name)

    def shutdown(self) -> None:
        """Every set's queued tasks run, then its threads end; later `get` starts anew."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)
