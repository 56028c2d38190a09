"""The bulk RESP executor (storage/wire/bulk.py) against real servers: replies of every kind, error
replies per command, values received in place, and connections that time out or break.

Every test that reads replies runs twice, once with the Python reader and once with the native loop
(lmcache_remote/native/_wire_resp.c): the two must agree on every reply and every error. The native
runs are skipped where the extension was not built, unless LMCR_REQUIRE_NATIVE=1 (the test command
sets it), which makes them fail instead."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import redis
from faultkit import bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import RedisServer

from lmcache_remote.config import CacheConfig
from lmcache_remote.storage.session.client import client_kwargs
from lmcache_remote.storage.wire import bulk as wire_mod
from lmcache_remote.storage.wire import resp
from lmcache_remote.storage.wire.arena import Arena, ArenaPool
from lmcache_remote.storage.wire.bulk import BulkPipeline, supports
from lmcache_remote.storage.wire.commands import chunk_write_command, command_key
from lmcache_remote.storage.wire.resp import pack


@pytest.fixture(params=[False, True], ids=["python", "native"])
def native(request: pytest.FixtureRequest) -> bool:
    """Which reader the test's `BulkPipeline` uses."""
    if request.param and wire_mod._native is None:
        if os.environ.get("LMCR_REQUIRE_NATIVE") == "1":
            pytest.fail("lmcache_remote.native._wire is not built (pip install -e . builds it)")
        pytest.skip("lmcache_remote.native._wire is not built here")
    return bool(request.param)


def test_the_native_loop_is_built_and_on_where_the_test_command_runs() -> None:
    if os.environ.get("LMCR_REQUIRE_NATIVE") != "1":
        pytest.skip("LMCR_REQUIRE_NATIVE is not set")
    assert wire_mod._native is not None
    assert wire_mod.NATIVE is (os.environ.get("LMCR_NATIVE_WIRE", "1") != "0")


def _client(url: str, timeout: float = 2.0) -> redis.Redis:
    cfg = CacheConfig(remote_url=url, remote_timeout=timeout)
    return redis.Redis.from_url(url, **client_kwargs(cfg))


def test_pack_sends_big_values_without_copying() -> None:
    big = memoryview(bytearray(200_000))
    pieces = pack(["SET", "k", big])
    assert any(p is big or (isinstance(p, memoryview) and p.obj is big.obj) for p in pieces)
    assert b"".join(bytes(p) for p in pieces) == (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$200000\r\n" + bytes(200_000) + b"\r\n"
    )


def test_replies_of_every_kind(redis_url: str, key_prefix: str, native: bool) -> None:
    client = _client(redis_url)
    wire = BulkPipeline(client, native=native)
    k = f"{key_prefix}:a"
    big = bytes(range(256)) * 1000  # 256 kB: sent as a memoryview, received by recv_into
    replies = wire.execute([
        ("SET", k, big), ("GET", k), ("GET", f"{key_prefix}:missing"),
        ("EXISTS", k, f"{key_prefix}:missing"),
        ("MSET", f"{key_prefix}:b", b"", f"{key_prefix}:c", b"x"),
        ("GET", f"{key_prefix}:b"), ("PEXPIRE", k, 60_000),
    ])
    assert replies[0] == b"OK"
    assert bytes(replies[1]) == big  # type: ignore[arg-type]
    assert replies[2] is None
    assert replies[3] == 1
    assert replies[4] == b"OK"
    assert bytes(replies[5]) == b""  # type: ignore[arg-type]
    assert replies[6] == 1
    assert client.get(k) == big
    client.close()


def test_bulk_replies_land_where_the_sink_says(redis_url: str, key_prefix: str,
                                               native: bool) -> None:
    client = _client(redis_url)
    client.set(f"{key_prefix}:x", b"abcdefghij")
    client.set(f"{key_prefix}:y", b"0123")
    wire = BulkPipeline(client, native=native)
    dest = bytearray(14)
    view = memoryview(dest)

    def sink(index: int, length: int) -> memoryview | list[memoryview]:
        return [view[0:3], view[3:10]] if index == 0 else view[10:14]

    replies = wire.execute([("GET", f"{key_prefix}:x"), ("GET", f"{key_prefix}:y")], sink)
    assert bytes(dest) == b"abcdefghij0123"
    assert isinstance(replies[0], list) and len(replies[0]) == 2
    client.close()


def test_places_given_up_front_take_the_replies_that_fit(redis_url: str, key_prefix: str,
                                                       native: bool) -> None:
    """A list sink: a bulk reply lands in its place when the place's buffers add up to its
    length, in a fresh buffer otherwise (the place untouched); other replies are as always.
    With ``digests`` the native loop gives each reply that landed in its place the XXH3-64 of
    the place's last buffer, and leaves every other entry None (the Python reader leaves
    all of them None: the caller hashes)."""
    import xxhash

    from lmcache_remote import native as native_mod

    client = _client(redis_url)
    x, y, big = f"{key_prefix}:x", f"{key_prefix}:y", f"{key_prefix}:big"
    payload = os.urandom(300_000)
    client.set(x, b"abcdefghij")
    client.set(y, b"0123")
    client.set(big, payload)
    wire = BulkPipeline(client, native=native)
    head, tail = memoryview(bytearray(3)), memoryview(bytearray(7))
    short = memoryview(bytearray(5))  # y is 4 bytes: does not fit
    whole = memoryview(bytearray(len(payload)))
    places: list[Any] = [[head, tail], short, None, None, None, whole]
    digests: list[int | None] = [None] * len(places)
    commands = [("GET", x), ("GET", y), ("GET", f"{key_prefix}:none"), ("EXISTS", x),
                ("GET", x), ("GET", big)]
    replies = wire.execute(commands, places, digests=digests)
    assert replies[0] is places[0] and bytes(head) + bytes(tail) == b"abcdefghij"
    assert replies[1] is not short and bytes(replies[1]) == b"0123"  # type: ignore[arg-type]
    assert bytes(short) == bytes(5)
    assert replies[2] is None and replies[3] == 1
    assert bytes(replies[4]) == b"abcdefghij"  # type: ignore[arg-type]
    assert replies[5] is whole and bytes(whole) == payload
    if native and native_mod.DIGESTS:
        assert digests == [xxhash.xxh3_64_intdigest(b"defghij"), None, None, None, None,
                           xxhash.xxh3_64_intdigest(payload)]
    else:
        assert digests == [None] * len(places)
    with pytest.raises(ValueError, match="places"):
        wire.execute(commands, places[:2])
    client.close()


