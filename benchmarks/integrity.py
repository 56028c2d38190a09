"""What the integrity key costs: store and retrieve with an `integrity_key` against without,
side by side in one run (issue 26's target: >= 0.8x).

    .venv/bin/python -m benchmarks.integrity            # 32 MiB x 16 and 1 MiB x 256, 5 reps
    .venv/bin/python -m benchmarks.integrity --tiny     # seconds: what the smoke test runs
    .venv/bin/python -m benchmarks.integrity --json     # the figures as one JSON document

Per chunk set, on one private redis-server, codec `raw`, repetitions interleaved
(`contenders.duel`): `RedisTier raw` (encode + send / receive + check + decode) and `engine
raw` (synchronous store, Redis-hit retrieve with the local tier off, KV copies into and out of
vLLM's paged layout included), each without and with a key (`file:` a 64-byte key file).
Keyed over unkeyed per operation is the figure the target reads; the MAC's own speed on this
machine (keyed BLAKE3 over one 32 MiB chunk in 4 MiB parts, one thread; beside it BLAKE3 with
two threads and HMAC-SHA256, the construction it replaced, for reference) says what bounds it.
Nothing is written to docs/: one run's figures are kept in `benchmarks/reading.md` ("The
integrity key"), which `benchmarks.run` copies into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import torch

from benchmarks import contenders
from benchmarks.data import (
    CHUNK,
    LLAMA8B,
    MIB1,
    TINY,
    Shape,
    chunk_tensor,
    empty_dense,
    normal_dense,
    paged_like,
)
from benchmarks.engine_rows import TierSource
from benchmarks.report import side_section
from benchmarks.server import LocalRedis
from lmcache_remote.values.integrity import IntegrityKey

TARGET = 0.8
SETS = {"full": ((LLAMA8B, 16), (MIB1, 256)), "tiny": ((TINY, 4),)}


def mac_speed(nbytes: int = 32 << 20, part: int = 4 << 20, reps: int = 5) -> float:
    """GB/s of `IntegrityKey.tag` over one chunk of ``nbytes`` in parts of ``part``, one
    thread, median of ``reps``."""
    data = memoryview(os.urandom(nbytes))
    parts = [data[i:i + part] for i in range(0, nbytes, part)]
    key = IntegrityKey(os.urandom(32).hex().encode())
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        key.tag("model:1:0:bfloat16:" + "0" * 32, b"h" * 200, parts)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


def reference_speeds(nbytes: int = 32 << 20, part: int = 4 << 20, reps: int = 5
                     ) -> dict[str, float]:
    """GB/s over the same input as `mac_speed` of what the MAC could have been: keyed BLAKE3
    with ``max_threads=2`` (this box's cores) and HMAC-SHA256 (the construction it replaced)."""
    data = memoryview(os.urandom(nbytes))
    parts = [data[i:i + part] for i in range(0, nbytes, part)]
    key = os.urandom(32)
    makers: dict[str, Callable[[], Any]] = {
        "keyed BLAKE3, 2 threads": lambda: blake3.blake3(key=key, max_threads=2),
        "HMAC-SHA256, one thread": lambda: hmac.new(key, b"", "sha256"),
    }
    out = {}
    for name, make in makers.items():
        times = []
        for _ in range(reps + 1):
            start = time.perf_counter()
            mac = make()
            for piece in parts:
                mac.update(piece)
            mac.digest()
            times.append(time.perf_counter() - start)
        out[name] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def duel(server: LocalRedis, shape: Shape, count: int, reps: int, key: str
         ) -> dict[str, float]:
    """GB/s of each contender's store and retrieve (``"{name}: {op}"``)."""
    num_tokens = count * CHUNK
    dense = normal_dense(shape, num_tokens)
    chunks = [chunk_tensor(dense, shape, i) for i in range(count)]
    kv = paged_like(dense, shape, num_tokens, seed=11)
    dest = paged_like(empty_dense(shape, num_tokens), shape, num_tokens, seed=12)
    source = TierSource(shape, chunks)
    keyed = {"integrity_key": key}
    field = [
        contenders.tier(server, source, "raw"),
        contenders.tier(server, source, "raw", " + integrity_key", **keyed),
        contenders.engine(server, shape, kv, dest, num_tokens, "raw"),
        contenders.engine(server, shape, kv, dest, num_tokens, "raw", " + integrity_key",
                          **keyed),
    ]
    try:
        result = contenders.duel(field, reps, server.settle)
    finally:
        source.release()
    nbytes = count * shape.chunk_bytes
    out = {}
    for name, (t_put, t_get) in result.items():
        out[f"{name}: store"] = nbytes / t_put / 1e9
        out[f"{name}: retrieve"] = nbytes / t_get / 1e9
    return out


def ratios(figures: dict[str, float]) -> list[str]:
    """Keyed over unkeyed, per contender and operation, with the target's verdict."""
    lines = []
    for name in ("RedisTier raw", "engine raw"):
        for op in ("store", "retrieve"):
            plain, keyed = figures[f"{name}: {op}"], figures[f"{name} + integrity_key: {op}"]
            verdict = "holds" if keyed >= TARGET * plain else "MISSED"
            lines.append(f"{name}, {op}: {keyed:.2f} GB/s with the key, {plain:.2f} without: "
                         f"{keyed / plain:.2f}x (target >= {TARGET}x): {verdict}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.integrity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="seconds; for the smoke test")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 1 tiny)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    reps = args.reps or (1 if args.tiny else 5)
    started = time.time()
    result: dict[str, object] = {"reps": reps, "sets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "integrity.key"
        path.write_text(os.urandom(32).hex() + "\n")
        path.chmod(0o600)
        with LocalRedis() as server:
            result["redis_server"] = server.version()
            for shape, count in SETS["tiny" if args.tiny else "full"]:
                figures = duel(server, shape, count, reps, f"file:{path}")
                result["sets"][side_section(shape, count)] = {  # type: ignore[index]
                    "figures": figures, "ratios": ratios(figures)}
    result["mac_gbps"] = mac_speed(reps=reps)
    result["reference_gbps"] = reference_speeds(reps=reps)
    result["elapsed_s"] = time.time() - started
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for section, got in result["sets"].items():  # type: ignore[attr-defined]
        print(f"## {section}")
        for name, value in got["figures"].items():
            print(f"{name}: {value:.2f} GB/s")
        for line in got["ratios"]:
            print(f"- {line}")
    print(f"keyed BLAKE3 (the MAC), one thread: {result['mac_gbps']:.2f} GB/s; "
          + "; ".join(f"{name}: {gbps:.2f} GB/s"
                      for name, gbps in result["reference_gbps"].items())  # type: ignore[attr-defined]
          + f"; {result['elapsed_s']:.0f} s in all")


if __name__ == "__main__":
    main()
