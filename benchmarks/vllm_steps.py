"""What the vLLM connector costs vLLM's steps: vLLM 0.33's real scheduler, a simulated forward.

    VPY="$(bash -c '. scripts/env.sh; ensure_vllm_env')"
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. "$VPY" -m benchmarks.vllm_steps [--json]

An engine is `tests/vllm_real/rig.py`'s `Instance` (vLLM's Scheduler, KV cache allocator,
connector factory and model-runner hooks) whose forward writes nothing and sleeps instead,
standing for GPU time: 20 ms a step plus 20 ms for a full token budget, so the CPU stays free
as it does on a GPU host. A stream of requests arrives, one every other step; half of them
start with a long prefix that is in Redis (written by another engine before the run), the
other half are as long and new (computed, then stored). Modes, in one run, each on a fresh
engine and its own keys: vLLM without the connector; the connector with loads and stores
within the step (`async_load_min_tokens: null`, `async_save: false`); with both in the
background (`async_load_min_tokens: 1024`, `async_save: true`, `lookup_wait_ms: 2`); and
those two again with Redis
stopped (SIGSTOP) for 2 s from the tenth step. Printed per mode: step time (median, p90,
max), the median step time of steps that ran while a background transfer was in flight,
a step's wall time over its simulated GPU time (median; and over the steps that ran while a
background transfer was in flight), the worst step's time beyond its GPU time, TTFT (from
arrival to the first token) of the hitting requests and of the others, output tokens per
second, and the targets of issue 13 as ratios of this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm_real"))

import rig  # noqa: E402

from lmcache_remote.admin.private_server import RedisServer  # noqa: E402

LAYERS, KV_HEADS, HEAD = 4, 8, 64  # 8 KiB of bfloat16 KV per token
PREFIX, SUFFIX, REQUESTS, NEW_TOKENS = 4096, 64, 16, 8
BUDGET, BLOCKS, REMOTE_TIMEOUT, PAUSE_S, PAUSE_AT = 2048, 1600, 0.5, 2.0, 10
GEOMETRY = {"layers": LAYERS, "kv_heads": KV_HEADS, "head_size": HEAD, "fake_compute": False,
            "max_batched_tokens": BUDGET, "num_blocks": BLOCKS}
MODES = {
    "off": None,
    "sync": {"async_load_min_tokens": None, "async_save": False},
    "async": {"async_load_min_tokens": 1024, "async_save": True, "lookup_wait_ms": 2},
    "sync, Redis paused": {"async_load_min_tokens": None, "async_save": False},
    "async, Redis paused": {"async_load_min_tokens": 1024, "async_save": True,
                            "lookup_wait_ms": 2},
}


def gpu_time(out: Any) -> float:
    return 0.020 + 0.020 * min(1.0, out.total_num_scheduled_tokens / BUDGET)


def connector_config(url: str, prefix: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"remote_url": url, "key_prefix": prefix, "chunk_size": rig.CHUNK,
            "local_cpu": False, "max_local_cpu_size": 1.0, "remote_timeout": REMOTE_TIMEOUT,
            "stats_publish_interval": None, **extra}


def workload() -> list[tuple[str, list[int], bool]]:
    prefix = rig.prompt(PREFIX, seed=1)
    reqs = []
    for i in range(REQUESTS):
        hit = i % 2 == 0
        tokens = (prefix + rig.prompt(SUFFIX, seed=100 + i) if hit
                  else rig.prompt(PREFIX + SUFFIX, seed=1000 + i))
        reqs.append((f"{'hit' if hit else 'new'}-{i}", tokens, hit))
    return reqs


def store_prefix(model: Any, url: str, prefix: str) -> None:
    writer = rig.Instance(model, connector_config(url, prefix, {"store_async": False}),
                          **GEOMETRY)
    writer.add("writer", rig.prompt(PREFIX, seed=1) + [0], max_tokens=1)
    writer.run(["writer"])
    writer.close()


def in_flight(engine: rig.Instance) -> bool:
    background = [r.connector._worker.side._background for r in engine.ranks
                  if r.connector is not None]
    return any(b._recving or any(not f.done() for fs in b._saving.values() for f in fs)
               for b in background)


def run_mode(model: Any, server: RedisServer, name: str, extra: dict[str, Any] | None,
             index: int) -> dict[str, Any]:
    prefix = f"lmcrbench{index}"
    if extra is not None:
        store_prefix(model, server.url, prefix)
    engine = rig.Instance(model, connector_config(server.url, prefix, extra or {}),
                          connector=extra is not None, step_time=gpu_time, **GEOMETRY)
    pending = workload()
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    steps: list[tuple[float, float, bool]] = []  # wall time, simulated GPU time, in flight
    resume: threading.Timer | None = None
    start = time.perf_counter()
    step = 0
    while len(engine.finished) < REQUESTS:
        if pending and step % 2 == 0:
            req_id, tokens, _ = pending.pop(0)
            engine.add(req_id, tokens, max_tokens=NEW_TOKENS)
            arrived[req_id] = time.perf_counter()
        if "paused" in name and step == PAUSE_AT:
            server.pause()
            resume = threading.Timer(PAUSE_S, server.resume)
            resume.start()
        busy = in_flight(engine)
        t0 = time.perf_counter()
        out = engine.step()
        gpu = gpu_time(out) if out.total_num_scheduled_tokens else 0.0
        steps.append((time.perf_counter() - t0, gpu, busy))
        now = time.perf_counter()
        for req_id, toks in engine.outputs.items():
            if toks and req_id not in first_token:
                first_token[req_id] = now
        if not out.total_num_scheduled_tokens:
            engine.wait_for_background(now + 30)
        step += 1
        if step > 2000:
            raise RuntimeError(f"{name}: requests did not finish")
    wall = time.perf_counter() - start
    if resume is not None:
        resume.join()
    engine.drain()
    engine.close()
    _drop_keys(server.url, prefix)
    durations = [d for d, _, _ in steps]
    # a step's wall time over its GPU time: what vLLM's steps lose to the connector's work
    slowdown = [d / g for d, g, _ in steps if g]
    busy_slowdown = [d / g for d, g, b in steps if g and b]
    ttft = {kind: [first_token[r] - arrived[r] for r in first_token if r.startswith(kind)]
            for kind in ("hit", "new")}
    return {
        "steps": len(steps), "wall_s": wall,
        "step_median_s": statistics.median(durations),
        "step_p90_s": sorted(durations)[int(0.9 * (len(durations) - 1))],
        "step_max_s": max(durations),
        "step_over_gpu_median": statistics.median(slowdown),
        "step_over_gpu_median_in_flight": (statistics.median(busy_slowdown)
                                           if busy_slowdown else None),
        "steps_in_flight": len(busy_slowdown),
        "step_max_over_gpu_s": max(d - g for d, g, _ in steps),
        "ttft_hit_median_s": statistics.median(ttft["hit"]),
        "ttft_new_median_s": statistics.median(ttft["new"]),
        "output_tokens_per_s": REQUESTS * NEW_TOKENS / wall,
    }


def _drop_keys(url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for i in range(0, len(keys), 500):
        client.unlink(*keys[i:i + 500])
    client.close()


def targets(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    off, sync, asyn = results["off"], results["sync"], results["async"]
    in_flight = asyn["step_over_gpu_median_in_flight"] or asyn["step_over_gpu_median"]
    return {
        "async, steps with transfers in flight: step/GPU time median over off's "
        "(target <= 1.05)": in_flight / off["step_over_gpu_median"],
        "sync: step/GPU time median over off's":
            sync["step_over_gpu_median"] / off["step_over_gpu_median"],
        "async: TTFT of hits over off's TTFT of the same requests, recomputed (target <= 1)":
            asyn["ttft_hit_median_s"] / off["ttft_hit_median_s"],
        "sync: TTFT of hits over off's TTFT of the same requests":
            sync["ttft_hit_median_s"] / off["ttft_hit_median_s"],
        "async, Redis paused: worst step over its GPU time / remote_timeout (target <= 1)":
            results["async, Redis paused"]["step_max_over_gpu_s"] / REMOTE_TIMEOUT,
        "sync, Redis paused: worst step over its GPU time / remote_timeout":
            results["sync, Redis paused"]["step_max_over_gpu_s"] / REMOTE_TIMEOUT,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    model = rig.model_config(Path(tempfile.mkdtemp()) / rig.MODEL_NAME)
    with RedisServer() as server:
        results = {name: run_mode(model, server, name, extra, i)
                   for i, (name, extra) in enumerate(MODES.items())}
    report = {"modes": results, "targets": targets(results),
              "workload": {"requests": REQUESTS, "prefix_tokens": PREFIX,
                           "suffix_tokens": SUFFIX, "new_tokens": NEW_TOKENS,
                           "kv_bytes_per_token": LAYERS * KV_HEADS * 2 * HEAD * 2,
                           "remote_timeout_s": REMOTE_TIMEOUT, "pause_s": PAUSE_S}}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    cols = ["steps", "step_median_s", "step_p90_s", "step_max_s", "step_over_gpu_median",
            "step_over_gpu_median_in_flight", "step_max_over_gpu_s", "ttft_hit_median_s",
            "ttft_new_median_s", "output_tokens_per_s"]
    print("| mode | " + " | ".join(cols) + " |")
    print("|" + " --- |" * (len(cols) + 1))
    for name, row in results.items():
        cells = [f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for label, value in report["targets"].items():
        print(f"{label}: {value:.3f}")


if __name__ == "__main__":
    main()
