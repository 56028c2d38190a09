"""Judging a soak run: the pass criteria, the per-window table, the JSON report.

A run passes only when every criterion holds (issue 11, point 5):

- `wrong_kv`: 0 retrieved tokens whose KV differs from `expected_kv` in any bit, 0 tokens
  written outside the hit run, 0 hit masks that are not a prefix;
- `exceptions`: 0 exceptions out of the library (warm-up included);
- `slowest_call`: no lookup, retrieve or store slower than 3 x remote_timeout + 1 s;
- `retrieved_lookup`: per engine, in fault-free time after its tier filled, tokens retrieved
  / tokens lookup promised >= 0.99 (reported, not required, in fault mode). An engine's tier
  counts as filled from the window after the one in which it first evicted a local chunk or
  was refused memory (a no-local-tier engine from its first window on); an engine whose tier
  never fills fails the criterion (the run was too short to show anything);
- `rss`: every engine's peak RSS (VmHWM, reset when it became ready) within its baseline +
  `max_local_cpu_size` + `rss_slack_mib` (the documented constant);
- `broken_counted`: per engine, the tokens the soak saw retrieve fall short of lookup equal
  the engine's own `engine.promise_broken_tokens` (what breaks the promise is counted);
- `engines`: every engine reported each window, finished its flush and exited 0, and every
  fault was applied as scheduled.

Reported, not judged: `popularity` (issue 25), the hit rate by the Zipf rank of a request's
first document, in chunks: of the first document's whole chunks, how many retrieve delivered,
for the `top_docs` most popular documents and for the rest, over every request and over the
requests whose first document the engine saw for the first time since it (re)started (only
Redis can serve those); with the engines' TOUCHes sent (`remote.touched_keys`), their
restarts, and Redis's own view over the run: `evicted_keys`, `keyspace_hits` and
`keyspace_misses` (every read command's lookups: EXISTS, GET and TOUCH alike).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from soak.controller import EngineRun, SoakResult
from soak.settings import MIB
from soak.worker import GROUPS, POPULARITY_FIELDS

FILL_SIGNS = ("local.evicted_chunks", "pool.failed_allocations", "remote.pool_full")


@dataclasses.dataclass
class Criterion:
    name: str
    ok: bool
    detail: str


def fill_window(run: EngineRun) -> int | None:
    """The window in which this engine's local tier first evicted or ran out of memory."""
    if run.role == "nolocal":
        return 0
    for doc in run.windows:
        if any(doc["counters"].get(k, 0) > 0 for k in FILL_SIGNS):
            return int(doc["index"])
    return None


def in_fault_time(result: SoakResult, doc: dict[str, Any]) -> bool:
    """Whether window `doc` reaches past the first fault."""
    s = result.settings
    return s.mode != "fault-free" and (doc["index"] + 1) * s.window > s.fault_start


def ratio_after_fill(result: SoakResult, run: EngineRun, faults: bool) -> tuple[int, int, int]:
    """(lookup tokens, retrieved tokens, windows) of `run` after its tier filled, in
    fault-free time (`faults` False) or in fault time (True)."""
    filled = fill_window(run)
    if filled is None:
        return 0, 0, 0
    judged = [d for d in run.windows
              if d["index"] > filled and in_fault_time(result, d) == faults]
    return (sum(d["lookup_tokens"] for d in judged), sum(d["retrieved_tokens"] for d in judged),
            len(judged))


def _sum(run: EngineRun, field: str) -> int:
    return sum(int(d[field]) for d in run.windows)


def _counter(run: EngineRun, name: str) -> int:
    return sum(int(d["counters"].get(name, 0)) for d in run.windows)


