from __future__ import annotations

import threading

import torch

from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool

LAYOUT = ChunkLayout(2, 2, 4, torch.bfloat16)


def test_pool_bound_and_reuse() -> None:
    size = LAYOUT.nbytes(16)
    pool = MemoryPool(3 * size, pin_memory=False)
    objs = [pool.allocate(LAYOUT.shape(16), LAYOUT.dtype) for _ in range(3)]
    assert all(o is not None for o in objs)
    assert pool.allocate(LAYOUT.shape(16), LAYOUT.dtype) is None
    assert pool.failed_allocations == 1
    first = objs[0]
    assert first is not None
    ptr = first.tensor.data_ptr()
    first.release()
    again = pool.allocate(LAYOUT.shape(16), LAYOUT.dtype)
    assert again is not None and again.tensor.data_ptr() == ptr  # a freed buffer is reused
    assert again.tensor.shape == LAYOUT.shape(16) and again.tensor.dtype == torch.bfloat16


def test_refcount_keeps_buffer_until_last_release() -> None:
    pool = MemoryPool(LAYOUT.nbytes(16), pin_memory=False)
    obj = pool.allocate(LAYOUT.shape(16), LAYOUT.dtype)
    assert obj is not None
    obj.retain()
    obj.release()
    assert pool.used_bytes == LAYOUT.nbytes(16)
    obj.release()
    assert pool.used_bytes == 0
    try:
        obj.release()
    except RuntimeError:
        pass
    else:  # pragma: no cover
        raise AssertionError("double release must fail")


def test_free_buffers_of_other_sizes_are_dropped_for_room() -> None:
    pool = MemoryPool(LAYOUT.nbytes(16) + LAYOUT.nbytes(8), pin_memory=False)
    a = pool.allocate(LAYOUT.shape(16), LAYOUT.dtype)
    b = pool.allocate(LAYOUT.shape(8), LAYOUT.dtype)
    assert a is not None and b is not None
    a.release()
    b.release()
    c = pool.allocate(LAYOUT.shape(24), LAYOUT.dtype)
    assert c is not None and pool.held_bytes <= pool.max_bytes


def test_threads_allocate_and_release_consistently() -> None:
    pool = MemoryPool(LAYOUT.nbytes(4) * 8, pin_memory=False)

    def work() -> None:
        for _ in range(500):
            obj = pool.allocate(LAYOUT.shape(4), LAYOUT.dtype)
            if obj is not None:
                obj.retain()
                obj.release()
                obj.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.used_bytes == 0 and pool.held_bytes <= pool.max_bytes


def test_every_freed_buffer_is_kept_within_the_bound() -> None:
    """A read of many chunks gets every buffer back reused (no count cap per size: 300 here,
    past the 64 an earlier cap kept), and what is kept free still counts toward the bound."""
    count = 300
    size = LAYOUT.nbytes(4)
    pool = MemoryPool(count * size, pin_memory=False)
    objs = [pool.allocate(LAYOUT.shape(4), LAYOUT.dtype) for _ in range(count)]
    assert all(o is not None for o in objs)
    ptrs = {o.tensor.data_ptr() for o in objs if o is not None}
    for o in objs:
        assert o is not None
        o.release()
    assert pool.used_bytes == 0 and pool.held_bytes == count * size
    again = [pool.allocate(LAYOUT.shape(4), LAYOUT.dtype) for _ in range(count)]
    assert {o.tensor.data_ptr() for o in again if o is not None} == ptrs
    for o in again:
        assert o is not None
        o.release()
    big = pool.allocate(LAYOUT.shape(4 * count), LAYOUT.dtype)  # kept buffers make room
    assert big is not None and pool.held_bytes <= pool.max_bytes
    pool.trim()
    assert pool.held_bytes == pool.used_bytes == count * size


def test_a_reused_buffer_keeps_its_views_and_each_shape_gets_its_own() -> None:
    """Reusing a buffer reuses the views made of it (the chunk tensor, the byte view), so a
    read makes no torch or numpy call per chunk; a buffer of the same size asked for in
    another shape or dtype gets a view of that shape, over the same bytes."""
    pool = MemoryPool(LAYOUT.nbytes(16), pin_memory=False)
    first = pool.allocate(LAYOUT.shape(16), LAYOUT.dtype)
    assert first is not None
    tensor, raw = first.tensor, first.raw_view()
    first.tensor.fill_(3)
    first.release()
    again = pool.allocate(LAYOUT.shape(16), LAYOUT.dtype)
    assert again is not None and again.tensor is tensor
    assert again.raw_view().obj is raw.obj and len(again.raw_view()) == LAYOUT.nbytes(16)
    again.release()
    other = pool.allocate((LAYOUT.nbytes(16) // 4,), torch.float32)  # same bytes, other view
    assert other is not None and other.tensor is not tensor
    assert tuple(other.tensor.shape) == (LAYOUT.nbytes(16) // 4,)
    assert other.tensor.dtype == torch.float32 and other.nbytes == LAYOUT.nbytes(16)
    assert other.tensor.data_ptr() == tensor.data_ptr()
    assert bytes(other.raw_view()) == bytes(raw)  # the same memory (bf16 threes)
    other.release()
    back = pool.allocate(LAYOUT.shape(16), LAYOUT.dtype)
    assert back is not None and back.tensor is tensor  # the first shape's view is still kept
    back.release()
