"""The soak's controller: start everything, run the windows, stop everything.

`run_soak(settings)` starts a private `redis-server` (a free loopback port, `--maxmemory`,
`allkeys-lru`, `--save "" --appendonly no`, DEBUG allowed from loopback), one
`python -m soak.worker` process per engine role, waits until every engine is warm, gives them
a common T0 and end time, injects faults on schedule (`soak.faults`, modes `faults` and
`both`), samples Redis' INFO once per window, and collects every engine's window reports. It
returns a `SoakResult` (judged by `soak.report`).

Everything it starts it stops, on success, on failure and on KeyboardInterrupt (Ctrl-C,
or SIGTERM, which it turns into one; the signal is also recorded, and the waits check the
record twice a second, so an interrupt that lands where Python drops exceptions, a `__del__`
run by the garbage collector, still stops the run): the engines are told to stop (stdin
closed), then SIGTERM, then SIGKILL; the server is stopped the same way. The engines also
die with the controller (PR_SET_PDEATHSIG) should it be killed with SIGKILL itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import redis

from lmcache_remote.admin.private_server import RedisServer
from soak.faults import FREE_RATE, FaultInjector
from soak.settings import MIB, SoakSettings
from tests.throttle import Throttle

ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 300.0  # imports + warm-up of every engine on a loaded 2-core machine
STOP_GRACE = 10.0


@dataclasses.dataclass
class EngineRun:
    name: str
    role: str
    proc: subprocess.Popen[bytes]
    ready: dict[str, Any] | None = None
    windows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    done: dict[str, Any] | None = None
    returncode: int | None = None


@dataclasses.dataclass
class SoakResult:
    settings: SoakSettings
    engines: list[EngineRun]
    redis_windows: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    redis_pid: int | None
    interrupted: bool = False
    error: str | None = None


def _engine_spec(settings: SoakSettings, name: str, role: str, index: int, url: str,
                 prefix: str) -> dict[str, Any]:
    return {
        "name": name, "role": role, "seed": settings.seed * 1000 + index,
        "corpus_seed": settings.seed, "window": settings.window, "rate": settings.rate,
        "top_docs": settings.top_docs, "restart_every": _restart_every(settings, role),
        "restart_phase": _restart_phase(settings, index),
        "geometry": {"num_layers": 2, "num_kv_heads": 2, "head_size": 64, "chunk_size": 64,
                     "block_size": 16, "dtype": "bfloat16"},
        "config": settings.engine_config(role, url, prefix),
    }


def _restart_every(settings: SoakSettings, role: str) -> float | None:
    """An engine without a local tier has nothing that a restart would empty."""
    return settings.restart_every if role != "nolocal" else None


def _restart_phase(settings: SoakSettings, index: int) -> float:
    """Seconds after T0 of the engine's first restart: the engines with a local tier take
    turns, evenly spread over `restart_every`."""
    if settings.restart_every is None:
        return 0.0
    local = [i for i, r in enumerate(settings.engines) if r != "nolocal"]
    turn = local.index(index) if index in local else 0
    return settings.restart_every * (turn + 1) / len(local)


def _reader(run: EngineRun, out: queue.Queue[tuple[EngineRun, dict[str, Any] | None]]) -> None:
    stream = run.proc.stdout
    assert stream is not None
    for raw in stream:
        try:
            doc = json.loads(raw)
        except ValueError:
            sys.stderr.write(f"[soak {run.name}] {raw.decode(errors='replace')}")
            continue
        out.put((run, doc))
    out.put((run, None))


def _redis_info(server: RedisServer, t0: float, index: int) -> dict[str, Any]:
    row: dict[str, Any] = {"index": index, "t": round(time.time() - t0, 1)}
    client = server.client(socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        info = client.info()
        row.update(used_memory=info.get("used_memory"), evicted_keys=info.get("evicted_keys"),
                   keyspace_hits=info.get("keyspace_hits"),
                   keyspace_misses=info.get("keyspace_misses"),
                   keys=client.dbsize(), clients=info.get("connected_clients"),
                   maxmemory=info.get("maxmemory"))
    except (redis.RedisError, OSError) as exc:
        row["error"] = type(exc).__name__
    finally:
        client.close()
    return row


class _Interrupted(Exception):
    pass


def run_soak(settings: SoakSettings, log: Callable[[str], None] = print) -> SoakResult:
    """One soak run; never leaves a process behind (see the module doc)."""
    prefix = f"soak{secrets.token_hex(4)}"
    maxmemory = settings.redis_maxmemory_mib * MIB
    server = RedisServer("--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru",
                         "--enable-debug-command", "local")
    engines: list[EngineRun] = []
    result = SoakResult(settings, engines, [], [], None)
    injector: FaultInjector | None = None
    link: Throttle | None = None
    _signalled.clear()
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    old_int = signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    try:
        server.start()
        # the engines reach Redis through a proxy whose link the slow-link fault turns down
        link = Throttle(server.port, FREE_RATE)
        result.redis_pid = server.pid
        log(f"redis-server pid {server.pid} on {server.url}, maxmemory "
            f"{settings.redis_maxmemory_mib} MiB allkeys-lru; key prefix {prefix}")
        inbox: queue.Queue[tuple[EngineRun, dict[str, Any] | None]] = queue.Queue()
        for i, role in enumerate(settings.engines):
            name = f"e{i}-{role}"
            spec = _engine_spec(settings, name, role, i, link.url, prefix)
            proc = subprocess.Popen(
                [sys.executable, "-m", "soak.worker", json.dumps(spec)], cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_worker_env())
            engines.append(EngineRun(name, role, proc))
        for run in engines:
            threading.Thread(target=_reader, args=(run, inbox), daemon=True).start()
        _wait_ready(engines, inbox, log)
        t0 = time.time() + 1.0
        end = t0 + settings.seconds
        for run in engines:
            _send(run.proc.stdin, f"go {t0} {end}\n")
        log(f"{len(engines)} engines warm; running {settings.seconds:g} s, mode {settings.mode}")
        if settings.mode != "fault-free":
            injector = FaultInjector(server, prefix, settings.remote_timeout, maxmemory,
                                     settings.fault_interval, settings.seed, link)
            injector.start(t0, settings.fault_start, settings.seconds - settings.fault_interval)
        _collect(settings, engines, inbox, server, t0, end, result, log)
    except (KeyboardInterrupt, _Interrupted):
        result.interrupted = True
        log("interrupted: stopping the engines and the server")
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        log(f"soak failed to run: {result.error}")
    finally:
        # the clean-up is bounded (the grace periods and timeouts): a second Ctrl-C or SIGTERM must
        # not cut it short and leave processes behind
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if injector is not None:
                injector.stop()
                result.faults = injector.events
            _stop_engines(engines)
            if link is not None:
                link.close()
            server.stop()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
    return result


#: Set by the run's SIGINT and SIGTERM handlers: the waits raise `_Interrupted` once it is set.
_signalled = threading.Event()


def _raise_interrupt(signum: int, frame: Any) -> None:
    _signalled.set()
    raise _Interrupted()


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    _signalled.set()
    raise KeyboardInterrupt


def _check_signalled() -> None:
    if _signalled.is_set():
        raise _Interrupted()


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")  # several engines share the cores
    return env


def _send(stream: IO[bytes] | None, text: str) -> None:
    if stream is None:
        return
    try:
        stream.write(text.encode())
        stream.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def _wait_ready(engines: list[EngineRun],
                inbox: queue.Queue[tuple[EngineRun, dict[str, Any] | None]],
                log: Callable[[str], None]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while any(r.ready is None for r in engines):
        _check_signalled()
        try:
            run, doc = inbox.get(timeout=min(0.5, max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() < deadline:
                continue
            raise RuntimeError(f"engines not ready within {READY_TIMEOUT:g} s") from None
        if doc is None:
            raise RuntimeError(f"engine {run.name} exited during start-up "
                               f"(status {run.proc.wait()})")
        if doc.get("type") == "ready":
            run.ready = doc
            log(f"  {run.name}: pid {doc['pid']}, baseline RSS {doc['baseline_rss'] / MIB:.0f} MiB")


def _collect(settings: SoakSettings, engines: list[EngineRun],
             inbox: queue.Queue[tuple[EngineRun, dict[str, Any] | None]], server: RedisServer,
             t0: float, end: float, result: SoakResult, log: Callable[[str], None]) -> None:
    """Gather window reports until every engine is done (or the hard deadline passes)."""
    # flushes are bounded by the timeouts; past this an engine is hung (and killed)
    hard_deadline = end + STOP_GRACE + 20 * settings.remote_timeout
    open_runs = {r.name for r in engines}
    next_info = 0
    while open_runs and time.time() < hard_deadline:
        _check_signalled()
        while time.time() >= t0 + (next_info + 1) * settings.window and next_info < _windows(
                settings):
            result.redis_windows.append(_redis_info(server, t0, next_info))
            next_info += 1
        try:
            run, doc = inbox.get(timeout=0.5)
        except queue.Empty:
            continue
        if doc is None:
            open_runs.discard(run.name)
            continue
        kind = doc.get("type")
        if kind == "window":
            run.windows.append(doc)
            log(_progress_line(run, doc))
        elif kind == "done":
            run.done = doc
    for name in open_runs:
        log(f"engine {name} did not finish by the deadline: killed")


def _windows(settings: SoakSettings) -> int:
    return int(-(-settings.seconds // settings.window))


def _progress_line(run: EngineRun, doc: dict[str, Any]) -> str:
    c = doc["counters"]
    ratio = doc["retrieved_tokens"] / doc["lookup_tokens"] if doc["lookup_tokens"] else 1.0
    return (f"  w{doc['index']:<3} {run.name:<11} req {doc['requests']:>4}  lookup "
            f"{doc['lookup_tokens']:>7}  retrieved {doc['retrieved_tokens']:>7} ({ratio:.3f})  "
            f"hit local {int(c['local.hit_tokens']):>7} remote {int(c['remote.hit_tokens']):>7}"
            f"  wrong {doc['wrong_tokens'] + doc['stray_tokens']}  exc {doc['exceptions']}  "
            f"slowest {max(doc['slowest'].values()):.2f}s  rss {doc['rss'] / MIB:.0f} MiB")


def _stop_engines(engines: list[EngineRun]) -> None:
    for run in engines:
        if run.proc.stdin is not None:
            with contextlib.suppress(OSError):
                run.proc.stdin.close()
    deadline = time.monotonic() + STOP_GRACE
    for run in engines:
        try:
            run.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.proc.terminate()
    for run in engines:
        try:
            run.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait()
        run.returncode = run.proc.returncode
