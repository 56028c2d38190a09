"""The benchmark suite runs end to end in its tiniest mode and writes its report (no timing
asserts: figures from a loaded test machine mean nothing; the full run is `benchmarks/`).

The smoke test leaves the real LMCache out (`--no-lmcache`): the peer needs a side environment
of 6 GB (scripts/lmcache_env.sh, the benchmark's own set-up, docs/benchmarks.md), and no test
builds an environment. What it cannot show: that the LMCache rows still run; a benchmark run
with the peer does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_suite_runs_in_tiny_mode(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--tiny", "--no-lmcache", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "python -m benchmarks.run --tiny" in text
    for heading in ("## Machine", "## Targets on this run", "## Results", "## Codecs per dtype"):
        assert heading in text
    for row in ("plain socket: retrieve", "redis-benchmark SET", "engine blosc2-zstd: store",
                "bfloat16 tiny-model KV | blosc2-lz4",
                "engine lz4: retrieve", "RedisTier raw: store", "store returns (write-behind)",
                "lookup 16 chunks, all hit", "peak RSS rise", "TTFT 256-token prefix, Redis hit",
                "bfloat16 tiny-model KV | lz4-planes", "engine zstd-planes: store",
                "bfloat16 tiny-model KV | zstd-planes"):
        assert row in text, row
    # the peer left out says so, and no LMCache row is made up
    assert "The real LMCache was left out of this run (`--no-lmcache`)" in text
    assert "the real LMCache was not measured in this run (--no-lmcache)" in text
    assert not re.findall(r"^\| [^|]+ \| LMCache", text, re.MULTILINE)  # no results row
    cpu = [line for line in text.splitlines() if line.startswith("| CPU per GB moved")]
    for name in ("RedisTier raw", "engine raw"):
        for op in ("store", "retrieve"):
            for whose in ("redis-server", "its own process"):
                assert any(f"| {name}: {op}, {whose} |" in line for line in cpu), (name, whose)
    busy = [line for line in text.splitlines() if line.startswith("| beside a busy Python")]
    for name in ("RedisTier raw", "engine raw"):
        for op in ("store", "retrieve"):
            assert any(f"| {name}: {op} |" in line for line in busy), (name, op)


def test_integrity_benchmark_runs_in_tiny_mode() -> None:
    """`benchmarks.integrity`: both contenders with and without the key, every ratio."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.integrity", "--tiny", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    (section,) = result["sets"].values()
    for name in ("RedisTier raw", "engine raw"):
        for op in ("store", "retrieve"):
            for label in ("", " + integrity_key"):
                assert section["figures"][f"{name}{label}: {op}"] > 0
    assert len(section["ratios"]) == 4 and result["mac_gbps"] > 0


def test_writes_benchmark_runs_in_tiny_mode(tmp_path: Path) -> None:
    """`benchmarks.writes`: every contender on both servers (empty and full under
    maxmemory), each row a figure and its spread, the ratios the issue asks for."""
    out = tmp_path / "writes.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.writes", "--tiny", "--reps", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    names = {"plain socket", "RedisTier", "RedisTier, 8 lanes (before)", "store + flush",
             "store + flush, one window (before)"}
    for server in ("empty", "full"):
        got = {r["name"]: r for r in rows if r["server"] == server}
        assert set(got) == names, server
        assert all(0 < r["low"] <= r["gbps"] <= r["high"] for r in got.values())
    assert "store + flush / plain socket" in proc.stdout


def test_keep_traces_benchmark_runs_in_tiny_mode(tmp_path: Path) -> None:
    """`benchmarks.keep_traces`: both shared traces, a replay per keep policy beside every
    simulated policy, one document a trace."""
    out = tmp_path / "keep.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.keep_traces", "--tiny",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    docs = json.loads(out.read_text())
    assert len(docs) == 2
    for doc in docs:
        names = {r["row"] for r in doc["rows"]}
        assert {"replay: learned", "replay: redis", "simulated: optimum",
                "simulated: lru"} <= names
        assert all(0.0 <= r["hit_rate"] <= 1.0 for r in doc["rows"])
    assert "| simulated: optimum |" in proc.stdout
