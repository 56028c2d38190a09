"""docs/benchmarks.md from one run: the tables, the targets checked on this run's ratios, the
command and the machine. The prose reading lives in `reading.md` next to this file and is
copied in as it is (it explains; the verdicts above it are computed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.timing import Results


def side_section(shape: Any, count: int) -> str:
    """The section of a chunk set's side-by-side rows: ``side by side, 32 MiB x 16``."""
    mib = shape.chunk_bytes / 2**20
    size = f"{mib:g} MiB" if mib >= 1 else f"{shape.chunk_bytes // 1024} KiB"
    return f"side by side, {size} x {count}"

def busy_section(shape: Any, count: int) -> str:
    """The section of the duel beside a busy Python thread (`benchmarks.spinner`)."""
    return side_section(shape, count).replace("side by side", "beside a busy Python thread")


def cpu_section(shape: Any, count: int) -> str:
    """The section of the CPU the side-by-side rows cost: ``CPU per GB moved, 1 MiB x 256``."""
    return cpu_section_of(side_section(shape, count))


def cpu_section_of(section: str) -> str:
    """The CPU section that goes with a side-by-side section."""
    return section.replace("side by side", "CPU per GB moved")


def server_busy(res: Results, section: str, name: str, op: str) -> float | None:
    """The share of one core redis-server was busy during ``name``'s ``op`` in ``section``
    (its CPU seconds per GB times the GB/s), or None where the run did not count CPU."""
    try:
        per_gb = res.get(cpu_section_of(section), f"{name}: {op}, redis-server")
    except KeyError:
        return None
    return per_gb * res.get(section, f"{name}: {op}")


#: The contenders of the busy duel: LMCache's default and fastest paths, the tier, the engine.
BUSY_FIELD = ("LMCache redis://", "LMCache resp://", "RedisTier raw", "engine raw")

CONSTANT_MIB = 128  # the "small constant" of the RSS target: interpreter threads, arenas, slack


def _verdict(ok: bool) -> str:
    return "**holds**" if ok else "**does not hold**"


LMCACHE = ("LMCache redis://", "LMCache redis:// + hiredis", "LMCache resp://")


def _ratio(value: float, target: float, aim: float | None = None) -> str:
    text = f"{value:.2f}x (target >= {target:g}x"
    text += f", aim {aim:g}x): " if aim is not None else "): "
    return text + _verdict(value >= target)


def lmcache_targets(res: Results, section: str) -> list[str]:
    """The LMCache targets of one chunk set: RedisTier raw against LMCache's fastest path per
    operation, the engine against LMCache's ``redis://`` default, Redis bytes per KV byte."""
    names = {r.name for r in res.rows if r.section == section}
    if f"{LMCACHE[0]}: store" not in names:
        return [f"- {section}: the real LMCache was not measured in this run (--no-lmcache)."]
    g = res.get
    lines = []
    for op, word in (("store", "put"), ("retrieve", "get")):
        best = max(LMCACHE, key=lambda n: g(section, f"{n}: {op}"))
        tier = g(section, f"RedisTier raw: {op}")
        loads = [server_busy(res, section, n, op) for n in ("RedisTier raw", best)]
        server = "" if None in loads else (f" (redis-server busy {loads[0]:.0%} and "
                                           f"{loads[1]:.0%} of a core)")
        lines.append(f"- {section}, {word}: RedisTier raw {tier:.2f} GB/s against LMCache's "
                     f"fastest here, {best} {g(section, f'{best}: {op}'):.2f} GB/s{server}: "
                     + _ratio(tier / g(section, f"{best}: {op}"), 1.0, 1.2) + ".")
    default = LMCACHE[0]
    for op, word, target in (("store", "store", 1.0), ("retrieve", "retrieve", 2.0)):
        engine = g(section, f"engine raw: {op}")
        lines.append(f"- {section}, {word}: CacheEngine raw (KV copies included) {engine:.2f} "
                     f"GB/s against {default} {g(section, f'{default}: {op}'):.2f} GB/s: "
                     + _ratio(engine / g(section, f"{default}: {op}"), target) + ".")
    mem = [f"{n} {g(section, f'{n}: Redis memory / KV byte'):.3f}" for n in LMCACHE]
    lines.append(f"- {section}: Redis bytes per KV byte: RedisTier raw "
                 f"{g(section, 'RedisTier raw: Redis memory / KV byte'):.3f}; "
                 + "; ".join(mem) + ".")
    busy = section.replace("side by side", "beside a busy Python thread")
    if "RedisTier raw: retrieve" in {r.name for r in res.rows if r.section == busy}:
        for op, word in (("store", "put"), ("retrieve", "get")):
            peers = [n for n in BUSY_FIELD if n.startswith("LMCache")]
            best = max(peers, key=lambda n: g(busy, f"{n}: {op}"))
            tier, engine = g(busy, f"RedisTier raw: {op}"), g(busy, f"engine raw: {op}")
            lines.append(
                f"- {busy}, {word} (measured, no target): RedisTier raw {tier:.2f} GB/s, "
                f"{tier / g(busy, f'{best}: {op}'):.2f}x LMCache's fastest there ({best}); "
                f"CacheEngine raw {engine:.2f} GB/s, "
                f"{engine / g(busy, f'{LMCACHE[0]}: {op}'):.2f}x {LMCACHE[0]}; idle, the tier "
                f"{tier / g(section, f'RedisTier raw: {op}'):.2f}x of its own figure above.")
    return lines


