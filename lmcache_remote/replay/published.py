"""Published online cache policies, simulated with the prefix cache's rules (`replay.offline`).

Each is the policy as its paper states it, over blocks of one size, written here (and tested
in tests/test_replay_offline.py against hand-worked sequences) so that lookups stop at the
first missing block as the engine's do:

- ``arc``: ARC (Megiddo and Modha, FAST'03): recency and frequency lists with ghosts, the
  split between them adapted on every ghost hit;
- ``sieve``: SIEVE (Zhang et al., NSDI'24): one FIFO queue, a visited bit, a hand that
  evicts the first unvisited block it passes;
- ``s3fifo``: S3-FIFO (Yang et al., SOSP'23): a small FIFO (10%), a main FIFO and a ghost
  FIFO; a block reaches the main queue when it was used again while small (or was a ghost);
- ``wtinylfu``: W-TinyLFU (Einziger et al., ACM ToS 2017; Caffeine): a 1% LRU window, a main
  segmented LRU (20% probation, 80% protected) and admission by frequency: the window's
  victim enters the main cache only when it was used more often than the main victim. The
  frequencies here are exact counts halved every 10x capacity accesses (the paper's reset),
  not a count-min sketch: the same decisions without the sketch's collisions.

Hits (leading blocks present) are accesses; every block a request lacks is offered to the
policy's insertion; blocks present after the first missing one are not touched (the engine
does not read them).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from lmcache_remote.replay.simcache import SimCache
from lmcache_remote.replay.trace import Trace

__all__ = ["PUBLISHED"]


class _PrefixCache(SimCache):
    """The prefix rules over `hit` (a resident block used) and `insert` (a missing one)."""

    def contains(self, block: int) -> bool:
        raise NotImplementedError

    def hit(self, block: int) -> None:
        raise NotImplementedError

    def insert(self, block: int) -> bool:
        raise NotImplementedError

    def lookup(self, blocks: Sequence[int], now: int) -> int:
        hits = 0
        for block in blocks:
            if not self.contains(block):
                break
            self.hit(block)
            hits += 1
        return hits

    def store(self, blocks: Sequence[int], now: int) -> int:
        return sum(self.insert(b) for b in blocks if not self.contains(b))


class ARCCache(_PrefixCache):
    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.t2: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.b1: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.b2: collections.OrderedDict[int, None] = collections.OrderedDict()

    def contains(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def hit(self, block: int) -> None:
        self.t1.pop(block, None)
        self.t2.pop(block, None)
        self.t2[block] = None

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and ((in_b2 and len(self.t1) == int(self.p)) or len(self.t1) > self.p):
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None
        elif self.t2:
            old, _ = self.t2.popitem(last=False)
            self.b2[old] = None
        elif self.t1:
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None

    def insert(self, block: int) -> bool:
        if self.c <= 0:
            return False
        if block in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._replace(False)
            del self.b1[block]
            self.t2[block] = None
            return True
        if block in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._replace(True)
            del self.b2[block]
            self.t2[block] = None
            return True
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 >= self.c:
            if len(self.t1) < self.c:
                self.b1.popitem(last=False)
                self._replace(False)
            else:
                self.t1.popitem(last=False)
        elif total >= self.c:
            if total >= 2 * self.c:
                self.b2.popitem(last=False)
            self._replace(False)
        self.t1[block] = None
        return True


class SieveCache(_PrefixCache):
    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.visited: dict[int, bool] = {}
        # a doubly linked FIFO: new blocks at the head; the hand walks from the tail to it
        self.newer: dict[int, int | None] = {}
        self.older: dict[int, int | None] = {}
        self.head: int | None = None
        self.tail: int | None = None
        self.hand: int | None = None

    def contains(self, block: int) -> bool:
        return block in self.visited

    def hit(self, block: int) -> None:
        self.visited[block] = True

    def _unlink(self, block: int) -> None:
        newer, older = self.newer.pop(block), self.older.pop(block)
        if newer is None:
            self.head = older
        else:
            self.older[newer] = older
        if older is None:
            self.tail = newer
        else:
            self.newer[older] = newer
        del self.visited[block]

    def _evict(self) -> None:
        block = self.hand if self.hand is not None else self.tail
        while block is not None and self.visited[block]:
            self.visited[block] = False
            block = self.newer[block] if self.newer[block] is not None else self.tail
        assert block is not None
        self.hand = self.newer[block]
        self._unlink(block)

    def insert(self, block: int) -> bool:
        if self.c <= 0:
            return False
        if len(self.visited) >= self.c:
            self._evict()
        self.visited[block] = False
        self.older[block] = self.head
        self.newer[block] = None
        if self.head is not None:
            self.newer[self.head] = block
        self.head = block
        if self.tail is None:
            self.tail = block
        return True


class S3FIFOCache(_PrefixCache):
    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.small_cap = max(1, capacity // 10)
        self.small: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.main: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.ghost: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.freq: dict[int, int] = {}

    def contains(self, block: int) -> bool:
        return block in self.freq

    def hit(self, block: int) -> None:
        self.freq[block] = min(self.freq[block] + 1, 3)

    def _evict_main(self) -> None:
        while self.main:
            block, _ = self.main.popitem(last=False)
            if self.freq[block] > 0:
                self.freq[block] -= 1
                self.main[block] = None
            else:
                del self.freq[block]
                return

    def _evict_small(self) -> None:
        while self.small:
            block, _ = self.small.popitem(last=False)
            if self.freq[block] > 1:
                self.main[block] = None
                if len(self.main) > self.c - len(self.small):
                    self._evict_main()
            else:
                del self.freq[block]
                self.ghost[block] = None
                if len(self.ghost) > self.c - self.small_cap:
                    self.ghost.popitem(last=False)
                return

    def insert(self, block: int) -> bool:
        if self.c <= 0:
            return False
        while len(self.freq) >= self.c:
            if len(self.small) >= self.small_cap or not self.main:
                self._evict_small()
            else:
                self._evict_main()
        if block in self.ghost:
            del self.ghost[block]
            self.main[block] = None
        else:
            self.small[block] = None
        self.freq[block] = 0
        return True


class WTinyLFUCache(_PrefixCache):
    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.window_cap = max(1, capacity // 100)
        main = capacity - self.window_cap
        self.protected_cap = int(main * 0.8)
        self.window: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.probation: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.protected: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.counts: collections.Counter[int] = collections.Counter()
        self.sample = 10 * max(1, capacity)
        self.accesses = 0

    def _count(self, block: int) -> None:
        self.counts[block] += 1
        self.accesses += 1
        if self.accesses >= self.sample:  # the reset: every count halved
            self.accesses //= 2
            self.counts = collections.Counter(
                {k: v // 2 for k, v in self.counts.items() if v // 2})

    def contains(self, block: int) -> bool:
        return block in self.window or block in self.probation or block in self.protected

    def hit(self, block: int) -> None:
        self._count(block)
        if block in self.window:
            self.window.move_to_end(block)
        elif block in self.protected:
            self.protected.move_to_end(block)
        else:
            del self.probation[block]
            self.protected[block] = None
            if len(self.protected) > self.protected_cap:
                demoted, _ = self.protected.popitem(last=False)
                self.probation[demoted] = None

    def insert(self, block: int) -> bool:
        if self.c <= 0:
            return False
        self._count(block)
        self.window[block] = None
        if len(self.window) <= self.window_cap:
            return True
        candidate, _ = self.window.popitem(last=False)
        main_size = len(self.probation) + len(self.protected)
        if main_size < self.c - self.window_cap:
            self.probation[candidate] = None
            return True
        victims = self.probation or self.protected
        victim = next(iter(victims))
        if self.counts[candidate] > self.counts[victim]:
            del victims[victim]
            self.probation[candidate] = None
        return True


def _builder(cls: Callable[[int], SimCache]) -> Callable[[int, Trace], SimCache]:
    return lambda capacity, trace: cls(capacity)


#: Policy name -> builder, beside `offline.POLICIES` in `offline.simulate`.
PUBLISHED: dict[str, Callable[[int, Trace], SimCache]] = {
    "arc": _builder(ARCCache),
    "sieve": _builder(SieveCache),
    "s3fifo": _builder(S3FIFOCache),
    "wtinylfu": _builder(WTinyLFUCache),
}
