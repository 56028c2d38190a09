"""Two checkouts of the project side by side in one run: did a change make the data path slower?

    .venv/bin/python -m benchmarks.ab BEFORE_DIR AFTER_DIR [--rounds 6] [--tokens 4096]

Each checkout must have its native extension built in place (`python setup.py build_ext
--inplace` there). One private redis-server serves both. Each round runs `ab_worker.py` once per
checkout, in a fresh process whose `lmcache_remote` is that checkout's, the order alternating
round by round (so drift in the machine's load hits both sides alike); each run repeats every
operation (see `benchmarks/ab_worker.py`) and checks the KV read back is exactly the KV stored.
The report gives, per operation, the median seconds of each side over all repetitions and the
ratio after / before (below 1: the change is faster). Absolute figures do not compare across
runs; the ratio within one run does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.server import LocalRedis

WORKER = Path(__file__).with_name("ab_worker.py")


def run_side(checkout: Path, url: str, tokens: int, reps: int) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    done = subprocess.run([sys.executable, str(WORKER), url, str(tokens), str(reps)],
                          cwd=checkout, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: the worker failed:\n{done.stderr[-4000:]}")
    result: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per worker run")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parser.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    with LocalRedis() as server:
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for name in order:
                got = run_side(sides[name], server.url, args.tokens, args.reps)
                for op, seconds in got.items():
                    figures[name].setdefault(op, []).extend(seconds)
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{args.tokens} tokens (8 layers, 8 KV heads of 128, bfloat16, kv_split blocks of 16); "
          f"128 pages of 1 MiB; {args.rounds} rounds x {args.reps} repetitions, medians")
    print("| operation | before (ms) | after (ms) | after / before |")
    print("|---|---|---|---|")
    table = {}
    for op in figures["before"]:
        before = statistics.median(figures["before"][op]) * 1e3
        after = statistics.median(figures["after"][op]) * 1e3
        table[op] = {"before_ms": before, "after_ms": after, "ratio": after / before}
        print(f"| {op} | {before:.1f} | {after:.1f} | {after / before:.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"sides": {k: str(v) for k, v in sides.items()},
                                         "tokens": args.tokens, "rounds": args.rounds,
                                         "reps": args.reps, "table": table,
                                         "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
