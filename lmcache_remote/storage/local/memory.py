"""Memory objects: ref-counted CPU buffers for chunks, from a pool with a byte bound.

A `MemoryObj` holds one chunk in its canonical layout (`[layers, 2, tokens, heads, head_size]`)
in CPU memory, pinned when CUDA is present so device copies can be asynchronous. Whoever keeps a
reference (the local tier, the write-behind queue, a retrieve in flight) holds a count; the
buffer goes back to the pool when the last one is released, never earlier.

`MemoryPool.allocate` returns None, never raises, when the bytes in use would pass the bound:
the caller keeps the chunks it got and stops (a store keeps the prefix that fits). Freed buffers
are kept and handed out again to the next allocation of the same size: fresh allocations
page-fault and copy several times slower than reused memory. A reused buffer also keeps the
views made of it (the chunk tensor of each shape, the byte view): making a torch view or a
numpy array is a call that gives up the GIL, and in an engine process with another busy
Python thread each such call waits up to the GIL's switch interval (5 ms) to get it back, four
of them per chunk read. Kept-but-free buffers count toward
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


class _Block:
    """One pool buffer (flat uint8) and the views made of it, kept while the pool reuses it:
    the chunk tensor per (shape, dtype) and the byte view. Only the pool's lock holder and
    the one `MemoryObj` that has the block touch it."""

    __slots__ = ("buffer", "raw", "size", "views")

    _MAX_VIEWS = 4  # shapes kept per buffer (one in practice: a size is one chunk shape)

    def __init__(self, buffer: torch.Tensor, size: int) -> None:
        self.buffer = buffer
        self.size = size
        self.raw: memoryview | None = None
        self.views: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        tensor = self.views.get((shape, dtype))
        if tensor is None:
            if len(self.views) >= self._MAX_VIEWS:
                self.views.clear()
            tensor = self.views[(shape, dtype)] = self.buffer[:nbytes].view(dtype).view(shape)
        return tensor

    def bytes_view(self, nbytes: int) -> memoryview:
        if self.raw is None:
            self.raw = memoryview(self.buffer.numpy())  # type: ignore[arg-type]
        return self.raw[:nbytes]


class MemoryObj:
    """One chunk's CPU buffer. Thread-safe reference counting; `tensor` is contiguous. The
    tensor object may be the one an earlier holder of the same pool buffer had (same memory,
    same shape): holders use it and do not change its metadata in place."""

    __slots__ = ("_block", "_nbytes", "_pool", "_raw", "_refs", "tensor")

    def __init__(
        self, block: _Block, shape: tuple[int, ...], dtype: torch.dtype, pool: MemoryPool
    ) -> None:
        self._block = block
        self._pool: MemoryPool | None = pool
        self._refs = 1
        self._raw: memoryview | None = None
        self._nbytes = _nbytes(shape, dtype)
        self.tensor = block.view(shape, dtype, self._nbytes)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def ref_count(self) -> int:
        return self._refs

    def raw_view(self) -> memoryview:
        """The chunk's bytes as a writable memoryview (no copy; made once per buffer)."""
        raw = self._raw
        if raw is None:  # the buffer is flat uint8 and the tensor its leading bytes
            raw = self._raw = self._block.bytes_view(self._nbytes)
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
        pool.give_back(self._block)


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
        self._free: dict[int, list[_Block]] = defaultdict(list)
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
            block = self._take_free(size)
            if block is None:
                if self._used_bytes + size > self.max_bytes:
                    self.failed_allocations += 1
                    return None
                self._drop_free(self._used_bytes + self._free_bytes + size - self.max_bytes)
                block = _Block(self._new_buffer(size), size)
            self._used_bytes += size
        return MemoryObj(block, shape, dtype, self)

    def shortfall(self, nbytes: int) -> int:
        """Bytes that must be freed (released by their holders) before an allocation of
        `nbytes` can succeed; 0 or less when it can now (kept-free buffers are dropped for it)."""
        with self.lock:
            return self._used_bytes + nbytes - self.max_bytes

    def give_back(self, block: _Block) -> None:
        size = block.size
        with self.lock:
            self._used_bytes -= size  # held bytes unchanged: still within the bound
            self._free[size].append(block)
            self._free_bytes += size

    def trim(self) -> None:
        """Drop every kept-free buffer (returns their memory to the system)."""
        with self.lock:
            self._drop_free(self._free_bytes)

    def _take_free(self, size: int) -> _Block | None:
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
