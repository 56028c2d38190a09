"""Offline simulations of a prefix cache on a trace: what a cache of a given size could hit.

The replayer (`replay.driver`) runs the real engine against a real Redis; beside it, on the
same requests, these simulate caches of the same capacity in blocks, with the rules the engine
follows:

- a request looks up its full blocks in order and hits the leading ones present (the first
  block missing cuts off the rest: later KV depends on every block before it);
- it then stores each of its full blocks the cache lacks (its policy may decline some);
- the hit rate is hit tokens over prompt tokens, counted for the requests at or after
  ``measure_from`` (the earlier ones warm the cache up).

Policies (`POLICIES`): ``lru`` (a block stored when missed, a hit refreshes it), ``optimum``
(Belady with bypass: a block not used again is never stored, and when full the block used
farthest in the future goes, or the new block is not stored when its next use is farther
than every resident's: the offline optimum the issue measures against, an upper bound no
online policy reaches), ``keep`` (`KeepSim`: this project's keep policy with its state in
memory), and beside them the published online policies of `replay.published`. Every policy
counts the blocks it writes. The offline optimum is "optimal" in the usual, block-level sense
(the bound the issue and the caching literature use); it does not weigh that a block is worth
nothing without its parents, so a prefix-aware offline policy could do a little better.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence

from lmcache_remote.replay.published import PUBLISHED
from lmcache_remote.replay.simcache import SimCache
from lmcache_remote.replay.trace import Trace, TraceRequest

__all__ = ["POLICIES", "SimCache", "SimResult", "next_uses", "simulate"]

INF = float("inf")


@dataclasses.dataclass
class SimResult:
    """What one simulated cache did on a trace."""

    policy: str
    capacity_blocks: int
    hit_tokens: int
    prompt_tokens: int
    written_blocks: int
    requests: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, float | int | str]:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}


class LRUCache(SimCache):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def lookup(self, blocks: Sequence[int], now: int) -> int:
        hits = 0
        for block in blocks:
            if block not in self.blocks:
                break
            self.blocks.move_to_end(block)
            hits += 1
        return hits

    def store(self, blocks: Sequence[int], now: int) -> int:
        written = 0
        for block in blocks:
            if block in self.blocks or self.capacity <= 0:
                continue
            if len(self.blocks) >= self.capacity:
                self.blocks.popitem(last=False)
            self.blocks[block] = None
            written += 1
        return written


def next_uses(requests: Sequence[TraceRequest]) -> list[list[float]]:
    """For each request and each of its full blocks, the index of the next request that asks
    for that block again (`INF`: none)."""
    out: list[list[float]] = [[] for _ in requests]
    later: dict[int, float] = {}
    for index in range(len(requests) - 1, -1, -1):
        request = requests[index]
        blocks = request.blocks[:request.full_blocks]
        out[index] = [later.get(b, INF) for b in blocks]
        for b in blocks:
            later[b] = index
    return out


class OptimumCache(SimCache):
    """Belady with bypass (the module doc); needs the trace's future (`next_uses`)."""

    def __init__(self, capacity: int, future: list[list[float]]) -> None:
        self.capacity = capacity
        self.future = future
        self.next: dict[int, float] = {}  # resident block -> its next use
        self.heap: list[tuple[float, int]] = []  # (-next use, block), stale entries skipped

    def lookup(self, blocks: Sequence[int], now: int) -> int:
        hits = 0
        for block in blocks:
            if block not in self.next:
                break
            hits += 1
        return hits

    def _farthest(self) -> tuple[float, int]:
        while True:
            neg, block = self.heap[0]
            if self.next.get(block) == -neg:
                return -neg, block
            heapq.heappop(self.heap)

    def store(self, blocks: Sequence[int], now: int) -> int:
        written = 0
        uses = self.future[now]
        for block, use in zip(blocks, uses, strict=False):
            if block in self.next:  # a use: its next one is known now
                self.next[block] = use
                heapq.heappush(self.heap, (-use, block))
                continue
            if use == INF or self.capacity <= 0:
                continue
            if len(self.next) >= self.capacity:
                far, victim = self._farthest()
                if far <= use:
                    continue  # everything resident is used sooner: bypass
                heapq.heappop(self.heap)
                del self.next[victim]
            self.next[block] = use
            heapq.heappush(self.heap, (-use, block))
            written += 1
        # a resident block asked for here but beyond this request's full blocks: none
        return written


def _lru(capacity: int, trace: Trace) -> SimCache:
    return LRUCache(capacity)


def _optimum(capacity: int, trace: Trace) -> SimCache:
    return OptimumCache(capacity, next_uses(trace.requests))


#: Policy name -> a builder of its simulated cache (capacity in blocks, the trace).
POLICIES: dict[str, Callable[[int, Trace], SimCache]] = {"lru": _lru, "optimum": _optimum}