def popularity_counts(windows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per group (`top`, `rest`) the summed popularity fields of `windows`, with `hit_rate`
    (hit_chunks / chunks) and `first_hit_rate` (the same over first sights); None where no
    chunk was asked for."""
    out: dict[str, dict[str, Any]] = {}
    for group in GROUPS:
        row: dict[str, Any] = {f: sum(int(d.get("popularity", {}).get(group, {}).get(f, 0))
                                      for d in windows) for f in POPULARITY_FIELDS}
        row["hit_rate"] = row["hit_chunks"] / row["chunks"] if row["chunks"] else None
        row["first_hit_rate"] = (row["first_hit_chunks"] / row["first_chunks"]
                                 if row["first_chunks"] else None)
        out[group] = row
    return out


def popularity_report(result: SoakResult) -> dict[str, Any]:
    """The whole run's popularity report: every engine's windows together, Redis's view."""
    windows = [d for r in result.engines for d in r.windows]
    rows = result.redis_windows
    return {
        "unit": "chunks of the first document retrieved / its whole chunks",
        "top_docs": result.settings.top_docs, "lru_touch": result.settings.lru_touch,
        **popularity_counts(windows),
        "touched_keys": sum(int(d["counters"].get("remote.touched_keys", 0)) for d in windows),
        "restarts": sum(int(d.get("restarts", 0)) for d in windows),
        "redis": {field: sum(per_window(rows, field).values())
                  for field in ("evicted_keys", "keyspace_hits", "keyspace_misses")},
    }


def engine_summary(result: SoakResult, run: EngineRun) -> dict[str, Any]:
    s = result.settings
    lookup, retrieved, judged = ratio_after_fill(result, run, faults=s.mode == "faults")
    f_lookup, f_retrieved, _ = ratio_after_fill(result, run, faults=True)
    total_lookup, total_retrieved = _sum(run, "lookup_tokens"), _sum(run, "retrieved_tokens")
    base = int(run.ready["baseline_rss"]) if run.ready else 0
    peak = max([int(d["hwm"]) for d in run.windows] + [int((run.done or {}).get("hwm", 0))])
    slowest: dict[str, float] = {}
    for d in run.windows:
        for call, secs in d["slowest"].items():
            slowest[call] = max(slowest.get(call, 0.0), float(secs))
    return {
        "role": run.role, "pid": run.ready["pid"] if run.ready else run.proc.pid,
        "requests": _sum(run, "requests"), "windows": len(run.windows),
        "fill_window": fill_window(run),
        "lookup_tokens": total_lookup, "retrieved_tokens": total_retrieved,
        "ratio": total_retrieved / total_lookup if total_lookup else None,
        "judged_lookup_tokens": lookup, "judged_retrieved_tokens": retrieved,
        "judged_windows": judged, "judged_ratio": retrieved / lookup if lookup else None,
        "fault_time_ratio": f_retrieved / f_lookup if f_lookup else None,
        "short_retrieves": _sum(run, "short_retrieves"),
        "local_hit_tokens": _counter(run, "local.hit_tokens"),
        "remote_hit_tokens": _counter(run, "remote.hit_tokens"),
        "remote_lookup_hit_tokens": _counter(run, "remote.lookup_hit_tokens"),
        "local_evicted_chunks": _counter(run, "local.evicted_chunks"),
        "remote_pool_full": _counter(run, "remote.pool_full"),
        "broken_tokens": total_lookup - total_retrieved,
        "promise_broken_tokens": _counter(run, "engine.promise_broken_tokens"),
        "lookup_capped_tokens": _counter(run, "engine.lookup_capped_tokens"),
        "no_room_chunks": _counter(run, "memory.no_room_chunks"),
        "remote_miss_chunks": _counter(run, "remote.miss_chunks"),
        "remote_incomplete_chunks": _counter(run, "remote.incomplete_chunks"),
        "remote_corrupt_chunks": _counter(run, "remote.corrupt_chunks"),
        "remote_unauthenticated_chunks": _counter(run, "remote.unauthenticated_chunks"),
        "wrong_tokens": _sum(run, "wrong_tokens"), "stray_tokens": _sum(run, "stray_tokens"),
        "bad_masks": _sum(run, "bad_masks"), "warnings": _sum(run, "warnings"),
        "exceptions": _sum(run, "exceptions") + len((run.ready or {}).get(
            "warm_up_exceptions", [])),
        "slowest": slowest, "flush_seconds": (run.done or {}).get("flush_seconds"),
        "baseline_rss": base, "peak_rss": peak,
        "rss_limit": base + int(s.local_mib * MIB) + int(s.rss_slack_mib * MIB),
        "finished": run.done is not None, "returncode": run.returncode,
        "popularity": popularity_counts(run.windows),
        "touched_keys": _counter(run, "remote.touched_keys"),
        "restarts": sum(int(d.get("restarts", 0)) for d in run.windows),
    }


def judge(result: SoakResult) -> tuple[list[Criterion], dict[str, dict[str, Any]]]:
    s = result.settings
    per = {r.name: engine_summary(result, r) for r in result.engines}
    out: list[Criterion] = []
    wrong = {n: e["wrong_tokens"] + e["stray_tokens"] + e["bad_masks"] for n, e in per.items()}
    out.append(Criterion("wrong_kv", not any(wrong.values()) and bool(per),
                         f"wrong/stray tokens and bad masks per engine: {wrong}"))
    exc = {n: e["exceptions"] for n, e in per.items()}
    out.append(Criterion("exceptions", not any(exc.values()) and bool(per),
                         f"exceptions out of the library per engine: {exc}"))
    slowest = max((max(e["slowest"].values(), default=0.0) for e in per.values()), default=0.0)
    out.append(Criterion("slowest_call", slowest <= s.call_bound,
                         f"slowest call {slowest:.2f} s, bound {s.call_bound:g} s"))
    if s.mode == "faults":
        shown = {n: _fmt(e["judged_ratio"]) for n, e in per.items()}
        out.append(Criterion("retrieved_lookup", True,
                             f"reported only in fault mode, after each tier filled: {shown}"))
    else:
        ratios: dict[str, float | None] = {n: e["judged_ratio"] for n, e in per.items()}
        ok = bool(per) and all(r is not None and r >= s.min_ratio for r in ratios.values())
        shown = {n: f"{_fmt(ratios[n])} after w{e['fill_window']}" if e["fill_window"] is not None
                 else "tier never filled" for n, e in per.items()}
        out.append(Criterion("retrieved_lookup", ok,
                             f"fault-free, each engine after its tier filled: {shown} "
                             f"(need >= {s.min_ratio})"))
    over = {n: f"{e['peak_rss'] / MIB:.0f}/{e['rss_limit'] / MIB:.0f} MiB"
            for n, e in per.items()}
    out.append(Criterion("rss", all(e["peak_rss"] <= e["rss_limit"] for e in per.values()),
                         f"peak/limit (baseline + {s.local_mib:g} + {s.rss_slack_mib:g} MiB): "
                         f"{over}"))
    counted = {n: f"{e['broken_tokens']} seen / {e['promise_broken_tokens']} counted"
               for n, e in per.items()}
    out.append(Criterion("broken_counted", all(
        e["broken_tokens"] == e["promise_broken_tokens"] for e in per.values()) and bool(per),
        f"tokens retrieve fell short of lookup: {counted}"))
    out.append(_engines_criterion(result, per))
    return out, per


def _engines_criterion(result: SoakResult, per: dict[str, dict[str, Any]]) -> Criterion:
    problems = []
    if result.error:
        problems.append(result.error)
    if result.interrupted:
        problems.append("interrupted")
    for name, e in per.items():
        if not e["finished"] or e["returncode"] != 0:
            problems.append(f"{name} finished={e['finished']} exit={e['returncode']}")
    problems += [f"fault {f['fault']} at {f['at']} s: {f['error']}"
                 for f in result.faults if "error" in f]
    if result.settings.mode != "fault-free" and not result.faults and not result.error:
        problems.append("no fault was injected")
    return Criterion("engines", not problems and bool(per), "; ".join(problems) or
                     f"{len(per)} engines ran to the end and exited 0; "
                     f"{len(result.faults)} faults applied")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def window_table(result: SoakResult) -> list[str]:
    """One line per window: per engine its ratio and hits, Redis' state, the faults."""
    s = result.settings
    lines = []
    count = max((len(r.windows) for r in result.engines), default=0)
    names = "  ".join(f"{r.name:>24}" for r in result.engines)
    lines.append(f"{'win':>3} {'t':>5}  {names}  {'redis MiB':>9} {'evicted':>8}  faults")
    lines.append(f"{'':>3} {'':>5}  " + "  ".join(
        f"{'ret/look local/remote hit':>24}" for _ in result.engines))
    evicted = evicted_per_window(result.redis_windows)
    for k in range(count):
        cells = []
        for r in result.engines:
            d = r.windows[k] if k < len(r.windows) else None
            if d is None:
                cells.append(f"{'-':>24}")
                continue
            ratio = d["retrieved_tokens"] / d["lookup_tokens"] if d["lookup_tokens"] else None
            c = d["counters"]
            bad = " !" if d["wrong_tokens"] or d["stray_tokens"] or d["exceptions"] else ""
            cells.append(f"{_fmt(ratio):>6} {int(c['local.hit_tokens']) // 1000:>6}k/"
                         f"{int(c['remote.hit_tokens']) // 1000:>5}k{bad:2}")
        info = next((i for i in result.redis_windows if i["index"] == k), {})
        mem = info.get("used_memory")
        faults = ",".join(f["fault"] for f in result.faults
                          if k * s.window <= f["at"] < (k + 1) * s.window)
        lines.append(f"{k:>3} {(k + 1) * s.window:>5.0f}  " + "  ".join(cells) +
                     f"  {(mem or 0) / MIB:>9.1f} {evicted.get(k, '-')!s:>8}  {faults}")
    return lines


def evicted_per_window(rows: list[dict[str, Any]]) -> dict[int, int]:
    """Keys Redis evicted in each window (INFO's counter restarts with the server)."""
    return per_window(rows, "evicted_keys")


def per_window(rows: list[dict[str, Any]], field: str) -> dict[int, int]:
    """The growth of INFO's counter `field` in each window (it restarts with the server)."""
    out, last = {}, 0
    for row in rows:
        now = row.get(field)
        if now is None:
            continue
        out[row["index"]] = now - last if now >= last else now
        last = now
    return out


def summary_lines(result: SoakResult, criteria: list[Criterion],
                  per: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["", "per engine (whole run):"]
    for name, e in per.items():
        slow = ", ".join(f"{k} {v:.2f}s" for k, v in e["slowest"].items())
        lines.append(
            f"  {name:<11} {e['requests']:>5} requests, lookup {e['lookup_tokens']} tokens, "
            f"retrieved {e['retrieved_tokens']} ({_fmt(e['ratio'])}); after fill "
            f"{_fmt(e['judged_ratio'])} over {e['judged_windows']} windows (in fault time "
            f"{_fmt(e['fault_time_ratio'])}); hits local "
            f"{e['local_hit_tokens']} remote {e['remote_hit_tokens']}; evicted "
            f"{e['local_evicted_chunks']}, pool_full {e['remote_pool_full']}, no_room "
            f"{e['no_room_chunks']}, lookup capped {e['lookup_capped_tokens']} tokens; Redis "
            f"misses {e['remote_miss_chunks']}, incomplete {e['remote_incomplete_chunks']}, "
            f"corrupt {e['remote_corrupt_chunks']}, unauthenticated "
            f"{e['remote_unauthenticated_chunks']}; warnings logged "
            f"{e['warnings']}; slowest {slow}; "
            f"RSS peak {e['peak_rss'] / MIB:.0f} MiB (baseline {e['baseline_rss'] / MIB:.0f})")
    lines += popularity_lines(popularity_report(result))
    lines.append("")
    for c in criteria:
        lines.append(f"  {'PASS' if c.ok else 'FAIL'}  {c.name:<17} {c.detail}")
    passed = all(c.ok for c in criteria)
    lines.append("")
    lines.append(f"soak {result.settings.mode}: {'PASSED' if passed else 'FAILED'}")
    return lines


def popularity_lines(pop: dict[str, Any]) -> list[str]:
    redis_view = pop["redis"]
    lines = ["", f"popularity (all engines; {pop['unit']}; LRU refresh "
             f"{'on' if pop['lru_touch'] else 'off'}, {pop['touched_keys']} keys touched, "
             f"{pop['restarts']} engine restarts):"]
    for group, label in (("top", f"top {pop['top_docs']} documents"), ("rest", "the rest")):
        g = pop[group]
        lines.append(
            f"  {label:<15} {g['hit_chunks']}/{g['chunks']} chunks hit ({_fmt(g['hit_rate'])}) "
            f"over {g['requests']} requests; first sight since the engine started "
            f"{g['first_hit_chunks']}/{g['first_chunks']} ({_fmt(g['first_hit_rate'])}) over "
            f"{g['first_requests']} requests")
    lines.append(f"  Redis: {redis_view['evicted_keys']} keys evicted, keyspace hits "
                 f"{redis_view['keyspace_hits']}, misses {redis_view['keyspace_misses']}")
    return lines


def json_report(result: SoakResult, criteria: list[Criterion],
                per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "passed": all(c.ok for c in criteria),
        "interrupted": result.interrupted,
        "settings": result.settings.to_json(),
        "criteria": [dataclasses.asdict(c) for c in criteria],
        "engines": {n: dict(e, window_reports=next(r.windows for r in result.engines
                                                     if r.name == n))
                    for n, e in per.items()},
        "redis": {"pid": result.redis_pid, "windows": result.redis_windows},
        "faults": result.faults,
        "popularity": popularity_report(result),
        "pids": [result.redis_pid] + [e["pid"] for e in per.values()],
    }
