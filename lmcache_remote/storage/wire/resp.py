"""RESP on a socket, in Python: command packing, scatter/gather sending, and the reader.

What `bulk.BulkPipeline` sends and reads with (the native loop, lmcache_remote/native/_wire_resp.c,
speaks the same protocol and takes `packed`'s commands):

- `pack(args)`: the RESP encoding of one command as buffers to send; big values (and any
  `bytearray`, which a seal may still fill) are views, never copied; a tuple argument is one
  bulk string sent from several buffers. `pack_small`/`pack_command`: a command of small
  arguments as one ``bytes``; `packed`: every command of a batch for the native loop.
- `send_buffers`: every byte of the buffers, in order, by `sendmsg` (one syscall per up to
  1024 buffers, partial sends resumed), or one `sendall` per buffer on TLS.
- `RespReader`: parses replies with one reused receive buffer; a bulk reply lands where the
  sink says (`as_list`, `fitting`), a longer one than ``max_bulk`` is refused before anything
  is allocated for it, every socket wait is cut to the batch's deadline. Error replies are
  returned as exceptions (`error_reply`: NOPERM as redis-py's `NoPermissionError`), never
  raised here; a broken stream raises redis-py's `ConnectionError` (`translate` maps what a
  reader raised onto redis-py's errors).
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import ResponseError

BytesLike = bytes | bytearray | memoryview
Reply = bytes | memoryview | list[memoryview] | int | None | ResponseError
Dest = memoryview | list[memoryview] | None
#: Where bulk replies go: asked per reply, or one place per command given up front.
Sink = Callable[[int, int], Dest] | Sequence[Dest]

_CRLF = b"\r\n"
COALESCE = 64 * 1024  # values smaller than this are copied into the command buffer
_RECV_CHUNK = 1024 * 1024
#: The longest bulk reply a batch accepts unless its caller says less (`execute`'s
#: ``max_bulk``): the largest value serde writes (a part of up to `serde.MAX_PART_SIZE` and
#: its header) stays under it.
MAX_BULK = 1 << 31
_IOV_MAX = 1024  # buffers per sendmsg (Linux's IOV_MAX)


def pack(args: Sequence[Any]) -> list[BytesLike]:
    """The RESP encoding of one command, as buffers to send; big values are not copied. An
    argument may be a tuple of buffers: one bulk string made of them, in order (a header and
    a payload sent without joining them). A `bytearray`, alone or in a tuple, is sent as
    itself, never copied, so that a seal can still fill it."""
    out: list[BytesLike] = []
    small: list[bytes] = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        if isinstance(arg, bytes) and len(arg) < COALESCE:
            small.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
            continue
        if isinstance(arg, tuple):  # one value given as several buffers, sent back to back
            views = [memoryview(a).cast("B") for a in arg]
            small.append(b"$%d\r\n" % sum(len(v) for v in views))
            for piece, view in zip(arg, views, strict=True):
                if len(view) < COALESCE and not isinstance(piece, bytearray):
                    small.append(view.tobytes())
                else:
                    out += (b"".join(small), view)
                    small = []
            small.append(_CRLF)
            continue
        view = memoryview(arg).cast("B")
        small.append(b"$%d\r\n" % len(view))
        if len(view) < COALESCE and not isinstance(arg, bytearray):
            small += (view.tobytes(), _CRLF)
            continue
        out += (b"".join(small), view)
        small = [_CRLF]
    out.append(b"".join(small))
    return out


def pack_command(args: Sequence[str | bytes | int]) -> bytes:
    """One command of small arguments, packed once (for commands sent again and again)."""
    packed = pack_small(args)
    if packed is None:
        raise ValueError("pack_command takes str, int and small bytes arguments only")
    return packed


def packed(commands: Sequence[Sequence[Any]]) -> list[bytes | list[BytesLike]]:
    """Every command for the native loop: one packed `bytes`, or, where it carries a buffer
    or a big value (a write), the buffers `pack` makes (values as views, not copied)."""
    out: list[bytes | list[BytesLike]] = []
    for args in commands:
        packed = args if isinstance(args, bytes) else pack_small(args)
        out.append(packed if packed is not None else pack(args))
    return out


def pack_small(args: Sequence[Any]) -> bytes | None:
    """One command of str keys and small ``bytes``/``int`` arguments as one ``bytes``; None
    when an argument needs `pack` (a buffer, or a value that is sent without copying)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        elif not isinstance(arg, bytes) or len(arg) >= COALESCE:
            return None  # a buffer, a big value or a tuple of buffers: `pack` sends it
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def send_buffers(sock: socket.socket, buffers: Sequence[BytesLike]) -> None:
    """Every byte of ``buffers``, in order: `sendmsg` (scatter/gather, partial sends resumed)
    where the socket has it, one `sendall` per buffer on a TLS socket."""
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            sock.sendall(buf)
        return
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + _IOV_MAX])
        while sent and i < len(views):
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