def simulate(trace: Trace, capacity_tokens: int, policy: str,
             measure_from: float | None = None) -> SimResult:
    """Runs ``policy`` (a `POLICIES` name, or one `replay.published` adds) over the trace
    with room for ``capacity_tokens`` tokens of full blocks; counts hits from
    ``measure_from`` seconds on (None: every request)."""
    builders = {**POLICIES, **PUBLISHED}
    if policy not in builders:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(sorted(builders))}")
    capacity = capacity_tokens // trace.block_size
    cache = builders[policy](capacity, trace)
    hit_tokens = prompt_tokens = written = counted = 0
    for now, request in enumerate(trace.requests):
        blocks = request.blocks[:request.full_blocks]
        hits = cache.lookup(blocks, now)
        written += cache.store(blocks, now)
        if measure_from is None or request.time >= measure_from:
            hit_tokens += hits * trace.block_size
            prompt_tokens += request.input_length
            counted += 1
    return SimResult(policy, capacity, hit_tokens, prompt_tokens, written, counted)


class KeepSim(SimCache):
    """The project's keep policy (`storage.keep.policy`) with its state in memory instead of
    Redis: the same classes, figures, scores and admission, the eviction of the lowest score
    and the ghosts. What it cannot show: Redis's memory (capacity here is a count of chunks),
    several engines learning at once, and the toucher's delay (a hit is learned from at once
    here, a moment later in the engine)."""

    def __init__(self, capacity: int, trace: Trace) -> None:
        from lmcache_remote.storage.keep import policy

        self.policy = policy
        self.capacity = capacity
        self.figures = policy.KeepFigures()
        self.score: dict[int, float] = {}
        self.heap: list[tuple[float, int]] = []
        self.meta: dict[int, tuple[int, float]] = {}  # block -> (class, last access ms)
        self.ghosts: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.ghost_max = max(policy.MIN_GHOSTS, int(policy.GHOST_FACTOR * capacity))
        self.requests = trace.requests
        self._hits = 0

    def _learn(self, blocks: Sequence[int], now_ms: float, depth: int,
               start: int, end: int) -> list[int]:
        classes = []
        for j in range(start, end):
            old = self.meta.get(blocks[j])
            klass = self.policy.chunk_class(j, len(blocks), depth, old is not None)
            self.figures.note(klass, None if old is None else old[0],
                              None if old is None else now_ms - old[1])
            self.meta[blocks[j]] = (klass, now_ms)
            classes.append(klass)
        return classes

    def _set(self, block: int, score: float) -> None:
        self.score[block] = score
        heapq.heappush(self.heap, (score, block))
        self.ghosts.pop(block, None)

    def _ghost(self, block: int) -> None:
        self.ghosts[block] = None
        self.ghosts.move_to_end(block)
        while len(self.ghosts) > self.ghost_max:
            old, _ = self.ghosts.popitem(last=False)
            self.meta.pop(old, None)

    def _lowest(self) -> tuple[float, int] | None:
        while self.heap:
            s, block = self.heap[0]
            if self.score.get(block) == s:
                return s, block
            heapq.heappop(self.heap)
        return None

    def lookup(self, blocks: Sequence[int], now: int) -> int:
        hits = 0
        for block in blocks:
            if block not in self.score:
                break
            hits += 1
        self._hits = hits
        return hits

    def store(self, blocks: Sequence[int], now: int) -> int:
        p = self.policy
        now_ms = self.requests[now].time * 1000.0
        hits = self._hits
        depth = hits
        while depth < len(blocks) and (blocks[depth] in self.score or blocks[depth] in self.meta):
            depth += 1
        horizons = self.figures.horizons()
        fallback = self.figures.horizon_ms(p.ALL) or 0.0
        hit_classes = self._learn(blocks, now_ms, depth, 0, hits)
        parent = math.inf
        for block, s in zip(blocks[:hits], p.scores(now_ms, hit_classes, horizons, fallback),
                            strict=True):
            self._set(block, s)
            parent = s
        missing = [j for j in range(hits, len(blocks)) if blocks[j] not in self.score]
        if not missing:
            return 0
        # the classes of the missing chunks (learned from: they were asked for)
        classes = []
        for j in missing:
            classes.extend(self._learn(blocks, now_ms, depth, j, j + 1))
        free = max(0, self.capacity - len(self.score))
        take = p.admit(classes, self.figures, free)
        written = 0
        prev_index = hits - 1
        for n, (j, klass) in enumerate(zip(missing, classes, strict=True)):
            block = blocks[j]
            if n >= take or self.capacity <= 0:
                self._ghost(block)
                continue
            if j - 1 > prev_index and blocks[j - 1] in self.score:
                parent = self.score[blocks[j - 1]]
            s = p.scores(now_ms, [klass], horizons, fallback, parent)[0]
            self._set(block, s)
            parent, prev_index = s, j
            written += 1
            while len(self.score) > self.capacity:
                low = self._lowest()
                assert low is not None
                heapq.heappop(self.heap)
                del self.score[low[1]]
                self._ghost(low[1])
        return written


POLICIES["keep"] = KeepSim
