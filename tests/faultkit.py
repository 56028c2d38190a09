"""Helpers for the fault, integrity, concurrency and security tests.

- `det_kv(tokens)`: a Hugging Face (dense) KV cache whose every value is derived from the token
  id and its position alone, so any thread or process can check a hit without the writer's
  tensors (the same chunk key implies the same tokens at the same positions).
- `check_retrieve(...)`: the invariant every retrieve must keep: the hit mask is a prefix of
  the requested range, every hit token holds exactly the source KV, every other token of the
  destination still holds the sentinel it was filled with.
- `CuttingProxy`: a loopback TCP proxy in front of a server that cuts each connection after a
  set number of bytes in either direction, to inject a connection lost in the middle of a
  value (a fault a real server cannot be asked to produce on cue).
- `timed(fn)`: run a call, return (result, seconds); `bound(n, remote_timeout)`: the most a
  call that the library bounds by `n` remote timeouts may take on a busy 2-core machine. A
  test holds a call to a time only where that bound is the promise under test; everything
  else waits on events or polls with a deadline (`wait_for`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from kvutil import HEAD, HEADS, LAYERS, SENTINEL

from lmcache_remote import DenseKV

T = TypeVar("T")
LOOPBACK = "127.0.0.1"


# -- deterministic KV -------------------------------------------------------------------------


def det_planes(toks: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[layers, 2, T, heads, head] of small integers (exact in bf16) from (token, position)."""
    t = torch.tensor(list(toks), dtype=torch.int64)
    base = (t * 2654435761 + torch.arange(len(t)) * 40503) % 1000003  # [T]
    lane = torch.arange(LAYERS * 2 * HEADS * HEAD).reshape(LAYERS, 2, 1, HEADS, HEAD)
    vals = (base.reshape(1, 1, -1, 1, 1) * (lane % 13 + 1) + lane * 7919) % 251 - 125
    return vals.to(dtype)


def det_kv(toks: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> DenseKV:
    """A DenseKV ([1, heads, T, head] per layer) holding `det_planes(toks)`."""
    planes = det_planes(toks, dtype)
    keys = [planes[i, 0].transpose(0, 1).unsqueeze(0).contiguous() for i in range(LAYERS)]
    values = [planes[i, 1].transpose(0, 1).unsqueeze(0).contiguous() for i in range(LAYERS)]
    return DenseKV(keys, values)


def sentinel_kv(n: int, dtype: torch.dtype = torch.bfloat16) -> tuple[DenseKV, Callable[[], Any]]:
    """A DenseKV of `n` tokens filled with SENTINEL, and a reader of its planes."""
    keys = [torch.full((1, HEADS, n, HEAD), SENTINEL, dtype=dtype) for _ in range(LAYERS)]
    values = [torch.full((1, HEADS, n, HEAD), SENTINEL, dtype=dtype) for _ in range(LAYERS)]

    def read() -> torch.Tensor:
        per_layer = [torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)])
                     for k, v in zip(keys, values, strict=True)]
        return torch.stack(per_layer)  # [layers, 2, T, heads, head]

    return DenseKV(keys, values), read


def check_retrieve(hit: torch.Tensor, toks: Sequence[int], read_dst: Callable[[], Any],
                   start: int = 0, dtype: torch.dtype = torch.bfloat16) -> int:
    """Assert the retrieve invariant; return the number of hit tokens.

    `start` is where the requested (masked) range begins; tokens before it must not be hits.
    """
    flags = hit.tolist()
    assert len(flags) == len(toks)
    n_hit = sum(flags)
    assert not any(flags[:start]), "a token outside the requested range is reported as a hit"
    assert flags[start:start + n_hit] == [True] * n_hit, f"hits are not a prefix: {flags}"
    got = read_dst()
    want = det_planes(toks, dtype)
    end = start + n_hit
    assert torch.equal(got[:, :, start:end], want[:, :, start:end]), "wrong KV served"
    outside = torch.cat([got[:, :, :start], got[:, :, end:]], dim=2)
    assert bool((outside == SENTINEL).all()), "KV written for tokens not reported as hits"
    return n_hit


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


#: What a busy 2-core machine may add to a call beyond the remote timeouts that bound it
#: (scheduling, the GIL, torch copies): a time bound fails for a hang or a timeout not
#: applied, never for load.
LOAD_MARGIN = 2.5


def bound(timeouts: float, remote_timeout: float) -> float:
    """The most a call that the library bounds by `timeouts` remote timeouts may take here."""
    return timeouts * remote_timeout + LOAD_MARGIN


def wait_for(cond: Callable[[], bool], limit: float = 30.0, poll: float = 0.05) -> bool:
    """Poll `cond` until it holds or `limit` seconds passed; its last answer."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return cond()


# -- a proxy that cuts connections --------------------------------------------------------------


class CuttingProxy:
    """Forwards loopback TCP connections to `target_port`; cuts each after a byte budget.

    `down_limit`: bytes server->client after which the connection is closed (None: no limit);
    `up_limit`: the same for client->server. The limits in force when a connection is
    accepted apply to it; change them between requests with `set_limits`. `cuts` counts the
    connections cut so far.
    """

    def __init__(self, target_port: int, down_limit: int | None = None,
                 up_limit: int | None = None) -> None:
        self.target_port = target_port
        self.down_limit = down_limit
        self.up_limit = up_limit
        self.cuts = 0
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="cut-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def set_limits(self, down_limit: int | None, up_limit: int | None = None) -> None:
        with self._lock:
            self.down_limit, self.up_limit = down_limit, up_limit

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            _shut(sock)

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection((LOOPBACK, self.target_port), timeout=5)
                server.settimeout(None)
            except OSError:
                _shut(client)
                continue
            with self._lock:
                down, up = self.down_limit, self.up_limit
                self._socks += [client, server]
            for src, dst, limit in ((server, client, down), (client, server, up)):
                threading.Thread(target=self._pump, args=(src, dst, limit, (client, server)),
                                 daemon=True, name="cut-proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None,
              pair: tuple[socket.socket, socket.socket]) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[:limit - sent])
                    with self._lock:
                        self.cuts += 1
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for sock in pair:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class Clock:
    """A monotonic clock that moves only when told to (`advance`), for code that takes a
    `clock` (the health gate, the load decision)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
