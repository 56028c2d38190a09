"""RedisTier.put_each and get over several connections at once (`write_lanes`, `read_lanes`),
against a real Redis: every chunk lands whole, a window whose connection breaks fails alone
(its chunks are not counted as written, and none is left half-written), the encoded bytes in
flight stay within the write budget, and a get still serves exactly the leading run of hits.

Windows are made small here (`WINDOW_BYTES` patched) so that one put of a few dozen small
chunks is cut into several windows, as a put of real 32 MiB chunks is."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis
import torch
from kvutil import tier_chunks

from lmcache_remote import CacheConfig
from lmcache_remote.naming.hashing import ChunkSpec, KeyNamespace, TokenDatabase
from lmcache_remote.storage.chunks import redis_tier
from lmcache_remote.storage.chunks.redis_tier import RedisTier
from lmcache_remote.storage.local.memory import ChunkLayout, MemoryObj, MemoryPool
from lmcache_remote.storage.wire import windows as wire_windows
from lmcache_remote.storage.wire.commands import command_key
from lmcache_remote.storage.wire.lanes import background_reads
from lmcache_remote.storage.wire.resp import pack
from lmcache_remote.storage.wire.windows import ByteBudget
from lmcache_remote.telemetry.metrics import Metrics

LAYOUT = ChunkLayout(2, 2, 8, torch.bfloat16)  # 8 KiB per 64-token chunk
DB = TokenDatabase(KeyNamespace("lanes/model", 1, 0, "bfloat16"), 64, save_unfull_chunk=False)
CHUNK_BYTES = LAYOUT.nbytes(64)
PER_WINDOW = 4  # chunks per write window (see `small_windows`)
N_CHUNKS = 16


@pytest.fixture(autouse=True)
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire_windows, "WINDOW_BYTES",
                        redis_tier.WRITE_LANES * PER_WINDOW * CHUNK_BYTES)


def make_chunks(pool: MemoryPool, seed: int) -> tuple[list[ChunkSpec], list[MemoryObj]]:
    return tier_chunks(DB, LAYOUT, pool, 64 * N_CHUNKS, seed)


@pytest.fixture
def pool() -> MemoryPool:
    return MemoryPool(64 * 1024 * 1024, pin_memory=False)


def make_tier(url: str, prefix: str, pool: MemoryPool, codec: str = "raw") -> RedisTier:
    # parts of at most 4 KiB: every chunk is several values written by one MSET
    cfg = CacheConfig(remote_url=url, key_prefix=prefix, remote_part_size=4096, serde=codec)
    tier = RedisTier(cfg, LAYOUT, pool, Metrics())
    assert tier.wire is not None and tier.write_lanes > 1
    return tier


@pytest.fixture
def tiers(redis_url: str, key_prefix: str, pool: MemoryPool) -> Iterator[list[RedisTier]]:
    made: list[RedisTier] = []
    yield made
    for t in made:
        t.close()


def part_counts(client: redis.Redis, tier: RedisTier, specs: Sequence[ChunkSpec]) -> list[int]:
    """How many of each chunk's values are in Redis."""
    return [int(client.exists(*tier._keys(s))) for s in specs]


