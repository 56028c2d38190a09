"""StoreBatch: the CPU buffers of one `CacheEngine` store while it is under way.

Per chunk of the store, in order: its source buffer (a chunk the local tier already held, a
fresh buffer the caller fills from the engine's KV, or None past the memory cut or where
nothing needs writing), which chunks still need their KV copied in (`copies`), and the
`StorePlan` that said where each chunk goes. `release()` drops every reference the batch holds,
the plan's included, and may be called more than once.
"""

from __future__ import annotations

import torch

from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.storage.local.memory import MemoryObj
from lmcache_remote.storage.manager.storage_manager import StorePlan


class StoreBatch:
    """The buffers of one store: per chunk its source (None past the memory cut or when
    nothing needs writing) and which chunks still need their KV copied in."""

    def __init__(self, plan: StorePlan) -> None:
        self.plan = plan
        self.sources: list[MemoryObj | None] = []
        self.copies: list[int] = []

    def copies_in(self, window: range | None = None) -> list[int]:
        """The chunks still to be copied in, those of ``window`` only when given."""
        return self.copies if window is None else [i for i in self.copies if i in window]

    def copy_ranges(self, specs: list[ChunkSpec], window: range | None = None
                    ) -> list[tuple[int, int]]:
        return [(specs[i].start, specs[i].end) for i in self.copies_in(window)]

    def copy_tensors(self, window: range | None = None) -> list[torch.Tensor]:
        return [_tensor(self.sources[i]) for i in self.copies_in(window)]

    def release(self) -> None:
        """Drop every reference the batch holds (idempotent)."""
        for obj in self.sources + self.plan.local_objs:
            if obj is not None:
                obj.release()
        self.sources = [None] * len(self.sources)
        self.plan.local_objs = [None] * len(self.plan.local_objs)


def present(obj: MemoryObj | None) -> MemoryObj:
    """A source the caller knows is there (not cut by memory)."""
    assert obj is not None
    return obj


def _tensor(obj: MemoryObj | None) -> torch.Tensor:
    return present(obj).tensor
