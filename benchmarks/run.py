"""The benchmark suite: one command, one private redis-server, the same data for every row.

    .venv/bin/python -m benchmarks.run            # full run, writes docs/benchmarks.md
    .venv/bin/python -m benchmarks.run --quick    # smaller sizes, fewer repetitions
    .venv/bin/python -m benchmarks.run --tiny --out /tmp/b.md   # seconds; what the smoke test runs

Every figure is a median of several repetitions; every ratio is computed from figures of the
same run (the machine is shared and noisy: absolute figures do not compare across runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import codec_rows, contenders, engine_rows, limits, lmcache_rows, report
from benchmarks.data import (
    CHUNK,
    LLAMA8B,
    MIB1,
    TINY,
    Shape,
    chunk_tensor,
    empty_dense,
    model_kv,
    normal_dense,
    paged_like,
)
from benchmarks.report import BUSY_FIELD, busy_section, cpu_section, side_section
from benchmarks.server import LocalRedis
from benchmarks.timing import Results, Row
from lmcache_remote import DenseKV, KVView
from lmcache_remote.values.serde import DEFAULT_PART_SIZE

CODECS = ("raw", "lz4", "lz4-planes", "zstd-planes", "blosc2-lz4", "blosc2-zstd")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each part of the run is."""

    name: str
    sets: tuple[tuple[Shape, int], ...]  # (chunk shape, chunks) per side-by-side duel
    reps: int
    codec_mib: int
    rss_total_mib: int
    rss_local_mib: int
    rss_queue_mib: int
    rss_shape: str
    ttft_prefix: int
    lookup_chunks: int
    model_tokens: int


MODES = {
    "full": Sizes("full", ((LLAMA8B, 16), (MIB1, 256)), 5, 16, 2048, 512, 256, "llama", 4096,
                  512, 2048),
    "quick": Sizes("quick", ((LLAMA8B, 4), (MIB1, 64)), 3, 8, 512, 128, 64, "llama", 4096, 512,
                   1024),
    "tiny": Sizes("tiny", ((TINY, 4), (TINY, 16)), 1, 1, 16, 8, 4, "tiny", 256, 16, 256),
}


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run(sizes: Sizes, out: Path | None, command: str, save: Path | None = None,
        with_lmcache: bool = True) -> Results:
    res = Results()
    shape, count = sizes.sets[0]
    num_tokens = count * CHUNK
    dense = normal_dense(shape, num_tokens)
    chunks = [chunk_tensor(dense, shape, i) for i in range(count)]
    nbytes = count * shape.chunk_bytes
    reps = sizes.reps
    started = time.time()
    env = lmcache_rows.SideEnv() if with_lmcache else None
    with LocalRedis() as server:
        print(f"redis-server {server.version()} on port {server.port}; "
              f"{'; '.join(side_section(s, n) for s, n in sizes.sets)}", flush=True)
        _limits(res, server, chunks, nbytes, reps)
        for i, (set_shape, set_count) in enumerate(sizes.sets):
            _side_by_side(res, server, set_shape, set_count, reps, env,
                          CODECS if i == 0 else ("raw",), busy=i == len(sizes.sets) - 1)
        # The engine rows copy out of (and into) vLLM's paged layout, as the product does.
        kv = paged_like(dense, shape, num_tokens, seed=11)
        dest = paged_like(empty_dense(shape, num_tokens), shape, num_tokens, seed=12)
        for codec in CODECS:
            _engine(res, server, shape, (kv, dest, dense), chunks, count, codec, reps)
        _codecs(res, sizes)
        for name, (planned, uniform) in engine_rows.allocation_rows(server, sizes.codec_mib * 4
                                                                   ).items():
            res.add("memory", f"Redis allocation / raw KV, {name}", planned, "ratio",
                    f"uniform {DEFAULT_PART_SIZE} B parts: {uniform:.3f}")
        lk = engine_rows.lookup_rows(server, TINY, reps, sizes.lookup_chunks * CHUNK)
        res.add("lookup", f"lookup {sizes.lookup_chunks} chunks, all hit", lk["hit"] * 1e3, "ms")
        res.add("lookup", f"lookup {sizes.lookup_chunks} chunks, all miss", lk["miss"] * 1e3, "ms")
        hs = engine_rows.hashing_rows(reps, sizes.lookup_chunks * CHUNK)
        n = sizes.lookup_chunks * CHUNK
        res.add("lookup", f"hash {n} tokens (tensor)", hs["tensor"] * 1e3, "ms")
        res.add("lookup", f"hash {n} tokens (list of ints)", hs["list"] * 1e3, "ms")
        _rss(res, server, sizes)
        _ttft(res, server, sizes)
    elapsed = time.time() - started
    print(f"done in {elapsed:.0f} s", flush=True)
    info = machine()
    if env is not None:
        info["lmcache"] = f"{lmcache_rows.VERSION} ({env.python})"
    if save is not None:
        save.write_text(json.dumps({
            "mode": sizes.name, "command": command, "machine": info, "elapsed": elapsed,
            "rows": [dataclasses.asdict(r) for r in res.rows],
        }, indent=1))
    if out is not None:
        out.write_text(report.render(res, sizes, command, info, elapsed, CODECS))
        print(f"wrote {out}")
    return res


