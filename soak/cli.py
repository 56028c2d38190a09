"""`python -m soak`: the command line of the soak (see the package doc)."""

from __future__ import annotations

import argparse
import json
import sys

from soak.controller import run_soak
from soak.report import json_report, judge, summary_lines, window_table
from soak.settings import MODES, ROLES, SoakSettings


def parse(argv: list[str]) -> tuple[SoakSettings, str | None]:
    d = SoakSettings()
    p = argparse.ArgumentParser(prog="python -m soak", description=(
        "A bounded soak of lmcache-remote: a private redis-server, several engine processes, "
        "every retrieved token checked. Exit 0 when every criterion passes, 1 otherwise, "
        "130 when interrupted."))
    p.add_argument("--minutes", type=float, default=d.minutes, help="run length (after warm-up)")
    p.add_argument("--mode", choices=MODES, default=d.mode,
                   help="fault-free, faults, or both (fault-free first half, faults second)")
    roles = "; ".join(f"{k} = {v}" for k, v in ROLES.items())
    p.add_argument("--engines", default=",".join(d.engines),
                   help=f"comma-separated roles: {roles}")
    p.add_argument("--window", type=float, default=d.window, help="report window, seconds")
    p.add_argument("--local-mib", type=float, default=d.local_mib,
                   help="max_local_cpu_size of each engine, MiB")
    p.add_argument("--redis-maxmemory-mib", type=int, default=d.redis_maxmemory_mib)
    p.add_argument("--remote-timeout", type=float, default=d.remote_timeout)
    p.add_argument("--rate", type=float, default=d.rate, help="requests/s per engine at most")
    p.add_argument("--fault-interval", type=float, default=d.fault_interval)
    p.add_argument("--rss-slack-mib", type=float, default=d.rss_slack_mib)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-lru-touch", action="store_true",
                   help="engines with remote_lru_touch off: no TOUCH refreshes Redis's LRU "
                        "for chunks a lookup promised or a local tier served")
    p.add_argument("--restart-every", type=float, default=d.restart_every, metavar="SECONDS",
                   help="each engine with a local tier restarts (a fresh CacheEngine, an empty "
                        "local tier) every SECONDS, staggered; default never")
    p.add_argument("--top-docs", type=int, default=d.top_docs,
                   help="the popularity report's top group: documents of Zipf rank 1..N")
    p.add_argument("--integrity-key", metavar="SOURCE", default=d.integrity_key,
                   help="every engine's integrity_key (file:PATH or env:NAME): values carry "
                        "a MAC, reads serve only those that verify")
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    a = p.parse_args(argv)
    try:
        settings = SoakSettings(
            minutes=a.minutes, mode=a.mode, engines=tuple(a.engines.split(",")), window=a.window,
            local_mib=a.local_mib, redis_maxmemory_mib=a.redis_maxmemory_mib,
            remote_timeout=a.remote_timeout, rate=a.rate, fault_interval=a.fault_interval,
            rss_slack_mib=a.rss_slack_mib, seed=a.seed, lru_touch=not a.no_lru_touch,
            restart_every=a.restart_every, top_docs=a.top_docs, integrity_key=a.integrity_key)
    except ValueError as exc:
        p.error(str(exc))
    return settings, a.json


def main(argv: list[str] | None = None) -> int:
    settings, json_path = parse(sys.argv[1:] if argv is None else argv)
    result = run_soak(settings, log=lambda line: print(line, flush=True))
    criteria, per = judge(result)
    print()
    for line in window_table(result) + summary_lines(result, criteria, per):
        print(line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(json_report(result, criteria, per), f, indent=1)
    if result.interrupted:
        return 130
    return 0 if all(c.ok for c in criteria) else 1
