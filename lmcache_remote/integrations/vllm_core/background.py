"""BackgroundTransfers: one rank's transfers that outlive the step that started them.

- Loads (`async_load` plans): `submit_load(req_id, work)` runs a whole load on the loader
  thread; `work` returns the blocks that did not arrive. `refuse_load(req_id, missed)` reports
  a load that never ran (the connector is off) the same way, at once. `finished_loads()`
  returns each request whose load is over once, with its missing blocks.
- Stores (`async_save`): `expect_stores(req_id)` marks a request with a store planned;
  `submit_store(req_id, work, on_wait)` runs a whole store on the saver thread. At most
  `MAX_WAITING_STORES` wait for it: past that the step waits for the oldest (`on_wait` is called
  first, to count it). `forget(req_id)` (vLLM finished the request) and `finished_stores()`
  report a finished request once all its stores are done (a failed one counts as done);
  `wait_for_stores(ids)` waits for a preempted request's stores, whose blocks are about to be
  reused, and still reports it later if it was finished.
- `wait_all()` waits for every transfer in flight; `close()` also stops the threads (new ones
  start on the next submit). A transfer logs its own failure: waiting never raises.
- `transfer_stream(layers, event)`: on CUDA, a background transfer's copies run on a stream of
  their own, after `event` (`step_event`: the point the step's KV was written); elsewhere it does
  nothing (untested: no GPU here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

#: Background stores (async_save) that may wait for the saver thread at once. Their chunk
#: buffers come from the memory budget; this bounds the tasks (and the blocks they keep).
MAX_WAITING_STORES = 64


class BackgroundTransfers:
    """One rank's loads and stores on their own threads; see the module docstring."""

    def __init__(self) -> None:
        self._recving: dict[str, Future[set[int]]] = {}  # background loads, not yet reported
        self._loader: ThreadPoolExecutor | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._saving: dict[str, list[Future[None]]] = {}  # background stores per request
        self._save_reqs: set[str] = set()  # requests with a store planned (async_save)
        self._finishing: set[str] = set()  # finished by vLLM, stores maybe still running

    # -- loads --------------------------------------------------------------------------------

    def submit_load(self, req_id: str, work: Callable[[], set[int]]) -> None:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="lmcr-vllm-load")
        self._recving[req_id] = self._loader.submit(work)

    def refuse_load(self, req_id: str, missed: set[int]) -> None:
        done: Future[set[int]] = Future()
        done.set_result(missed)
        self._recving[req_id] = done

    def finished_loads(self) -> dict[str, set[int]]:
        done = [req_id for req_id, fut in self._recving.items() if fut.done()]
        return {req_id: self._recving.pop(req_id).result() for req_id in done}

    # -- stores -------------------------------------------------------------------------------

    def expect_stores(self, req_id: str) -> None:
        self._save_reqs.add(req_id)

    def forget(self, req_id: str) -> None:
        if req_id in self._save_reqs:
            self._save_reqs.discard(req_id)
            self._finishing.add(req_id)

    def submit_store(self, req_id: str, work: Callable[[], None],
                     on_wait: Callable[[], None]) -> None:
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="lmcr-vllm-save")
        waiting = [f for fs in self._saving.values() for f in fs if not f.done()]
        if len(waiting) >= MAX_WAITING_STORES:  # the saver cannot keep up: the step waits
            on_wait()
            waiting[0].exception()
        future = self._saver.submit(work)
        self._saving.setdefault(req_id, []).append(future)
        self._prune_done(req_id)

    def finished_stores(self) -> set[str]:
        done = {r for r in self._finishing
                if all(f.done() for f in self._saving.get(r, ()))}
        for req_id in done:
            self._finishing.discard(req_id)
            self._saving.pop(req_id, None)
        return done

    def wait_for_stores(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            futures = self._saving.pop(req_id, [])
            for future in futures:
                future.exception()  # waits; the store logs its own failure
            if req_id in self._finishing:
                self._saving[req_id] = futures  # still to be reported as finished

    def _prune_done(self, req_id: str) -> None:
        """Keep a running request's list of background stores short."""
        futures = self._saving.get(req_id, [])
        if len(futures) > 1:
            self._saving[req_id] = [f for f in futures[:-1] if not f.done()] + futures[-1:]

    # -- all ----------------------------------------------------------------------------------

    def wait_all(self) -> None:
        pending: list[Future[Any]] = [*self._recving.values(),
                                      *(f for fs in self._saving.values() for f in fs)]
        for future in pending:
            future.exception()  # waits; each logs its own failure

    def close(self) -> None:
        for executor in (self._loader, self._saver):
            if executor is not None:  # no access to the cache after this returns
                executor.shutdown(wait=True)
        self._loader = self._saver = None


@contextlib.contextmanager
def transfer_stream(layers: Sequence[torch.Tensor],
                    event: object | None = None) -> Iterator[None]:
    """On CUDA, a background transfer's copies (a load or a store) run on a stream of their
    own, which first waits for `event` when given (untested: no GPU here)."""
    if not layers or not layers[0].is_cuda:
        yield
        return
    stream = torch.cuda.Stream(layers[0].device)  # one per transfer: threads differ
    if event is not None:
        stream.wait_event(event)  # type: ignore[arg-type]
    with torch.cuda.stream(stream):
        yield


def step_event(layers: Sequence[torch.Tensor]) -> object | None:
    """On CUDA, an event recorded now on the current stream: the point the step's KV is
    written at, which background copies must wait for."""
    if not layers or not layers[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event
