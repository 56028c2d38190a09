"""The scheduler side: hit counting and per-step plans.

Scheduler side (`SchedulerSide`, one per vLLM engine, in the scheduler process):

- `num_new_matched_tokens(req_id, prompt, num_computed, identity)`: the prompt tokens past
  `num_computed` (vLLM's own prefix cache) that the cache can load now: one `PrefixLookup`
  over every rank's key namespace in one Redis round trip (a token counts when every rank
  holds it), never the whole prompt (vLLM must compute
  at least one token to sample from: a hit on the whole prompt is cut to the last chunk
  boundary before its last token). May be called several times for one request.
- `after_alloc(req_id, num_external)`: vLLM allocated blocks for the hit; the load
  is now promised to the worker.
- `build(new, cached, num_scheduled, finished)`: the step's `RequestPlan`s: per request the
  tokens, their slots, what to load (whole chunks from the last chunk boundary at or before
  `num_computed`) and what to store (the prompt's chunks completed by this step and not yet
  stored or known to be stored). A preempted request comes back either as a `CachedRequest`
  flagged `resumed` (vLLM 0.32 and 0.33's Model Runner V1) or as a `NewRequest` with its
  whole block table (vLLM 0.34): a known request is planned from that table either way.
  Only prompt tokens are stored, never decode tokens. A request that vLLM rolled back
  (`num_computed` below what was counted as stored: a short load being recomputed) has its
  chunks from there on stored again.
- `loads_async(n)`: whether a hit of `n` tokens is offered as an asynchronous load
  (`async_load_min_tokens`; `may_load_async`: whether a request could get one, before any
  lookup); such a load is planned from the blocks given to `after_alloc`, in the next
  `build`, while vLLM keeps the request waiting. With `lookup_wait_s` lookups run on a
  thread (`BackgroundLookup`) and answer None while still running.
- `finish(req_id)`: forget the request; True (with `async_save`) when vLLM must keep its
  blocks until the workers report its background stores done.
- What it claims is decided (`engine.decision.LoadDecision`, once per request and hit): the
  part of the hit whose expected load time is shorter than computing it, nothing while a
  worker reports its link down (but a probe now and then), and nothing for a request whose
  load failed `MAX_LOAD_FAILURES` times, however vLLM learnt of the failure (a failed block
  or a failed request: `load_failed`). A probe loads in the background, never within a step.
- `worker_report(...)`: what the workers measured and saw this step (vLLM's worker
  metadata): failed loads, the link's state and throughput, the forward's time, which feeds
  the decision's prefill figures.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from lmcache_remote.engine.decision import LoadDecision, Verdict, publish_figures
from lmcache_remote.integrations.vllm_core.groups import MAMBA, KVGroup, plain
from lmcache_remote.integrations.vllm_core.lookup import BackgroundLookup
from lmcache_remote.integrations.vllm_core.plans import RequestPlan, Span, slot_mapping
from lmcache_remote.naming.identity import RequestIdentity
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

logger = logging.getLogger(__name__)

#: A request whose load failed this many times is not promised a hit again.
MAX_LOAD_FAILURES = 2


#: Block ids of a request: one list per KV cache group (a flat list: the only group's).
BlockIds = Sequence[Sequence[int]] | Sequence[int]


@dataclasses.dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (vLLM's NewRequestData, what is used of it)."""

    req_id: str
    prompt_token_ids: Sequence[int]
    block_ids: BlockIds
    num_computed_tokens: int


@dataclasses.dataclass(frozen=True)
class CachedRequest:
    """A request scheduled again (one entry of vLLM's CachedRequestData)."""

    req_id: str
    new_block_ids: BlockIds | None
    resumed: bool
    num_computed_tokens: int


@dataclasses.dataclass
class _Tracker:
    prompt: list[int]
    block_ids: list[list[int]]  # per group
    identity: RequestIdentity | None
    stored_end: int = 0


def per_group(block_ids: BlockIds | None, num_groups: int) -> list[list[int]] | None:
    """`block_ids` as one list per group (a flat list is the only group's)."""
    if block_ids is None:
        return None
    if len(block_ids) and isinstance(block_ids[0], (list, tuple)):
        lists = [list(ids) for ids in block_ids]  # type: ignore[arg-type]
    elif num_groups == 1:
        lists = [list(block_ids)]  # type: ignore[arg-type]
    else:
        lists = [[] for _ in range(num_groups)] if not len(block_ids) else []
    if len(lists) != num_groups:
        raise ValueError(f"block ids of {len(lists)} KV cache groups, expected {num_groups}")
    return lists


