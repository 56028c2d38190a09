"""A small RESP pipeline executor for the bulk data path, over redis-py's own connections.

Why: redis-py's pipeline copies every value at least twice on the way out (its hiredis packer
builds one new buffer per command) and allocates a fresh `bytes` per reply on the way in, which
caps 32 MiB chunks far below what loopback and Redis allow. This executor sends values as
memoryviews straight from the chunk buffers and receives bulk replies with ``recv_into``
straight into buffers the caller chooses (a chunk's own bytes for the raw codec) or into a
reused arena.

Contract:

- `BulkPipeline(client)` borrows connections from ``client.connection_pool`` (so AUTH, SELECT,
  TLS, timeouts and reconnects stay redis-py's), one per `execute` call, and gives each back.
- `execute(commands, sink)` sends every command (a sequence of arguments, or `bytes` already
  packed by `pack_command`), then reads exactly one reply per command, in order. A bulk
  string reply is received into ``sink(index, length)`` when that returns a writable buffer
  of exactly ``length`` bytes (or a list of buffers that add up to it, and the reply is then
  that list), else into a fresh buffer; a nil is None, an integer an int, a status a `bytes`.
  ``sink`` may also be a list of places, one per command, given up front (a buffer, a list of
  buffers, or None): a bulk reply whose length is its place's total lands there, any other in
  a fresh buffer. The native loop runs such a batch without the GIL from end to end, and
  with ``digests`` (a list, one None per command) it also stores the XXH3-64 of each place's
  last buffer as it fills it, while the bytes are still in the CPU cache; entries it leaves
  None (the Python reader, a reply that did not fit, no XXH3 bound: `native.DIGESTS`) are
  the caller's to hash.
- ``seals`` (a list, one `Seal` or None per command) has the checksums of a write computed
  as it is sent: the native loop hashes each command's sources just before the kernel copies
  them into the socket (while they are still in the CPU cache, without the GIL): a source the
  command sends ahead of ``dest`` in 256 KiB pieces, each hashed and sent in turn, the others
  just before ``dest`` goes out; the Python reader seals every command first
  (`apply_seals`). Either way ``dest`` holds the checksums after `execute`.
- Error replies (``-ERR``, ``-NOPERM``, ``-OOM``) do not stop the reading: every reply is read,
  so the connection stays in step, then the first error is raised as redis-py would raise it.
- A socket timeout raises `redis.TimeoutError`, a lost connection or a reply this reader does
  not understand raises `redis.ConnectionError`; in both cases the connection is disconnected
  before it goes back to the pool (never reused in an unknown state), and nothing received
  may be used: the exception propagates and the caller drops what it got.
- Only plain single-node `redis.Redis` clients qualify (`supports`); a cluster client keeps
  redis-py's pipeline. The executor is per connection pool, so a cluster could use one per node.

Two readers speak this protocol. On a plain TCP or UNIX socket every batch (the GETs of a
read, the EXISTS of a lookup, the SETs of a write) runs in `lmcache_remote._wire`
(lmcache_remote/_wire.c, built with the package): values are sent as views by one `sendmsg`
per 1024 buffers, each bulk payload is read by one ``readv`` into its destination and a small
tail buffer, no copy through a receive buffer, and with no sink or a list of places the whole
batch runs without the GIL, its replies made into Python objects at the end (a callable sink
is called with the GIL, per bulk reply). TLS sockets, or a build without the extension, run
in `_Reader`, the Python reference, with the same results and errors (tests/test_wire.py
runs both). `NATIVE` says whether the native loop is used; ``LMCR_NATIVE_WIRE=0`` turns it
off.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import redis
from redis.exceptions import ResponseError

from lmcache_remote.native import DIGESTS, xxh3
from lmcache_remote.native import wire as _native  # the C loop, or None: Python does it all
from lmcache_remote.storage.deadline import current as _deadline

BytesLike = bytes | bytearray | memoryview
Reply = bytes | memoryview | list[memoryview] | int | None | ResponseError
Dest = memoryview | list[memoryview] | None
#: Where bulk replies go: asked per reply, or one place per command given up front.
Sink = Callable[[int, int], Dest] | Sequence[Dest]
#: Checksums written into a command's buffer just before it is sent: (dest, sources, offsets,
#: sum_at): the XXH3-64 of each source, little-endian, at its offset in ``dest`` (a writable
#: buffer the command sends as is), then, when ``sum_at >= 0``, the low 32 bits of the XXH3-64
#: of ``dest[:sum_at]`` at ``sum_at``.
Seal = tuple[bytearray, list[Any], list[int], int]

_CRLF = b"\r\n"
_COALESCE = 64 * 1024  # values smaller than this are copied into the command buffer
_RECV_CHUNK = 1024 * 1024
#: The longest bulk reply a batch accepts unless its caller says less (`execute`'s
#: ``max_bulk``): the largest value serde writes (a part of up to `serde.MAX_PART_SIZE` and
#: its header) stays under it.
MAX_BULK = 1 << 31
_IOV_MAX = 1024  # buffers per sendmsg (Linux's IOV_MAX)

#: Whether `BulkPipeline` runs its batches in the native loop by default (not on TLS).
NATIVE = _native is not None and os.environ.get("LMCR_NATIVE_WIRE", "1") != "0"


def supports(client: object) -> TypeGuard[redis.Redis]:
    """Whether `BulkPipeline` can drive this client: a single-node `redis.Redis` (TCP, UNIX or
    TLS socket, any pool, Sentinel's included); a `RedisCluster` is not one."""
    return isinstance(client, redis.Redis)


class Arena:
    """Reused receive memory: `take` hands out slices of one kept block, `reset` recycles it.

    Fresh multi-MiB allocations page-fault and run several times slower than reused memory,
    so replies that have no destination of their own land here. A block grows (a new, larger
    one) when a batch needs more, and stays at that size; slices from the old block stay valid.
    Not thread-safe: one arena per call in flight (`ArenaPool`).
    """

    def __init__(self, nbytes: int = 0) -> None:
        self._block = memoryview(bytearray(nbytes))
        self._used = 0

    @property
    def capacity(self) -> int:
        return len(self._block)

    def reserve(self, nbytes: int) -> None:
        """Make sure the next `nbytes` of `take` come from one block."""
        if self._used + nbytes > len(self._block):
            self._block = memoryview(bytearray(max(nbytes, len(self._block))))
            self._used = 0

    def take(self, nbytes: int) -> memoryview:
        self.reserve(nbytes)
        out = self._block[self._used:self._used + nbytes]
        self._used += nbytes
        return out

    def reset(self) -> None:
        self._used = 0


class ArenaPool:
    """A few `Arena`s, one per call in flight; at most ``keep`` are kept between calls."""

    def __init__(self, keep: int = 2) -> None:
        self._free: list[Arena] = []
        self._keep = keep
        self._lock = threading.Lock()

    def acquire(self) -> Arena:
        with self._lock:
            return self._free.pop() if self._free else Arena()

    def release(self, arena: Arena) -> None:
        arena.reset()
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(arena)


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
        if isinstance(arg, bytes) and len(arg) < _COALESCE:
            small.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
            continue
        if isinstance(arg, tuple):  # one value given as several buffers, sent back to back
            views = [memoryview(a).cast("B") for a in arg]
            small.append(b"$%d\r\n" % sum(len(v) for v in views))
            for piece, view in zip(arg, views, strict=True):
                if len(view) < _COALESCE and not isinstance(piece, bytearray):
                    small.append(view.tobytes())
                else:
                    out += (b"".join(small), view)
                    small = []
            small.append(_CRLF)
            continue
        view = memoryview(arg).cast("B")
        small.append(b"$%d\r\n" % len(view))
        if len(view) < _COALESCE and not isinstance(arg, bytearray):
            small += (view.tobytes(), _CRLF)
            continue
        out += (b"".join(small), view)
        small = [_CRLF]
    out.append(b"".join(small))
    return out


class _Reader:
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
                dest = _fitting(sink[index], length)
            dests = _as_list(dest, length)
            self.into(dests)
            self.skip_crlf()
            return dests[0] if len(dests) == 1 else dests
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            return _error(rest.decode("utf-8", "replace"))
        if kind == b"_":
            return None
        raise redis.ConnectionError(f"protocol error: unexpected reply {line[:20]!r}")


def translate(exc: BaseException) -> BaseException:
    """The error `BulkPipeline.execute` raises for what its reader raised: redis-py's
    TimeoutError for a socket timeout, its ConnectionError for a broken connection or a reply
    not understood (both readers), anything else as it is."""
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return redis.TimeoutError(f"timeout on the bulk path: {exc}")
    if isinstance(exc, (OSError, ValueError)) and not isinstance(exc, redis.RedisError):
        return redis.ConnectionError(f"bulk path: {exc}")
    return exc


def _as_list(dest: memoryview | list[memoryview] | None, length: int) -> list[memoryview]:
    if dest is None:
        return [memoryview(bytearray(length))]
    dests = [dest] if isinstance(dest, memoryview) else dest if isinstance(dest, list) \
        else list(dest)  # a list given is the reply itself, as in the native loop
    if sum(len(d) for d in dests) != length:
        raise ValueError("sink returned buffers that do not add up to the reply length")
    return dests


def _fitting(place: Any, length: int) -> Any:
    """A list sink's place when its buffers add up to ``length``, else None (a fresh one)."""
    if place is None:
        return None
    total = len(place) if isinstance(place, memoryview) else sum(len(d) for d in place)
    return place if total == length else None


def _error(text: str) -> ResponseError:
    if text.startswith("NOPERM"):
        from redis.exceptions import NoPermissionError

        return NoPermissionError(text)
    return ResponseError(text)


def _connection_args(pool: Any) -> tuple[str, ...]:
    """What `pool.get_connection` needs: nothing from redis-py 5.3 on (and a warning for a
    command name from 6 on); before that a command name (any: the pool only uses it to pick a
    node in a cluster, which this pool is not)."""
    import inspect

    param = inspect.signature(pool.get_connection).parameters.get("command_name")
    return ("_",) if param is not None and param.default is inspect.Parameter.empty else ()


class BulkPipeline:
    """Runs batches of commands over one pooled connection each; thread-safe like the pool.
    ``native`` (default `NATIVE`) picks the reader for its batches."""

    def __init__(self, client: redis.Redis, *, native: bool | None = None) -> None:
        self.pool = client.connection_pool
        self._connection_args = _connection_args(self.pool)
        if native and _native is None:
            raise RuntimeError("lmcache_remote._wire is not built (see setup.py)")
        self.native = NATIVE if native is None else native

    def execute(self, commands: Sequence[Sequence[Any]], sink: Sink | None = None, *,
                reply_sizes: Sequence[int] | None = None, inflight_bytes: int = 0,
                digests: list[int | None] | None = None,
                seals: Sequence[Seal | None] | None = None,
                max_bulk: int = MAX_BULK) -> list[Reply]:
        """Runs the batch. With ``reply_sizes`` (the expected size of each reply) and
        ``inflight_bytes``, commands are sent as the replies come in, so that the replies
        asked for and not yet read add up to at most ``inflight_bytes`` (at least one command
        is always out): Redis then never queues a whole batch of big replies in its output
        buffers (memory it allocates and page-faults per batch), and it prepares the next reply
        while this side reads the current one. Without them every command goes out first.
        A bulk reply announced longer than ``max_bulk`` bytes fails the batch before anything
        is allocated for it (a ValueError, "protocol error"): a server, or whatever sits
        between, cannot make this process allocate what it announces."""
        if not commands:
            return []
        if reply_sizes is not None and len(reply_sizes) != len(commands):
            raise ValueError(f"{len(reply_sizes)} reply sizes for {len(commands)} commands")
        if sink is not None and not callable(sink):
            sink = list(sink)
            if len(sink) != len(commands):
                raise ValueError(f"{len(sink)} places for {len(commands)} commands")
        if digests is not None and len(digests) != len(commands):
            raise ValueError(f"{len(digests)} digest slots for {len(commands)} commands")
        if seals is not None:
            if len(seals) != len(commands):
                raise ValueError(f"{len(seals)} seals for {len(commands)} commands")
            for seal in seals:
                if seal is not None:
                    _check_seal(seal)
        conn = self.pool.get_connection(*self._connection_args)
        try:
            replies = self._run(conn, commands, sink, reply_sizes, inflight_bytes, digests,
                                seals, max_bulk)
        except BaseException as exc:
            conn.disconnect()
            self.pool.release(conn)
            mapped = translate(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        self.pool.release(conn)
        for reply in replies:
            if isinstance(reply, ResponseError):
                if digests is not None:  # the caller redoes the batch another way
                    digests[:] = [None] * len(digests)
                raise reply
        return replies

    def _run(self, conn: Any, commands: Sequence[Sequence[Any]], sink: Sink | None,
             reply_sizes: Sequence[int] | None, inflight_bytes: int,
             digests: list[int | None] | None = None,
             seals: Sequence[Seal | None] | None = None,
             max_bulk: int = MAX_BULK) -> list[Reply]:
        sock = conn._sock
        if sock is None:
            conn.connect()
            sock = conn._sock
        native = self.native and _native is not None and not isinstance(sock, ssl.SSLSocket)
        if seals is not None and not (native and DIGESTS):
            apply_seals(seals)  # no native XXH3 to seal as it sends: all of them first
            seals = None
        until = _deadline()
        if native:
            timeout = sock.gettimeout()
            left = -1.0 if until is None else max(0.0, until - time.monotonic())
            replies: list[Reply] = _native.run_batch(
                sock.fileno(), -1.0 if timeout is None else timeout, _packed(commands),
                None if reply_sizes is None else list(reply_sizes), inflight_bytes,
                sink if sink is None or callable(sink) else list(sink), _error,
                digests if DIGESTS else None, None if seals is None else list(seals), max_bulk,
                left)
            return replies
        reader = _Reader(sock, max_bulk, until)
        try:
            return self._run_python(reader, commands, sink, reply_sizes, inflight_bytes)
        finally:
            sock.settimeout(reader.timeout)  # the connection goes back to the pool as it came

    def _run_python(self, reader: _Reader, commands: Sequence[Sequence[Any]],
                    sink: Sink | None, reply_sizes: Sequence[int] | None,
                    inflight_bytes: int) -> list[Reply]:
        """`_run` with the Python reader: sends as `execute` says, reads every reply."""
        sock = reader.sock
        if reply_sizes is None or inflight_bytes <= 0:
            reader.arm()
            self._send(sock, commands)
            replies = [reader.reply(i, sink) for i in range(len(commands))]
        else:
            replies = []
            sent = outstanding = 0
            for i in range(len(commands)):
                end = sent
                while end < len(commands) and (
                    end == i or outstanding + reply_sizes[end] <= inflight_bytes
                ):
                    outstanding += reply_sizes[end]
                    end += 1
                if end > sent:
                    reader.arm()
                    self._send(sock, commands[sent:end])
                    sent = end
                replies.append(reader.reply(i, sink))
                outstanding -= reply_sizes[i]
        if reader.start != reader.end:
            raise redis.ConnectionError("protocol error: unexpected bytes after the replies")
        return replies

    @staticmethod
    def _send(sock: socket.socket, commands: Sequence[Sequence[Any]]) -> None:
        """Sends the commands: small pieces joined, big values as views, in one `sendmsg`
        per up to `_IOV_MAX` buffers (one syscall for many chunks, where one `sendall` per
        buffer cost a syscall and a server wake-up per value)."""
        buffers: list[BytesLike] = []
        pending: list[bytes] = []
        for args in commands:
            small = args if isinstance(args, bytes) else _pack_small(args)
            for piece in [small] if small is not None else pack(args):
                if isinstance(piece, bytes) and len(piece) < _COALESCE:
                    pending.append(piece)
                    continue
                if pending:
                    buffers.append(b"".join(pending))
                    pending = []
                buffers.append(piece)
        if pending:
            buffers.append(b"".join(pending))
        send_buffers(sock, buffers)


def apply_seals(seals: Sequence[Seal | None]) -> None:
    """What the native loop does for each `Seal` as it sends its command, done here in Python
    for all of them (None: no seal)."""
    for seal in seals:
        if seal is None:
            continue
        dest, sources, offsets, sum_at = seal
        for source, offset in zip(sources, offsets, strict=True):
            dest[offset:offset + 8] = xxh3(source).to_bytes(8, "little")
        if sum_at >= 0:
            dest[sum_at:sum_at + 4] = (xxh3(memoryview(dest)[:sum_at]) & 0xFFFFFFFF).to_bytes(
                4, "little")


def _check_seal(seal: Seal) -> None:
    dest, sources, offsets, sum_at = seal
    if len(sources) != len(offsets):
        raise ValueError(f"a seal with {len(sources)} sources and {len(offsets)} offsets")
    size = len(memoryview(dest))
    if any(not 0 <= at <= size - 8 for at in offsets) or not -1 <= sum_at <= size - 4:
        raise ValueError(f"a seal's offsets {offsets}, {sum_at} lie outside its {size} bytes")


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


def pack_command(args: Sequence[str | bytes | int]) -> bytes:
    """One command of small arguments, packed once (for commands sent again and again)."""
    packed = _pack_small(args)
    if packed is None:
        raise ValueError("pack_command takes str, int and small bytes arguments only")
    return packed


def _packed(commands: Sequence[Sequence[Any]]) -> list[bytes | list[BytesLike]]:
    """Every command for the native loop: one packed `bytes`, or, where it carries a buffer
    or a big value (a write), the buffers `pack` makes (values as views, not copied)."""
    out: list[bytes | list[BytesLike]] = []
    for args in commands:
        packed = args if isinstance(args, bytes) else _pack_small(args)
        out.append(packed if packed is not None else pack(args))
    return out


def _pack_small(args: Sequence[Any]) -> bytes | None:
    """One command of str keys and small ``bytes``/``int`` arguments as one ``bytes``; None
    when an argument needs `pack` (a buffer, or a value that is sent without copying)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        elif not isinstance(arg, bytes) or len(arg) >= _COALESCE:
            return None  # a buffer, a big value or a tuple of buffers: `pack` sends it
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)