def rerender(saved: Path, out: Path) -> None:
    """Writes the report again from a run saved with ``--save`` (same figures, new prose)."""
    data = json.loads(saved.read_text())
    res = Results(echo=False)
    res.rows = [Row(**r) for r in data["rows"]]
    codecs = tuple(c for c in CODECS if any(r.name == f"engine {c}: store" for r in res.rows))
    out.write_text(report.render(res, MODES[data["mode"]], data["command"], data["machine"],
                                 data["elapsed"], codecs))
    print(f"wrote {out} from {saved}")


def _limits(res: Results, server: LocalRedis, chunks: list[torch.Tensor], nbytes: int,
            reps: int) -> None:
    part = min(DEFAULT_PART_SIZE, chunks[0].nbytes)
    reused, fresh = limits.memcpy(chunks[0], reps * 2)
    res.add("limits", "memcpy into a reused buffer", gbps(chunks[0].nbytes, reused), "GB/s")
    res.add("limits", "memcpy into a fresh buffer", gbps(chunks[0].nbytes, fresh), "GB/s")
    rb = limits.redis_benchmark(server.port, part, nbytes, pipeline=8)
    for op in ("SET", "GET"):
        if op in rb:
            res.add("limits", f"redis-benchmark {op}", rb[op], "GB/s",
                    f"-d {part} -P 8 -c 1, one key (its value stays in the CPU cache)")
    server.clear()