def test_the_loops_digests_are_the_xxhash_packages() -> None:
    """The receive loop hashes with the xxhash package's own XXH3 (bound by path), so a
    digest it makes is the checksum serde would compute, for every length."""
    import xxhash

    from lmcache_remote import native as native_mod

    if wire_mod._native is None:
        if os.environ.get("LMCR_REQUIRE_NATIVE") == "1":
            pytest.fail("lmcache_remote.native._wire is not built")
        pytest.skip("lmcache_remote.native._wire is not built here")
    assert native_mod.DIGESTS
    data = os.urandom(1 << 20)
    for n in [0, 1, 2, 3, 4, 7, 8, 9, 16, 17, 100, 128, 129, 239, 240, 241, 1000, 1024, 4096,
              65_537, 1 << 20]:
        assert wire_mod._native.xxh3(data[:n]) == xxhash.xxh3_64_intdigest(data[:n]), n


def test_error_replies_are_raised_after_reading_everything(
    redis_url: str, key_prefix: str, native: bool
) -> None:
    client = _client(redis_url)
    client.rpush(f"{key_prefix}:list", b"x")
    wire = BulkPipeline(client, native=native)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        wire.execute([("GET", f"{key_prefix}:list"), ("SET", f"{key_prefix}:after", b"v")])
    assert client.get(f"{key_prefix}:after") == b"v"  # the command after the error still ran
    # the connection went back to the pool in step: the next batch reads its own replies
    assert wire.execute([("GET", f"{key_prefix}:after")])[0] == b"v"
    client.close()


def _streaming_batch(prefix: str, client: redis.Redis) -> tuple[list[tuple], list[int], list]:
    """GETs of values of several sizes, a missing key and a key of the wrong type, with their
    expected replies (bytes, None, or the error class)."""
    commands: list[tuple] = []
    sizes: list[int] = []
    expected: list = []
    for i in range(30):
        value = bytes([i]) * (300_000 if i % 3 == 0 else 70_000 + i)
        client.set(f"{prefix}:v{i}", value)
        commands.append(("GET", f"{prefix}:v{i}"))
        sizes.append(len(value))
        expected.append(value)
    client.rpush(f"{prefix}:list", b"x")
    commands[7:7] = [("GET", f"{prefix}:missing"), ("GET", f"{prefix}:list")]
    sizes[7:7] = [0, 0]
    expected[7:7] = [None, redis.ResponseError]
    return commands, sizes, expected


def test_streamed_batch_reads_what_a_plain_batch_reads(redis_url: str, key_prefix: str,
                                                       native: bool) -> None:
    """Commands sent as replies come in give the same replies, in place where the sink says,
    raise an error reply only after reading everything, and leave the connection in step."""
    client = _client(redis_url)
    commands, sizes, expected = _streaming_batch(key_prefix, client)
    ok = [i for i, e in enumerate(expected) if isinstance(e, bytes)]
    wire = BulkPipeline(client, native=native)
    dests = {i: memoryview(bytearray(sizes[i])) for i in ok}
    for inflight in (1, 200_000, 650_000, 10**9):
        for dest in dests.values():
            dest[:] = bytes(len(dest))
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            wire.execute(commands, lambda i, n: dests.get(i), reply_sizes=sizes,
                         inflight_bytes=inflight)
        assert all(bytes(dests[i]) == expected[i] for i in ok), inflight
    good = [commands[i] for i in range(len(commands)) if i != 8]
    replies = wire.execute(good, reply_sizes=[s for i, s in enumerate(sizes) if i != 8],
                           inflight_bytes=400_000)
    assert [None if r is None else bytes(r) for r in replies] == [  # type: ignore[arg-type]
        e for i, e in enumerate(expected) if i != 8]
    with pytest.raises(ValueError, match="reply sizes"):
        wire.execute(good, reply_sizes=sizes[:3], inflight_bytes=1)
    assert bytes(wire.execute([("GET", f"{key_prefix}:v1")])[0]) == expected[1]  # type: ignore
    client.close()