def test_a_put_over_several_connections_writes_every_chunk(
    redis_url: str, key_prefix: str, pool: MemoryPool, tiers: list[RedisTier]
) -> None:
    writer = make_tier(redis_url, key_prefix, pool, "lz4")
    reader = make_tier(redis_url, key_prefix, pool, "raw")
    tiers += [writer, reader]
    specs, objs = make_chunks(pool, seed=1)
    windows = writer.writes._write_windows(objs, wire_windows.WINDOW_BYTES // writer.write_lanes)
    assert len(windows) == N_CHUNKS // PER_WINDOW
    assert sum(writer.put_each([s.key for s in specs], objs)) == N_CHUNKS
    assert writer.metrics.get("remote.written_chunks") == N_CHUNKS
    got = reader.get(specs)
    assert len(got) == N_CHUNKS
    for want, have in zip(objs, got, strict=True):
        assert torch.equal(want.tensor.view(torch.uint8), have.tensor.view(torch.uint8))
        have.release()


def test_a_broken_connection_fails_its_window_alone_and_leaves_no_half_chunk(
    redis_url: str, key_prefix: str, pool: MemoryPool, tiers: list[RedisTier],
    redis_client: redis.Redis,
) -> None:
    """The stub: the connection carrying the third window waits until the three other windows
    (on their own connections) are answered, then sends its first chunk whole, half of the
    second chunk's MSET (inside its MULTI: the default `remote_ttl` writes a transaction), and
    is shut down (on every attempt, so the caller's retry fails too). Redis drops the half
    command and the open transaction."""
    writer = make_tier(redis_url, key_prefix, pool)
    reader = make_tier(redis_url, key_prefix, pool)
    tiers += [writer, reader]
    specs, objs = make_chunks(pool, seed=2)
    broken = specs[2 * PER_WINDOW: 3 * PER_WINDOW]
    target = writer._keys(broken[0])[0]
    assert writer.wire is not None
    honest_send = writer.wire._send
    honest_write = writer.writes._write
    cut, others_done = threading.Event(), threading.Event()
    answered = []

    def write(batch: Any, seals: Any = None) -> list[bool]:
        n = honest_write(batch, seals)
        answered.append(n)
        if len(answered) == N_CHUNKS // PER_WINDOW - 1:
            others_done.set()
        return n

    def send(sock: socket.socket, commands: Sequence[Sequence[Any]]) -> None:
        writes = [i for i, c in enumerate(commands) if c[0] in ("MSET", "SET", "EVAL")]
        if command_key(commands[writes[0]]) != target:
            honest_send(sock, commands)
            return
        assert others_done.wait(60)
        # the first chunk whole (with `remote_ttl`: its MULTI ... EXEC), then the second's
        # MULTI if it has one, then half of its MSET
        honest_send(sock, commands[:writes[1]])
        second = b"".join(bytes(p) for p in pack(commands[writes[1]]))
        sock.sendall(second[: len(second) // 2])
        sock.shutdown(socket.SHUT_WR)
        cut.set()

    writer.wire.native = False  # the stub cuts the Python path's send (test_wire cuts both)
    writer.wire._send = send  # type: ignore[method-assign]
    writer.writes._write = write  # type: ignore[method-assign]
    flags = writer.put_each([s.key for s in specs], objs)  # other windows landed: no raise
    assert cut.is_set()
    assert writer.metrics.get("remote.errors") >= 1
    counts = part_counts(redis_client, writer, specs)
    nparts = len(writer._keys(specs[0]))
    assert nparts >= 2
    assert all(c in (0, nparts) for c in counts), counts  # whole or absent, never half
    landed = [i for i, c in enumerate(counts) if c == nparts]
    assert counts[2 * PER_WINDOW] == nparts and counts[2 * PER_WINDOW + 1] == 0
    others = [i for i in range(N_CHUNKS) if not 2 * PER_WINDOW <= i < 3 * PER_WINDOW]
    assert set(others) <= set(landed)
    # only the windows whose replies all came back are counted as written, and as landed
    assert writer.metrics.get("remote.written_chunks") == len(others)
    assert [i for i, ok in enumerate(flags) if ok] == others
    for i in landed:
        got = reader.get([specs[i]])
        assert len(got) == 1 and torch.equal(got[0].tensor, objs[i].tensor)
        got[0].release()
    assert reader.metrics.get("remote.corrupt_chunks") == 0
    # every value that landed carries the expiry (the transaction writes both or neither)
    assert all(redis_client.pttl(k) > 0 for i in landed for k in writer._keys(specs[i]))


class _RecordingBudget(ByteBudget):
    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.total = nbytes
        self.taken = 0
        self.peak = 0
        self.lock = threading.Lock()

    def acquire(self, nbytes: int) -> None:
        super().acquire(nbytes)
        with self.lock:
            self.taken += nbytes
            self.peak = max(self.peak, self.taken)

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.taken -= nbytes
        super().release(nbytes)


def test_encoded_bytes_in_flight_stay_within_the_budget(
    redis_url: str, key_prefix: str, pool: MemoryPool, tiers: list[RedisTier]
) -> None:
    writer = make_tier(redis_url, key_prefix, pool, "lz4")
    tiers.append(writer)
    budget = _RecordingBudget(2 * PER_WINDOW * CHUNK_BYTES)  # two windows' worth, of eight lanes
    writer.writes._write_budget = budget
    specs, objs = make_chunks(pool, seed=3)
    assert sum(writer.put_each([s.key for s in specs], objs)) == N_CHUNKS
    assert 0 < budget.peak <= budget.total
    assert budget.taken == 0


def test_byte_budget_lets_one_oversized_request_through_alone() -> None:
    budget = ByteBudget(10)
    budget.acquire(25)  # nothing taken: passes, alone
    entered = threading.Event()

    def second() -> None:
        budget.acquire(1)
        entered.set()
        budget.release(1)

    t = threading.Thread(target=second)
    t.start()
    budget.release(25)
    assert entered.wait(10)
    t.join(10)
    budget.acquire(10)
    budget.release(10)


def test_a_get_over_several_connections_serves_the_prefix_and_frees_the_rest(
    redis_url: str, key_prefix: str, pool: MemoryPool, tiers: list[RedisTier],
    redis_client: redis.Redis,
) -> None:
    """Reads are cut into windows read at once (`read_lanes`) too: a chunk missing in the
    third window ends the hits there, whatever the windows after it hold, and their buffers go
    back to the pool."""
    tier = make_tier(redis_url, key_prefix, pool)
    tiers.append(tier)
    assert tier.read_lanes > 1
    tier.read_lanes = redis_tier.WRITE_LANES  # read windows of PER_WINDOW chunks, as writes
    specs, objs = make_chunks(pool, seed=4)
    assert sum(tier.put_each([s.key for s in specs], objs)) == N_CHUNKS
    held = pool.used_bytes
    got = tier.get(specs)
    assert len(got) == N_CHUNKS
    for want, have in zip(objs, got, strict=True):
        assert torch.equal(want.tensor, have.tensor)
        have.release()
    missing = 2 * PER_WINDOW + 1
    redis_client.unlink(*tier._keys(specs[missing]))
    got = tier.get(specs)
    assert len(got) == missing
    for want, have in zip(objs[:missing], got, strict=True):
        assert torch.equal(want.tensor, have.tensor)
    assert pool.used_bytes == held + missing * CHUNK_BYTES
    for have in got:
        have.release()
    assert pool.used_bytes == held


def test_the_steps_reads_go_before_a_background_load(
    private_redis: Any, key_prefix: str, pool: MemoryPool, tiers: list[RedisTier],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A background load (`background_reads`) has queued all its windows; a read of the step
    that comes after takes the next free lane before the background's waiting windows: it
    waits only for the windows already in flight (one per lane). Redis is paused while both
    queue up, so the order is the lanes' choice, not the network's."""
    monkeypatch.setattr(wire_windows, "WINDOW_BYTES", 2 * CHUNK_BYTES)  # one chunk a window
    tier = make_tier(private_redis.url, key_prefix, pool)
    tiers.append(tier)
    tier.read_lanes = 2
    background, _ = tier_chunks(DB, LAYOUT, pool, 64 * N_CHUNKS, seed=5)
    step, _ = tier_chunks(DB, LAYOUT, pool, 64 * N_CHUNKS, seed=6)
    for specs, seed in ((background, 5), (step, 6)):
        objs = tier_chunks(DB, LAYOUT, pool, 64 * N_CHUNKS, seed)[1]
        assert sum(tier.put_each([s.key for s in specs], objs)) == N_CHUNKS
    started: list[Any] = []
    two_in_flight = threading.Event()
    real = tier.reads._get_window

    def spy(window: Sequence[ChunkSpec]) -> Any:
        started.append(window[0].key)
        if len(started) == 2:
            two_in_flight.set()
        return real(window)

    monkeypatch.setattr(tier.reads, "_get_window", spy)
    got: dict[str, list[MemoryObj]] = {}

    def read(name: str, specs: list[ChunkSpec], in_background: bool) -> None:
        with background_reads() if in_background else contextlib.nullcontext():
            got[name] = tier.get(specs)

    private_redis.pause()
    try:
        slow = threading.Thread(target=read, args=("background", background, True))
        slow.start()
        assert two_in_flight.wait(30)
        fast = threading.Thread(target=read, args=("step", step, False))
        fast.start()
        lanes = tier._readers
        assert lanes is not None
        deadline = time.monotonic() + 30
        while len(lanes._queues[0]) < N_CHUNKS:  # every step window queued behind the two
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        private_redis.resume()
    slow.join(30)
    fast.join(30)
    assert len(got["background"]) == len(got["step"]) == N_CHUNKS
    for obj in got["background"] + got["step"]:
        obj.release()
    step_keys = {s.key for s in step}
    order = ["step" if key in step_keys else "background" for key in started]
    assert order[:2] == ["background", "background"]  # in flight when the step came
    assert order[2:2 + N_CHUNKS] == ["step"] * N_CHUNKS
