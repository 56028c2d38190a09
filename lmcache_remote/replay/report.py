"""Replays and simulations side by side: `compare` runs each capacity through the real engine
(`driver.replay`, once per keep policy) and the offline simulations (`offline.simulate`) on
the same requests; `markdown` renders the table, `plot` the hit rate against capacity
(matplotlib, SVG or PNG by the file's suffix).

Rows name what they are: ``replay: learned`` and ``replay: redis`` are the engine against a
real Redis (the keep policy, and Redis's own `maxmemory-policy` deciding as before);
``simulated: X`` is policy X simulated on the same requests (no Redis): ``optimum`` (Belady
with bypass), ``lru``, the published policies, and ``keep`` (this project's policy with its
state in memory).
"""

from __future__ import annotations

import dataclasses
import platform
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmcache_remote.replay.driver import ReplaySettings, replay
from lmcache_remote.replay.offline import simulate
from lmcache_remote.replay.trace import Trace

__all__ = ["SIMULATED", "compare", "markdown", "parse_tokens", "plot"]

#: The simulated rows, in the order the table lists them.
SIMULATED = ("optimum", "lru", "arc", "s3fifo", "sieve", "wtinylfu", "keep")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")


def parse_tokens(text: str) -> int:
    """A token count as ``1000000``, ``500k``, ``1M`` or ``1.5M``; `ValueError` otherwise."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"not a token count: {text!r} (use 1000000, 500k, 1M, ...)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2).lower()]
    value = int(float(match.group(1)) * scale)
    if value <= 0:
        raise ValueError(f"a capacity must be positive, got {text!r}")
    return value


def compare(trace: Trace, capacities: Sequence[int], *, policies: Sequence[str] = (
        "learned", "redis"), simulated: Sequence[str] = SIMULATED,
        settings: ReplaySettings | None = None,
        note: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every capacity through every keep policy (a replay each, in an order that rotates per
    capacity so that no policy always runs first) and every simulated policy; one JSON-able
    document. ``settings``: the replay's other settings (its capacity and policy are set
    here)."""
    base = settings or ReplaySettings(capacity_tokens=1)
    measure_from = trace.split_time(base.measure_from)
    rows: list[dict[str, Any]] = []
    for n, capacity in enumerate(capacities):
        for name in simulated:
            result = simulate(trace, capacity, name, measure_from)
            rows.append({"row": f"simulated: {name}", "capacity_tokens": capacity,
                         "hit_rate": result.hit_rate, "written_chunks": result.written_blocks})
        order = list(policies[n % len(policies):]) + list(policies[:n % len(policies)]) \
            if policies else []
        for policy in order:
            note(f"replaying {len(trace)} requests at {capacity} tokens, keep_policy {policy}")
            run = replay(trace, dataclasses.replace(base, capacity_tokens=capacity,
                                                    keep_policy=policy))
            rows.append({"row": f"replay: {policy}", "capacity_tokens": capacity,
                         "hit_rate": run.hit_rate, "written_chunks": run.written_chunks,
                         "written_bytes": run.written_bytes, "evicted_keys": run.evicted_keys,
                         "expired_keys": run.expired_keys, "late_requests": run.late_requests,
                         "max_lag_s": run.max_lag_s, "maxmemory": run.maxmemory,
                         "chunk_cost": run.chunk_cost, "server": run.server_version,
                         "keep": {k: v for k, v in run.counters.items()
                                  if k.startswith("keep.")}})
    return {"trace": trace.source, "requests": len(trace), "span_s": trace.span,
            "block_size": trace.block_size, "measure_from_s": measure_from - (
                trace.requests[0].time if trace.requests else 0.0),
            "settings": {**dataclasses.asdict(base), "config": dict(base.config)},
            "capacities": list(capacities), "rows": rows,
            "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version()}


def markdown(doc: dict[str, Any]) -> str:
    """The document as a table: a row per policy, a column per capacity, each cell the hit
    rate (its ratio to the optimum's) and the chunks written."""
    capacities = doc["capacities"]
    optimum = {r["capacity_tokens"]: r["hit_rate"] for r in doc["rows"]
               if r["row"] == "simulated: optimum"}
    names: list[str] = []
    for row in doc["rows"]:
        if row["row"] not in names:
            names.append(row["row"])
    names.sort(key=lambda n: (not n.startswith("replay"), n != "simulated: optimum", n))
    head = "| row | " + " | ".join(_tokens(c) + " tokens" for c in capacities) + " |"
    lines = [head, "|---|" + "---|" * len(capacities)]
    cells = {(r["row"], r["capacity_tokens"]): r for r in doc["rows"]}
    for name in names:
        out = []
        for capacity in capacities:
            row = cells.get((name, capacity))
            if row is None:
                out.append("-")
                continue
            best = optimum.get(capacity)
            ratio = f" ({row['hit_rate'] / best:.2f}x)" if best else ""
            extra = f", {row['evicted_keys']} evicted by Redis" if "evicted_keys" in row else ""
            out.append(f"{row['hit_rate']:.3f}{ratio}, {row['written_chunks']} written{extra}")
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def _tokens(n: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale and n % (scale // 10 or 1) == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def plot(doc: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Hit rate against capacity, a line per row, the optimum dashed, replays bold; written
    to ``path`` (its suffix picks the format). Needs matplotlib (the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # an optional extra
        raise RuntimeError("plotting needs matplotlib: pip install "
                           "'lmcache-remote[plot]'") from exc
    path = Path(path)
    series: dict[str, list[tuple[int, float]]] = {}
    for row in doc["rows"]:
        series.setdefault(row["row"], []).append((row["capacity_tokens"], row["hit_rate"]))
    fig, ax = plt.subplots(figsize=(9.0, 4.5))
    for name, points in sorted(series.items()):
        points.sort()
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        style: dict[str, Any] = {"marker": "o", "linewidth": 1.0}
        if name == "simulated: optimum":
            style.update(linestyle="--", color="black", linewidth=1.5)
        elif name.startswith("replay"):
            style.update(linewidth=2.5)
        else:
            style.update(alpha=0.6, marker=".")
        ax.plot(xs, ys, label=name, **style)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (tokens of KV)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or f"{Path(doc['trace']).name}: hit rate against capacity")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return path
