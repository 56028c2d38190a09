"""LoadDecision: how much of a hit to load, so that a load never costs more than computing.

`decide(start, end, bytes_per_token)` takes a hit of prompt tokens `[start, end)` (the engine
already has `[0, start)`) and answers a `Verdict`: load `[start, load_end)` and compute the
rest. With `load_policy: always` the whole hit is loaded. With `pays` (the default) it is the
prefix `[start, h)`, `h` on a chunk boundary or `end`, that saves the most time, where

    load(h)    = rtt + bytes(h) / throughput          (the link)
    compute(h) = seconds to prefill [start, h)        (this engine, at that context)
    saving(h)  = compute(h) - load(h)

and nothing when no prefix saves time. A prefix whose expected load time passes
`TIMEOUT_SHARE` of `remote_timeout` is never chosen: the read would be cut there. The figures,
in order of precedence:

1. set by the operator (`link_gbps`, `link_rtt_ms`, `prefill_tokens_per_s`): a fleet that
   knows its figures;
2. measured by the engine itself, all the time (`telemetry.figures`): the link from its own
   loads and lookups, the prefill from its own steps;
3. the priors, until a figure exists: `PRIOR_THROUGHPUT` (10 Gbit/s), `PRIOR_RTT` (1 ms),
   `PRIOR_PREFILL_TOKENS_PER_S` (4,000 tokens a second at any context). They are today's
   behaviour on a datacenter link: a hit is loaded until a measurement says it does not pay.
   The first load on an unmeasured slow link is therefore tried; its deadline is what
   computing would cost (`load_budget`), so it costs at most that before vLLM recomputes,
   and it measures the link for every request after it.

A declined link is probed: when nothing pays and no load has gone out for `probe_interval`
seconds, the verdict loads the hit's first chunk (`probe`), within the time computing that
chunk would take, so that a recovered link is measured, and used again, within a request or
two. A probe after which the link still does not pay doubles the wait for the next one (up to
`MAX_PROBE_BACKOFF` times `probe_interval`); a load that pays resets it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from lmcache_remote.config import LOAD_POLICIES
from lmcache_remote.naming.hashing import ChunkSpec
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.telemetry.figures import LinkFigures, PrefillFigures
from lmcache_remote.telemetry.metrics import Metrics

#: Priors, used until the figure is measured (or set): a 10 Gbit/s link, a 1 ms round trip,
#: and an engine that prefills 4,000 tokens a second at any context.
PRIOR_THROUGHPUT = 10e9 / 8
PRIOR_RTT = 0.001
PRIOR_PREFILL_TOKENS_PER_S = 4000.0
#: The deadline of a load is this many times its expected compute time (at least
#: `MIN_LOAD_BUDGET` seconds): past it, computing would have been quicker.
BUDGET_FACTOR = 2.0
MIN_LOAD_BUDGET = 0.25
#: A probe's deadline: its chunk's expected compute time, at least this.
MIN_PROBE_BUDGET = 0.1
#: Probes of a link that stays declined back off to this many times `probe_interval`.
MAX_PROBE_BACKOFF = 8
#: A read is cut at `remote_timeout`: a prefix expected to take more than this share of it
#: is not loaded (the margin covers the figures' error).
TIMEOUT_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What to load of a hit `[start, end)`: `[start, load_end)`; `declined` tokens are left
    to compute because computing them is cheaper. `probe`: a one-chunk load of a declined
    link, to measure it. `load_s` / `compute_s`: the expected seconds of loading and of
    computing `[start, end)` (what the verdict weighed; None under `always`).
    `load_budget`: seconds the load may take before it is abandoned (None: no bound but
    `remote_timeout`)."""

    start: int
    end: int
    load_end: int
    probe: bool = False
    load_s: float | None = None
    compute_s: float | None = None
    load_budget: float | None = None

    @property
    def declined(self) -> int:
        return self.end - self.load_end


@dataclasses.dataclass(frozen=True)
class Figures:
    """The figures a decision uses now, with where each came from (`set`, `measured`,
    `prior`)."""

    throughput: float
    throughput_source: str
    rtt: float
    rtt_source: str
    prefill_tokens_per_s: float
    prefill_source: str

    def describe(self) -> str:
        """One line for logs: link MB/s and ms, prefill tokens/s, with their sources."""
        return (f"link {self.throughput / 1e6:.1f} MB/s ({self.throughput_source}), "
                f"round trip {self.rtt * 1e3:.2f} ms ({self.rtt_source}), prefill "
                f"{self.prefill_tokens_per_s:.0f} tokens/s ({self.prefill_source})")