def test_streamed_batch_keeps_replies_in_flight_under_the_bound(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each send goes out only when the replies asked for and not yet read stay within
    ``inflight_bytes`` (or nothing is out: one command always goes). The Python reader,
    observed from inside; the native loop's bound is checked from the server side below."""
    client = _client(redis_url)
    commands, sizes, _ = _streaming_batch(key_prefix, client)
    del commands[8], sizes[8]
    read = [0]
    events: list[tuple[int, int]] = []  # (replies read, commands sent so far) at each send
    real_reply, real_send = resp.RespReader.reply, BulkPipeline._send

    def reply(self, index, sink):  # type: ignore[no-untyped-def]
        out = real_reply(self, index, sink)
        read[0] += 1
        return out

    def send(sock, batch):  # type: ignore[no-untyped-def]
        events.append((read[0], (events[-1][1] if events else 0) + len(batch)))
        real_send(sock, batch)

    monkeypatch.setattr(resp.RespReader, "reply", reply)
    monkeypatch.setattr(BulkPipeline, "_send", staticmethod(send))
    bound = 650_000
    BulkPipeline(client, native=False).execute(commands, reply_sizes=sizes, inflight_bytes=bound)
    assert events[-1][1] == len(commands) and len(events) > 3
    for done, sent in events:
        out = sizes[done:sent]
        assert sent > done and (len(out) == 1 or sum(out) <= bound), (done, sent)
    client.close()



def test_reads_ask_two_of_their_largest_chunks_ahead_at_most_the_cap() -> None:
    """The fast read path's in-flight bound follows the chunks: two of the largest (the one
    being read and the next), never more than `INFLIGHT_BYTES` (32 MiB chunks' parts)."""
    from lmcache_remote.storage.wire.windows import INFLIGHT_BYTES, read_ahead

    assert read_ahead([1_044_160 + 4_416] * 256) == 2 * 2**20  # head and tail: a whole chunk
    assert read_ahead([3 * 2**20, 2**20]) == 6 * 2**20 <= INFLIGHT_BYTES
    assert read_ahead([33 * 2**20]) == INFLIGHT_BYTES
    assert read_ahead([]) == 0  # no replies, nothing to ask for


def _stored_chunks(redis_url: str, key_prefix: str, heads: int, head_dim: int,
                   **settings: Any) -> tuple[Any, list[Any], list[Any]]:
    """A raw `RedisTier` over 4 chunks of 256 tokens (4 layers, bfloat16), written: chunk i
    filled with i. Returns the tier, the specs and the written chunks."""
    import torch

    from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase
    from lmcache_remote.storage.chunks.redis_tier import RedisTier
    from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
    from lmcache_remote.telemetry.metrics import Metrics

    layout = ChunkLayout(4, heads, head_dim, torch.bfloat16)
    db = TokenDatabase(KeyNamespace("wire/tier", 1, 0, "bfloat16"), 256, save_unfull_chunk=True)
    specs = db.chunks(list(range(256 * 4)))
    pool = MemoryPool(64 * 1024 * 1024, pin_memory=False)
    objs = [pool.allocate(layout.shape(s.num_tokens), layout.dtype) for s in specs]
    for i, obj in enumerate(objs):
        assert obj is not None
        obj.tensor.fill_(i)
    cfg = CacheConfig(remote_url=redis_url, key_prefix=key_prefix, serde="raw", **settings)
    tier = RedisTier(cfg, layout, pool, Metrics())
    assert sum(tier.put_each([s.key for s in specs], objs)) == len(specs)  # type: ignore[arg-type]
    return tier, specs, objs


def test_a_get_keeps_two_whole_chunks_asked_ahead(redis_url: str, key_prefix: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """What `RedisTier.get` asks its connection for: two chunks' worth of replies ahead, so
    with a head and a tail per chunk (1 MiB chunks) the next chunk's head is asked for before
    this chunk's is read."""
    tier, specs, objs = _stored_chunks(redis_url, key_prefix, 2, 128)  # 1 MiB per chunk
    assert all(len(tier._keys(s)) == 2 for s in specs)  # a head and a tail each
    seen: list[tuple[list[int], int]] = []
    real = BulkPipeline.execute

    def execute(self, commands, sink=None, *, reply_sizes=None, inflight_bytes=0, **kw):  # type: ignore[no-untyped-def]
        if reply_sizes is not None:
            seen.append((list(reply_sizes), inflight_bytes))
        return real(self, commands, sink, reply_sizes=reply_sizes,
                    inflight_bytes=inflight_bytes, **kw)

    monkeypatch.setattr(BulkPipeline, "execute", execute)
    got = tier.get(specs)
    assert [int(o.tensor[0, 0, 0, 0, 0]) for o in got] == list(range(len(specs)))
    assert seen and all(ahead >= sum(sizes[:4]) for sizes, ahead in seen)  # two chunks
    for obj in got + objs:
        obj.release()  # type: ignore[union-attr]
    tier.close()


def test_noperm_and_oom_replies(redis_factory: object, key_prefix: str, native: bool) -> None:
    server: RedisServer = redis_factory()  # type: ignore[operator]
    admin = server.client()
    admin.acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["*"],
                      commands=["+get", "+exists", "+ping", "+hello", "+client"])
    url = f"redis://reader:pw@127.0.0.1:{server.port}/0"
    wire = BulkPipeline(_client(url), native=native)
    with pytest.raises(redis.exceptions.NoPermissionError):
        wire.execute([("SET", "k", b"v")])
    assert wire.execute([("GET", "k")]) == [None]
    admin.config_set("maxmemory", 1)
    with pytest.raises(redis.ResponseError, match="OOM"):
        BulkPipeline(admin, native=native).execute([("SET", "k", b"v" * 1000)])
    admin.close()


@pytest.mark.parametrize("places", [False, True], ids=["sink", "places"])
def test_timeout_raises_and_the_connection_is_dropped(private_redis: RedisServer,
                                                      native: bool, places: bool) -> None:
    """Also with places given up front, where the native loop waits without the GIL and must
    take it back to raise."""
    client = _client(private_redis.url, timeout=0.3)
    client.set("k", b"v" * 100_000)
    wire = BulkPipeline(client, native=native)
    private_redis.pause()
    try:
        start = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            wire.execute([("GET", "k")], [memoryview(bytearray(100_000))] if places else None)
        assert time.monotonic() - start < bound(1, 0.3)  # the socket timeout, not a hang
    finally:
        private_redis.resume()
    pool = client.connection_pool
    assert all(c._sock is None for c in pool._available_connections)  # type: ignore[attr-defined]
    assert bytes(wire.execute([("GET", "k")])[0]) == b"v" * 100_000  # type: ignore[arg-type]
    client.close()


@pytest.mark.parametrize("places", [False, True], ids=["sink", "places"])
def test_connection_lost_mid_reply_raises_connection_error(private_redis: RedisServer,
                                                          native: bool, places: bool) -> None:
    client = _client(private_redis.url, timeout=5.0)
    size = 64 * 1024 * 1024
    client.set("big", b"z" * size)
    wire = BulkPipeline(client, native=native)
    dests = [memoryview(bytearray(size)) for _ in range(4)] if places else None
    killer = threading.Timer(0.02, private_redis.kill)
    killer.start()
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        for _ in range(100):
            wire.execute([("GET", "big")] * 4, dests)
    killer.join()
    pool = client.connection_pool
    assert all(c._sock is None for c in pool._available_connections)  # type: ignore[attr-defined]
    client.close()


def test_supports_only_single_node_clients() -> None:
    assert supports(redis.Redis())
    assert not supports(object())


def test_arena_reuses_its_block() -> None:
    arena = Arena()
    arena.reserve(100)
    a = arena.take(40)
    b = arena.take(60)
    a[:] = b"a" * 40
    b[:] = b"b" * 60
    assert arena.capacity == 100
    arena.reset()
    assert arena.take(100).obj is a.obj  # same memory again, no new allocation
    big = arena.take(10)  # past the block: a new one, old slices stay valid
    assert big.obj is not a.obj and bytes(b) == b"b" * 60
    pool = ArenaPool(keep=1)
    first = pool.acquire()
    pool.release(first)
    assert pool.acquire() is first


def test_a_value_given_as_several_buffers_is_one_value(redis_url: str, key_prefix: str,
                                                       native: bool) -> None:
    head, body = b"header:", memoryview(bytes(range(256)) * 400)  # body sent without a copy
    client = _client(redis_url)
    wire = BulkPipeline(client, native=native)
    assert wire.execute([("SET", f"{key_prefix}:joined", (head, body))]) == [b"OK"]
    assert client.get(f"{key_prefix}:joined") == head + bytes(body)
    client.close()


def test_a_seal_fills_in_checksums_as_its_command_is_sent(redis_url: str, key_prefix: str,
                                                         native: bool) -> None:
    """A seal writes each source's XXH3-64 at its offset in a header sent as its own buffer,
    then the low 32 bits of the header's own XXH3 at ``sum_at``; what Redis stores is the
    sealed header, byte for byte, on both readers. Commands without a seal go out as given."""
    import xxhash

    client = _client(redis_url)
    wire = BulkPipeline(client, native=native)
    bodies = [bytes(range(256)) * 1000, b"tail" * 1111]  # one sent as a view, one coalesced
    headers = [bytearray(b"H" * 8 + bytes(16) + b"M" * 4 + bytes(4)) for _ in range(3)]
    commands: list[Any] = [
        ("MSET", f"{key_prefix}:s0", (headers[0], memoryview(bodies[0])),
         f"{key_prefix}:s1", bodies[1]),
        ("SET", f"{key_prefix}:plain", b"as given"),
        ("SET", f"{key_prefix}:s2", (headers[1], bodies[1])),
        ("SET", f"{key_prefix}:s3", headers[2]),
    ]
    seals: list[Any] = [(headers[0], [memoryview(bodies[0]), bodies[1]], [8, 16], 28), None,
                        (headers[1], [bodies[1]], [16], -1), (headers[2], [], [], 28)]
    assert wire.execute(commands, seals=seals) == [b"OK"] * 4

    def sealed(header: bytes, digests: dict[int, bytes], sum_at: int) -> bytes:
        out = bytearray(header)
        for at, data in digests.items():
            out[at:at + 8] = xxhash.xxh3_64_intdigest(data).to_bytes(8, "little")
        if sum_at >= 0:
            out[sum_at:sum_at + 4] = (xxhash.xxh3_64_intdigest(bytes(out[:sum_at]))
                                      & 0xFFFFFFFF).to_bytes(4, "little")
        return bytes(out)

    blank = b"H" * 8 + bytes(16) + b"M" * 4 + bytes(4)
    want0 = sealed(blank, {8: bodies[0], 16: bodies[1]}, 28)
    want2 = sealed(blank, {16: bodies[1]}, -1)
    assert want0 != blank and bytes(headers[0]) == want0
    assert client.get(f"{key_prefix}:s0") == want0 + bodies[0]
    assert client.get(f"{key_prefix}:s1") == bodies[1]
    assert client.get(f"{key_prefix}:plain") == b"as given"
    assert client.get(f"{key_prefix}:s2") == want2 + bodies[1]
    assert client.get(f"{key_prefix}:s3") == sealed(blank, {}, 28)
    client.close()


def test_a_seal_hashes_the_parts_sent_before_its_header_as_they_go(
    redis_url: str, key_prefix: str, native: bool
) -> None:
    """A chunk as `chunk_write_command` names it, last part first and the header last: the
    native loop hashes each part ahead of the header as it sends it (a part over 256 KiB one
    piece at a time), and the rest (a part coalesced into a small buffer, part 0 after the
    header) before the header goes. Every digest is still the XXH3-64 of its whole part, on
    both readers."""
    import xxhash

    client = _client(redis_url)
    wire = BulkPipeline(client, native=native)
    rng = random.Random(7)
    big = memoryview(rng.randbytes(3 * 256 * 1024 + 12345))  # four pieces, the last short
    small = b"small part" * 10  # coalesced by `pack`
    part0 = memoryview(rng.randbytes(300 * 1024))  # after the header, in value 0
    header = bytearray(b"H" * 8 + bytes(24) + bytes(4))
    keys = [f"{key_prefix}:big", f"{key_prefix}:small", f"{key_prefix}:head"]
    command = chunk_write_command(keys[::-1], [(header, part0), small, big], None)
    assert command[1] == keys[0] and command_key(command) == keys[2]
    seal = (header, [part0, small, big], [24, 16, 8], 32)
    assert wire.execute([command, ("PING",)], seals=[seal, None]) == [b"OK", b"PONG"]
    want = bytearray(b"H" * 8 + bytes(24) + bytes(4))
    for at, data in ((8, big), (16, small), (24, part0)):
        want[at:at + 8] = xxhash.xxh3_64_intdigest(bytes(data)).to_bytes(8, "little")
    want[32:36] = (xxhash.xxh3_64_intdigest(bytes(want[:32])) & 0xFFFFFFFF).to_bytes(4, "little")
    assert bytes(header) == bytes(want)
    assert client.get(keys[2]) == bytes(want) + bytes(part0)
    assert client.get(keys[0]) == bytes(big) and client.get(keys[1]) == small
    client.close()


@pytest.mark.parametrize("seal", [
    (bytearray(16), [b"x"], [9], -1), (bytearray(16), [b"x"], [-1], -1),
    (bytearray(16), [], [], 13), (bytearray(16), [b"x", b"y"], [0], -1),
], ids=["offset-past-end", "negative-offset", "sum-past-end", "offsets-short"])
def test_a_seal_outside_its_buffer_is_refused_before_anything_is_sent(
    redis_url: str, key_prefix: str, native: bool, seal: Any
) -> None:
    client = _client(redis_url)
    wire = BulkPipeline(client, native=native)
    with pytest.raises(ValueError):
        wire.execute([("SET", f"{key_prefix}:never", (seal[0], b"body"))], seals=[seal])
    assert seal[0] == bytearray(16) and client.exists(f"{key_prefix}:never") == 0
    assert wire.execute([("PING",)]) == [b"PONG"]  # the pool's connections still work
    client.close()


def test_the_tiers_sealed_writes_store_exactly_what_serde_encodes(
    redis_url: str, key_prefix: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`RedisTier.put_each` leaves a chunk's checksums to the wire's seals; every value it stores
    is byte for byte the one `Serde.encode` makes with its checksums computed up front."""
    monkeypatch.setattr(wire_mod, "NATIVE", native)
    tier, specs, objs = _stored_chunks(redis_url, key_prefix, 2, 32, remote_part_size=96 * 1024)
    client = redis.Redis.from_url(redis_url)
    for spec, obj in zip(specs, objs, strict=True):
        want = tier.serde.encode(obj, spec.key.hash_bytes, spec.num_tokens)
        keys = tier._keys(spec)
        assert len(keys) == len(want) >= 2
        assert [client.get(k) for k in keys] == [bytes(v) for v in want]
    for obj in objs:
        obj.release()  # type: ignore[union-attr]
    client.close()
    tier.close()


def test_a_raw_get_on_the_native_loop_checks_its_loops_digests(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`RedisTier.get` (raw, native loop): every part is checked against the digest the loop
    made as it arrived, so serde hashes only the small headers; a part damaged in Redis is
    still caught, by that digest, and cuts the read there."""
    import torch

    from lmcache_remote import native as native_mod
    from lmcache_remote.values import serde as serde_mod
    from lmcache_remote.values import value_format

    if wire_mod._native is None or not native_mod.DIGESTS:
        if os.environ.get("LMCR_REQUIRE_NATIVE") == "1":
            pytest.fail("the native loop with digests is required here")
        pytest.skip("no native loop with digests here")
    monkeypatch.setattr(wire_mod, "NATIVE", True)
    # 256 KiB per chunk, in 32 KiB parts
    tier, specs, objs = _stored_chunks(redis_url, key_prefix, 2, 32, remote_part_size=32 * 1024)
    assert all(len(tier._keys(s)) >= 4 for s in specs)
    hashed: list[int] = []
    real = serde_mod.checksum

    def counting(data: Any) -> int:
        hashed.append(len(memoryview(data).cast("B")))
        return real(data)

    monkeypatch.setattr(serde_mod, "checksum", counting)
    monkeypatch.setattr(value_format, "checksum", counting)  # the headers' checksums
    got = tier.get(specs)
    assert [torch.equal(g.tensor, o.tensor) for g, o in zip(got, objs, strict=True)] == \
        [True] * len(specs)  # type: ignore[union-attr]
    assert hashed and max(hashed) < 1024  # headers only: the parts' digests came from the loop
    for obj in got:
        obj.release()
    client = redis.Redis.from_url(redis_url)
    third = tier._keys(specs[2])[2]  # a part of the third chunk, flipped in Redis
    value = bytearray(client.get(third))  # type: ignore[arg-type]
    value[100] ^= 0x10
    client.set(third, bytes(value))
    got = tier.get(specs)
    assert len(got) == 2 and tier.metrics.get("remote.corrupt_chunks") == 1
    for obj in got + objs:
        obj.release()  # type: ignore[union-attr]
    client.close()
    tier.close()


@pytest.mark.parametrize(("write", "read"), [
    (("raw", 8192), ("raw", 4096)), (("lz4", 4096), ("raw", 8192)),
    (("raw", 4096), ("lz4-planes", 8192)), (("lz4-planes", 100_000), ("raw", 4096)),
])
def test_tier_reads_chunks_written_with_other_codec_or_part_size(
    redis_url: str, key_prefix: str, write: tuple[str, int], read: tuple[str, int],
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raw replies are received straight into the chunk only when their length fits; a chunk
    written with another part size or codec still decodes, exactly, through the header (with
    either reader)."""
    monkeypatch.setattr(wire_mod, "NATIVE", native)
    import torch

    from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase
    from lmcache_remote.storage.chunks.redis_tier import RedisTier
    from lmcache_remote.storage.local.memory import ChunkLayout, MemoryPool
    from lmcache_remote.telemetry.metrics import Metrics

    layout = ChunkLayout(2, 2, 8, torch.bfloat16)
    db = TokenDatabase(KeyNamespace("wire/model", 1, 0, "bfloat16"), 64, save_unfull_chunk=True)
    specs = db.chunks(list(range(64 * 3 + 10)))
    pool = MemoryPool(64 * 1024 * 1024, pin_memory=False)
    objs = []
    gen = torch.Generator().manual_seed(9)
    for s in specs:
        obj = pool.allocate(layout.shape(s.num_tokens), layout.dtype)
        assert obj is not None
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen).to(layout.dtype))
        objs.append(obj)

    def tier(codec: str, part: int) -> RedisTier:
        cfg = CacheConfig(remote_url=redis_url, key_prefix=key_prefix, serde=codec,
                          remote_part_size=part)
        return RedisTier(cfg, layout, pool, Metrics())

    writer, reader = tier(*write), tier(*read)
    assert reader.wire is not None and reader.wire.native is native
    assert sum(writer.put_each([s.key for s in specs], objs)) == len(specs)
    got = reader.get(specs)
    assert len(got) == len(specs)
    for want, have in zip(objs, got, strict=True):
        assert torch.equal(want.tensor.view(torch.uint8), have.tensor.view(torch.uint8))
        have.release()
    assert reader.metrics.snapshot().get("remote", {}).get("corrupt_chunks", 0) == 0
    writer.close()
    reader.close()


def test_send_buffers_sends_every_byte_in_order_across_partial_sends() -> None:
    """More buffers than one sendmsg takes, empty ones among them, and more bytes than the
    socket buffer holds (so sendmsg returns partial counts): the peer reads exactly their
    concatenation."""
    from lmcache_remote.storage.wire.resp import send_buffers

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    buffers = [bytes([i % 251]) * (i % 7) for i in range(3000)] + [memoryview(bytes(3 << 20))]
    want = b"".join(bytes(x) for x in buffers)
    got = bytearray()

    def read() -> None:
        while len(got) < len(want):
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    send_buffers(a, buffers)
    reader.join(60)
    a.close()
    b.close()
    assert bytes(got) == want


# -- both readers against a scripted server (one end of a socket pair) -------------------------


def _scripted(native: bool, script: Callable[[socket.socket], None],
              commands: list[tuple[str, str]], sink: Any = None,
              sizes: list[int] | None = None, inflight: int = 0,
              digests: list[int | None] | None = None) -> list[Any]:
    """Runs a batch on one end of a socket pair while ``script`` plays the server on the
    other; returns the replies, or raises what `BulkPipeline.execute` would raise."""
    client_end, server_end = socket.socketpair()
    client_end.settimeout(20)
    server_end.settimeout(20)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            script(server_end)
        except BaseException as exc:  # reported by the test, not lost in the thread
            failure.append(exc)
        finally:
            server_end.close()

    thread = threading.Thread(target=serve)
    thread.start()
    pipeline = BulkPipeline(redis.Redis(), native=native)
    try:
        return pipeline._run(types.SimpleNamespace(_sock=client_end), commands, sink, sizes,
                             inflight, digests)
    except BaseException as exc:
        raise resp.translate(exc) from exc
    finally:
        client_end.close()
        thread.join(30)
        assert not thread.is_alive()
        if failure:
            raise failure[0]


def _gets(n: int) -> tuple[list[tuple[str, str]], list[bytes]]:
    commands = [("GET", f"k{i}") for i in range(n)]
    return commands, [resp.pack_command(c) for c in commands]


def _read_commands(sock: socket.socket, packed: list[bytes], have: bytearray, count: int
                   ) -> None:
    """Reads from ``sock`` until ``have`` holds the first ``count`` packed commands."""
    want = sum(len(p) for p in packed[:count])
    while len(have) < want:
        data = sock.recv(65536)
        assert data, "client closed early"
        have += data
    assert bytes(have[:want]) == b"".join(packed[:count])


def test_every_reply_kind_byte_by_byte_reads_the_same(native: bool) -> None:
    """Replies that arrive one byte per send (lines, lengths and CRLFs cut everywhere): both
    readers return the same replies."""
    commands, packed = _gets(8)
    payload = bytes(range(256)) * 300
    replies = [b"$%d\r\n%s\r\n" % (len(payload), payload), b"$-1\r\n", b":42\r\n",
               b":-7\r\n", b"+OK\r\n", b"-ERR no such thing\r\n", b"$0\r\n\r\n",
               b"$3\r\n\r\n\r\r\n"]
    wire = b"".join(replies)

    def script(sock: socket.socket) -> None:
        _read_commands(sock, packed, bytearray(), len(packed))
        for i in range(len(wire)):
            sock.sendall(wire[i:i + 1])

    got = _scripted(native, script, commands)
    assert bytes(got[0]) == payload
    assert got[1] is None and got[2] == 42 and got[3] == -7 and got[4] == b"OK"
    assert isinstance(got[5], redis.ResponseError) and "no such thing" in str(got[5])
    assert bytes(got[6]) == b"" and bytes(got[7]) == b"\r\n\r"


def test_an_array_reply_is_its_length_or_its_first_error_byte_by_byte(native: bool) -> None:
    """EXEC's and scripts' array replies: the batch keeps an array's length, or the first
    error element inside it (nested arrays and bulk strings skipped whole), and the replies
    after it stay in step; with either reader, the bytes arriving one at a time."""
    commands, packed = _gets(5)
    replies = [b"*3\r\n+OK\r\n:1\r\n:1\r\n",
               b"*3\r\n+OK\r\n-ERR inside the transaction\r\n-ERR second\r\n",
               b"*2\r\n*2\r\n$5\r\nhello\r\n$-1\r\n:7\r\n",
               b"*-1\r\n", b":9\r\n"]
    wire = b"".join(replies)

    def script(sock: socket.socket) -> None:
        _read_commands(sock, packed, bytearray(), len(packed))
        for i in range(len(wire)):
            sock.sendall(wire[i:i + 1])

    got = _scripted(native, script, commands)
    assert got[0] == 3
    assert isinstance(got[1], redis.ResponseError) and "inside the transaction" in str(got[1])
    assert got[2] == 2 and got[3] is None and got[4] == 9


@pytest.mark.parametrize("reply", [b"*1\r\n$1\r\na", b"*1\r\n%1\r\n", b"$3\r\nabcXY",
                                   b"$x\r\n", b":12a\r\n", b"$5\r\nab"])
def test_a_reply_not_understood_or_cut_off_is_a_connection_error(native: bool, reply: bytes
                                                                   ) -> None:
    commands, packed = _gets(1)

    def script(sock: socket.socket) -> None:
        _read_commands(sock, packed, bytearray(), 1)
        sock.sendall(reply)  # then the server end closes

    with pytest.raises(redis.ConnectionError):
        _scripted(native, script, commands)


def test_a_write_cut_off_by_the_server_is_a_connection_error_and_sends_the_values_whole(
        native: bool) -> None:
    """Writes: each value goes out from the caller's buffer (several buffers for one value
    joined on the wire), byte for byte; a server that closes in the middle of a write batch
    is a ConnectionError, with either reader."""
    value = os.urandom(300_000)
    head, body = value[:1000], memoryview(value)[1000:]
    commands: list[tuple[Any, ...]] = [("SET", "a", memoryview(value)), ("SET", "b", (head, body)),
                                       ("SET", "c", b"small")]
    wire = b"".join(b"".join(bytes(p) for p in pack(c)) for c in commands)

    def script(sock: socket.socket) -> None:
        got = bytearray()
        while len(got) < len(wire):
            data = sock.recv(65536)
            assert data, "client closed early"
            got += data
        assert bytes(got) == wire
        sock.sendall(b"+OK\r\n+OK\r\n+OK\r\n")

    assert _scripted(native, script, commands) == [b"OK", b"OK", b"OK"]

    def cut(sock: socket.socket) -> None:
        sock.recv(1000)  # then the server end closes, a write half sent

    with pytest.raises(redis.ConnectionError):
        _scripted(native, cut, commands * 40)


def test_bytes_after_the_last_reply_are_a_connection_error(native: bool) -> None:
    commands, packed = _gets(1)

    def script(sock: socket.socket) -> None:
        _read_commands(sock, packed, bytearray(), 1)
        sock.sendall(b"+OK\r\n+EXTRA\r\n")

    with pytest.raises(redis.ConnectionError, match="unexpected bytes"):
        _scripted(native, script, commands)


def test_sends_follow_the_replies_within_the_bound(native: bool) -> None:
    """Seen from the server: before reply k goes out the client has sent exactly the commands
    whose replies, from k on, fit within ``inflight`` (at least command k), never more; the
    payloads land where the sink says, bit for bit."""
    sizes = [300_000 if i % 3 == 0 else 70_000 + i for i in range(24)]
    bound = 650_000
    commands, packed = _gets(len(sizes))
    values = [bytes([i]) * n for i, n in enumerate(sizes)]
    dests = [memoryview(bytearray(n)) for n in sizes]

    def sent_before(k: int) -> int:
        end, out = k + 1, sizes[k]
        while end < len(sizes) and out + sizes[end] <= bound:
            out += sizes[end]
            end += 1
        return end

    def script(sock: socket.socket) -> None:
        have = bytearray()
        for k, value in enumerate(values):
            expect = sent_before(k)
            _read_commands(sock, packed, have, expect)
            assert len(have) == sum(len(p) for p in packed[:expect]), k  # nothing more yet
            sock.sendall(b"$%d\r\n" % len(value))
            sock.sendall(value[:1000])
            sock.sendall(value[1000:] + b"\r\n")

    got = _scripted(native, script, commands, lambda i, n: dests[i], sizes, bound)
    assert [bytes(d) for d in dests] == values
    assert all(g is d for g, d in zip(got, dests, strict=True))


_REPLY = st.one_of(
    st.binary(max_size=70_000).map(lambda b: ("bulk", b)),
    st.just(("nil", None)),
    st.integers(-(2**62), 2**62).map(lambda n: ("int", n)),
    st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)
      .map(lambda b: ("status", b)),
    st.text(alphabet="abcdefgh XYZ-:", max_size=40).map(lambda t: ("error", "ERR " + t)),
)


def _encode(kind: str, value: Any) -> bytes:
    if kind == "bulk":
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if kind == "nil":
        return b"$-1\r\n"
    if kind == "int":
        return b":%d\r\n" % value
    if kind == "status":
        return b"+%s\r\n" % value
    return b"-%s\r\n" % value.encode()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(replies=st.lists(_REPLY, min_size=1, max_size=12),
       cuts=st.lists(st.integers(1, 90_000), min_size=1, max_size=30),
       split_at=st.integers(0, 100))
def test_both_readers_parse_any_replies_cut_anywhere(
    replies: list[tuple[str, Any]], cuts: list[int], split_at: int
) -> None:
    """Random replies of every kind, sent in random pieces: both readers return exactly them,
    bulk payloads landing where the sink says (some split over two buffers), or in places
    given up front when they fit (the native loop hashing exactly those), and agree."""
    import xxhash

    from lmcache_remote import native as native_mod

    commands, packed = _gets(len(replies))
    wire = b"".join(_encode(k, v) for k, v in replies)
    results = []
    readers = [False, True] if wire_mod._native is not None else [False]
    for native, up_front in [(n, g) for n in readers for g in (False, True)]:
        dests: dict[int, list[memoryview]] = {}

        def sink(index: int, length: int, dests: dict[int, list[memoryview]] = dests
                 ) -> list[memoryview]:
            buf = memoryview(bytearray(length))
            cut = min(length, split_at)
            dests[index] = [buf[:cut], buf[cut:]] if 0 < cut < length else [buf]
            return dests[index]

        if up_front:  # the same places up front, for bulk replies; every third one a byte off
            places: list[Any] = [None] * len(replies)
            for i, (kind, value) in enumerate(replies):
                if kind == "bulk":
                    places[i] = sink(i, len(value) + (1 if i % 3 == 2 else 0))

        def script(sock: socket.socket) -> None:
            _read_commands(sock, packed, bytearray(), len(packed))
            pos, i = 0, 0
            while pos < len(wire):
                step = cuts[i % len(cuts)]
                sock.sendall(wire[pos:pos + step])
                pos, i = pos + step, i + 1

        digests: list[int | None] = [None] * len(replies)
        got = _scripted(native, script, commands, places if up_front else sink, digests=digests)
        out = []
        for i, ((kind, value), reply) in enumerate(zip(replies, got, strict=True)):
            if kind == "bulk":
                parts = reply if isinstance(reply, list) else [reply]
                assert b"".join(bytes(p) for p in parts) == value
                if up_front:  # in its place exactly when the place fits
                    fits = i % 3 != 2
                    assert (reply is places[i] or reply is places[i][0]) is fits
                    hashed = native and fits and native_mod.DIGESTS
                    assert digests[i] == (xxhash.xxh3_64_intdigest(bytes(parts[-1]))
                                          if hashed else None)
                out.append(value)
            elif kind == "error":
                assert isinstance(reply, redis.ResponseError) and str(reply) == value
                out.append(str(reply))
            elif kind == "nil":
                assert reply is None
                out.append(None)
            else:
                assert reply == value
                out.append(reply)
        results.append(out)
    assert all(r == results[0] for r in results)


# -- a server cannot make the reader allocate what it announces ------------------------------

class _Announcer:
    """A scripted server: to every command it answers a bulk reply of `length` bytes and sends
    none of them, leaving the connection open (a reader that believed it would wait)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self.conns.append(conn)
        conn.recv(65536)
        conn.sendall(f"${self.length}\r\n".encode())

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.mark.filterwarnings("ignore:Call to '__init__' function with deprecated usage")
@pytest.mark.parametrize("sink", ["none", "callable", "places"])
def test_a_bulk_reply_longer_than_expected_is_refused_unallocated(native: bool,
                                                                  sink: str) -> None:
    """A reply announced as 2**40 bytes (1 TiB) is refused before anything is allocated or
    read for it, whatever its destination; within the bound the batch works as before."""
    server = _Announcer(1 << 40)
    client = redis.Redis(port=server.port, socket_timeout=60, protocol=2, lib_name=None,
                         lib_version=None)  # no handshake: the first command is ours
    try:
        wire = BulkPipeline(client, native=native)
        sinks = {"none": None, "callable": lambda index, length: bytearray(length),
                 "places": [bytearray(4096)]}
        with pytest.raises(redis.ConnectionError, match="more than the 1048576 expected"):
            wire.execute([("GET", "k")], sinks[sink], max_bulk=1 << 20)
    finally:
        client.close()
        server.close()
