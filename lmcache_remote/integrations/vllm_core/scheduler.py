"""The scheduler side: hit counting and per-step plans.

Scheduler side (`SchedulerSide`, one per vLLM engine, in the scheduler process):

- `num_new_matched_tokens(req_id, prompt, num_computed, cache_salt)`: the prompt tokens past
  `num_computed` (vLLM's own prefix cache) that the cache can load now: one `PrefixLookup`
  over every rank's key namespace in one Redis round trip (a token counts when every rank
  holds it), never the whole prompt (vLLM must compute
  at least one token to sample from: a hit on the whole prompt is cut to the last chunk
  boundary before its last token). May be called several times for one request.
- `after_alloc(req_id, num_external, cache_salt)`: vLLM allocated blocks for the hit; the load
  is now promised to the worker.
- `build(new, cached, num_scheduled, finished)`: the step's `RequestPlan`s: per request the
  tokens, their slots, what to load (whole chunks from the last chunk boundary at or before
  `num_computed`) and what to store (the prompt's chunks completed by this step and not yet
  stored or known to be stored). Only prompt tokens are stored, never decode tokens. A
  request that vLLM rolled back (`num_computed` below what was counted as stored: a short
  load being recomputed) has its chunks from there on stored again.
- `loads_async(n)`: whether a hit of `n` tokens is offered as an asynchronous load
  (`async_load_min_tokens`); such a load is planned from the blocks given to `after_alloc`,
  in the next `build`, while vLLM keeps the request waiting. With `lookup_wait_s` lookups run
  on a thread (`BackgroundLookup`) and answer None while still running.
- `finish(req_id)`: forget the request; True (with `async_save`) when vLLM must keep its
  blocks until the workers report its background stores done.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from lmcache_remote.integrations.vllm_core.lookup import BackgroundLookup
from lmcache_remote.integrations.vllm_core.plans import RequestPlan, Span, slot_mapping
from lmcache_remote.metrics import Metrics, RateLimitedLogger

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (vLLM's NewRequestData, what is used of it)."""

    req_id: str
    prompt_token_ids: Sequence[int]
    block_ids: Sequence[int]
    num_computed_tokens: int


@dataclasses.dataclass(frozen=True)
class CachedRequest:
    """A request scheduled again (one entry of vLLM's CachedRequestData)."""

    req_id: str
    new_block_ids: Sequence[int] | None
    resumed: bool
    num_computed_tokens: int


@dataclasses.dataclass
class _Tracker:
    prompt: list[int]
    block_ids: list[int]
    salt: str | None
    stored_end: int = 0


