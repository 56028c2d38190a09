"""The keep policy's judgment, free of I/O (`storage.keep.policy`): classes, what it learns,
horizons, scores and admission, on figures worked out by hand."""

from __future__ import annotations

import math

import pytest

from lmcache_remote.storage.keep import policy
from lmcache_remote.storage.keep.policy import KeepFigures


def test_every_class_has_one_number() -> None:
    seen = set()
    for depth in (0, 1, 5):
        for index in range(6):
            for full in (index + 1, index + 2, index + 10):
                for before in (False, True):
                    seen.add(policy.chunk_class(index, full, depth, before))
    # every class but "inside a known prefix of none" is reached, each by one number
    reachable = {c for c, fields in enumerate(policy.CLASSES) if fields[:2] != ("d0", "old")}
    assert seen == reachable


def test_class_fields_follow_the_request() -> None:
    # chunk 3 of 10, the fleet knew 5 chunks: a later turn, inside the known prefix, far
    # from the end, seen before
    assert policy.CLASSES[policy.chunk_class(3, 10, 5, True)] == ("cont", "old", "em", "s2")
    # the last chunk of a first turn that only shared the system prompt, new
    assert policy.CLASSES[policy.chunk_class(9, 10, 1, False)] == ("d1", "new", "e0", "s1")
    assert policy.CLASSES[policy.chunk_class(7, 10, 0, False)] == ("d0", "new", "e1", "s1")


def test_reuse_odds_start_at_the_prior_and_learn() -> None:
    figures = KeepFigures()
    assert figures.reuse_odds(3) == pytest.approx(0.5)
    for _ in range(8):
        figures.note(3, None, None)
    assert figures.reuse_odds(3) == pytest.approx(1 / 10)
    figures.note(4, 3, 1000.0)  # a later access of a chunk last accessed in class 3
    figures.note(4, 3, 1000.0)
    assert figures.reuse_odds(3) == pytest.approx(3 / 10)
    assert figures.accesses[4] == 2


def test_the_horizon_is_the_median_gap_once_a_class_has_enough() -> None:
    figures = KeepFigures()
    assert figures.horizon_ms(2) is None
    for gap in (100.0, 200.0, 400.0):
        figures.note(1, 2, gap)
    # under MIN_SAMPLES gaps of its own: the overall histogram's median (200 ms's bucket)
    assert figures.horizon_ms(2) == pytest.approx(policy.bucket_ms(policy.gap_bucket(200.0)))
    for gap in (10_000.0,) * 4:
        figures.note(1, 2, gap)
    # 7 gaps, 4 of them 10 s: the median is 10 s's bucket, for class 2 and overall
    assert figures.horizon_ms(2) == pytest.approx(policy.bucket_ms(policy.gap_bucket(1e4)))
    # a class with no gaps of its own borrows the overall median
    assert figures.horizon_ms(5) == figures.horizon_ms(policy.ALL)


def test_buckets_are_quarter_octaves_and_their_top_is_above_the_gap() -> None:
    for gap in (0.0, 1.0, 3.0, 999.0, 123_456.0):
        b = policy.gap_bucket(gap)
        assert policy.bucket_ms(b) >= gap
        assert policy.bucket_ms(b - 1) <= gap + 1e-9
    assert policy.gap_bucket(2 ** 10 - 1) == 40


def test_figures_round_trip_through_redis_fields() -> None:
    figures = KeepFigures()
    figures.note(5, None, None)
    figures.note(6, 5, 750.0)
    fields = {f"n:{c}": v for c, v in figures.accesses.items()}
    fields.update({f"u:{c}": v for c, v in figures.reuses.items()})
    fields.update({f"g:{c}:{b}": v for c, hist in figures.gaps.items() for b, v in hist.items()})
    fields.update({"bytes": 123.0, "h:5": 9.0, "n:x": 1.0})  # not figures: ignored
    back = KeepFigures.from_fields(fields)
    assert back == figures


def test_scores_never_pass_the_parent_and_break_ties_toward_children() -> None:
    horizons = {1: 5000.0, 2: 60_000.0}
    out = policy.scores(1000.0, [2, 1, 2], horizons, default_ms=0.0)
    assert out == [61_000.0, 6000.0, 5999.0]
    capped = policy.scores(1000.0, [2], horizons, default_ms=0.0, parent=10_000.0)
    assert capped == [9999.0]
    assert policy.scores(1000.0, [7], horizons, default_ms=0.0) == [1000.0]


def test_admission_takes_the_room_then_cuts_at_the_first_unlikely_class() -> None:
    figures = KeepFigures()
    for _ in range(98):
        figures.note(1, None, None)  # class 1: odds 1 / 100
    for _ in range(2):
        figures.note(2, None, None)  # class 2: odds 1 / 4, at or above THRESHOLD
    assert figures.reuse_odds(1) < policy.THRESHOLD <= figures.reuse_odds(2)
    assert policy.admit([2, 2, 1, 2], figures, free=0) == 2
    assert policy.admit([2, 2, 1, 2], figures, free=3) == 4  # the room covers the unlikely one
    assert policy.admit([1, 2], figures, free=0) == 0  # cut: the rest is useless without it
    assert policy.admit([], figures, free=0) == 0
    assert math.isclose(policy.THRESHOLD, 0.2)
