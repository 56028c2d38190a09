"""The real LMCache beside the project: ``lmcache==0.5.6`` in a side environment of its own
(scripts/lmcache_env.sh builds it once), driven as a subprocess per variant
(`benchmarks.lmcache_peer`), on the same redis-server and the same bf16 bytes as every other
contender of the side-by-side rows.

Variants: its ``redis://`` connector as ``pip install lmcache`` leaves it (redis-py without
hiredis), the same with hiredis on the path, and ``resp://`` (its C++ RESP client).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from benchmarks.contenders import Contender
from benchmarks.data import Shape
from benchmarks.server import LocalRedis

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.5.6"
#: Row name -> (URL scheme, hiredis on the path).
VARIANTS = {
    "LMCache redis://": ("redis", False),
    "LMCache redis:// + hiredis": ("redis", True),
    "LMCache resp://": ("resp", False),
}


class SideEnv:
    """The LMCache environment: its python and the folder that adds hiredis."""

    def __init__(self) -> None:
        out = subprocess.run(["bash", str(ROOT / "scripts" / "lmcache_env.sh")],
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"scripts/lmcache_env.sh failed:\n{out.stderr[-3000:]}")
        self.python, self.hiredis = out.stdout.strip().splitlines()[-2:]


class DataFile:
    """The chunks' bytes in one temporary file, in order, for the LMCache processes to load."""

    def __init__(self, chunks: Sequence[torch.Tensor]) -> None:
        fd, self.path = tempfile.mkstemp(prefix="lmcr-bench-", suffix=".bin")
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk.contiguous().view(torch.uint8).reshape(-1).numpy().data)

    def remove(self) -> None:
        Path(self.path).unlink(missing_ok=True)


class _Peer:
    """One LMCache process answering put/get/check/clean on its stdin (one JSON line each)."""

    def __init__(self, env: SideEnv, url: str, hiredis: bool, data: DataFile, shape: Shape,
                 count: int) -> None:
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = env.hiredis if hiredis else ""
        child_env["LMCACHE_LOG_LEVEL"] = "WARNING"
        args = [env.python, "-m", "benchmarks.lmcache_peer", url, data.path,
                str(shape.chunk_bytes), str(count), str(shape.layers), str(shape.kv_heads),
                str(shape.head)]
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(args, cwd=ROOT, env=child_env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._read()  # {"ready": true}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self._log.seek(0)
            raise RuntimeError("the LMCache process died:\n"
                               + self._log.read()[-3000:].decode("utf-8", "replace"))
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, command: str) -> bool:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return bool(self._read()["ok"])

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def contenders(env: SideEnv, server: LocalRedis, data: DataFile, shape: Shape, count: int
               ) -> list[Contender]:
    """One contender per `VARIANTS` entry, each its own LMCache process on ``server``."""
    out = []
    for name, (scheme, hiredis) in VARIANTS.items():
        url = f"{scheme}://127.0.0.1:{server.port}" + ("/0" if scheme == "redis" else "")
        peer = _Peer(env, url, hiredis, data, shape, count)

        def put(peer: _Peer = peer, name: str = name) -> None:
            assert peer.ask("put"), f"{name}: put failed"

        def get(peer: _Peer = peer, name: str = name) -> None:
            assert peer.ask("get"), f"{name}: get missed"

        def clean(peer: _Peer = peer) -> None:
            peer.ask("clean")
            server.clear()

        def busy(on: bool, peer: _Peer = peer) -> None:
            peer.ask("spin" if on else "still")

        def check(peer: _Peer = peer) -> bool:
            return peer.ask("check")

        out.append(Contender(name, put, get, clean, check=check, close=peer.close, busy=busy,
                             pid=peer.proc.pid))
    return out
