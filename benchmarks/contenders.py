"""The side-by-side rows: every contender moves the same chunks, and the repetitions are
interleaved (rep 1 of each contender, then rep 2 of each, ...) so that the load of a shared
machine falls on all of them alike and their ratios stay meaningful.

A contender has ``put()`` and ``get()`` (timed) and ``clean()`` (untimed, right after its
get: removes its keys, so every put starts on an empty server), and ``busy(on)``, which starts
or stops a spinning Python thread in the contender's own process (`benchmarks.spinner`) for
the duel beside a busy thread.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import torch

from benchmarks.data import Shape, same_kv
from benchmarks.engine_rows import TierSource, _config
from benchmarks.limits import PlainSocket, split
from benchmarks.server import LocalRedis
from benchmarks.spinner import Spinner
from lmcache_remote import CacheEngine, KVView
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import MemoryObj
from lmcache_remote.telemetry.metrics import Metrics

#: The spinning thread of this process (the project's contenders run here).
SPINNER = Spinner()


def _raw(chunk: torch.Tensor) -> memoryview:
    return chunk.view(torch.uint8).reshape(-1).numpy().data


@dataclass
class Contender:
    name: str
    put: Callable[[], object]
    get: Callable[[], object]
    clean: Callable[[], object]
    check: Callable[[], bool] = lambda: True
    after: Callable[[], object] = lambda: None  # untimed, after each get (frees buffers)
    close: Callable[[], object] = lambda: None
    busy: Callable[[bool], object] = SPINNER.set  # a spinning thread in its own process
    pid: int = field(default_factory=os.getpid)  # the process that does its work


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuShare:
    """Median CPU seconds of one contender's timed put and get: its own process's, and
    redis-server's (the same server for every contender)."""
    put_client: float
    put_server: float
    get_client: float
    get_server: float


def plain_socket(server: LocalRedis, chunks: Sequence[torch.Tensor], part: int) -> Contender:
    values = [v for c in chunks for v in split(c.view(torch.uint8).reshape(-1).numpy().data, part)]
    keys = [b"plain:%d" % i for i in range(len(values))]
    dests = [memoryview(bytearray(len(v))) for v in values]
    conn = PlainSocket(server.port)
    return Contender(
        "plain socket", lambda: conn.set_many(keys, values), lambda: conn.get_many(keys, dests),
        lambda: server.clear(),
        check=lambda: all(bytes(d) == bytes(v) for d, v in zip(dests, values, strict=True)),
        close=conn.close,
    )


def redis_py_whole(server: LocalRedis, chunks: Sequence[torch.Tensor]) -> Contender:
    client = redis.Redis.from_url(server.url, socket_timeout=60)
    keys = [f"rp:{i}" for i in range(len(chunks))]
    dests = [torch.empty_like(c) for c in chunks]

    def put() -> None:
        for key, chunk in zip(keys, chunks, strict=True):
            client.set(key, _raw(chunk))

    def get() -> None:
        for key, dest in zip(keys, dests, strict=True):
            value = client.get(key)
            assert isinstance(value, bytes), f"{key} missing"
            _raw(dest)[:] = value

    return Contender("redis-py whole chunks", put, get, lambda: client.unlink(*keys),
                     check=lambda: all(torch.equal(a, b) for a, b in zip(chunks, dests,
                                                                         strict=True)),
                     close=client.close)


def tier(server: LocalRedis, source: TierSource, codec: str, label: str = "",
         **overrides: Any) -> Contender:
    """`RedisTier` put and get of the chunks; ``overrides``: more configuration (its name
    gets ``label``)."""
    t = RedisTier(_config(server.url, codec, **overrides), source.shape.layout, source.pool,
                  Metrics())
    keys = [s.key for s in source.specs]
    last: list[MemoryObj] = []

    def get() -> None:
        last[:] = t.get(source.specs)

    def check() -> bool:
        return len(last) == len(source.objs) and all(
            torch.equal(a.tensor, b.tensor) for a, b in zip(last, source.objs, strict=True))

    def after() -> None:
        for obj in last:
            obj.release()
        last.clear()

    return Contender(f"RedisTier {codec}{label}", lambda: t.put_each(keys, source.objs), get,
                     lambda: t.delete(keys), check=check, after=after, close=t.close)