def _side_by_side(res: Results, server: LocalRedis, shape: Shape, count: int, reps: int,
                  env: lmcache_rows.SideEnv | None, codecs: Sequence[str],
                  busy: bool = False, full: bool = False) -> None:
    """One duel over ``count`` chunks of ``shape``: the plain socket, the real LMCache (when
    ``env``), the tier and the engine per codec; then Redis's bytes per KV byte for the tier
    and each LMCache variant (`MEMORY USAGE` of every key a put wrote). With ``busy``, a
    second duel of LMCache's ``redis://`` and ``resp://``, the tier and the engine (raw), each
    with a spinning Python thread in its own process (`busy_section`). With ``full`` every put
    starts on a server full of the contender's own values under `maxmemory`
    (`LocalRedis.fill_with`: writes evict and reuse memory, as in production), else on an
    empty one that handed its pages back (`LocalRedis.settle`: every write page-faults)."""
    num_tokens = count * CHUNK
    dense = normal_dense(shape, num_tokens)
    chunks = [chunk_tensor(dense, shape, i) for i in range(count)]
    kv = paged_like(dense, shape, num_tokens, seed=11)
    dest = paged_like(empty_dense(shape, num_tokens), shape, num_tokens, seed=12)
    nbytes = count * shape.chunk_bytes
    part = min(DEFAULT_PART_SIZE, chunks[0].nbytes)
    source = engine_rows.TierSource(shape, chunks)
    data = lmcache_rows.DataFile(chunks) if env is not None else None
    field = [contenders.plain_socket(server, chunks, part)]
    if len(codecs) > 1:
        field.append(contenders.redis_py_whole(server, chunks))
    if env is not None and data is not None:
        field += lmcache_rows.contenders(env, server, data, shape, count)
    field += [contenders.tier(server, source, codec) for codec in codecs]
    field += [contenders.engine(server, shape, kv, dest, num_tokens, codec) for codec in codecs]
    notes = {
        "plain socket": f"values of {part} B, pipelined, into reused buffers: the limit",
        "redis-py whole chunks": "one SET / GET per chunk",
        "LMCache redis://": f"lmcache=={lmcache_rows.VERSION} RemoteBackend, remote_serde "
                            "naive, redis-py without hiredis (as pip leaves it)",
        "LMCache redis:// + hiredis": "the same with hiredis installed",
        "LMCache resp://": "its C++ RESP client (8 threads), save_chunk_meta False",
    }
    sec = side_section(shape, count)
    memory_of = [c for c in field if c.name.startswith("LMCache") or c.name == "RedisTier raw"]
    busy_field = [c for c in field if c.name in BUSY_FIELD]
    keep = busy_field + [c for c in memory_of if c not in busy_field] if busy else memory_of
    try:
        cpu: dict[str, contenders.CpuShare] = {}
        result = contenders.duel(field, reps, server.settle, keep_open=keep,
                                 server_pid=server.pid, cpu=cpu,
                                 full=server if full else None)
        for name, (t_put, t_get) in result.items():
            if name.startswith("engine"):
                put_note, get_note = ("synchronous store, copy out of vLLM's paged layout "
                                      "included", "Redis hit, local tier off, copy into vLLM's "
                                      "paged layout included")
            elif name.startswith("RedisTier"):
                put_note, get_note = "encode + send", "receive + check + decode"
            else:
                put_note = get_note = notes[name]
            res.add(sec, f"{name}: store", gbps(nbytes, t_put), "GB/s", put_note)
            res.add(sec, f"{name}: retrieve", gbps(nbytes, t_get), "GB/s", get_note)
        csec = cpu_section(shape, count)
        for name, share in cpu.items():
            for op, mine, theirs in (("store", share.put_client, share.put_server),
                                     ("retrieve", share.get_client, share.get_server)):
                res.add(csec, f"{name}: {op}, redis-server", theirs / nbytes * 1e9, "CPU s/GB",
                        "the server's user + system time (10 ms ticks)")
                res.add(csec, f"{name}: {op}, its own process", mine / nbytes * 1e9,
                        "CPU s/GB", "every thread of the contender's process")
        for c in memory_of:
            res.add(sec, f"{c.name}: Redis memory / KV byte",
                    contenders.redis_bytes(server, c, nbytes), "ratio",
                    "MEMORY USAGE of every key written, keys included")
        if busy:
            result = contenders.duel(busy_field, reps, server.settle, keep_open=busy_field,
                                     busy=True, full=server if full else None)
            for name, (t_put, t_get) in result.items():
                note = "a spinning Python thread in its own process"
                res.add(busy_section(shape, count), f"{name}: store", gbps(nbytes, t_put),
                        "GB/s", note)
                res.add(busy_section(shape, count), f"{name}: retrieve", gbps(nbytes, t_get),
                        "GB/s", note)
    finally:
        for c in keep:
            c.close()
        source.release()
        if data is not None:
            data.remove()


def _engine(res: Results, server: LocalRedis, shape: Shape,
            views: tuple[KVView, KVView, DenseKV], chunks: list[torch.Tensor], count: int,
            codec: str, reps: int) -> None:
    num_tokens = count * CHUNK
    nbytes = count * shape.chunk_bytes
    e = engine_rows.write_behind_rows(server, shape, *views, num_tokens, codec, reps)
    sync = nbytes / res.get(side_section(shape, count), f"engine {codec}: store") / 1e9
    sec = f"engine {codec}"
    res.add(sec, "KV copy out of the cache alone", e["gather"] * 1e3, "ms",
            "gather into reused chunk buffers, vLLM's paged layout (blocks of 16)")
    res.add(sec, "KV copy out of a Hugging Face cache", e["gather_dense"] * 1e3, "ms",
            "the same KV as `[heads, T, head]` per layer: a transposing copy")
    res.add(sec, "store returns (write-behind)", e["store_async_return"] * 1e3, "ms")
    res.add(sec, "store return / synchronous store", e["store_async_return"] / sync, "ratio")
    res.add(sec, "store until in Redis (write-behind)", gbps(nbytes, e["store_async_landed"]),
            "GB/s")
    res.add(sec, "retrieve, local-tier hit", gbps(nbytes, e["retrieve_local"]), "GB/s")
    res.add(sec, "Redis memory / raw KV", engine_rows.redis_memory(server, shape, chunks, codec),
            "ratio", "used_memory growth per KV byte")