class LoadDecision:
    """Decides how much of a hit to load; see the module docstring. Thread-safe."""

    def __init__(self, policy: str = "pays", *, link: LinkFigures | None = None,
                 prefill: PrefillFigures | None = None, throughput: float | None = None,
                 rtt: float | None = None, prefill_tokens_per_s: float | None = None,
                 chunk_size: int = 256, probe_interval: float = 10.0,
                 max_load_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {LOAD_POLICIES}, got {policy!r}")
        self.policy = policy
        self.link = link if link is not None else LinkFigures(clock)
        self.prefill = prefill if prefill is not None else PrefillFigures()
        self._throughput = throughput
        self._rtt = rtt
        self._tps = prefill_tokens_per_s
        self.chunk_size = chunk_size
        self.probe_interval = probe_interval
        #: the longest a load may be expected to take (a read is cut at `remote_timeout`)
        self.max_load_s = max_load_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_load: float | None = None  # when a load (or probe) last went out
        self._interval = probe_interval  # between probes now (backs off)

    @classmethod
    def from_config(cls, config: object, **kwargs: object) -> LoadDecision:
        """The decision a `CacheConfig` asks for (`load_policy`, `link_gbps`, `link_rtt_ms`,
        `prefill_tokens_per_s`, `load_probe_interval`, `chunk_size`)."""
        gbps = getattr(config, "link_gbps", None)
        rtt_ms = getattr(config, "link_rtt_ms", None)
        return cls(str(getattr(config, "load_policy", "pays")),
                   throughput=None if gbps is None else float(gbps) * 1e9 / 8,
                   rtt=None if rtt_ms is None else float(rtt_ms) / 1e3,
                   prefill_tokens_per_s=getattr(config, "prefill_tokens_per_s", None),
                   chunk_size=int(getattr(config, "chunk_size", 256)),
                   probe_interval=float(getattr(config, "load_probe_interval", 10.0)),
                   max_load_s=float(getattr(config, "remote_timeout", 2.0)) * TIMEOUT_SHARE,
                   **kwargs)  # type: ignore[arg-type]

    def figures(self) -> Figures:
        link = self.link.snapshot()
        throughput, tp_source = _pick(self._throughput, link.throughput, PRIOR_THROUGHPUT)
        rtt, rtt_source = _pick(self._rtt, link.rtt, PRIOR_RTT)
        if self._tps is not None:
            tps, tps_source = self._tps, "set"
        else:
            per_token = self.prefill.per_token(0)
            tps, tps_source = ((1.0 / per_token, "measured") if per_token
                               else (PRIOR_PREFILL_TOKENS_PER_S, "prior"))
        return Figures(throughput, tp_source, rtt, rtt_source, tps, tps_source)

    def compute_seconds(self, start: int, end: int) -> float:
        """Expected seconds to prefill tokens `[start, end)` on this engine."""
        if end <= start:
            return 0.0
        if self._tps is not None:
            return (end - start) / self._tps
        measured = self.prefill.seconds_for(start, end)
        return (end - start) / PRIOR_PREFILL_TOKENS_PER_S if measured is None else measured

    def load_seconds(self, nbytes: float) -> float:
        """Expected seconds to load `nbytes` over the link (one round trip and the bytes)."""
        figures = self.figures()
        return figures.rtt + nbytes / figures.throughput

    def decide(self, start: int, end: int, bytes_per_token: float, *,
               link_down: bool = False) -> Verdict:
        """The verdict on a hit `[start, end)` whose KV weighs `bytes_per_token` a token; see
        the module docstring. A load decided here counts as the link's last use (probes).
        `link_down` (the link failed and is backing off, whatever the policy): nothing is
        loaded but a probe, when one is due."""
        if end <= start:
            return Verdict(start, end, start)
        cs = self.chunk_size
        skip = start // cs * cs  # a load moves whole chunks from the chunk holding `start`
        candidates = [h for h in range(skip + cs, end, cs) if h > start] + [end]
        if link_down:
            if self._probe_due():
                return Verdict(start, end, candidates[0], True,
                               load_budget=self._probe_budget(start, candidates[0]))
            return Verdict(start, end, start)
        if self.policy == "always":
            self._loaded(paid=True)
            return Verdict(start, end, end)
        best, best_saving = start, 0.0
        for h in candidates:
            load = self.load_seconds((h - skip) * bytes_per_token)
            if self.max_load_s is not None and load > self.max_load_s:
                break  # it would be cut at remote_timeout: this prefix and longer never pay
            saving = self.compute_seconds(start, h) - load
            if saving > best_saving:
                best, best_saving = h, saving
        load_s = self.load_seconds((end - skip) * bytes_per_token)
        compute_s = self.compute_seconds(start, end)
        if best > start:
            self._loaded(paid=True)
            return Verdict(start, end, best, False, load_s, compute_s, self._budget(start, best))
        if self._probe_due():
            probe_end = candidates[0]
            return Verdict(start, end, probe_end, True, load_s, compute_s,
                           self._probe_budget(start, probe_end))
        return Verdict(start, end, start, False, load_s, compute_s)

    def _budget(self, start: int, end: int) -> float:
        return max(MIN_LOAD_BUDGET, BUDGET_FACTOR * self.compute_seconds(start, end))

    def _probe_budget(self, start: int, end: int) -> float:
        """A probe may cost what computing its chunk would (at least `MIN_PROBE_BUDGET`):
        it measures the link whether it finishes or not."""
        return max(MIN_PROBE_BUDGET, self.compute_seconds(start, end))

    def _loaded(self, paid: bool = False) -> None:
        """A load goes out now; `paid`: a verdict found it pays (the probes' back-off ends)."""
        with self._lock:
            self._last_load = self._clock()
            if paid:
                self._interval = self.probe_interval

    def load_ended(self) -> None:
        """A load just ended (a failed one, typically): the next probe waits a whole
        interval from now, not from when the load was decided."""
        self._loaded()

    @property
    def probe_wait(self) -> float:
        """Seconds between probes now: `probe_interval`, doubled after each probe that did
        not bring the link back (up to `MAX_PROBE_BACKOFF` times it)."""
        with self._lock:
            return self._interval

    def _probe_due(self) -> bool:
        with self._lock:
            now = self._clock()
            if self._last_load is not None and now - self._last_load < self._interval:
                return False
            if self._last_load is not None:  # a probe without a paying load since: back off
                self._interval = min(self._interval * 2,
                                     self.probe_interval * MAX_PROBE_BACKOFF)
            self._last_load = now
            return True

    def snapshot(self) -> dict[str, object]:
        """The figures in use, for stats and metrics: `link_bytes_per_s`, `link_rtt_s`,
        `prefill_tokens_per_s` (at short context), their sources, and the measured seconds
        per token by context band."""
        figures = self.figures()
        return {"policy": self.policy,
                "link_bytes_per_s": figures.throughput,
                "link_bytes_per_s_source": figures.throughput_source,
                "link_rtt_s": figures.rtt, "link_rtt_s_source": figures.rtt_source,
                "prefill_tokens_per_s": figures.prefill_tokens_per_s,
                "prefill_tokens_per_s_source": figures.prefill_source,
                "prefill_seconds_per_token": self.prefill.snapshot()}


def _pick(fixed: float | None, measured: float | None, prior: float) -> tuple[float, str]:
    if fixed is not None:
        return fixed, "set"
    if measured is not None:
        return measured, "measured"
    return prior, "prior"


#: Lookup verdicts remembered for the retrieve that follows (oldest forgotten first).
VERDICTS_KEPT = 4096


class ChunkDecisions:
    """`CacheEngine`'s side of the decision: how many leading chunks of a run to load, the
    chunks the local tier holds always (they cost no link), the rest by `LoadDecision`. A
    lookup's verdict that declined tokens is remembered (keyed by the first chunk it weighed)
    so that the retrieve that follows loads what the lookup promised, a probe included,
    instead of deciding again; a retrieve with no such verdict decides itself. Counts
    `engine.declined_tokens`, `engine.declined_requests` and `engine.probe_loads`, and keeps
    the figures in the engine's gauges (`decision.*`). Thread-safe."""

    def __init__(self, decision: LoadDecision, bytes_per_token: float,
                 local_prefix: Callable[[Sequence[ChunkSpec]], int], metrics: Metrics) -> None:
        self.decision = decision
        self._bytes_per_token = bytes_per_token
        self._local_prefix = local_prefix
        self._metrics = metrics
        self._verdicts: OrderedDict[CacheEngineKey, int] = OrderedDict()
        self._lock = threading.Lock()
        self.publish()

    def cut(self, specs: Sequence[ChunkSpec], policy: str | None, *, remember: bool) -> int:
        """How many leading chunks of `specs` (a run the caller wants loaded) to load."""
        if not specs or (policy or self.decision.policy) == "always":
            return len(specs)
        local = self._local_prefix(specs)
        if local >= len(specs):
            return len(specs)
        first = specs[local]
        with self._lock:
            end = None if remember else self._verdicts.pop(first.key, None)
        if end is None:
            verdict = self.decision.decide(first.start, specs[-1].end, self._bytes_per_token)
            end = verdict.load_end
            self._count(verdict)
            if remember and verdict.declined:  # what loads whole needs no reminder
                with self._lock:
                    self._verdicts[first.key] = end
                    self._verdicts.move_to_end(first.key)
                    if len(self._verdicts) > VERDICTS_KEPT:
                        self._verdicts.popitem(last=False)
        return local + sum(1 for s in specs[local:] if s.end <= end)

    def _count(self, verdict: Verdict) -> None:
        if verdict.probe:
            self._metrics.inc("engine.probe_loads")
        if verdict.declined:
            self._metrics.inc("engine.declined_requests")
            self._metrics.inc("engine.declined_tokens", verdict.declined)
        self.publish()

    def publish(self) -> None:
        """The figures in use into the engine's gauges (`decision.link_bytes_per_s`,
        `decision.link_rtt_seconds`, `decision.prefill_tokens_per_s`)."""
        publish_figures(self._metrics, self.decision.figures())


def publish_figures(metrics: Metrics, figures: Figures) -> None:
    """`figures` into `metrics`' gauges, under `decision.*`."""
    metrics.set_gauge("decision.link_bytes_per_s", figures.throughput)
    metrics.set_gauge("decision.link_rtt_seconds", figures.rtt)
    metrics.set_gauge("decision.prefill_tokens_per_s", figures.prefill_tokens_per_s)
