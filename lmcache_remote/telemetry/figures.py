"""What an engine measures of itself, for deciding whether a hit pays: its link to Redis and its
own prefill speed.

- `LinkFigures`, one per Redis endpoint a process reads from: the round trip (from small calls:
  lookups, existence checks) and the throughput of bulk reads (bytes over seconds less one
  round trip). Each figure is an exponentially weighted mean of the logarithms (a geometric
  mean): news that the link got worse weighs `WORSE_WEIGHT` (a link a thousand times slower
  is within 2x of its new speed after one load), news that it got better `BETTER_WEIGHT` (a
  thousand times faster: within 1.5x after three), so a slow load is not repeated on an
  average that still remembers a fast link, nor one lucky sample trusted. A read
  that timed out is a throughput sample too: at most half the rate it would have needed to
  finish in the time it was given. `update(throughput, rtt)` takes figures measured elsewhere
  (a vLLM worker's, sent to its scheduler).
- `PrefillFigures`: seconds per computed token by context length, from the engine's own steps:
  `observe(tokens, work, seconds)` with `work` the tokens' summed context (sum of
  `position`), one figure per context band (`BANDS`: 0-1k, 1k-2k, ... 32k and over), each a
  weighted mean (`PREFILL_WEIGHT` on the newest step). `seconds_for(start, end)` is the
  expected time to compute tokens `[start, end)` of a prompt: the band of each piece's
  context, or the nearest band measured. Steps of fewer than `MIN_STEP_TOKENS` tokens are
  ignored (per-step overhead, decode).

Both are thread-safe and never raise on odd samples (zero or negative times are ignored).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import threading
import time

#: Weight of the newest link sample in the running mean: when it says the link got worse
#: (slower, longer round trip), and when it says better.
WORSE_WEIGHT = 0.9
BETTER_WEIGHT = 0.6
PREFILL_WEIGHT = 0.3
#: Steps computing fewer tokens say more about per-step overhead than about prefill.
MIN_STEP_TOKENS = 32
#: Upper context bounds (tokens) of the prefill bands; the last band is open.
BANDS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclasses.dataclass(frozen=True)
class LinkSnapshot:
    """A link's figures at one moment: bytes a second and seconds per round trip (None
    where nothing was measured), the samples behind each, and how old the newest
    throughput sample is (seconds; None: never)."""

    throughput: float | None
    rtt: float | None
    throughput_samples: int
    rtt_samples: int
    throughput_age: float | None


class LinkFigures:
    """A link's measured round trip and throughput; see the module docstring."""

    def __init__(self, clock: object = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._throughput: float | None = None
        self._rtt: float | None = None
        self._tp_samples = 0
        self._rtt_samples = 0
        self._tp_at: float | None = None

    def _now(self) -> float:
        return float(self._clock())  # type: ignore[operator]

    def round_trip(self, seconds: float) -> None:
        """A small call (a lookup's existence check) took `seconds`."""
        if seconds <= 0:
            return
        with self._lock:
            self._rtt = _log_mean(self._rtt, seconds, seconds > (self._rtt or 0))
            self._rtt_samples += 1

    def transfer(self, nbytes: int, seconds: float) -> None:
        """A bulk read of `nbytes` took `seconds` (one round trip included). A small read
        says little of the link's throughput and underrates it (the time is mostly the round
        trip, of which at most half is taken off): never in the direction of a slow load."""
        if seconds <= 0 or nbytes <= 0:
            return
        with self._lock:
            moving = max(seconds - (self._rtt or 0.0), seconds / 2)
            sample = nbytes / moving
            self._throughput = _log_mean(self._throughput, sample,
                                         self._throughput is not None
                                         and sample < self._throughput)
            self._tp_samples += 1
            self._tp_at = self._now()

    def stalled(self, nbytes: int, seconds: float) -> None:
        """A bulk read of `nbytes` did not finish in `seconds` (it timed out): the link
        moves at most half of `nbytes / seconds`, and the figure drops at least to that."""
        if seconds <= 0 or nbytes <= 0:
            return
        bound = nbytes / seconds / 2
        with self._lock:
            current = self._throughput
            self._throughput = bound if current is None else min(
                _log_mean(current, bound, True), bound)
            self._tp_samples += 1
            self._tp_at = self._now()

    def update(self, throughput: float | None, rtt: float | None) -> None:
        """Figures measured elsewhere (a worker's, in its scheduler), taken as they are."""
        with self._lock:
            if throughput is not None and throughput > 0:
                self._throughput = throughput
                self._tp_samples += 1
                self._tp_at = self._now()
            if rtt is not None and rtt > 0:
                self._rtt = rtt
                self._rtt_samples += 1

    def snapshot(self) -> LinkSnapshot:
        with self._lock:
            age = None if self._tp_at is None else max(0.0, self._now() - self._tp_at)
            return LinkSnapshot(self._throughput, self._rtt, self._tp_samples,
                                self._rtt_samples, age)


class PrefillFigures:
    """Seconds per computed token by context band; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._per_token: list[float | None] = [None] * (len(BANDS) + 1)
        self._samples = 0

    def observe(self, tokens: int, work: float, seconds: float) -> None:
        """A step computed `tokens` tokens at summed context `work` (the sum of their
        positions) in `seconds`."""
        if tokens < MIN_STEP_TOKENS or seconds <= 0:
            return
        band = bisect.bisect_right(BANDS, work / tokens)
        with self._lock:
            self._per_token[band] = _mean(self._per_token[band], seconds / tokens,
                                          PREFILL_WEIGHT)
            self._samples += 1

    @property
    def samples(self) -> int:
        return self._samples

    def per_token(self, context: float) -> float | None:
        """Seconds per token at `context`: its band's figure, else the nearest band's
        measured (None: nothing measured yet)."""
        band = bisect.bisect_right(BANDS, context)
        with self._lock:
            figures = list(self._per_token)
        known = [i for i, f in enumerate(figures) if f is not None]
        if not known:
            return None
        nearest = min(known, key=lambda i: (abs(i - band), -i))
        return figures[nearest]

    def seconds_for(self, start: int, end: int) -> float | None:
        """Expected seconds to compute tokens `[start, end)` (None: nothing measured)."""
        if end <= start:
            return 0.0
        total = 0.0
        edges = [b for b in BANDS if start < b < end]
        for lo, hi in zip([start, *edges], [*edges, end], strict=True):
            rate = self.per_token((lo + hi) / 2)
            if rate is None:
                return None
            total += rate * (hi - lo)
        return total

    def snapshot(self) -> dict[str, float]:
        """Measured seconds per token by band (`"<1024"`, ..., `">=32768"`)."""
        with self._lock:
            figures = list(self._per_token)
        names = [f"<{b}" for b in BANDS] + [f">={BANDS[-1]}"]
        return {name: f for name, f in zip(names, figures, strict=True) if f is not None}


def _mean(current: float | None, sample: float, weight: float) -> float:
    return sample if current is None else (1 - weight) * current + weight * sample


def _log_mean(current: float | None, sample: float, worse: bool) -> float:
    """The running geometric mean, `sample` weighed as news that the link got `worse` or
    better: a factor of 1000 is followed like one of 2."""
    if current is None:
        return sample
    weight = WORSE_WEIGHT if worse else BETTER_WEIGHT
    return math.exp((1 - weight) * math.log(current) + weight * math.log(sample))
