"""Traces and the offline simulations (`lmcache_remote.replay`): the readers of both formats,
and every simulated policy on sequences worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmcache_remote.replay.offline import LRUCache, OptimumCache, next_uses, simulate
from lmcache_remote.replay.published import ARCCache, S3FIFOCache, SieveCache, WTinyLFUCache
from lmcache_remote.replay.report import parse_tokens
from lmcache_remote.replay.trace import Trace, TraceFormatError, TraceRequest, read_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def write_lines(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def mooncake(tmp_path: Path, rows: list[tuple[int, list[int]]], block: int = 512) -> Trace:
    """A Mooncake trace of (timestamp ms, hash ids), every block full."""
    return read_trace(write_lines(tmp_path / "t.jsonl", [
        {"timestamp": t, "input_length": len(ids) * block, "output_length": 1,
         "hash_ids": ids} for t, ids in rows]))


def test_mooncake_blocks_are_prefix_chained(tmp_path: Path) -> None:
    trace = mooncake(tmp_path, [(0, [0, 1, 2]), (5, [0, 1, 7]), (9, [3, 1])])
    a, b, c = trace.requests
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    # the same id after another prefix is another block
    assert c.blocks[1] != a.blocks[1]
    assert [r.time for r in trace] == [0.0, 0.005, 0.009]
    # made-up tokens: equal exactly where the blocks are
    ta, tb = a.tokens(), b.tokens()
    assert ta.dtype == np.uint32 and len(ta) == 3 * 512
    assert np.array_equal(ta[:1024], tb[:1024]) and not np.array_equal(ta[1024:], tb[1024:])


def test_a_partial_last_block_is_neither_stored_nor_hit(tmp_path: Path) -> None:
    trace = read_trace(write_lines(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 700, "hash_ids": [4, 5]},
        {"timestamp": 1, "input_length": 700, "hash_ids": [4, 5]}]))
    assert trace.requests[0].full_blocks == 1
    result = simulate(trace, 10 * 512, "lru")
    assert result.hit_tokens == 512 and result.prompt_tokens == 1400


def test_the_projects_format_reads_tokens_and_chunk_hashes(tmp_path: Path) -> None:
    shared = list(range(8))
    trace = read_trace(write_lines(tmp_path / "t.jsonl", [
        {"timestamp": 20, "tokens": shared + [9, 9, 9, 9], "cache_salt": "s"},
        {"timestamp": 10, "tokens": shared + [1, 2, 3, 4], "conversation": 7},
        {"timestamp": 30, "tokens": shared + [1, 2, 3, 4]},
    ]), block_size=4)
    first, second, third = trace.requests  # sorted by time
    assert [r.time for r in trace] == [0.01, 0.02, 0.03]
    assert first.conversation == "7" and second.cache_salt == "s"
    assert first.blocks == third.blocks  # same tokens, no salt
    assert second.blocks[0] != first.blocks[0]  # the salt starts another chain
    assert np.array_equal(third.tokens(), np.array(shared + [1, 2, 3, 4], dtype=np.uint32))
    hashes = read_trace(write_lines(tmp_path / "h.jsonl", [
        {"timestamp": 0, "chunks": ["aa", "bb"], "input_length": 1024},
        {"timestamp": 1, "chunks": ["AA", "cc"], "input_length": 1000}]))
    h1, h2 = hashes.requests
    assert h1.blocks[0] == h2.blocks[0] and h1.blocks[1] != h2.blocks[1]
    assert h2.full_blocks == 1


@pytest.mark.parametrize(("record", "message"), [
    ({"input_length": 5, "hash_ids": [1]}, "timestamp"),
    ({"timestamp": 0, "input_length": 2000, "hash_ids": [1]}, "4 hash_ids"[2:]),
    ({"timestamp": -1, "hash_ids": [1]}, "'timestamp' must be a number"),
    ({"timestamp": 0, "hash_ids": ["x"]}, "list of integers"),
    ({"timestamp": 0, "tokens": [2 ** 32]}, "2**32"),
    ({"timestamp": 0, "prompt": "hi"}, "'hash_ids' (Mooncake), 'tokens' or 'chunks'"),
])
def test_a_bad_line_is_refused_naming_it(tmp_path: Path, record: dict[str, object],
                                         message: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", [{"timestamp": 0, "hash_ids": [1],
                                                "input_length": 512}, record])
    with pytest.raises(TraceFormatError, match=":2: ") as info:
        read_trace(path)
    assert message in str(info.value)


def test_not_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1], "input_length": 512}\n{oops\n')
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: not JSON"):
        read_trace(path)


def test_lru_on_a_worked_sequence() -> None:
    cache = LRUCache(2)
    assert cache.store([1, 2], 0) == 2
    assert cache.lookup([1, 2], 1) == 2  # 1 then 2 refreshed: 1 is the oldest
    assert cache.store([3], 2) == 1  # evicts 1
    assert cache.lookup([1, 2], 3) == 0  # the first block missing cuts the rest
    assert cache.lookup([2, 3], 4) == 2


def test_the_optimum_bypasses_what_is_not_used_again_and_keeps_the_soonest() -> None:
    trace = Trace([TraceRequest(float(t), 512 * len(b), tuple(b), 512) for t, b in enumerate(
        [[1], [2], [3], [1], [2], [1]])], 512)
    future = next_uses(trace.requests)
    assert future[0] == [3] and future[2] == [float("inf")]
    result = simulate(trace, 2 * 512, "optimum")
    # 1 and 2 fit; 3 is never used again (bypassed): every later request hits
    assert result.hit_tokens == 3 * 512 and result.written_blocks == 2
    cache = OptimumCache(1, next_uses(trace.requests))
    cache.store([1], 0)
    cache.store([2], 1)  # 2's next use (4) is after 1's (3): bypassed
    assert cache.lookup([1], 3) == 1


def test_sieve_spares_the_visited_and_evicts_the_first_unvisited() -> None:
    cache = SieveCache(3)
    cache.store([1, 2, 3], 0)
    assert cache.lookup([1], 1) == 1
    cache.store([4], 2)  # the hand passes 1 (visited: cleared) and evicts 2
    assert [cache.contains(b) for b in (1, 2, 3, 4)] == [True, False, True, True]
    cache.store([5], 3)  # the hand goes on from 3: unvisited, evicted
    assert [cache.contains(b) for b in (1, 3, 4, 5)] == [True, False, True, True]


def test_s3fifo_sends_a_ghost_back_to_the_main_queue() -> None:
    cache = S3FIFOCache(10)  # a small queue of one
    cache.store([1], 0)
    for b in range(2, 11):
        cache.store([b], b)  # 1 leaves the small queue unused: a ghost
    cache.store([11], 11)
    assert not cache.contains(1) and 1 in cache.ghost
    cache.store([1], 12)
    assert 1 in cache.main


def test_arc_keeps_a_block_used_twice_through_a_scan() -> None:
    cache = ARCCache(2)
    cache.store([1], 0)
    assert cache.lookup([1], 1) == 1  # used twice: frequency list
    for b in (2, 3, 4, 5):
        cache.store([b], b)  # a scan of blocks used once
    assert cache.lookup([1], 6) == 1


def test_wtinylfu_admits_by_frequency() -> None:
    cache = WTinyLFUCache(100)  # a window of one
    for t in range(5):
        cache.store([7], t)
        cache.lookup([7], t)
    for b in range(1000, 1300):  # a scan of one-shot blocks
        cache.store([b], b)
    assert cache.lookup([7], 2000) == 1


def test_the_keep_simulation_beats_lru_under_a_flood_and_writes_less(tmp_path: Path) -> None:
    rows: list[tuple[int, list[int]]] = []
    next_id = 1000
    conversation: list[int] = [0]
    for i in range(400):
        t = i * 1000
        if i % 4 == 0:  # a conversation's next turn: its prompt so far and two new blocks
            conversation = conversation + [next_id, next_id + 1]
            next_id += 2
            rows.append((t, list(conversation)))
        else:  # a one-shot prompt of 6 blocks after the shared system prompt
            rows.append((t, [0] + list(range(next_id, next_id + 6))))
            next_id += 6
    trace = mooncake(tmp_path, rows)
    capacity = 40 * 512
    lru = simulate(trace, capacity, "lru", trace.split_time(0.5))
    keep = simulate(trace, capacity, "keep", trace.split_time(0.5))
    optimum = simulate(trace, capacity, "optimum", trace.split_time(0.5))
    assert lru.hit_rate < keep.hit_rate <= optimum.hit_rate
    assert keep.written_blocks < lru.written_blocks


def test_the_traces_reproduce_their_readmes_figures() -> None:
    trace = read_trace(TRACES / "mooncake-conversation-first-30min.jsonl")
    assert len(trace) == 5719
    # ../shared/traces/README.md: LRU 0.052 and the optimum 0.249 at 1M tokens (its LRU also
    # stored the partial last block, which takes room here never: 0.054)
    assert simulate(trace, 1_000_000, "lru").hit_rate == pytest.approx(0.054, abs=0.002)
    assert simulate(trace, 1_000_000, "optimum").hit_rate == pytest.approx(0.249, abs=0.005)


@pytest.mark.parametrize(("text", "value"), [("1M", 10**6), ("500k", 500_000),
                                             ("1.5M", 1_500_000), ("42", 42)])
def test_capacities_parse(text: str, value: int) -> None:
    assert parse_tokens(text) == value


@pytest.mark.parametrize("text", ["", "1T", "-1M", "0", "M"])
def test_bad_capacities_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_tokens(text)
