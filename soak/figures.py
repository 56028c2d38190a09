"""`python -m soak.figures REPORT.json...`: the Markdown tables of docs/reliability.md.

For each `--json` report of a soak run: one row per engine (the whole run), then one row per
minute (the windows of that minute summed): per engine retrieved/lookup and the remote share
of the hits, Redis' evicted keys, and the faults applied.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from soak.report import evicted_per_window

MIB = 1 << 20


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.4f}" if den else "n/a"


def engine_rows(doc: dict[str, Any]) -> list[str]:
    rows = ["| engine | requests | lookup tokens | retrieved | ratio after fill | hits local / "
            "remote | wrong KV | exceptions | broken (counted) | slowest call | RSS peak - "
            "baseline |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, e in doc["engines"].items():
        slow = max(e["slowest"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        judged = e["judged_ratio"]
        rows.append(
            f"| {name} | {e['requests']} | {e['lookup_tokens']} | {e['retrieved_tokens']} | "
            f"{'n/a' if judged is None else f'{judged:.4f}'} (from w{e['fill_window']}) | "
            f"{e['local_hit_tokens']} / {e['remote_hit_tokens']} | "
            f"{e['wrong_tokens'] + e['stray_tokens']} | {e['exceptions']} | "
            f"{e['lookup_tokens'] - e['retrieved_tokens']} "
            f"({e.get('promise_broken_tokens', '-')}) | "
            f"{slow[1]:.2f} s ({slow[0]}) | "
            f"{(e['peak_rss'] - e['baseline_rss']) / MIB:.1f} MiB |")
    return rows


def minute_rows(doc: dict[str, Any]) -> list[str]:
    window = float(doc["settings"]["window"])
    per_minute = max(1, int(round(60 / window)))
    names = list(doc["engines"])
    head = " | ".join(f"{n} ret/look (remote hits)" for n in names)
    rows = [f"| minute | {head} | Redis evicted keys | faults applied | RSS - baseline, MiB "
            "(highest engine) |",
            "| ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |"]
    count = max(len(e["window_reports"]) for e in doc["engines"].values())
    evicted = evicted_per_window(doc["redis"]["windows"])
    for m in range(-(-count // per_minute)):
        ks = range(m * per_minute, (m + 1) * per_minute)
        if not any(w["requests"] for e in doc["engines"].values()
                   for w in e["window_reports"] if w["index"] in ks):
            continue  # the closing window after the last request (the final flush)
        cells = []
        rise = 0.0
        for n in names:
            ws = [w for w in doc["engines"][n]["window_reports"] if w["index"] in ks]
            look = sum(w["lookup_tokens"] for w in ws)
            got = sum(w["retrieved_tokens"] for w in ws)
            remote = sum(int(w["counters"].get("remote.hit_tokens", 0)) for w in ws)
            cells.append(f"{_ratio(got, look)} ({remote})")
            base = doc["engines"][n]["baseline_rss"]
            rise = max([rise] + [(w["rss"] - base) / MIB for w in ws])
        ev = sum(evicted.get(k, 0) for k in ks)
        faults = [f["fault"] for f in doc["faults"] if m * 60 <= f["at"] < (m + 1) * 60]
        rows.append(f"| {m + 1} | " + " | ".join(cells) + f" | {ev} | {len(faults)} | {rise:.1f} |")
    return rows


def main(argv: list[str]) -> int:
    for path in argv:
        with open(path) as f:
            doc = json.load(f)
        verdict = "passed" if doc["passed"] else "FAILED: " + ", ".join(
            c["name"] for c in doc["criteria"] if not c["ok"])
        print(f"#### {doc['settings']['mode']}, {doc['settings']['minutes']:g} min: {verdict}\n")
        print("\n".join(engine_rows(doc)))
        print()
        print("\n".join(minute_rows(doc)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
