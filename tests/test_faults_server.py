"""Server faults against real redis-server processes: killed, hung, restarted empty, full.

Every test owns its server (``private_redis`` / ``redis_factory``) so it can hurt it. What each
fault must cost is written down in docs/reliability.md; these tests hold the engine to it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
import redis
from faultkit import bound, check_retrieve, det_kv, sentinel_kv, timed, wait_for
from kvutil import engine
from servers import RedisServer, unread_bytes

from lmcache_remote import CacheEngine

TIMEOUT = 0.5
CHUNK = 256


def toks_for(rng: random.Random, shared: list[list[int]], n_chunks: int) -> list[int]:
    """A request that starts with one of a few shared prefixes, then its own tokens."""
    head = rng.choice(shared)[: CHUNK * rng.randint(0, 2)]
    tail = [rng.randrange(50_000) for _ in range(CHUNK * n_chunks - len(head))]
    return head + tail


def remote_write_works(e: CacheEngine, rng: random.Random) -> bool:
    """Store a new request and flush: True once Redis took it (the engine uses Redis again)."""
    toks = [rng.randrange(50_000) for _ in range(CHUNK)]
    before = e.stats()["remote"].get("written_chunks", 0)
    e.store(toks, det_kv(toks))
    e.flush()
    return e.stats()["remote"].get("written_chunks", 0) > before


# -- killed ------------------------------------------------------------------------------------


def test_sigkill_during_threaded_traffic_then_restart(private_redis: RedisServer,
                                                      key_prefix: str) -> None:
    shared_rng = random.Random(1)
    shared = [[shared_rng.randrange(50_000) for _ in range(2 * CHUNK)] for _ in range(3)]
    errors: list[BaseException] = []
    slowest = [0.0]
    stop = threading.Event()
    hits_exact = [0]
    lock = threading.Lock()

    def worker(e: CacheEngine, seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                toks = toks_for(rng, shared, 3)
                accepted, t_store = timed(lambda t=toks: e.store(t, det_kv(t)))
                assert 0 <= accepted <= len(toks)
                dst, read = sentinel_kv(len(toks))
                hit, t_get = timed(lambda t=toks, d=dst: e.retrieve(t, d))
                n = check_retrieve(hit, toks, read)
                _, t_look = timed(lambda t=toks: e.lookup(t))
                with lock:
                    slowest[0] = max(slowest[0], t_store, t_get, t_look)
                    hits_exact[0] += n > 0
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    with engine(private_redis.url, key_prefix, local_cpu=False, remote_timeout=TIMEOUT,
                unhealthy_backoff=0.2) as e:
        threads = [threading.Thread(target=worker, args=(e, s)) for s in range(4)]
        for t in threads:
            t.start()

        def remote(name: str) -> int:
            return int(e.stats()["remote"].get(name, 0))

        def exact_hits() -> int:
            with lock:
                return hits_exact[0]

        # traffic reaches Redis and hits come back, then the kill, which the workers meet
        assert wait_for(lambda: remote("written_chunks") > 0 and exact_hits() > 0)
        written_before_kill = remote("written_chunks")
        private_redis.kill()
        assert wait_for(lambda: remote("errors") >= 1 and remote("dropped_chunks") >= 1)
        private_redis.start()  # same port, empty
        written_at_restart = remote("written_chunks")
        assert wait_for(lambda: remote("written_chunks") > written_at_restart)  # writes again
        stop.set()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a call hung"
        assert not errors, errors
        # a retrieve may make one retried call plus a clean-up: bounded by 3 timeouts
        assert slowest[0] < bound(3, TIMEOUT)
        stats = e.stats()["remote"]
        assert written_before_kill > 0 and hits_exact[0] > 0
        assert stats["errors"] >= 1 and stats["dropped_chunks"] >= 1

        # the same engine, never restarted, writes to and hits in the new server again
        rng = random.Random(99)
        assert wait_for(lambda: remote_write_works(e, rng))
        toks = [rng.randrange(50_000) for _ in range(3 * CHUNK)]
        assert e.store(toks, det_kv(toks)) == len(toks)
        assert e.flush() is True
        dst, read = sentinel_kv(len(toks))
        assert check_retrieve(e.retrieve(toks, dst), toks, read) == len(toks)
        assert e.stats()["remote"]["healthy"] is True


def test_restarted_empty_is_a_miss_not_an_error(private_redis: RedisServer,
                                               key_prefix: str) -> None:
    toks = [random.Random(3).randrange(50_000) for _ in range(4 * CHUNK)]
    with engine(private_redis.url, key_prefix, local_cpu=False, remote_timeout=TIMEOUT) as e:
        assert e.store(toks, det_kv(toks)) == len(toks)
        assert e.flush() is True
        assert e.lookup(toks) == len(toks)
        private_redis.restart()  # pooled connections now point at a dead process
        errors_before = e.stats()["remote"].get("errors", 0)
        assert e.lookup(toks) == 0
        dst, read = sentinel_kv(len(toks))
        assert check_retrieve(e.retrieve(toks, dst), toks, read) == 0
        stats = e.stats()["remote"]
        assert stats.get("errors", 0) == errors_before  # a broken pooled connection is retried
        assert stats.get("corrupt_chunks", 0) == 0
        assert stats["healthy"] is True
        # and it fills again
        assert e.store(toks, det_kv(toks)) == len(toks)
        assert e.flush() is True
        assert e.lookup(toks) == len(toks)


# -- hung --------------------------------------------------------------------------------------


def test_sigstop_bounds_every_call_and_sigcont_recovers(private_redis: RedisServer,
                                                        key_prefix: str) -> None:
    rng = random.Random(5)
    stored = [rng.randrange(50_000) for _ in range(4 * CHUNK)]
    backoff = 5.0  # longer than anything below takes while the server hangs
    with engine(private_redis.url, key_prefix, local_cpu=False, remote_timeout=TIMEOUT,
                unhealthy_backoff=backoff) as e:
        assert e.store(stored, det_kv(stored)) == len(stored)
        assert e.flush() is True
        private_redis.pause()
        try:
            durations: list[float] = []
            errors: list[BaseException] = []

            def one_call(kind: int) -> None:
                try:
                    toks = stored if kind % 2 else [rng.randrange(50_000) for _ in range(CHUNK)]
                    dst, read = sentinel_kv(len(toks))
                    calls: list[Callable[[], object]] = [
                        lambda: e.lookup(toks),
                        lambda: check_retrieve(e.retrieve(toks, dst), toks, read),
                        lambda: e.store(toks, det_kv(toks)),
                    ]
                    _, took = timed(calls[kind % 3])
                    durations.append(took)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)

            # calls from several threads at once, while the server hangs
            threads = [threading.Thread(target=one_call, args=(k,)) for k in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert not errors, errors
            assert len(durations) == 6
            assert max(durations) < bound(1, TIMEOUT)  # one timeout each, not one per call
            assert e.stats()["remote"]["healthy"] is False
            assert unread_bytes(private_redis.port) > 0  # those calls did reach the server

            # while unhealthy, the tier is skipped at once: 100 lookups send the hung server
            # not one byte (the kernel's receive queues of its connections do not grow)
            e.flush()  # no write of those calls still in flight (bounded: checked below)
            sent = unread_bytes(private_redis.port)
            assert all(e.lookup(stored) == 0 for _ in range(100))
            assert unread_bytes(private_redis.port) == sent
            _, flush_took = timed(e.flush)
            assert flush_took < bound(2, TIMEOUT)
        finally:
            private_redis.resume()
        # after the back-off one probe goes through and the tier is back, hits exact; the
        # load decision took the timed-out read for a slow link: it probes the link with one
        # chunk (`load_probe_interval`), which measures it, and then loads whole again
        def whole() -> bool:
            dst, read = sentinel_kv(len(stored))
            e.lookup(stored)
            return check_retrieve(e.retrieve(stored, dst), stored, read) == len(stored)

        assert wait_for(whole, backoff * 2 + 30)
        assert e.lookup(stored) == len(stored)
        assert e.stats()["remote"]["healthy"] is True


# -- out of memory -----------------------------------------------------------------------------


def used_memory(server: RedisServer) -> int:
    client = server.client()
    try:
        return int(client.info("memory")["used_memory"])
    finally:
        client.close()


def test_noeviction_full_counts_write_errors_and_reads_still_work(
        redis_factory: Callable[..., RedisServer], key_prefix: str) -> None:
    server = redis_factory()
    limit = used_memory(server) + 1024 * 1024
    client = server.client()
    client.config_set("maxmemory", limit)
    client.config_set("maxmemory-policy", "noeviction")
    rng = random.Random(11)
    first = [rng.randrange(50_000) for _ in range(2 * CHUNK)]
    # keep_policy redis: the learned policy would evict before Redis refuses anything; this
    # is what a full noeviction server costs an engine that leaves eviction to the server
    with engine(server.url, key_prefix, local_cpu=False, remote_timeout=TIMEOUT,
                unhealthy_backoff=5.0, keep_policy="redis") as e:
        assert e.store(first, det_kv(first)) == len(first)
        assert e.flush() is True
        assert e.lookup(first) == len(first)
        # fill the server past maxmemory: later writes are refused by Redis (OOM)
        for _ in range(60):
            toks = [rng.randrange(50_000) for _ in range(4 * CHUNK)]
            e.store(toks, det_kv(toks))
            e.flush()
            if e.stats()["remote"].get("errors", 0):
                break
        stats = e.stats()["remote"]
        assert stats["errors"] >= 1 and stats["dropped_chunks"] >= 1
        # reads go on at once, not skipped for the back-off: the server answers, it is full
        assert e.lookup(first) == len(first)
        dst, read = sentinel_kv(len(first))
        assert check_retrieve(e.retrieve(first, dst), first, read) == len(first)
        assert e.stats()["remote"]["healthy"] is True
        assert e.stats()["remote"].get("corrupt_chunks", 0) == 0
    client.close()


def wait_for_lru_tick(client: redis.Redis, marker: str) -> None:
    """Until Redis's LRU clock (1 s resolution) has ticked since now: a key set now turns idle.
    Everything written before returns is older, to the LRU, than everything written after."""
    client.set(marker, b"1")
    assert wait_for(lambda: int(client.object("idletime", marker) or 0) >= 1)


@pytest.mark.parametrize("part_size", [None, 4096], ids=["one_value", "multipart"])
def test_allkeys_lru_serves_exact_prefixes_never_wrong_kv(
        redis_factory: Callable[..., RedisServer], key_prefix: str,
        part_size: int | None) -> None:
    """~5 MiB of chunks into 3 MiB. Redis's LRU clock ticks once a second and keys of the same
    tick are evicted in random order, so the requests go in two batches a tick apart: the older
    batch is evicted first (part by part: a multi-part chunk missing a part is no hit), and the
    newer one mostly survives."""
    server = redis_factory("--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "10")
    client = server.client()
    client.config_set("maxmemory", used_memory(server) + 3 * 1024 * 1024)
    rng = random.Random(13)
    requests = [[rng.randrange(50_000) for _ in range(4 * CHUNK)] for _ in range(40)]
    # keep_policy redis: Redis's own eviction is what this reads through (the learned policy
    # drops whole chunks before the server would: tests/test_keep.py)
    extra: dict[str, object] = {"keep_policy": "redis"}
    if part_size is not None:
        extra["remote_part_size"] = part_size
    with engine(server.url, key_prefix, local_cpu=False, store_async=False, serde="raw",
                remote_timeout=2.0, **extra) as w:
        for i, toks in enumerate(requests):
            if i == len(requests) // 2:
                wait_for_lru_tick(client, f"{key_prefix}:tick")
            w.store(toks, det_kv(toks))
    assert int(client.info("stats")["evicted_keys"]) > 0
    client.close()
    hit_tokens = partial = 0
    with engine(server.url, key_prefix, local_cpu=False, remote_timeout=2.0, **extra) as r:
        for toks in reversed(requests):  # the newest first: some of them are whole
            dst, read = sentinel_kv(len(toks))
            n = check_retrieve(r.retrieve(toks, dst), toks, read)
            assert n % CHUNK == 0
            hit_tokens += n
            partial += n < len(toks)
        assert r.stats()["remote"].get("errors", 0) == 0
    assert hit_tokens > 0 and partial > 0  # some chunks survived, some were evicted


def test_close_and_flush_with_a_hung_server_are_bounded(private_redis: RedisServer,
                                                        key_prefix: str) -> None:
    rng = random.Random(17)
    e = engine(private_redis.url, key_prefix, remote_timeout=TIMEOUT, unhealthy_backoff=5.0)
    try:
        private_redis.pause()
        for _ in range(5):  # writes queued behind a server that answers nothing
            toks = [rng.randrange(50_000) for _ in range(2 * CHUNK)]
            assert e.store(toks, det_kv(toks)) == len(toks)  # the local tier holds them
        _, took = timed(lambda: e.flush(2 * TIMEOUT))
        assert took < bound(2, TIMEOUT)
        _, took = timed(e.close)
        assert took < bound(6, TIMEOUT)
        assert e.stats()["remote"]["dropped_chunks"] >= 1
    finally:
        private_redis.resume()
        e.close()
