"""The replayer (`lmcache_remote.replay.driver`, `lmcache-remote replay`): a trace through the
real engine against a private Redis at a capacity, in one process and in two, beside the
offline simulations of the same requests; the CLI's table, JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_remote.replay.driver import ReplaySettings, replay
from lmcache_remote.replay.offline import simulate
from lmcache_remote.replay.trace import read_trace
from tests.cliutil import run, run_json


def conversation_trace(path: Path, requests: int = 60) -> Path:
    """Turns of a few conversations (each turn its prompt so far plus two blocks) between
    one-shot prompts, 50 ms apart, every prompt after a shared system block."""
    rows = []
    next_id = 100
    talks: dict[int, list[int]] = {0: [0], 1: [0], 2: [0]}
    for i in range(requests):
        if i % 2 == 0:
            talk = talks[(i // 2) % 3]
            talk += [next_id, next_id + 1]
            ids = list(talk)
            next_id += 2
        else:
            ids = [0, next_id, next_id + 1, next_id + 2]
            next_id += 3
        rows.append({"timestamp": 50 * i, "input_length": 512 * len(ids) + 100,
                     "output_length": 1, "hash_ids": ids + [next_id]})
        next_id += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("processes", [1, 2])
def test_a_replay_counts_what_the_engines_found_and_wrote(tmp_path: Path,
                                                          processes: int) -> None:
    trace = read_trace(conversation_trace(tmp_path / "t.jsonl"))
    # synchronous stores: a request's chunks are in Redis before the next request's lookup
    settings = ReplaySettings(capacity_tokens=400 * 512, speedup=20.0, processes=processes,
                              bytes_per_token=64, measure_from=0.0, keep_policy="learned",
                              config=(("store_async", False),))
    result = replay(trace, settings)
    # room for every chunk: one engine hits exactly what the simulation of the same requests
    # hits (every chunk seen before); two engines at most that (a request may come before
    # the other engine's write-behind of its prefix landed), and each chunk is written once
    expected = simulate(trace, 400 * 512, "lru")
    if processes == 1:
        assert result.hit_tokens == expected.hit_tokens > 0
        assert result.written_chunks == expected.written_blocks
    else:
        assert 0 < result.hit_tokens <= expected.hit_tokens
        assert result.written_chunks >= expected.written_blocks
    assert result.prompt_tokens == expected.prompt_tokens
    assert result.requests == len(trace)
    assert result.written_bytes >= result.written_chunks * 512 * 64
    assert result.evicted_keys == 0
    assert result.maxmemory > result.chunk_cost * 400
    assert result.counters["keep.admitted_chunks"] == result.written_chunks


def test_a_small_capacity_evicts_and_the_learned_policy_drops_whole_chunks(
        tmp_path: Path) -> None:
    trace = read_trace(conversation_trace(tmp_path / "t.jsonl", requests=600))
    small = 300 * 512  # a third of the chunks (a server of ~12 MB: room for writes in flight)
    learned = replay(trace, ReplaySettings(capacity_tokens=small, speedup=20.0,
                                           measure_from=0.5))
    redis = replay(trace, ReplaySettings(capacity_tokens=small, speedup=20.0,
                                         measure_from=0.5, keep_policy="redis"))
    assert learned.evicted_keys == 0 and learned.counters["keep.evicted_chunks"] > 0
    assert redis.evicted_keys > 0  # Redis's own eviction, value by value
    assert learned.hit_tokens <= simulate(trace, small, "optimum", trace.split_time(0.5)
                                          ).hit_tokens


def test_bad_settings_are_refused() -> None:
    for bad in ({"capacity_tokens": 0}, {"capacity_tokens": 1, "speedup": 0},
                {"capacity_tokens": 1, "bytes_per_token": 6},
                {"capacity_tokens": 1, "measure_from": 1.0},
                {"capacity_tokens": 1, "server": "memcached"}):
        with pytest.raises(ValueError):
            ReplaySettings(**bad)  # type: ignore[arg-type]


def test_the_cli_replays_simulates_and_plots(tmp_path: Path) -> None:
    path = conversation_trace(tmp_path / "t.jsonl")
    svg = tmp_path / "plot.svg"
    doc = run_json("replay", str(path), "--capacity", "20k", "--capacity", "100k",
                   "--speedup", "40", "--policy", "learned", "--plot", str(svg))
    rows = {(r["row"], r["capacity_tokens"]) for r in doc["rows"]}
    for capacity in (20_000, 100_000):
        for name in ("replay: learned", "simulated: optimum", "simulated: lru",
                     "simulated: arc", "simulated: s3fifo", "simulated: sieve",
                     "simulated: wtinylfu", "simulated: keep"):
            assert (name, capacity) in rows
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()
    human = run("replay", str(path), "--simulate-only", "--capacity", "1M")
    assert human.exit_code == 0 and "| simulated: optimum | " in human.stdout
    assert "replay:" not in human.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--capacity", "lots"], "not a token count"),
    (["--bytes-per-token", "6"], "multiple of 4"),
])
def test_the_cli_refuses_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    path = conversation_trace(tmp_path / "t.jsonl")
    result = run("replay", str(path), "--simulate-only", *args)
    assert result.exit_code == 2 and message in result.stderr


def test_the_cli_names_a_bad_trace_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1], "input_length": 512}\n{"x": 1}\n')
    result = run("replay", str(path), "--simulate-only")
    assert result.exit_code == 2 and "bad.jsonl:2" in result.stderr
