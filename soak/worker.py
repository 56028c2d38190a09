"""One soak engine process: `python -m soak.worker SPEC_JSON` (started by `soak.controller`).

Protocol, one JSON document per line:

- stdout `{"type": "ready", "pid", "baseline_rss"}` after the imports and a warm-up request
  (its own cache salt, so it shares nothing with the run); `baseline_rss` is VmRSS then, less
  the bytes the memory pool holds (those are the budget's, not the baseline's).
- stdin `go T0 END` (wall-clock seconds): run requests until END; window k covers
  T0 + k * window .. T0 + (k + 1) * window. stdout `{"type": "window", ...}` at the end of each
  window, then `{"type": "done", ...}` with the flush's time and the final counters.
- stdin `stop`, stdin closed (the controller is gone), SIGTERM or SIGINT: stop after the
  current request, flush, close the engine and exit 0. The process also asks the kernel for
  SIGTERM when its parent dies (PR_SET_PDEATHSIG), so it never outlives the controller.

Each request follows vLLM's flow: `lookup(tokens)`; `retrieve(tokens[:hit])` into a paged
cache whose slots hold a sentinel; every retrieved token is compared bit for bit with
`expected_kv`, every other slot must still hold the sentinel; then "prefill" writes the rest
and (read-write roles) `store(tokens, kv, mask)` with the retrieved prefix masked off.

Each window also counts, by the Zipf rank of the request's first document (`GROUPS`), that
document's whole chunks and how many of them retrieve delivered (`POPULARITY_FIELDS`). With
`restart_every` the engine closes its `CacheEngine` and opens a fresh one (an empty local
tier) every so many seconds from T0 + `restart_phase`, between two requests.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_EXC_LOG_LIMIT = 5

# Counters of engine.stats() reported per window (deltas) and gauges (values at the end).
COUNTERS = (
    "local.hit_tokens", "remote.hit_tokens", "local.lookup_hit_tokens",
    "remote.lookup_hit_tokens", "local.evicted_chunks", "remote.pool_full", "remote.errors",
    "remote.dropped_chunks", "remote.written_chunks", "remote.corrupt_chunks",
    "remote.incomplete_chunks", "remote.miss_chunks", "engine.store_out_of_memory_chunks",
    "engine.promise_broken_tokens", "engine.lookup_capped_tokens", "memory.no_room_chunks",
    "remote.duplicate_writes_skipped", "remote.touched_keys", "remote.unauthenticated_chunks",
)
#: The popularity report (per window, per group of the first document's Zipf rank): requests,
#: the whole chunks of the first document (`chunks`) and how many of them retrieve delivered
#: (`hit_chunks`); `first_*` the same for requests whose first document this engine sees for
#: the first time since it (re)started, whose chunks its local tier cannot hold: only Redis
#: can serve them.
GROUPS = ("top", "rest")
POPULARITY_FIELDS = ("requests", "chunks", "hit_chunks", "first_requests", "first_chunks",
                     "first_hit_chunks")
GAUGES = ("local.entries", "local.bytes", "pool.used_bytes", "pool.held_bytes",
          "remote.queued_bytes", "remote.healthy")


def _flatten(stats: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for scope, values in stats.items():
        if isinstance(values, dict):
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    out[f"{scope}.{name}"] = float(value)
    return out


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _CountingHandler(logging.Handler):
    """Counts the library's WARNING-and-above records per window (and lets them print)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