def targets(res: Results, sizes: Any, codecs: Sequence[str]) -> list[str]:
    g = res.get
    main = side_section(*sizes.sets[0])

    def side(name: str, op: str) -> float:
        return g(main, f"{name}: {op}")

    lines = []
    for shape, count in sizes.sets:
        lines += lmcache_targets(res, side_section(shape, count))
    sock_set, sock_get = side("plain socket", "store"), side("plain socket", "retrieve")
    for codec in codecs:
        store, get = side(f"engine {codec}", "store"), side(f"engine {codec}", "retrieve")
        tput, tget = side(f"RedisTier {codec}", "store"), side(f"RedisTier {codec}", "retrieve")
        lines.append(
            f"- {main}, `{codec}`: engine store {store / sock_set:.2f}x and retrieve "
            f"{get / sock_get:.2f}x the plain socket (RedisTier alone: put {tput / sock_set:.2f}x,"
            f" get {tget / sock_get:.2f}x); target >= 0.8x: store "
            f"{_verdict(store >= 0.8 * sock_set)}, retrieve {_verdict(get >= 0.8 * sock_get)}."
        )
    for codec in codecs:
        r = g(f"engine {codec}", "store return / synchronous store")
        copy = g(f"engine {codec}", "KV copy out of the cache alone")
        back = g(f"engine {codec}", "store returns (write-behind)")
        lines.append(f"- `{codec}`: `store` returns in {r * 100:.1f}% of the synchronous store's "
                     f"time ({back:.0f} ms, of which the KV copy alone takes {copy:.0f} ms); "
                     f"target < 10%: {_verdict(r < 0.1)}.")
    n = sizes.lookup_chunks
    hit = g("lookup", f"lookup {n} chunks, all hit")
    miss = g("lookup", f"lookup {n} chunks, all miss")
    lines.append(f"- lookup of {n} chunks (one round trip): {hit:.2f} ms all hit, {miss:.2f} ms "
                 f"all miss; target < 5 ms: {_verdict(max(hit, miss) < 5)}.")
    tokens = n * 256
    h = g("lookup", f"hash {tokens} tokens (tensor)")
    h_list = g("lookup", f"hash {tokens} tokens (list of ints)")
    lines.append(f"- hashing {tokens} tokens: {h:.2f} ms from a tensor, {h_list:.2f} ms from a "
                 f"Python list (as vLLM passes them); target < 5 ms: "
                 f"{_verdict(max(h, h_list) < 5)}.")
    for row in res.rows:
        if row.section == "memory" and row.name.startswith("Redis allocation"):
            lines.append(f"- {row.name}: Redis allocates {row.value:.3f} bytes per raw KV byte "
                         f"(keys included; {row.note}).")
        elif row.section == "memory":
            bound = (sizes.rss_local_mib + sizes.rss_queue_mib)
            lines.append(
                f"- {row.name}: +{row.value:.0f} MiB against local tier + queue = {bound} MiB "
                f"(+ {CONSTANT_MIB} MiB constant): {_verdict(row.value <= bound + CONSTANT_MIB)}."
            )
    raw_get = side("engine raw", "retrieve")
    raw_store = side("engine raw", "store")
    best, best_mem = "raw", g("engine raw", "Redis memory / raw KV")
    for codec in codecs:
        mem = g(f"engine {codec}", "Redis memory / raw KV")
        speed = min(side(f"engine {codec}", "retrieve") / raw_get,
                    side(f"engine {codec}", "store") / raw_store)
        lines.append(f"- `{codec}`: Redis holds {mem:.3f} bytes per raw KV byte; end-to-end "
                     f"speed {speed:.2f}x raw's (the lower of store and retrieve).")
        if speed >= 0.7 and mem < best_mem:
            best, best_mem = codec, mem
    lines.append(f"- the codec that saves the most Redis memory at >= 0.7x raw's end-to-end "
                 f"speed on this run: `{best}`.")
    return lines