class RespReader:
    """Parses RESP replies from a socket with one reused receive buffer."""

    def __init__(self, sock: socket.socket, max_bulk: int = MAX_BULK,
                 until: float | None = None) -> None:
        self.sock = sock
        self.max_bulk = max_bulk
        self.until = until  # the batch's deadline (time.monotonic()), or None
        self.timeout = sock.gettimeout()
        self.buf = bytearray(_RECV_CHUNK)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            tail = self.end - self.start
            self.buf[:tail] = self.buf[self.start:self.end]
            self.start, self.end = 0, tail
        self.arm()
        n = self.sock.recv_into(self.view[self.end:])
        if n == 0:
            raise redis.ConnectionError("connection closed by the server")
        self.end += n

    def arm(self) -> None:
        """The socket's timeout for the next call: its own, cut to what is left of the
        batch's deadline; a timeout at once when nothing is left."""
        if self.until is None:
            return
        left = self.until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self.sock.settimeout(left if self.timeout is None else min(left, self.timeout))

    def line(self) -> bytes:
        while True:
            i = self.buf.find(_CRLF, self.start, self.end)
            if i >= 0:
                out = bytes(self.buf[self.start:i])
                self.start = i + 2
                return out
            if self.end - self.start > 64 * 1024:
                raise redis.ConnectionError("protocol error: reply line too long")
            self._fill()

    def into(self, dests: list[memoryview]) -> None:
        """Fills each buffer in turn from the stream, buffered bytes first, then the socket."""
        for dest in dests:
            pos = 0
            have = min(self.end - self.start, len(dest))
            if have:
                dest[:have] = self.view[self.start:self.start + have]
                self.start += have
                pos = have
            while pos < len(dest):
                self.arm()
                n = self.sock.recv_into(dest[pos:])
                if n == 0:
                    raise redis.ConnectionError("connection closed by the server")
                pos += n

    def skip_crlf(self) -> None:
        while self.end - self.start < 2:
            self._fill()
        if self.buf[self.start:self.start + 2] != _CRLF:
            raise redis.ConnectionError("protocol error: bulk reply not terminated")
        self.start += 2

    def reply(self, index: int, sink: Sink | None) -> Reply:
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            if length > self.max_bulk:  # refused before anything is allocated for it
                raise ValueError(f"protocol error: a bulk reply of {length} bytes, more than "
                                 f"the {self.max_bulk} expected")
            if sink is None:
                dest = None
            elif callable(sink):
                dest = sink(index, length)
            else:
                dest = fitting(sink[index], length)
            dests = as_list(dest, length)
            self.into(dests)
            self.skip_crlf()
            return dests[0] if len(dests) == 1 else dests
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            return error_reply(rest.decode("utf-8", "replace"))
        if kind == b"_":
            return None
        if kind == b"*":
            count = int(rest)
            if count < 0:
                return None
            first = self.skim(count, 0)
            return count if first is None else first
        raise redis.ConnectionError(f"protocol error: unexpected reply {line[:20]!r}")

    def skim(self, count: int, depth: int) -> ResponseError | None:
        """Reads ``count`` elements of an array reply (EXEC's, a script's), keeping only its
        first error element: the batch sees an array as its length, or that error."""
        if depth > 8:
            raise redis.ConnectionError("protocol error: arrays nested too deep")
        first: ResponseError | None = None
        for _ in range(count):
            line = self.line()
            kind, rest = line[:1], line[1:]
            if kind == b"$" and int(rest) >= 0:
                if int(rest) > self.max_bulk:
                    raise ValueError(f"protocol error: a bulk reply of {int(rest)} bytes, "
                                     f"more than the {self.max_bulk} expected")
                self.into([memoryview(bytearray(int(rest)))])
                self.skip_crlf()
            elif kind == b"*":
                inner = self.skim(max(0, int(rest)), depth + 1)
                first = first or inner
            elif kind == b"-":
                first = first or error_reply(rest.decode("utf-8", "replace"))
            elif kind not in (b"$", b":", b"+", b"_"):
                raise redis.ConnectionError(f"protocol error: unexpected reply {line[:20]!r}")
        return first


def translate(exc: BaseException) -> BaseException:
    """The error `BulkPipeline.execute` raises for what its reader raised: redis-py's
    TimeoutError for a socket timeout, its ConnectionError for a broken connection or a reply
    not understood (both readers), anything else as it is."""
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return redis.TimeoutError(f"timeout on the bulk path: {exc}")
    if isinstance(exc, (OSError, ValueError)) and not isinstance(exc, redis.RedisError):
        return redis.ConnectionError(f"bulk path: {exc}")
    return exc


def as_list(dest: memoryview | list[memoryview] | None, length: int) -> list[memoryview]:
    if dest is None:
        return [memoryview(bytearray(length))]
    dests = [dest] if isinstance(dest, memoryview) else dest if isinstance(dest, list) \
        else list(dest)  # a list given is the reply itself, as in the native loop
    if sum(len(d) for d in dests) != length:
        raise ValueError("sink returned buffers that do not add up to the reply length")
    return dests


def fitting(place: Any, length: int) -> Any:
    """A list sink's place when its buffers add up to ``length``, else None (a fresh one)."""
    if place is None:
        return None
    total = len(place) if isinstance(place, memoryview) else sum(len(d) for d in place)
    return place if total == length else None


def error_reply(text: str) -> ResponseError:
    if text.startswith("NOPERM"):
        from redis.exceptions import NoPermissionError

        return NoPermissionError(text)
    return ResponseError(text)