class SchedulerSide:
    """Hit counting and per-step plans; see the module docstring. Not thread-safe (vLLM's
    scheduler calls it from one thread)."""

    def __init__(self, lookup: Callable[[Sequence[int], str | None], int], chunk_size: int,
                 block_size: int, *, save_unfull_chunk: bool = False, can_load: bool = True,
                 can_save: bool = True, async_load_min_tokens: int | None = None,
                 async_save: bool = False, lookup_wait_s: float | None = None) -> None:
        self._lookup = lookup
        self._background = (BackgroundLookup(lookup, lookup_wait_s)
                            if lookup_wait_s is not None else None)
        self.async_save = async_save
        self._saved: set[str] = set()  # requests with a store planned (async_save)
        self.async_load_min_tokens = async_load_min_tokens
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.save_unfull_chunk = save_unfull_chunk
        self.can_load = can_load
        self.can_save = can_save
        self._hits: dict[str, tuple[int, int]] = {}  # req -> (num_computed, loadable end)
        self._loads: dict[str, Span] = {}
        self._load_blocks: dict[str, list[int]] = {}  # for loads vLLM may run asynchronously
        self._salts: dict[str, str | None] = {}
        self._prompts: dict[str, list[int]] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._counted: set[str] = set()  # requests whose prompt is in `metrics`
        #: `vllm.prompt_tokens`, `vllm.device_cached_tokens`, `vllm.promised_tokens`: per
        #: request, once, when vLLM first allocates for it (vllm_core.stats)
        self.metrics = Metrics()
        self._log = RateLimitedLogger(logger)

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int,
                               cache_salt: str | None = None) -> int | None:
        """The hit to claim; None (with `lookup_wait_s`) while the lookup is still running."""
        self._salts[req_id] = cache_salt
        if not self.can_load or len(prompt) < 2:
            return 0
        try:
            if self._background is not None:
                found = self._background(req_id, prompt, cache_salt)
                if found is None:
                    return None
                hits = found
            else:
                hits = self._lookup(prompt, cache_salt)
        except Exception as exc:  # a lookup must never fail a request
            self._log.warning("lookup", "lookup failed, counted as a miss: %s", exc)
            return 0
        n = len(prompt)
        end = hits if hits < n else (n - 1) // self.chunk_size * self.chunk_size
        self._hits[req_id] = (num_computed, end)
        self._prompts[req_id] = list(prompt)
        return max(0, end - num_computed)

    def turn_off(self, reason: str) -> None:
        """A worker's connector is off (its KV cache layout unproven): claim no more hits and
        plan no more stores (once; logged at ERROR)."""
        if self.can_load or self.can_save:
            logger.error("lmcache-remote: no more lookups or stores, a worker turned the "
                         "connector off: %s", reason)
        self.can_load = self.can_save = False

    def loads_async(self, num_tokens: int) -> bool:
        """Whether a hit of `num_tokens` is offered to vLLM as an asynchronous load."""
        limit = self.async_load_min_tokens
        return limit is not None and num_tokens >= limit

    def after_alloc(self, req_id: str, num_external: int, cache_salt: str | None = None,
                    block_ids: Sequence[int] | None = None, prompt_tokens: int = 0) -> None:
        """vLLM allocated blocks (`block_ids`: all of the request's) for `num_external` hit
        tokens. A load that vLLM runs asynchronously is planned from these blocks in the next
        `build` (the request is not scheduled until it has arrived). The first time for a
        request, its prompt is counted: its length, what vLLM's own prefix cache held, what
        this cache promised."""
        self._salts[req_id] = cache_salt
        known = self._hits.get(req_id)
        if req_id not in self._counted:
            self._counted.add(req_id)
            self.metrics.inc("vllm.prompt_tokens", prompt_tokens)
            self.metrics.inc("vllm.device_cached_tokens", known[0] if known else 0)
            self.metrics.inc("vllm.promised_tokens", max(0, num_external))
        if num_external <= 0 or known is None:
            return
        num_computed = known[0]
        skip = num_computed // self.chunk_size * self.chunk_size
        self._loads[req_id] = Span(skip, num_computed, num_computed + num_external)
        if block_ids is not None:
            self._load_blocks[req_id] = list(block_ids)

    def build(self, new: Iterable[NewRequest], cached: Iterable[CachedRequest],
              num_scheduled: Mapping[str, int], finished: Iterable[str] = ()) -> list[RequestPlan]:
        for req_id in finished:
            self.finish(req_id)
        plans = []
        for req in new:
            tracker = self._trackers.get(req.req_id)  # known: its load ran asynchronously
            if tracker is None:
                tracker = _Tracker(list(req.prompt_token_ids), list(req.block_ids),
                                   self._salts.get(req.req_id))
                tracker.stored_end = self._hits.get(req.req_id, (0, 0))[1]
                self._trackers[req.req_id] = tracker
            else:
                tracker.block_ids = list(req.block_ids)
                self._roll_back(tracker, req.num_computed_tokens)
            self._load_blocks.pop(req.req_id, None)
            end = req.num_computed_tokens + num_scheduled.get(req.req_id, 0)
            plans.append(self._plan(req.req_id, tracker, end))
        for creq in cached:
            known = self._trackers.get(creq.req_id)
            if known is None:
                continue
            self._roll_back(known, creq.num_computed_tokens)
            self._load_blocks.pop(creq.req_id, None)
            if creq.resumed:
                known.block_ids = list(creq.new_block_ids or [])
            elif creq.new_block_ids:
                known.block_ids.extend(creq.new_block_ids)
            end = creq.num_computed_tokens + num_scheduled.get(creq.req_id, 0)
            plans.append(self._plan(creq.req_id, known, end))
        plans.extend(self._async_loads())
        return [p for p in plans if p is not None]

    def _roll_back(self, tracker: _Tracker, num_computed: int) -> None:
        """vLLM rolled the request back when it computes less than was counted as stored (a
        load came back short and is recomputed, or a preempted request resumed with a shorter
        hit): what it computes again is stored again, from the chunk it restarts in. Chunks
        still in Redis are skipped by the store's existence check."""
        if num_computed < tracker.stored_end:
            tracker.stored_end = num_computed // self.chunk_size * self.chunk_size

    def _async_loads(self) -> list[RequestPlan | None]:
        """Loads promised in `after_alloc` for requests this step does not schedule: vLLM
        runs them asynchronously. The request's tracker starts here, with its hit counted as
        stored."""
        plans: list[RequestPlan | None] = []
        for req_id, block_ids in list(self._load_blocks.items()):
            load = self._loads.pop(req_id, None)
            del self._load_blocks[req_id]
            prompt = self._prompts.pop(req_id, None)
            self._hits.pop(req_id, None)
            if load is None or prompt is None:
                continue
            tracker = _Tracker(list(prompt), list(block_ids), self._salts.get(req_id),
                               stored_end=load.end)
            self._trackers[req_id] = tracker
            try:
                slots = slot_mapping(block_ids, self.block_size, load.end)
            except ValueError as exc:
                self._log.warning("plan", "request %s skipped: %s", req_id, exc)
                plans.append(None)
                continue
            plans.append(RequestPlan(req_id, tracker.prompt[:load.end], slots, tracker.salt,
                                     load, None, async_load=True))
        return plans

    def finish(self, req_id: str) -> bool:
        """Forget the request; True when vLLM must keep its blocks until the workers report
        its stores done (`async_save` and a store was planned: every worker applies the same
        rule to the same plans, so each reports it)."""
        delay = req_id in self._saved
        self._saved.discard(req_id)
        self._counted.discard(req_id)
        if self._background is not None:
            self._background.forget(req_id)
        self._hits.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._load_blocks.pop(req_id, None)
        self._prompts.pop(req_id, None)
        self._salts.pop(req_id, None)
        self._trackers.pop(req_id, None)
        return delay

    def close(self) -> None:
        if self._background is not None:
            self._background.close()

    def _plan(self, req_id: str, tracker: _Tracker, computed_end: int) -> RequestPlan | None:
        load = self._loads.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._prompts.pop(req_id, None)
        save = self._save_span(tracker, computed_end) if self.can_save else None
        if load is None and save is None:
            return None
        n = max(load.end if load else 0, save.end if save else 0)
        try:
            slots = slot_mapping(tracker.block_ids, self.block_size, n)
        except ValueError as exc:
            self._log.warning("plan", "request %s skipped: %s", req_id, exc)
            return None
        if save is not None:
            tracker.stored_end = save.end
            if self.async_save:
                self._saved.add(req_id)
        return RequestPlan(req_id, tracker.prompt[:n], slots, tracker.salt, load, save)

    def _save_span(self, tracker: _Tracker, computed_end: int) -> Span | None:
        prompt_done = min(computed_end, len(tracker.prompt))
        end = prompt_done // self.chunk_size * self.chunk_size
        if self.save_unfull_chunk and prompt_done == len(tracker.prompt):
            end = prompt_done
        if end <= tracker.stored_end:
            return None
        start = tracker.stored_end // self.chunk_size * self.chunk_size
        return Span(start, tracker.stored_end, end)