def _table(res: Results, sections: Sequence[str]) -> list[str]:
    out = ["| section | row | value | unit | note |", "|---|---|---:|---|---|"]
    for row in res.rows:
        if row.section in sections:
            out.append(f"| {row.section} | {row.name} | {row.cell()} | {row.unit} | {row.note} |")
    return out


def _peer_paragraph(measured: bool) -> str:
    """What the run did with the real LMCache."""
    if not measured:
        return ("The real LMCache was left out of this run (`--no-lmcache`): no LMCache row "
                "below was measured. Its side environment is the benchmark's own set-up, "
                "`bash scripts/lmcache_env.sh`, which a run with the peer calls.")
    return ("The real LMCache (`lmcache==0.5.6`, its `RemoteBackend` with `remote_serde: naive` "
            "over a `LocalCPUBackend` on a `HostMemoryAllocator`) runs in the same run, on the "
            "same redis-server and the same bf16 bytes, one subprocess per variant "
            "(`benchmarks/lmcache_peer.py`): `redis://` as `pip install lmcache` leaves it "
            "(redis-py without hiredis), the same with hiredis on its path, and `resp://` (its "
            "C++ RESP client, `save_chunk_meta: False`). Its environment lives outside the "
            "checkout and is built once by `scripts/lmcache_env.sh` (torch==2.14.1 from local "
            "disk first, then lmcache from PyPI; hiredis in a folder of its own), the "
            "benchmark's own set-up, which the run calls; `--no-lmcache` leaves these rows out.")


def render(res: Results, sizes: Any, command: str, machine: dict[str, str], elapsed: float,
           codecs: Sequence[str]) -> str:
    shape, count = sizes.sets[0]
    others = ", ".join(f"{n} chunks of {s.chunk_bytes / 2**20:g} MiB ({s.name})"
                       for s, n in sizes.sets[1:])
    sections = list(dict.fromkeys(r.section for r in res.rows if r.section != "codecs"))
    codec_rows = [r for r in res.rows if r.section == "codecs"]
    lines = [
        "# Benchmarks",
        "",
        "Produced by one run of",
        "",
        "```",
        command,
        "```",
        "",
        f"in {elapsed:.0f} s, against a private `redis-server` the run started (no persistence). "
        f"Throughput rows move the same {count} chunks of {shape.name} KV "
        f"({shape.layers} layers, {shape.kv_heads} KV heads, head {shape.head}, "
        f"{str(shape.dtype)[6:]}: {shape.chunk_bytes / 2**20:.2f} MiB per 256-token chunk, "
        f"{count * shape.chunk_bytes / 2**20:.0f} MiB in all; normal data, std 1)"
        + (f", and a second side-by-side set of {others}. " if others else ". ") +
        f"Each figure is the median of {sizes.reps} repetitions after one warm-up; GB/s are "
        "10^9 bytes of raw KV per second. Ratios compare figures of this run only. The run "
        "also saved its figures (`--save docs/benchmarks.json`); `--render` rewrites this page "
        "from them without running anything.",
        "",
        _peer_paragraph("lmcache" in machine)
        + " The last set is run a second time beside a busy Python thread (`beside a busy "
        "Python thread` rows): " + ", ".join(BUSY_FIELD)
        + ", each with one thread spinning in its own process (`benchmarks/spinner.py`) and "
        "none elsewhere.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in machine.items()],
        "- shared with other work while it ran: absolute figures are noisy, ratios less so.",
        "",
        "## Targets on this run",
        "",
        *targets(res, sizes, codecs),
        "",
        "## Results",
        "",
        *_table(res, sections),
        "",
        "## Codecs per dtype and data",
        "",
        "Ratio = raw bytes / stored bytes (headers included). Encode and decode on all cores, "
        "one chunk cut into parts of the default part size.",
        "",
        "| data | codec | ratio | speed |",
        "|---|---|---:|---|",
        *[f"| {r.name.split(' | ')[0]} | {r.name.split(' | ')[1]} | {r.value:.3f} | {r.note} |"
          for r in codec_rows],
        "",
    ]
    reading = Path(__file__).with_name("reading.md")
    if reading.exists():
        lines += ["## Reading", "", reading.read_text().strip(), ""]
    return "\n".join(lines)