class Window:
    """What one engine saw in one time window."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.requests = 0
        self.prompt_tokens = 0
        self.lookup_tokens = 0
        self.retrieved_tokens = 0
        self.short_retrieves = 0
        self.wrong_tokens = 0
        self.stray_tokens = 0
        self.bad_masks = 0
        self.exceptions = 0
        self.stored_tokens = 0
        self.warnings = 0
        self.restarts = 0
        self.slowest: dict[str, float] = {"lookup": 0.0, "retrieve": 0.0, "store": 0.0}
        self.popularity = {group: dict.fromkeys(POPULARITY_FIELDS, 0) for group in GROUPS}

    def doc(self, counters: dict[str, float], gauges: dict[str, float]) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items()}
        out.update(type="window", counters=counters, gauges=gauges,
                   rss=rss_bytes(), hwm=rss_bytes("VmHWM"))
        return out


class Worker:
    """The request loop of one engine; see the module doc."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch

        from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata
        from soak.workload import Corpus, Geometry, PagedCache, PromptStream

        self.spec = spec
        self.role: str = spec["role"]
        geo = dict(spec["geometry"])
        geo["dtype"] = getattr(torch, geo["dtype"])
        self.geometry = Geometry(**geo)
        self.corpus = Corpus(self.geometry, seed=spec["corpus_seed"])
        self.prompts = PromptStream(self.corpus, seed=spec["seed"])
        max_tokens = len(self.corpus.system) + 48 + sum(
            sorted((len(d) for d in self.corpus.docs), reverse=True)[:6])
        self.cache = PagedCache(self.geometry, max_tokens, seed=spec["seed"] + 1)
        g = self.geometry
        meta = EngineMetadata("soak/tiny", 1, 0, g.dtype, g.num_layers, g.num_kv_heads,
                              g.head_size)
        self._open: Callable[[], CacheEngine] = lambda: CacheEngine(
            CacheConfig(**spec["config"]), meta)
        self.engine = self._open()
        self.top_docs = int(spec.get("top_docs", 5))
        self.seen: set[int] = set()  # first documents seen since the engine (re)started
        self.restart_every: float | None = spec.get("restart_every")
        self.restart_phase = float(spec.get("restart_phase", 0.0))
        self.stop = threading.Event()
        self.window = Window(0)
        self._last = _flatten(self.engine.metrics.snapshot())
        self._carry: dict[str, float] = {}  # counter deltas of engines closed in this window
        self.exception_log: list[str] = []
        self.warnings = _CountingHandler()
        logging.basicConfig(level=logging.WARNING,
                            format=f"[soak {spec['name']}] %(levelname)s %(name)s: %(message)s")
        logging.getLogger("lmcache_remote").addHandler(self.warnings)

    # -- one request ---------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T]) -> tuple[T | None, bool]:
        start = time.perf_counter()
        try:
            return fn(), True
        except Exception:
            self.window.exceptions += 1
            if len(self.exception_log) < _EXC_LOG_LIMIT:
                text = traceback.format_exc()
                self.exception_log.append(text)
                sys.stderr.write(f"[soak {self.spec['name']}] {what} raised:\n{text}")
            return None, False
        finally:
            took = time.perf_counter() - start
            self.window.slowest[what] = max(self.window.slowest[what], took)

    def request(self, salt: str | None = None) -> None:
        import torch

        from soak.workload import count_wrong, expected_kv

        tokens, docs = self.prompts.draw()
        n = len(tokens)
        want = expected_kv(tokens, self.geometry)
        kv = self.cache.begin(n)
        w = self.window
        w.requests += 1
        w.prompt_tokens += n
        hit, ok = self._call("lookup", lambda: self.engine.lookup(tokens, cache_salt=salt))
        hit = int(hit or 0) if ok else 0
        got = 0
        if hit:
            mask, ok = self._call(
                "retrieve", lambda: self.engine.retrieve(tokens[:hit], kv, cache_salt=salt))
            if ok and mask is not None:
                got = int(mask.sum())
                if not bool(mask[:got].all()):
                    w.bad_masks += 1
        w.lookup_tokens += hit
        w.retrieved_tokens += min(got, hit)
        w.short_retrieves += int(got < hit)
        wrong, stray = count_wrong(self.cache.read(), want, got)
        w.wrong_tokens += wrong
        w.stray_tokens += stray
        if salt is None:
            self._count_popularity(docs[0], min(got, hit))
        self.cache.write(got, want[:, :, got:])  # prefill of the tokens not loaded
        if self.role == "ro":
            return
        mask_t = None
        if got:
            mask_t = torch.ones(n, dtype=torch.bool)
            mask_t[:got] = False
        stored, ok = self._call(
            "store", lambda: self.engine.store(tokens, kv, mask_t, cache_salt=salt))
        w.stored_tokens += int(stored or 0)

    def _count_popularity(self, doc: int, got: int) -> None:
        """The first document's whole chunks and how many of them were retrieved (it starts
        right after the system prompt, on a chunk boundary)."""
        c = self.geometry.chunk_size
        start = len(self.corpus.system) // c
        chunks = len(self.corpus.docs[doc]) // c
        hit = min(max(got // c - start, 0), chunks)
        row = self.window.popularity["top" if doc < self.top_docs else "rest"]
        row["requests"] += 1
        row["chunks"] += chunks
        row["hit_chunks"] += hit
        if doc not in self.seen:
            self.seen.add(doc)
            row["first_requests"] += 1
            row["first_chunks"] += chunks
            row["first_hit_chunks"] += hit

    def restart(self) -> None:
        """Close the engine and open a fresh one (an empty local tier), as an engine restarting
        or a new one joining; its counters carry on into the window's deltas."""
        now = self._counters()
        for k, v in now.items():
            self._carry[k] = self._carry.get(k, 0.0) + v - self._last.get(k, 0.0)
        self.engine.close()
        self.engine = self._open()
        self._last = self._counters()
        self.seen.clear()
        self.window.restarts += 1

    def _counters(self) -> dict[str, float]:
        now = _flatten(self.engine.metrics.snapshot())
        now["pool.failed_allocations"] = float(self.engine.storage.pool.failed_allocations)
        return now

    def warm_up(self) -> dict[str, Any]:
        """Two requests under a salt of their own (imports, threads, connections, the first
        buffers), then every counter starts afresh; returns the `ready` document."""
        for _ in range(2):
            self.request(salt=f"soak-warm-up-{self.spec['name']}")
        self.engine.flush()
        self.window = Window(0)
        self.warnings.count = 0
        self.seen.clear()
        pool = self.engine.storage.pool
        self._last = self._counters()
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now: the peak is measured from here on
        return {"type": "ready", "pid": os.getpid(), "baseline_rss": rss_bytes() - pool.held_bytes,
                "warm_up_exceptions": self.exception_log}

    # -- windows -------------------------------------------------------------------------

    def close_window(self) -> None:
        flat = _flatten(self.engine.stats())
        gauges = {k: flat.get(k, 0.0) for k in GAUGES}
        now = self._counters()
        deltas = {k: self._carry.get(k, 0.0) + now.get(k, 0.0) - self._last.get(k, 0.0)
                  for k in (*COUNTERS, "pool.failed_allocations")}
        self._last, self._carry = now, {}
        self.window.warnings, self.warnings.count = self.warnings.count, 0
        emit(self.window.doc(deltas, gauges))
        self.window = Window(self.window.index + 1)

    def run(self, t0: float, end: float, window: float, rate: float) -> None:
        gap = 1.0 / rate
        next_start = time.time()
        every = self.restart_every
        next_restart = t0 + self.restart_phase if every else float("inf")
        while not self.stop.is_set() and time.time() < end:
            if every and time.time() >= next_restart:
                self.restart()
                next_restart += every
            self.request()
            while time.time() >= t0 + (self.window.index + 1) * window:
                self.close_window()
            next_start = max(next_start + gap, time.time() - gap)
            self.stop.wait(max(0.0, min(next_start, end) - time.time()))
        start = time.perf_counter()
        flushed = self.engine.flush()
        flush_seconds = time.perf_counter() - start
        self.close_window()
        emit({"type": "done", "flush_seconds": flush_seconds, "flushed": flushed,
              "stats": self.engine.stats(), "exception_log": self.exception_log,
              "hwm": rss_bytes("VmHWM")})


def _read_commands(worker: Worker, go: list[tuple[float, float]], started: threading.Event
                   ) -> None:
    for line in sys.stdin:
        parts = line.split()
        if parts and parts[0] == "go":
            go.append((float(parts[1]), float(parts[2])))
            started.set()
        elif parts and parts[0] == "stop":
            break
    worker.stop.set()
    started.set()


def main(argv: list[str]) -> int:
    _die_with_parent()
    spec = json.loads(argv[0])
    stop_early = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop_early.set()
        if worker_box:
            worker_box[0].stop.set()

    worker_box: list[Worker] = []
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker = Worker(spec)
    worker_box.append(worker)
    try:
        emit(worker.warm_up())
        go: list[tuple[float, float]] = []
        started = threading.Event()
        threading.Thread(target=_read_commands, args=(worker, go, started), daemon=True).start()
        started.wait()
        if go and not stop_early.is_set():
            t0, end = go[0]
            worker.run(t0, end, float(spec["window"]), float(spec["rate"]))
    finally:
        worker.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
