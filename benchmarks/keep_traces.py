"""The keep policy on real traffic (issue 54): each trace replayed through the real engine
against a real Redis at 1M, 3M and 10M tokens of KV, with `keep_policy` `learned` (the
default) and `redis` (every chunk written, Redis's `volatile-lru` deciding: what earlier
releases did), beside the offline optimum and LRU, ARC, S3-FIFO, SIEVE, W-TinyLFU and the
policy itself simulated on the same requests (`lmcache_remote.replay.report.compare`).

    .venv/bin/python -m benchmarks.keep_traces [--trace PATH ...] [--speedup 10]
        [--capacity 1M ...] [--measure-from 0.5] [--processes 1] [--tiny]

Default traces: ../shared/traces/ (the conversation trace's first 30 minutes and the
synthetic trace). Mooncake's whole conversation trace (59 minutes:
`FAST25-release/traces/conversation_trace.jsonl` in kvcache-ai/Mooncake) is what the issue
measured: pass it with `--trace PATH --measure-from 0.509`, so the first 30 minutes (the half
the policy was designed on) are the warm-up and its last 29 minutes, traffic no test has
seen, are measured. Writes `benchmarks/keep_traces_results.json` (one document a trace) and
`docs/keep_<trace>.svg` (hit rate against capacity), and prints the tables for
docs/benchmarks.md. `--tiny`: the first 300 requests of each default trace at one small
capacity, at 100x (the smoke test's run; figures meaningless).

What it cannot show: a model's compute (replays store made-up KV and load nothing), the time
a hit saves (docs/load-decision.md), a fleet beyond one machine.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from lmcache_remote.replay.driver import ReplaySettings
from lmcache_remote.replay.report import compare, markdown, parse_tokens, plot
from lmcache_remote.replay.trace import read_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
DEFAULT = [TRACES / "mooncake-conversation-first-30min.jsonl",
           TRACES / "mooncake-synthetic.jsonl"]
RESULTS = Path(__file__).with_name("keep_traces_results.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--trace", action="append", type=Path)
    parser.add_argument("--capacity", action="append", type=parse_tokens)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--measure-from", type=float, default=0.5)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--bytes-per-token", type=int, default=64)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--plots", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    traces = args.trace or DEFAULT
    capacities = args.capacity or ([20_000] if args.tiny else
                                   [1_000_000, 3_000_000, 10_000_000])
    speedup = 100.0 if args.tiny else args.speedup
    docs = []
    for path in traces:
        trace = read_trace(path, limit=300 if args.tiny else None)
        settings = ReplaySettings(capacity_tokens=capacities[0], speedup=speedup,
                                  measure_from=args.measure_from, processes=args.processes,
                                  bytes_per_token=args.bytes_per_token)
        doc = compare(trace, capacities, settings=settings,
                      note=lambda m: print(m, flush=True))
        docs.append(doc)
        print(f"\n{path.name}: {len(trace)} requests, hits from {doc['measure_from_s']:.0f} s "
              "on\n", flush=True)
        print(markdown(doc), flush=True)
        if not args.tiny:
            svg = args.plots / f"keep_{path.stem}.svg"
            plot(doc, svg)
            print(f"plot: {svg}")
    args.out.write_text(json.dumps(docs, indent=1) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