def _codecs(res: Results, sizes: Sizes) -> None:
    nbytes = sizes.codec_mib * 2**20
    cases: list[tuple[str, torch.Tensor]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        name = str(dtype)[6:]
        for scale in (0.05, 1.0, 20.0):
            data = codec_rows.synthetic(dtype, scale, nbytes)
            cases.append((f"{name} normal std {scale:g}", data))
        cases.append((f"{name} tiny-model KV", model_kv(sizes.model_tokens, dtype)))
    for label, tensor in cases:
        for codec in CODECS:
            r = codec_rows.codec_case(codec, tensor, max(1, sizes.reps // 2 + 1))
            res.add("codecs", f"{label} | {codec}", r["ratio"], "ratio",
                    f"encode {r['encode']:.2f} GB/s, decode {r['decode']:.2f} GB/s")


def _rss(res: Results, server: LocalRedis, sizes: Sizes) -> None:
    for codec in ("raw", "lz4"):
        cmd = [sys.executable, "-m", "benchmarks.rss", server.url, str(sizes.rss_total_mib),
               str(sizes.rss_local_mib), str(sizes.rss_queue_mib), codec, sizes.rss_shape]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600,
                             cwd=Path(__file__).resolve().parent.parent)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        bound = r["local_bytes"] + r["queue_bytes"]
        res.add("memory", f"peak RSS rise storing {sizes.rss_total_mib} MiB ({codec})",
                r["rise"] / 2**20, "MiB",
                f"local {sizes.rss_local_mib} MiB + queue {sizes.rss_queue_mib} MiB = "
                f"{bound / 2**20:.0f} MiB; {r['dropped']} chunks dropped (queue full)")
        server.clear()


def _ttft(res: Results, server: LocalRedis, sizes: Sizes) -> None:
    from benchmarks.ttft import ttft_rows

    t = ttft_rows(server.url, sizes.ttft_prefix, max(3, 2 * sizes.reps - 1))
    for name, label in (("recompute", "recompute"), ("local_hit", "local-tier hit"),
                        ("redis_hit", "Redis hit")):
        res.add("ttft", f"TTFT {sizes.ttft_prefix}-token prefix, {label}", t[name] * 1e3, "ms")
    server.clear()


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import redis

    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores visible", "memory": f"{mem:.0f} GiB",
        "os": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "redis-py": redis.__version__,
        "redis-server": server.split()[2] if server else "?",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    mode.add_argument("--tiny", action="store_true", help="seconds; for the smoke test")
    parser.add_argument("--out", type=Path, default=None,
                        help="markdown report (default: docs/benchmarks.md for a full run, "
                             "none otherwise)")
    parser.add_argument("--save", type=Path, default=None,
                        help="also keep the figures as JSON (for --render)")
    parser.add_argument("--no-lmcache", action="store_true",
                        help="leave out the real LMCache rows (no side environment needed)")
    parser.add_argument("--render", type=Path, default=None, metavar="SAVED_JSON",
                        help="run nothing: write the report from a run saved with --save")
    args = parser.parse_args(argv)
    if args.render is not None:
        rerender(args.render, args.out or Path("docs/benchmarks.md"))
        return
    name = "tiny" if args.tiny else "quick" if args.quick else "full"
    out = args.out
    if out is None and name == "full":
        out = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    command = ".venv/bin/python -m benchmarks.run" + (f" --{name}" if name != "full" else "")
    torch.set_num_threads(os.cpu_count() or 1)
    run(MODES[name], out, command, args.save, with_lmcache=not args.no_lmcache)


if __name__ == "__main__":
    main()
