"""The soak (`python -m soak`, issue 11 point 5): its checker, its verdicts, and a short run.

- The checker: `expected_kv` is a function of the token prefix alone, and `count_wrong`
  catches a single flipped bit and a single stray write.
- The verdicts: `soak.report.judge` fails a run with a wrong token, an exception, a slow
  call, a low retrieved/lookup ratio after the tier filled, or a tier that never filled.
- The short run: the real command, a real redis-server and four engine processes (4 MiB
  local tiers, so that even the read-only one fills within the first half), 45 s
  fault-free then 45 s of faults (`--mode both`); it must exit 0 with every criterion passed,
  and leave no process behind. Its only time bounds are the soak's own promises (the slowest
  call), nothing about this machine's speed.
- Interrupting the soak (SIGINT, as Ctrl-C) stops every process it started and exits 130.
- The popularity report (issue 25): summed per group of the first document's rank, with
  Redis's counters across a server restart; a short real run with `--no-lru-touch` and
  `--restart-every` sends no TOUCH, restarts its engines and reports every request in a group
  (the run with the refresh on, above, touches).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from soak.controller import EngineRun, SoakResult
from soak.report import judge, popularity_report
from soak.settings import SoakSettings
from soak.workload import (
    SENTINEL,
    Corpus,
    Geometry,
    PagedCache,
    PromptStream,
    count_wrong,
    expected_kv,
)

ROOT = Path(__file__).resolve().parent.parent
GEO = Geometry()


# -- the checker ------------------------------------------------------------------------------


def test_expected_kv_is_a_function_of_the_prefix() -> None:
    corpus = Corpus(GEO, num_docs=20)
    a, b = PromptStream(corpus, seed=1).next(), PromptStream(corpus, seed=2).next()
    shared = len(corpus.system)  # every prompt opens with the system prompt
    ka, kb = expected_kv(a, GEO), expected_kv(b, GEO)
    assert torch.equal(ka[:, :, :shared], kb[:, :, :shared])
    assert torch.equal(ka, expected_kv(a.copy(), GEO))
    other = a.copy()
    other[0] ^= 1  # one token of the first chunk changed: every later chunk changes too
    kc = expected_kv(other, GEO)
    for start in range(0, len(a), GEO.chunk_size):
        assert not torch.equal(ka[:, :, start:start + GEO.chunk_size],
                               kc[:, :, start:start + GEO.chunk_size])


def test_count_wrong_sees_one_flipped_bit_and_one_stray_write() -> None:
    tokens = np.arange(300, dtype=np.uint32)
    want = expected_kv(tokens, GEO)
    cache = PagedCache(GEO, 320, seed=3)
    cache.begin(len(tokens))
    cache.write(0, want[:, :, :128])
    assert count_wrong(cache.read(), want, 128) == (0, 0)
    got = cache.read()
    bits = got.view(torch.int16)
    bits[1, 0, 77, 1, 5] ^= 1  # the lowest mantissa bit of one value of token 77
    assert count_wrong(got, want, 128) == (1, 0)
    got = cache.read()
    got[0, 1, 200, 0, 0] = 0.0  # a token past the hit run no longer holds the sentinel
    assert count_wrong(got, want, 128) == (0, 1)
    assert float(cache.read()[0, 0, 250, 0, 0]) == SENTINEL


# -- the verdicts -----------------------------------------------------------------------------


def _window(index: int, **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "index": index, "requests": 10, "prompt_tokens": 5000, "lookup_tokens": 1000,
        "retrieved_tokens": 1000, "short_retrieves": 0, "wrong_tokens": 0, "stray_tokens": 0,
        "bad_masks": 0, "exceptions": 0, "stored_tokens": 100, "warnings": 0,
        "slowest": {"lookup": 0.01, "retrieve": 0.01, "store": 0.01},
        "counters": {"local.hit_tokens": 800, "remote.hit_tokens": 200,
                     "local.evicted_chunks": 5 if index >= 1 else 0},
        "gauges": {}, "rss": 300 << 20, "hwm": 300 << 20,
    }
    doc.update(over)
    return doc


def _result(windows: list[dict[str, Any]], mode: str = "fault-free") -> SoakResult:
    settings = SoakSettings(minutes=1, mode=mode, engines=("rw",), window=10)
    run = EngineRun("e0-rw", "rw", proc=None)  # type: ignore[arg-type]
    run.ready = {"pid": 1, "baseline_rss": 280 << 20}
    run.windows, run.done, run.returncode = windows, {"hwm": 300 << 20}, 0
    faults = [{"fault": "pause", "at": 40.0}] if mode != "fault-free" else []
    return SoakResult(settings, [run], [], faults, 2)


def _verdict(windows: list[dict[str, Any]], mode: str = "fault-free") -> dict[str, bool]:
    criteria, _ = judge(_result(windows, mode))
    return {c.name: c.ok for c in criteria}


def test_judge_passes_a_clean_run_and_fails_each_broken_promise() -> None:
    clean = [_window(i) for i in range(6)]
    assert all(_verdict(clean).values())
    assert not _verdict(clean[:2] + [_window(2, wrong_tokens=1)] + clean[3:])["wrong_kv"]
    assert not _verdict(clean[:2] + [_window(2, stray_tokens=3)] + clean[3:])["wrong_kv"]
    assert not _verdict(clean[:2] + [_window(2, exceptions=1)] + clean[3:])["exceptions"]
    slow = {"lookup": 0.01, "retrieve": 4.5, "store": 0.01}  # bound: 3 x 1.0 + 1 s
    assert not _verdict(clean[:2] + [_window(2, slowest=slow)] + clean[3:])["slowest_call"]
    short = [_window(i, retrieved_tokens=980) for i in range(6)]
    assert not _verdict(short)["retrieved_lookup"]
    assert not _verdict(short)["broken_counted"]  # 120 tokens short, none counted
    counted = [dict(w, counters=dict(w["counters"], **{"engine.promise_broken_tokens": 20}))
               for w in short]
    assert _verdict(counted)["broken_counted"]
    # before the tier filled (window 1) a short retrieve is not judged; after it, it is
    assert _verdict([_window(0, retrieved_tokens=0)] + clean[1:])["retrieved_lookup"]
    assert not _verdict(clean[:3] + [_window(3, retrieved_tokens=0)] + clean[4:])[
        "retrieved_lookup"]
    never = [dict(_window(i), counters={"local.hit_tokens": 1000}) for i in range(6)]
    assert not _verdict(never)["retrieved_lookup"]
    assert _verdict(counted, mode="faults")["retrieved_lookup"]  # reported only
    fat = [_window(i, hwm=(280 + 8 + 49) << 20) for i in range(6)]
    assert not _verdict(fat)["rss"]


def test_popularity_report_sums_the_groups_and_redis_counters() -> None:
    pop = {"top": {"requests": 3, "chunks": 12, "hit_chunks": 9, "first_requests": 1,
                   "first_chunks": 4, "first_hit_chunks": 1},
           "rest": {"requests": 7, "chunks": 20, "hit_chunks": 5, "first_requests": 6,
                    "first_chunks": 18, "first_hit_chunks": 3}}
    windows = [_window(i, popularity=pop, restarts=i % 2) for i in range(4)]
    for w in windows:
        w["counters"]["remote.touched_keys"] = 10
    result = _result(windows)
    # INFO's counters restart with the server after index 1: 100 + 50 + 30 + 40 evicted,
    # 7 + 2 + 4 + 2 hits
    result.redis_windows = [{"index": i, "evicted_keys": e, "keyspace_hits": h,
                             "keyspace_misses": 5 * (i + 1)}
                            for i, (e, h) in enumerate([(100, 7), (150, 9), (30, 4), (70, 6)])]
    doc = popularity_report(result)
    assert doc["top"]["chunks"] == 48 and doc["top"]["hit_chunks"] == 36
    assert doc["top"]["hit_rate"] == 0.75 and doc["top"]["first_hit_rate"] == 0.25
    assert doc["rest"]["requests"] == 28 and doc["rest"]["first_hit_rate"] == 12 / 72
    assert (doc["touched_keys"], doc["restarts"], doc["top_docs"]) == (40, 2, 5)
    assert doc["redis"] == {"evicted_keys": 220, "keyspace_hits": 15, "keyspace_misses": 20}
    empty = popularity_report(_result([_window(0)]))
    assert empty["top"]["chunks"] == 0 and empty["top"]["hit_rate"] is None


# -- the real thing ---------------------------------------------------------------------------


def _soak(args: list[str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "soak", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes only once reaped; the soak reaps its children
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.timeout(900)
def test_short_soak_passes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    proc = _soak(["--minutes", "1.5", "--mode", "both", "--window", "5", "--local-mib", "4",
                  "--fault-interval", "4", "--json", str(report)])
    out, _ = proc.communicate(timeout=840)
    assert report.exists(), out
    doc = json.loads(report.read_text())
    failed = [c for c in doc["criteria"] if not c["ok"]]
    assert proc.returncode == 0 and doc["passed"] and not failed, out[-6000:]
    kinds = {f["fault"] for f in doc["faults"]}
    assert kinds == {"pause", "client-kill", "corrupt", "slow-link", "debug-sleep",
                     "delete-parts", "next-release", "squeeze", "kill-restart"}
    for name, engine in doc["engines"].items():
        assert engine["judged_windows"] >= 1, name  # the ratio was judged after the fill
        assert engine["wrong_tokens"] == 0 and engine["exceptions"] == 0
    roles = {e["role"] for e in doc["engines"].values()}
    assert roles == {"rw", "ro", "nolocal"}
    assert not [pid for pid in doc["pids"] if _alive(pid)]
    pop = doc["popularity"]
    assert pop["lru_touch"] and pop["touched_keys"] > 0 and pop["restarts"] == 0
    assert pop["top"]["hit_chunks"] > 0 and pop["redis"]["evicted_keys"] > 0


@pytest.mark.timeout(600)
def test_soak_without_lru_touch_restarts_engines_and_reports_popularity(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    proc = _soak(["--minutes", "0.5", "--window", "5", "--engines", "rw,ro,nolocal",
                  "--no-lru-touch", "--restart-every", "10", "--json", str(report)])
    out, _ = proc.communicate(timeout=540)
    assert report.exists(), out
    doc = json.loads(report.read_text())
    assert "popularity (all engines" in out and "LRU refresh off" in out, out[-3000:]
    pop = doc["popularity"]
    assert not pop["lru_touch"] and pop["touched_keys"] == 0
    engines = doc["engines"]
    assert all(e["touched_keys"] == 0 for e in engines.values())
    # 30 s, every 10 s, the two engines with a local tier taking turns (at 5 s and 10 s)
    assert {n: e["restarts"] for n, e in engines.items()} == {
        "e0-rw": 3, "e1-ro": 2, "e2-nolocal": 0}
    for e in engines.values():
        assert e["wrong_tokens"] == 0 and e["exceptions"] == 0
        groups = e["popularity"]
        assert groups["top"]["requests"] + groups["rest"]["requests"] == e["requests"]
        for g in groups.values():
            assert 0 <= g["hit_chunks"] <= g["chunks"]
            assert g["first_requests"] <= g["requests"] and g["first_chunks"] <= g["chunks"]
    assert pop["top"]["requests"] > 0 and pop["top"]["hit_chunks"] > 0
    assert pop["top"]["requests"] == sum(e["popularity"]["top"]["requests"]
                                         for e in engines.values())
    assert not [pid for pid in doc["pids"] if _alive(pid)]


@pytest.mark.timeout(600)
def test_interrupted_soak_stops_every_process(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    proc = _soak(["--minutes", "10", "--json", str(report)])
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the run has begun once every engine is warm
        seen.append(line)
        if "engines warm" in line:
            break
    else:
        pytest.fail("".join(seen))
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, "".join(seen) + rest
    doc = json.loads(report.read_text())
    assert doc["interrupted"] and not doc["passed"]
    assert len(doc["pids"]) == 5 and not [pid for pid in doc["pids"] if _alive(pid)]