def engine(server: LocalRedis, shape: Shape, kv: KVView, dest: KVView, num_tokens: int,
           codec: str, label: str = "", **overrides: Any) -> Contender:
    """A synchronous store and a Redis-hit retrieve (local tier off), KV copies included;
    ``overrides``: more configuration (its name gets ``label``)."""
    e = CacheEngine(_config(server.url, codec, store_async=False, local_cpu=False,
                            **overrides), shape.metadata())
    tokens = list(range(num_tokens))
    salts = itertools.count()
    salt = ["s"]

    def put() -> None:
        salt[0] = f"s{next(salts)}"
        assert e.store(tokens, kv, cache_salt=salt[0]) == num_tokens

    def get() -> None:
        assert int(e.retrieve(tokens, dest, cache_salt=salt[0]).sum()) == num_tokens

    return Contender(f"engine {codec}{label}", put, get, server.clear,
                     check=lambda: same_kv(kv, dest, shape, num_tokens), close=e.close)


def redis_bytes(server: LocalRedis, c: Contender, nbytes: int) -> float:
    """Bytes Redis allocates (`MEMORY USAGE` of every key, keys included) per KV byte after
    one put of ``c`` (``nbytes`` of KV) on an emptied server; empties it again."""
    c.clean()
    server.settle()
    c.put()
    used = server.key_bytes()
    c.clean()
    return used / nbytes


def duel(contenders: Sequence[Contender], reps: int, settle: Callable[[], object],
         keep_open: Sequence[Contender] = (), busy: bool = False,
         server_pid: int | None = None, cpu: dict[str, CpuShare] | None = None,
         full: LocalRedis | None = None, puts: dict[str, list[float]] | None = None
         ) -> dict[str, tuple[float, float]]:
    """Median (put, get) seconds per contender, repetitions interleaved, one warm-up each;
    every contender is closed after, but those in ``keep_open``. With ``server_pid`` and
    ``cpu``, ``cpu`` gets each contender's median `CpuShare` (the CPU each timed operation
    cost its process and the server).
    Every put starts on an empty server that has freed what the last contender wrote and
    handed its pages back (its ``clean``, then ``settle``, untimed): data left by one
    contender would change the server's memory state, and so the speed, of the next. With
    ``busy`` each contender's put and get run with a spinning Python thread in its own process
    (and none elsewhere). With ``full`` (the server) every put instead starts on a server
    full of the contender's own values under `maxmemory` (`LocalRedis.fill_with`): the
    production state of a cache tier, where writes evict and reuse memory. ``puts`` gets every
    timed put's seconds per contender (the spread of the median)."""
    times: dict[str, tuple[list[float], list[float]]] = {c.name: ([], []) for c in contenders}
    shares: dict[str, list[tuple[float, float, float, float]]] = {c.name: [] for c in contenders}

    def used(c: Contender) -> tuple[float, float]:
        if server_pid is None or cpu is None:
            return (0.0, 0.0)
        return (cpu_seconds(c.pid), cpu_seconds(server_pid))

    for c in contenders:
        c.clean()
    for rep in range(reps + 1):
        for c in contenders:
            if full is not None:
                full.fill_with(c.put)
            else:
                settle()
            c.busy(busy)
            before = used(c)
            start = time.perf_counter()
            c.put()
            middle = time.perf_counter()
            between = used(c)
            c.get()
            end = time.perf_counter()
            after = used(c)
            c.busy(False)
            if rep == 0:
                assert c.check(), f"{c.name} read back different bytes"
            else:
                times[c.name][0].append(middle - start)
                times[c.name][1].append(end - middle)
                shares[c.name].append((between[0] - before[0], between[1] - before[1],
                                       after[0] - between[0], after[1] - between[1]))
            c.after()
            c.clean()
    if full is not None:
        full.unfill()
    if puts is not None:
        puts.update({name: p for name, (p, _) in times.items()})
    for c in contenders:
        if c not in keep_open:
            c.close()
    if cpu is not None and server_pid is not None:
        for name, rows in shares.items():
            cpu[name] = CpuShare(*(statistics.median(r[i] for r in rows) for i in range(4)))
    return {name: (statistics.median(p), statistics.median(g)) for name, (p, g) in times.items()}
