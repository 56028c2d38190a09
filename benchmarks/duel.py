"""One side-by-side duel, alone: the quick way to compare a change against the peers.

    .venv/bin/python -m benchmarks.duel                 # 1 MiB x 256, LMCache included
    .venv/bin/python -m benchmarks.duel --set llama --count 16 --reps 5 --no-lmcache
    .venv/bin/python -m benchmarks.duel --busy          # also the duel beside a busy thread
    .venv/bin/python -m benchmarks.duel --full          # on a server full under maxmemory

The same field as `benchmarks.run`'s side-by-side rows (plain socket, the real LMCache's three
variants when its environment is there, `RedisTier raw`, `engine raw`), interleaved
repetitions on one private redis-server; it prints each row and the ratios the targets use.
Nothing is written to docs/.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import lmcache_rows
from benchmarks.data import LLAMA8B, MIB1
from benchmarks.report import lmcache_targets, side_section
from benchmarks.run import _side_by_side
from benchmarks.server import LocalRedis
from benchmarks.timing import Results

SETS = {"1mib": MIB1, "llama": LLAMA8B}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.duel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=sorted(SETS), default="1mib")
    parser.add_argument("--count", type=int, default=256, help="chunks (default 256)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-lmcache", action="store_true")
    parser.add_argument("--busy", action="store_true",
                        help="then the duel with a spinning Python thread in each process")
    parser.add_argument("--full", action="store_true",
                        help="every put on a server full of the contender's own values under "
                        "maxmemory (writes evict and reuse memory, as in production), not an "
                        "empty one whose every write page-faults")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    shape = SETS[args.set]
    env = None if args.no_lmcache else lmcache_rows.SideEnv()
    res = Results()
    with LocalRedis() as server:
        _side_by_side(res, server, shape, args.count, args.reps, env, ("raw",),
                      busy=args.busy, full=args.full)
    for line in lmcache_targets(res, side_section(shape, args.count)) if env else []:
        print(line)
    sec = side_section(shape, args.count)
    fig = {r.name: r.value for r in res.rows if r.section == sec}
    peers = [n for n in fig if n.startswith("LMCache") and n.endswith((": store", ": retrieve"))]
    for op in ("store", "retrieve"):
        tier, eng = fig[f"RedisTier raw: {op}"], fig[f"engine raw: {op}"]
        line = f"{op}: tier {tier:.2f}, engine {eng:.2f}, plain socket " \
               f"{fig[f'plain socket: {op}']:.2f} GB/s"
        best = max((fig[n] for n in peers if n.endswith(op)), default=None)
        if best is not None:
            line += f"; tier / LMCache fastest {tier / best:.2f}x, engine / LMCache redis:// " \
                    f"{eng / fig[f'LMCache redis://: {op}']:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
