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
  that list), else into a fresh buffer; a nil is None, an integer an int, a status a `bytes`,
  an array (EXEC's, a script's) its length as an int, or its first error element as an error
  reply (nothing else of it is kept).
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

Two readers speak this protocol. On a plain TCP or UNIX socket every batch (the GETs of a read, the
EXISTS of a lookup, the SETs of a write) runs in `lmcache_remote.native._wire`
(lmcache_remote/native/_wire_resp.c, built with the package): values are sent as views by one
`sendmsg` per 1024 buffers, each bulk payload is read by one ``readv`` into its destination and a
small tail buffer, no copy through a receive buffer, and with no sink or a list of places the whole
batch runs without the GIL, its replies made into Python objects at the end (a callable sink is
called with the GIL, per bulk reply). TLS sockets, or a build without the extension, run in
`resp.RespReader`, the Python reference, with the same results and errors (tests/test_wire.py runs
both). `NATIVE` says whether the native loop is used; ``LMCR_NATIVE_WIRE=0`` turns it off. Reply
arenas are `arena.ArenaPool`'s.
"""


from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any, TypeGuard

import redis
from redis.exceptions import ResponseError

from lmcache_remote.native import DIGESTS, xxh3
from lmcache_remote.native import wire as _native  # the C loop, or None: Python does it all
from lmcache_remote.storage.wire.deadline import current as _deadline
from lmcache_remote.storage.wire.resp import (
    COALESCE,
    MAX_BULK,
    BytesLike,
    Reply,
    RespReader,
    Sink,
    error_reply,
    pack,
    pack_small,
    packed,
    send_buffers,
    translate,
)

#: Checksums written into a command's buffer just before it is sent: (dest, sources, offsets,
#: sum_at): the XXH3-64 of each source, little-endian, at its offset in ``dest`` (a writable
#: buffer the command sends as is), then, when ``sum_at >= 0``, the low 32 bits of the XXH3-64
#: of ``dest[:sum_at]`` at ``sum_at``.
Seal = tuple[bytearray, list[Any], list[int], int]

#: Whether `BulkPipeline` runs its batches in the native loop by default (not on TLS).
NATIVE = _native is not None and os.environ.get("LMCR_NATIVE_WIRE", "1") != "0"


def supports(client: object) -> TypeGuard[redis.Redis]:
    """Whether `BulkPipeline` can drive this client: a single-node `redis.Redis` (TCP, UNIX or
    TLS socket, any pool, Sentinel's included); a `RedisCluster` is not one."""
    return isinstance(client, redis.Redis)


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
            raise RuntimeError("lmcache_remote.native._wire is not built (see setup.py)")
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
                sock.fileno(), -1.0 if timeout is None else timeout, packed(commands),
                None if reply_sizes is None else list(reply_sizes), inflight_bytes,
                sink if sink is None or callable(sink) else list(sink), error_reply,
                digests if DIGESTS else None, None if seals is None else list(seals), max_bulk,
                left)
            return replies
        reader = RespReader(sock, max_bulk, until)
        try:
            return self._run_python(reader, commands, sink, reply_sizes, inflight_bytes)
        finally:
            sock.settimeout(reader.timeout)  # the connection goes back to the pool as it came

    def _run_python(self, reader: RespReader, commands: Sequence[Sequence[Any]],
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
            small = args if isinstance(args, bytes) else pack_small(args)
            for piece in [small] if small is not None else pack(args):
                if isinstance(piece, bytes) and len(piece) < COALESCE:
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
