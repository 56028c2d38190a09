"""The vLLM engine rig of the engine benchmarks (`vllm_engine`, `load_decision`,
`vllm_images`), apart from what each measures and reports:

- `snapshot_project(work)`: the copy of the checkout's `lmcache_remote` every engine of a run
  imports (its `_wire` compiled from that copy), and its digest;
- `Engine`: `tests/vllm_cpu/enginekit.Engine` (one engine process over pipes) with the
  benchmarks' environment (`ENGINE_ENV`: a 2 GiB KV cache, one OpenMP thread on core 0, no
  telemetry) and a hang killed after `ENGINE_TIMEOUT_S`;
- `LMCacheServer`: one `lmcache server` (LMCache's multiprocess mode) with Redis as its L2;
- the quiet-machine checks: `busy()`, `quiet_machine()`, `wait_quiet(minutes)` (no `pytest`
  and no other engine process running);
- `settle_keys` (Redis's key count once it stops changing), `dist_version`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[1]
# tests/ by folder, not as the `tests` package: some environments' site-packages hold one
sys.path[:0] = [str(ROOT / "tests" / "vllm_cpu"), str(ROOT / "tests")]

import enginekit  # noqa: E402

from lmcache_remote.admin.private_server import free_port  # noqa: E402

CHUNK = 256  # the chunk size of both caches (ours and LMCache's)
TAIL = 52  # the tokens after each prefix, in every engine benchmark's prompts
ENGINE_TIMEOUT_S = 900.0  # an engine start or one request longer than this: killed, reported
KVCACHE_GIB = "2"  # 2 GiB = 131k tokens: a whole round of both sizes with prefix caching on
LMCACHE_L1_GB = "2"
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": KVCACHE_GIB, "VLLM_CPU_OMP_THREADS_BIND": "0",
              "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1",
              "VLLM_NO_USAGE_STATS": "1", "LMCACHE_DISABLE_BANNER": "1"}


def snapshot_project(work: Path, attempts: int = 20) -> tuple[Path, str]:
    """A copy of the checkout's `lmcache_remote` (the working tree, uncommitted edits
    included) with its native part `_wire` compiled from that copy's C source, for every
    engine of the run: the checkout may be edited while the run goes on, and a module edited
    between two engines, or a `_wire` built from another version of the C source, would make
    the rows disagree. Retried every 30 s while the copy does not import (an edit under way).
    Returns the folder to put first on the engines' PYTHONPATH and the copy's digest."""
    setup = ("from glob import glob; from setuptools import Extension, setup; setup(ext_modules="
             "[Extension('lmcache_remote.native._wire', "
             "sorted(glob('lmcache_remote/native/_wire*.c')), "
             "extra_compile_args=['-O2'])])")
    check = ("import lmcache_remote.integrations.vllm, lmcache_remote.storage.wire.bulk as w; "
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
    run's copy of `lmcache_remote` first on the path). An engine whose start or request takes
    more than `ENGINE_TIMEOUT_S` is killed with its child processes (a hang becomes the
    engine's error, its log's tail)."""

    python_path: ClassVar[str] = str(ROOT)

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        super().__init__(spec, log, {**ENGINE_ENV, "PYTHONPATH": self.python_path})

    def _answer(self, timeout: float | None = None) -> dict[str, Any]:
        timer = threading.Timer(ENGINE_TIMEOUT_S, _kill_tree, (self._proc.pid,))
        timer.daemon = True
        timer.start()
        try:
            return super()._answer(timeout)
        finally:
            timer.cancel()


def _kill_tree(pid: int) -> None:
    """SIGKILL to `pid` (an engine this run started) and its descendants, children first."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                              text=True).stdout.split()
    for child in children:
        _kill_tree(int(child))
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    print(f"!!! killed process {pid}: no answer within {ENGINE_TIMEOUT_S:.0f} s", flush=True)


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


def busy() -> list[str]:
    """The command lines of running `pytest` and vLLM engine (`engine_proc.py`) processes."""
    found = subprocess.run(["pgrep", "-af", "pytest|engine_proc"], capture_output=True,
                           text=True).stdout.splitlines()
    return [line for line in found if str(os.getpid()) != line.split()[0]]


def quiet_machine() -> bool:
    return not busy()


def wait_quiet(minutes: float) -> float:
    """Polls every 30 s, up to `minutes`, until `quiet_machine()`; returns the seconds
    waited."""
    start = time.monotonic()
    while not quiet_machine() and time.monotonic() - start < minutes * 60:
        print(f"  waiting for a quiet machine ({(time.monotonic() - start) / 60:.1f} min): "
              + "; ".join(line[:120] for line in busy()), flush=True)
        time.sleep(30)
    return time.monotonic() - start


def settle_keys(client: Any, notes: list[str], what: str, timeout: float = 120.0) -> int:
    """Wait until Redis's key count stops changing (1.5 s unchanged); note it and return it."""
    deadline = time.monotonic() + timeout
    last, still = -1, 0
    while time.monotonic() < deadline:
        count = int(client.dbsize())
        still = still + 1 if count == last and count > 0 else 0
        if still >= 3:
            notes.append(f"Redis held {count} keys after {what}")
            print(f"  Redis holds {count} keys after {what}", flush=True)
            return count
        last = count
        time.sleep(0.5)
    raise RuntimeError(f"Redis's key count did not settle after {what} (last {last})")


def dist_version(dist: str) -> str:
    """The installed release of the distribution `dist` (in this environment)."""
    from importlib.metadata import version

    return version(dist)
