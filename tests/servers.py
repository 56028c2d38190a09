"""Real Redis and Valkey servers on free loopback ports, for the tests: the library's private
servers (`lmcache_remote.admin.private_server`: `RedisServer`, `ValkeyServer`, binary discovery,
see there for the contract), and what only tests ask of a server, read from the kernel's own
tables: ``listen_addresses`` (where a server really listens) and ``unread_bytes`` (what its
clients sent that it has not read: a paused server's backlog)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from lmcache_remote.admin.private_server import (
    LOOPBACK,
    REDIS_SERVER_ENV,
    VALKEY_SERVER_ENV,
    RedisServer,
    ServerNotFoundError,
    ServerStartError,
    ValkeyServer,
    find_redis_server,
    find_valkey_server,
    free_port,
    ping,
    server_version,
)

__all__ = [
    "LOOPBACK",
    "REDIS_SERVER_ENV",
    "VALKEY_SERVER_ENV",
    "RedisServer",
    "ServerNotFoundError",
    "ServerStartError",
    "ValkeyServer",
    "find_redis_server",
    "find_valkey_server",
    "free_port",
    "listen_addresses",
    "ping",
    "server_version",
    "unread_bytes",
]


def listen_addresses(port: int) -> list[str]:
    """The local addresses of every TCP socket of this host listening on ``port``, from the
    kernel's own tables: where a server really bound, whatever its arguments said
    (``0.0.0.0`` / ``::`` = every interface)."""
    found = []
    for address, local_port, state, _ in _tcp_sockets():
        if state != "0A" or local_port != port:  # 0A = LISTEN
            continue
        raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
        packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
        found.append(socket.inet_ntop(family, packed))
    return sorted(found)


def _tcp_sockets() -> Iterator[tuple[str, int, str, int]]:
    """(local address hex, local port, state hex, rx_queue bytes) of every TCP socket of this
    host, from ``/proc/net/tcp`` and ``/proc/net/tcp6``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            next(f)  # the header line
            for line in f:
                fields = line.split()
                address, _, hex_port = fields[1].partition(":")
                rx_queue = int(fields[4].partition(":")[2], 16)
                yield address, int(hex_port, 16), fields[3], rx_queue


def unread_bytes(port: int) -> int:
    """Bytes that clients sent to the server on ``port`` and it has not read yet (the receive
    queues of its connections, as the kernel reports them): while the server is paused, this
    grows by every byte any client sends it, and by nothing else."""
    return sum(rx for _, local_port, state, rx in _tcp_sockets()
               if local_port == port and state != "0A")  # 0A = LISTEN
