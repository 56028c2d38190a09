"""Memory objects: ref-counted CPU buffers for chunks, from a pool with a byte bound.

A `MemoryObj` holds one chunk in its canonical layout (`[layers, 2, tokens, heads, head_size]`)
in CPU memory, pinned when CUDA is present so device copies can be asynchronous. Whoever keeps a
reference (the local tier, the write-behind queue, a retrieve in flight) holds a count; the
buffer goes back to the pool when the last one is released, never earlier.

`MemoryPool.allocate` returns None, never raises, when the bytes in use would pass the bound:
the caller keeps the chunks it got and stops (a store keeps the prefix that fits). Freed buffers
are kept and handed out again to the next allocation of the same size: fresh allocations
page-fault and copy several times slower than reused memory. Kept-but-free buffers count toward
the bound and are dropped first when room is needed (largest sizes first), so the bound on
bytes held is the only bound: every freed buffer is kept, whatever its size or how many of its
size are kept already (a read of 256 chunks gets 256 reused buffers, not a few and 200 fresh
ones), and `trim` hands them all back to the system.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable

import torch


class MemoryObj:
    """One chunk's CPU buffer. Thread-safe reference counting; `tensor` is contiguous."""

    __slots__ = ("_buffer", "_pool", "_raw", "_refs", "tensor")

    def __init__(
        self, buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, pool: MemoryPool
    ) -> None:
        self._buffer = buffer
        self._pool: MemoryPool | None = pool
        self._refs = 1
        self._raw: memoryview | None = None
        self.tensor = buffer[: _nbytes(shape, dtype)].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def ref_count(self) -> int:
        return self._refs

    def raw_view(self) -> memoryview:
        """The chunk's bytes as a writable memoryview (no copy; made once per object)."""
        raw = self._raw
        if raw is None:  # the buffer is flat uint8 and the tensor its leading bytes
            raw = self._raw = memoryview(self._buffer.numpy())[: self.nbytes]  # type: ignore[arg-type]
        return raw

    def retain(self) -> MemoryObj:
        pool = self._pool
        if pool is None:
            raise RuntimeError("retain() on a released MemoryObj")
        with pool.lock:
            self._refs += 1
        return self

    def release(self) -> None:
        pool = self._pool
        if pool is None:
            raise RuntimeError("release() on a released MemoryObj")
        with pool.lock:
            self._refs -= 1
            if self._refs > 0:
                return
            self._pool = None
        pool.give_back(self._buffer)


def leading_fit(sizes: Iterable[int], room: int) -> int:
    """How many leading items of `sizes` (bytes) fit together in `room` bytes: the budget
    rule every holder of the pool applies (the write-behind queue's share, a read's share)."""
    count = 0
    for size in sizes:
        room -= size
        if room < 0:
            break
        count += 1
    return count


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class MemoryPool:
    """Hands out `MemoryObj`s while the bytes held (in use or kept free) stay within the bound."""

    def __init__(self, max_bytes: int, pin_memory: bool | None = None) -> None:
        self.max_bytes = max_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.lock = threading.RLock()
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self._used_bytes = 0
        self.failed_allocations = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def held_bytes(self) -> int:
        return self._used_bytes + self._free_bytes

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> MemoryObj | None:
        """A buffer for a chunk of `shape`/`dtype`, or None if it would pass the bound."""
        size = _nbytes(shape, dtype)
        with self.lock:
            buffer = self._take_free(size)
            if buffer is None:
                if self._used_bytes + size > self.max_bytes:
                    self.failed_allocations += 1
                    return None
                self._drop_free(self._used_bytes + self._free_bytes + size - self.max_bytes)
                buffer = self._new_buffer(size)
            self._used_bytes += size
        return MemoryObj(buffer, shape, dtype, self)

    def shortfall(self, nbytes: int) -> int:
        """Bytes that must be freed (released by their holders) before an allocation of
        `nbytes` can succeed; 0 or less when it can now (kept-free buffers are dropped for it)."""
        with self.lock:
            return self._used_bytes + nbytes - self.max_bytes

    def give_back(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self.lock:
            self._used_bytes -= size  # held bytes unchanged: still within the bound
            self._free[size].append(buffer)
            self._free_bytes += size

    def trim(self) -> None:
        """Drop every kept-free buffer (returns their memory to the system)."""
        with self.lock:
            self._drop_free(self._free_bytes)

    def _take_free(self, size: int) -> torch.Tensor | None:
        bucket = self._free.get(size)
        if not bucket:
            return None
        self._free_bytes -= size
        return bucket.pop()

    def _drop_free(self, need: int) -> None:
        for size in sorted(self._free, reverse=True):
            bucket = self._free[size]
            while bucket and need > 0:
                bucket.pop()
                self._free_bytes -= size
                need -= size
        if need > 0 and self._free_bytes < 0:  # pragma: no cover - invariant
            raise AssertionError("free-bytes accounting went negative")

    def _new_buffer(self, size: int) -> torch.Tensor:
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError:
            if not self.pin_memory:
                raise
            return torch.empty(size, dtype=torch.uint8)


class ChunkLayout:
    """The canonical chunk geometry of one engine: `[layers, planes, tokens, heads, head_size]`.

    `planes` is 2 (K and V) for ordinary attention, 1 for MLA's single latent.
    """

    __slots__ = ("dtype", "head_size", "kv_planes", "num_kv_heads", "num_layers")

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        kv_planes: int = 2,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.kv_planes = kv_planes

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        return (self.num_layers, self.kv_planes, num_tokens, self.num_kv_heads, self.head_size)

    def nbytes(self, num_tokens: int) -> int:
        return _nbytes(self.shape(num_tokens), self.dtype)

    def __repr__(self) -> str:
        return f"ChunkLayout{self.shape(0)[:2] + ('T',) + self.shape(0)[3:]} {self.dtype}"
