"""The keep policy's judgment, apart from where its state lives: which chunks a store writes,
and the order in which the fleet's own eviction drops them (docs/keep.md).

What it learns, online, from the traffic the fleet sees (`KeepFigures`, kept in Redis by
`keep.book.KeepBook` so that every engine and every restart shares it):

- each chunk access is put in a *class* (`chunk_class`): how deep the request's prefix was
  already known to the fleet (none past the first chunk, the first chunk only, more: a
  conversation's later turn), whether the chunk lies inside that known prefix, how far it is
  from the request's last full chunk, and whether the chunk was seen before;
- per class, how many accesses there were (``n``) and how many of them were followed by
  another access to the same chunk (``u``): the class's odds of being read again
  (`KeepFigures.reuse_odds`, with a prior of one in two);
- per class, the times between an access and the chunk's next one, in a log-scale histogram
  (quarter-octave buckets of milliseconds): the class's *horizon*, the median of those times
  (`KeepFigures.horizon`), learned in whatever time the traffic runs at (a replay at ten times
  the pace learns horizons ten times shorter): no time constant is fitted to one service.

What it decides:

- *retention*: every chunk the fleet holds has a score, the time by which its class expects
  it read again (its last access plus its class's horizon), never later than its parent's
  score in the same request (a chunk is worth nothing without the chunks before it, so
  children go before their parents). The fleet's eviction drops the lowest score first, whole
  chunks (`keep.book`);
- *admission* (`admit`): a store writes, in prefix order, each chunk the fleet lacks while
  the cache has room, then each whose class has reuse odds of at least `THRESHOLD`; the
  first chunk refused cuts off the rest (they could never be hit without it). A refused
  chunk is remembered as a *ghost* (its class and time, no KV), so that its next access is
  learned from too. The ghosts are bounded by the cache's size (`GHOST_FACTOR`), so a class's
  odds count only the reuses that come soon enough for a cache of that size to have kept
  the chunk: a small cache admits only what comes back soon.

Constants, all without a unit of time: `THRESHOLD` (0.2), `QUANTILE` (0.5), the prior, the
ghost bound (`GHOST_FACTOR` times the chunks held), `MIN_SAMPLES` gaps before a class's own
horizon is trusted (the overall horizon before), and `DECAY_AT` accesses after which every
count is halved, so that the figures follow traffic that changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

__all__ = ["CLASSES", "KeepFigures", "THRESHOLD", "admit", "chunk_class", "gap_bucket",
           "scores"]

#: Reuse odds at or above which a chunk is admitted into a full cache.
THRESHOLD = 0.2
#: The quantile of a class's reuse gaps that is its horizon.
QUANTILE = 0.5
#: The prior of the reuse odds: (reuses + 1) / (accesses + 2).
PRIOR = (1, 2)
#: Gaps a class needs before its own horizon is used (the overall one before).
MIN_SAMPLES = 5
#: Ghosts kept at most, as a multiple of the chunks held (at least `MIN_GHOSTS`).
GHOST_FACTOR = 2.0
MIN_GHOSTS = 64
#: Accesses counted (all classes) after which every count is halved.
DECAY_AT = 1 << 20
#: Buckets per doubling of the gap histograms.
BUCKETS_PER_OCTAVE = 4
#: The overall histogram's class number.
ALL = -1

_DEPTHS = ("d0", "d1", "cont")
_SPANS = ("old", "new")
_ENDS = ("e0", "e1", "em")
_SEEN = ("s1", "s2")
#: Every class, by number: (known depth, inside it, distance from the end, seen before).
CLASSES = [(d, s, e, n) for d in _DEPTHS for s in _SPANS for e in _ENDS for n in _SEEN]


def chunk_class(index: int, full_chunks: int, known_depth: int, seen_before: bool) -> int:
    """The class of chunk ``index`` of a request with ``full_chunks`` full chunks whose first
    ``known_depth`` chunks the fleet holds or remembers (see the module doc)."""
    depth = 0 if known_depth == 0 else (1 if known_depth == 1 else 2)
    span = 0 if index < known_depth else 1
    from_end = full_chunks - 1 - index
    end = 0 if from_end <= 0 else (1 if from_end <= 2 else 2)
    return ((depth * 2 + span) * 3 + end) * 2 + (1 if seen_before else 0)


def gap_bucket(gap_ms: float) -> int:
    """The histogram bucket of a gap between two accesses, in milliseconds."""
    return int(math.log2(max(0.0, gap_ms) + 1.0) * BUCKETS_PER_OCTAVE)


def bucket_ms(bucket: int) -> float:
    """The gap at the top of a bucket, in milliseconds."""
    return float(2.0 ** ((bucket + 1) / BUCKETS_PER_OCTAVE) - 1.0)


@dataclasses.dataclass
class KeepFigures:
    """What the fleet has learned (the module doc): accesses and reuses per class, and the
    reuse gaps per class and overall. Plain counts, so several engines add to them at once
    (HINCRBY in Redis) and `from_fields` reads them back."""

    accesses: dict[int, float] = dataclasses.field(default_factory=dict)
    reuses: dict[int, float] = dataclasses.field(default_factory=dict)
    gaps: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)

    def reuse_odds(self, klass: int) -> float:
        n = self.accesses.get(klass, 0.0)
        u = min(self.reuses.get(klass, 0.0), n)
        return (u + PRIOR[0]) / (n + PRIOR[1])

    def horizon_ms(self, klass: int) -> float | None:
        """The class's horizon in ms (its own gaps once it has `MIN_SAMPLES`, else every
        class's); None before any gap was seen."""
        own = self.gaps.get(klass)
        if own is not None and sum(own.values()) >= MIN_SAMPLES:
            return _quantile(own, QUANTILE)
        overall = self.gaps.get(ALL)
        if overall:
            return _quantile(overall, QUANTILE)
        return None

    def horizons(self) -> dict[int, float]:
        """Every class's horizon (ms) that is known."""
        out = {}
        for klass in range(len(CLASSES)):
            h = self.horizon_ms(klass)
            if h is not None:
                out[klass] = h
        return out

    def note(self, klass: int, previous: int | None, gap_ms: float | None) -> None:
        """One access of class ``klass``; ``previous``: the class of the chunk's access
        before (its reuse), ``gap_ms`` the time since it."""
        self.accesses[klass] = self.accesses.get(klass, 0.0) + 1
        if previous is not None and gap_ms is not None:
            self.reuses[previous] = self.reuses.get(previous, 0.0) + 1
            bucket = gap_bucket(gap_ms)
            for c in (previous, ALL):
                hist = self.gaps.setdefault(c, {})
                hist[bucket] = hist.get(bucket, 0.0) + 1

    @classmethod
    def from_fields(cls, fields: Mapping[str, float]) -> KeepFigures:
        """Reads the figures from the fields `field_names` writes (``n:C``, ``u:C``,
        ``g:C:B``; the overall histogram is class -1)."""
        out = cls()
        for name, value in fields.items():
            parts = name.split(":")
            try:
                if parts[0] == "n" and len(parts) == 2:
                    out.accesses[int(parts[1])] = float(value)
                elif parts[0] == "u" and len(parts) == 2:
                    out.reuses[int(parts[1])] = float(value)
                elif parts[0] == "g" and len(parts) == 3:
                    out.gaps.setdefault(int(parts[1]), {})[int(parts[2])] = float(value)
            except ValueError:
                continue  # a field of another release: not ours to read
        return out


def _quantile(hist: Mapping[int, float], q: float) -> float:
    total = sum(hist.values())
    target = q * total
    seen = 0.0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= target:
            return bucket_ms(bucket)
    return bucket_ms(max(hist))


def scores(now_ms: float, classes: Sequence[int], horizons: Mapping[int, float],
           default_ms: float, parent: float = math.inf) -> list[float]:
    """Each chunk's score (ms), in prefix order: its last access plus its class's horizon
    (``default_ms`` for a class with none yet), never later than the chunk before it (each
    a millisecond earlier than its parent when capped, so that ties drop children first)."""
    out = []
    for klass in classes:
        s = now_ms + horizons.get(klass, default_ms)
        if s >= parent:
            s = parent - 1.0
        out.append(s)
        parent = s
    return out


def admit(classes: Sequence[int], figures: KeepFigures, free: int) -> int:
    """How many of these chunks (a store's missing chunks, in prefix order, classed) to
    write: the first ``free`` whatever their class (the room the cache has), then up to the first
    whose class's reuse odds are under `THRESHOLD`."""
    for i, klass in enumerate(classes):
        if i >= free and figures.reuse_odds(klass) < THRESHOLD:
            return i
    return len(classes)