class SchedulerSide:
    """Hit counting and per-step plans; see the module docstring. Not thread-safe (vLLM's
    scheduler calls it from one thread)."""

    def __init__(self, lookup: Callable[[Sequence[int], RequestIdentity | None], int],
                 chunk_size: int, block_size: int, *, save_unfull_chunk: bool = False,
                 can_load: bool = True, can_save: bool = True,
                 async_load_min_tokens: int | None = None, async_save: bool = False,
                 lookup_wait_s: float | None = None,
                 groups: Sequence[KVGroup] | None = None,
                 decision: LoadDecision | None = None, bytes_per_token: float = 0.0) -> None:
        self._lookup = lookup
        #: how much of a hit to claim (None: all of it, as `load_policy: always`)
        self.decision = decision
        self.bytes_per_token = bytes_per_token
        self._verdicts: dict[str, Verdict] = {}  # request -> the verdict on its hit
        self._link_down = False  # a worker said its link to Redis is backing off
        #: the KV cache groups of a model that is not plain (`groups.plain`): plans per group,
        #: every load in the background; None: one full-attention group, as always
        self.groups = None if groups is None or plain(groups) else list(groups)
        self._failures: dict[str, int] = {}  # request -> background loads that failed
        #: requests whose current load was already counted failed: the workers' report and
        #: vLLM's failed request come in different steps (a background load ends on each rank
        #: in its own time); vLLM learns of the failure by the last of them, so a new promise
        #: comes after all of them
        self._failure_noted: set[str] = set()
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
        self._load_blocks: dict[str, list[list[int]]] = {}  # for loads run asynchronously
        #: requests vLLM asked about, and what names their chunks beside the tokens
        self._identities: dict[str, RequestIdentity | None] = {}
        self._retain: dict[str, float] = {}  # seconds each request asked to stay pinned
        self._unnamed: set[str] = set()  # requests passed through (`unnamed`)
        self._prompts: dict[str, list[int]] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._counted: set[str] = set()  # requests whose prompt is in `metrics`
        #: `vllm.prompt_tokens`, `vllm.device_cached_tokens`, `vllm.promised_tokens`: per
        #: request, once, when vLLM first allocates for it (vllm_core.stats)
        self.metrics = Metrics()
        if decision is not None:
            publish_figures(self.metrics, decision.figures())
        self._log = RateLimitedLogger(logger)

    def retain(self, req_id: str, seconds: float | None) -> None:
        """The request asks its prefix to stay pinned this long (`requests.retention`); every
        plan of it carries the ask to the workers."""
        if seconds is None:
            self._retain.pop(req_id, None)
        else:
            self._retain[req_id] = seconds

    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int,
                               identity: RequestIdentity | None = None, *,
                               read: bool = True) -> int | None:
        """The hit to claim; None (with `lookup_wait_s`) while the lookup is still running.
        `identity`: what names the request's chunks beside its tokens (None: a text request).
        `read=False`: vLLM reads no external KV for this request (prompt logprobs): no lookup,
        0, nothing left to promise; its prompt is still stored."""
        self._identities[req_id] = identity
        if not read:
            self._hits.pop(req_id, None)
            self._verdicts.pop(req_id, None)
            return 0
        if not self.can_load or len(prompt) < 2:
            return 0
        if self._failures.get(req_id, 0) >= MAX_LOAD_FAILURES:
            return 0  # its load failed the same way each time: vLLM computes it
        try:
            if self._background is not None:
                found = self._background(req_id, prompt, identity)
                if found is None:
                    return None
                hits = found
            else:
                hits = self._lookup(prompt, identity)
        except Exception as exc:  # a lookup must never fail a request
            self._log.warning("lookup", "lookup failed, counted as a miss: %s", exc)
            return 0
        n = len(prompt)
        end = hits if hits < n else (n - 1) // self.chunk_size * self.chunk_size
        end = self._decide(req_id, num_computed, end)
        self._hits[req_id] = (num_computed, end)
        self._prompts[req_id] = list(prompt)
        if end > num_computed:
            self._failure_noted.discard(req_id)  # a new promise: its failure counts anew
        return max(0, end - num_computed)

    def _decide(self, req_id: str, num_computed: int, end: int) -> int:
        """The end of what to claim of a hit `[num_computed, end)`: the request's verdict,
        made once per hit (vLLM asks again while the request waits)."""
        if self.decision is None or end <= num_computed:
            self._verdicts.pop(req_id, None)
            return end
        verdict = self._verdicts.get(req_id)
        if verdict is None or (verdict.start, verdict.end) != (num_computed, end):
            verdict = self.decision.decide(num_computed, end, self.bytes_per_token,
                                           link_down=self._link_down)
            self._verdicts[req_id] = verdict
        return verdict.load_end

    def worker_report(self, failed_loads: Iterable[str], link_down: bool,
                      throughput: float | None, step: tuple[int, float, float] | None) -> None:
        """What the workers saw this step (see the module docstring)."""
        self.load_failed(failed_loads)
        self._link_down = link_down
        if self.decision is None:
            return
        if throughput is not None:
            self.decision.link.update(throughput, None)
        if step is not None:
            self.decision.prefill.observe(*step)
        publish_figures(self.metrics, self.decision.figures())

    def turn_off(self, reason: str) -> None:
        """A worker's connector is off (its KV cache layout unproven): claim no more hits and
        plan no more stores (once; logged at ERROR)."""
        if self.can_load or self.can_save:
            logger.error("lmcache-remote: no more lookups or stores, a worker turned the "
                         "connector off: %s", reason)
        self.can_load = self.can_save = False

    def loads_async(self, num_tokens: int, req_id: str | None = None) -> bool:
        """Whether a hit of `num_tokens` is offered to vLLM as an asynchronous load: always
        for a model of several groups (vLLM cannot take a failed block of such a model, only
        a failed request, which it recomputes whole) and for a probe (a link declined or
        down must never hold a step)."""
        verdict = self._verdicts.get(req_id) if req_id is not None else None
        if num_tokens > 0 and verdict is not None and verdict.probe:
            return True
        if self.groups is not None:
            return num_tokens > 0
        limit = self.async_load_min_tokens
        return limit is not None and num_tokens >= limit

    def may_load_async(self, req_id: str, num_prompt_tokens: int) -> bool:
        """Whether a request with a prompt this long could be answered with a background load
        (`loads_async`), without a lookup: its longest possible hit (whole chunks short of
        its last token) is. False when it cannot load at all (loads off, or its load failed
        `MAX_LOAD_FAILURES` times). A probe is not foreseen."""
        if not self.can_load or self._failures.get(req_id, 0) >= MAX_LOAD_FAILURES:
            return False
        longest = (num_prompt_tokens - 1) // self.chunk_size * self.chunk_size
        if longest <= 0:
            return False
        if self.groups is not None:
            return True
        limit = self.async_load_min_tokens
        return limit is not None and longest >= limit

    def load_failed(self, req_ids: Iterable[str]) -> None:
        """These requests' loads failed (vLLM recomputes them): a request whose load failed
        `MAX_LOAD_FAILURES` times is not promised a hit again, and its next ask is decided
        anew. A load counts once however many ranks report it, in whichever steps."""
        failed = set(req_ids)
        if failed and self.decision is not None:
            self.decision.load_ended()
        for req_id in failed - self._failure_noted:
            self._failure_noted.add(req_id)
            self._verdicts.pop(req_id, None)
            self._failures[req_id] = self._failures.get(req_id, 0) + 1
            self.metrics.inc("vllm.failed_load_requests")
            if self._failures[req_id] == MAX_LOAD_FAILURES:
                self._log.warning("load", "request %s: its load from the cache failed %d "
                                  "times; no hit is promised for it again", req_id,
                                  MAX_LOAD_FAILURES)

    def unnamed(self, req_id: str, reason: str) -> None:
        """The request's KV depends on something its keys cannot bind: it is passed
        through (never looked up, planned or stored), counted and logged (rate-limited)."""
        self._identities.pop(req_id, None)
        if req_id in self._unnamed:
            return  # vLLM asks again while the request waits: counted once
        self._unnamed.add(req_id)
        self.metrics.inc("vllm.unnamed_requests")
        self._log.warning("unnamed", "request %s passes through the cache: %s", req_id, reason)

    def knows(self, req_id: str) -> bool:
        """Whether vLLM asked about the request (`num_new_matched_tokens`): only such a
        request's chunks can be named, so only such a request is planned."""
        return req_id in self._identities

    def after_alloc(self, req_id: str, num_external: int, block_ids: BlockIds | None = None,
                    prompt_tokens: int = 0) -> None:
        """vLLM allocated blocks (`block_ids`: all of the request's) for `num_external` hit
        tokens. A load that vLLM runs asynchronously is planned from these blocks in the next
        `build` (the request is not scheduled until it has arrived). The first time for a
        request, its prompt is counted: its length, what vLLM's own prefix cache held, what
        this cache promised."""
        known = self._hits.get(req_id)
        if req_id not in self._counted:
            self._counted.add(req_id)
            self.metrics.inc("vllm.prompt_tokens", prompt_tokens)
            self.metrics.inc("vllm.device_cached_tokens", known[0] if known else 0)
            self.metrics.inc("vllm.promised_tokens", max(0, num_external))
            verdict = self._verdicts.get(req_id)
            if verdict is not None:
                self.metrics.inc("vllm.declined_tokens", verdict.declined)
                self.metrics.inc("vllm.probe_loads", int(verdict.probe))
        if num_external <= 0 or known is None:
            return
        num_computed = known[0]
        skip = num_computed // self.chunk_size * self.chunk_size
        self._loads[req_id] = Span(skip, num_computed, num_computed + num_external)
        if block_ids is not None:
            lists = per_group(block_ids, self._num_groups)
            assert lists is not None
            self._load_blocks[req_id] = lists

    def build(self, new: Iterable[NewRequest], cached: Iterable[CachedRequest],
              num_scheduled: Mapping[str, int], finished: Iterable[str] = ()) -> list[RequestPlan]:
        """The step's plans (vLLM's `build_connector_meta`): for each scheduled request, new
        (`new`) or running again (`cached`, a resumed one planned from its whole block
        table), what each rank loads (the promised hit, into the blocks vLLM allocated) and
        stores (the chunks this step completes, `num_scheduled` tokens each), plus the
        background loads whose requests wait; `finished` requests are forgotten first."""
        for req_id in finished:
            self.finish(req_id)
        plans: list[RequestPlan | None] = []
        for req in new:
            tracker = self._trackers.get(req.req_id)  # known: its load ran asynchronously
            blocks = per_group(req.block_ids, self._num_groups) or []
            if tracker is None:
                tracker = _Tracker(list(req.prompt_token_ids), blocks,
                                   self._identities.get(req.req_id))
                tracker.stored_end = self._hits.get(req.req_id, (0, 0))[1]
                self._trackers[req.req_id] = tracker
            else:
                tracker.block_ids = blocks
                self._roll_back(tracker, req.num_computed_tokens)
            self._load_blocks.pop(req.req_id, None)
            end = req.num_computed_tokens + num_scheduled.get(req.req_id, 0)
            plans.extend(self._plan(req.req_id, tracker, req.num_computed_tokens, end))
        for creq in cached:
            known = self._trackers.get(creq.req_id)
            if known is None:
                continue
            self._roll_back(known, creq.num_computed_tokens)
            self._load_blocks.pop(creq.req_id, None)
            added = per_group(creq.new_block_ids, self._num_groups)
            if creq.resumed:
                known.block_ids = added or [[] for _ in range(self._num_groups)]
            elif added:
                for ids, more in zip(known.block_ids, added, strict=True):
                    ids.extend(more)
            end = creq.num_computed_tokens + num_scheduled.get(creq.req_id, 0)
            plans.extend(self._plan(creq.req_id, known, creq.num_computed_tokens, end))
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
            tracker = _Tracker(list(prompt), block_ids, self._identities.get(req_id),
                               stored_end=load.end)
            self._trackers[req_id] = tracker
            mine = []  # every group's part, or none: a load is never half planned
            try:
                for group in range(self._num_groups):
                    span = self._group_load(group, load)
                    if span is None:
                        continue
                    slots = slot_mapping(block_ids[group], self._block_size(group), load.end)
                    mine.append(RequestPlan(req_id, tracker.prompt[:load.end], slots,
                                            tracker.identity, span, None, async_load=True,
                                            group=group, load_budget=self._budget(req_id),
                                            retain=self._retain.get(req_id)))
            except ValueError as exc:
                self._log.warning("plan", "request %s skipped: %s", req_id, exc)
                mine = []
            plans.extend(mine)
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
        self._identities.pop(req_id, None)
        self._retain.pop(req_id, None)
        self._unnamed.discard(req_id)
        self._trackers.pop(req_id, None)
        self._failures.pop(req_id, None)
        self._failure_noted.discard(req_id)
        self._verdicts.pop(req_id, None)
        return delay

    def close(self) -> None:
        """Stop the background lookups (vLLM shuts down)."""
        if self._background is not None:
            self._background.close()

    def _plan(self, req_id: str, tracker: _Tracker, num_computed: int,
              computed_end: int) -> list[RequestPlan]:
        """The step's plans for one request: one per group with something to move."""
        load = self._loads.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._prompts.pop(req_id, None)
        save = self._save_span(tracker, computed_end) if self.can_save else None
        if load is None and save is None:
            return []
        plans = []
        for group in range(self._num_groups):
            group_load = None if load is None else self._group_load(group, load)
            group_save = None if save is None else self._group_save(group, tracker, save,
                                                                    num_computed, computed_end)
            if group_load is None and group_save is None:
                continue
            n = max(group_load.end if group_load else 0, group_save.end if group_save else 0)
            try:
                slots = slot_mapping(tracker.block_ids[group], self._block_size(group), n)
            except ValueError as exc:
                self._log.warning("plan", "request %s skipped: %s", req_id, exc)
                return []
            plans.append(RequestPlan(req_id, tracker.prompt[:n], slots, tracker.identity,
                                     group_load, group_save, group=group,
                                     load_budget=None if group_load is None
                                     else self._budget(req_id),
                                     retain=self._retain.get(req_id)))
        if save is not None:
            tracker.stored_end = save.end
            if self.async_save and plans:
                self._saved.add(req_id)
        return plans

    def _budget(self, req_id: str) -> float | None:
        verdict = self._verdicts.get(req_id)
        return None if verdict is None else verdict.load_budget

    @property
    def _num_groups(self) -> int:
        return 1 if self.groups is None else len(self.groups)

    def _block_size(self, group: int) -> int:
        return self.block_size if self.groups is None else self.groups[group].block_size

    def _group_load(self, group: int, load: Span) -> Span | None:
        """The group's part of a load: an SWA group loads only what vLLM keeps at the hit,
        the blocks of its last window (below them vLLM gave it the null block)."""
        if self.groups is None:
            return load
        kept = self.groups[group].first_kept(load.end)
        skip = max(load.skip, kept)
        if skip >= load.end:
            return None
        return Span(skip, max(load.start, skip), load.end)

    def _group_save(self, group: int, tracker: _Tracker, save: Span, num_computed: int,
                    computed_end: int) -> Span | None:
        """The group's part of a store: an SWA group stores only whole chunks whose blocks
        vLLM holds for the request through this step: none below the first block kept at
        `num_computed` (vLLM frees those and hands them to other requests) nor a null
        block (below the window of a hit). A Mamba group stores the state this step ends
        with, when it ends on a chunk (= block) boundary: the chunk ending there, from the
        block vLLM keeps that state in."""
        if self.groups is None:
            return save
        blocks = tracker.block_ids[group]
        size = self._block_size(group)
        if self.groups[group].kind == MAMBA:
            end = save.end
            index = (end - 1) // size
            if (end != computed_end or end < self.chunk_size or index >= len(blocks)
                    or blocks[index] == 0):
                return None
            start = end - self.chunk_size
            return Span(start, max(save.start, start), end)
        first_real = next((i for i, b in enumerate(blocks) if b != 0), len(blocks)) * size
        held = max(save.skip, self.groups[group].first_kept(num_computed), first_real)
        skip = -(-held // self.chunk_size) * self.chunk_size
        if skip >= save.end:
            return None
        return Span(skip, max(save.start, skip), save.end)

    def _save_span(self, tracker: _Tracker, computed_end: int) -> Span | None:
        prompt_done = min(computed_end, len(tracker.prompt))
        end = prompt_done // self.chunk_size * self.chunk_size
        if self.save_unfull_chunk and prompt_done == len(tracker.prompt):
            end = prompt_done
        if end <= tracker.stored_end:
            return None
        start = tracker.stored_end // self.chunk_size * self.chunk_size
        return Span(start, tracker.stored_end, end)

