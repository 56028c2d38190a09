"""Sentinel: a master, one replica and three sentinels on loopback. The `redis+sentinel://` URL
alone makes the engine use the master Sentinel names; after a planned fail-over
(`SENTINEL FAILOVER`) and after the master is killed and the replica promoted, stores and
retrieves go on against the new master, and while there is no master the engine misses
without raising. The CLI works on the same URL."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis
import torch
from click.testing import CliRunner
from lmcache_remote_cli.main import cli
from redis.sentinel import SentinelConnectionPool

from lmcache_remote import CacheEngine, PagedKV
from lmcache_remote.naming.keys import scan_pattern
from tests import kvutil
from tests.cluster_servers import SERVICE, SentinelSetup
from tests.servers import RedisServer, ServerNotFoundError, ServerStartError

CHUNK = 64
TOKENS = 512


@pytest.fixture
def sentinel_setup() -> Iterator[SentinelSetup]:
    try:
        setup = SentinelSetup(sentinels=3).start()
    except (ServerNotFoundError, ServerStartError) as exc:
        pytest.fail(f"cannot start the sentinel setup for the tests:\n{exc}")
    try:
        yield setup
    finally:
        setup.stop()


def _round_trip(eng: CacheEngine, tokens: torch.Tensor, seed: int) -> bool:
    """Store then retrieve `tokens`; True when every token came back exactly."""
    src, slots = kvutil.paged_cache("kv_split", torch.bfloat16, seed), kvutil.slots(TOKENS, seed)
    eng.store(tokens, PagedKV(src, slots))
    dst = kvutil.paged_cache("kv_split", torch.bfloat16, None)
    mask = eng.retrieve(tokens, PagedKV(dst, slots))
    if not bool(mask.all()):
        return False
    read = kvutil.token_kv_paged
    assert torch.equal(read(dst, "kv_split", slots), read(src, "kv_split", slots))
    return True


def _until_served_by(
    eng: CacheEngine, setup: SentinelSetup, server: RedisServer, prefix: str, base: int,
    timeout: float = 40,
) -> int:
    """Round-trip new requests until one is stored on `server` and read back; returns the base
    of the request that was. Misses on the way are fine, exceptions are not. (Right after a
    planned fail-over the old master still accepts writes for a few seconds, until the
    sentinels demote it; the engine follows once it is.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        base += 100_000
        if not _is_master(server):  # a replica's count grows by replication: not evidence
            time.sleep(0.2)
            continue
        before = _observe_chunks(server, prefix)
        if before is None:
            continue
        ok = _round_trip(eng, torch.arange(TOKENS) + base, seed=base % 1000)
        if ok and _observe_chunks(server, prefix) == before + TOKENS // CHUNK:
            return base
        time.sleep(0.2)
    raise AssertionError(f"no store/retrieve on the new master {server.port} within {timeout} s")


def _is_master(server: RedisServer) -> bool:
    """Whether `server` is a master now. A server changing role closes its clients' connections,
    this observer's too: that answers "not yet", the caller asks again."""
    try:
        with server.client() as client:
            return bool(client.execute_command("ROLE")[0] == b"master")
    except redis.ConnectionError:
        return False


def _observe_chunks(server: RedisServer, prefix: str) -> int | None:
    """`_chunks_on`, or None where the server closed this observer's connection (role change)."""
    try:
        return _chunks_on(server, prefix)
    except redis.ConnectionError:
        return None


def _wait_replicating(server: RedisServer, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with server.client(decode_responses=True) as client:
            info = client.info("replication")
        if info["role"] == "slave" and info.get("master_link_status") == "up":
            return
        time.sleep(0.2)
    raise AssertionError(f"{server.port} did not become a synced replica within {timeout} s")


def _chunks_on(server: RedisServer, prefix: str) -> int:
    with server.client() as client:
        return len(kvutil.chunk_heads(client.scan_iter(match=scan_pattern(prefix))))


def test_engine_follows_the_master_after_fail_overs(
    sentinel_setup: SentinelSetup, key_prefix: str
) -> None:
    setup = sentinel_setup
    overrides = {"chunk_size": CHUNK, "local_cpu": False, "store_async": False,
                 "remote_timeout": 1.0, "unhealthy_backoff": 0.2}
    with kvutil.engine(setup.url, key_prefix, **overrides) as eng:
        assert isinstance(eng.storage.remote.client.connection_pool, SentinelConnectionPool)
        assert _round_trip(eng, torch.arange(TOKENS), seed=1)
        with setup.master.client() as client:
            assert _chunks_on(setup.master, key_prefix) == TOKENS // CHUNK  # on the master
            assert client.execute_command("WAIT", 1, 5000) == 1  # and on the replica

        # planned: the sentinels hand the master role to the replica, the old master follows it
        with setup.sentinels[0].client() as client:
            client.execute_command("SENTINEL", "FAILOVER", SERVICE)
        _until_served_by(eng, setup, setup.replica, key_prefix, base=0)
        assert setup.master_port() == setup.replica.port

        # a crash: the new master dies, the old one (its replica by now) is promoted
        _wait_replicating(setup.master)
        with setup.replica.client() as client:
            assert client.execute_command("WAIT", 1, 5000) == 1
        # while two of the three sentinels are paused no fail-over can be agreed (quorum 2),
        # so a request after the kill meets the dead master whatever the machine's load: a
        # miss, the gap counted, nothing raised
        for sentinel in setup.sentinels[1:]:
            sentinel.pause()
        try:
            setup.replica.kill()
            assert not _round_trip(eng, torch.arange(TOKENS) + 20_000_000, seed=7)
            assert eng.stats()["remote"]["errors"] > 0
        finally:
            for sentinel in setup.sentinels[1:]:
                sentinel.resume()
        _until_served_by(eng, setup, setup.master, key_prefix, base=10_000_000)
        with setup.master.client(decode_responses=True) as client:
            assert client.info("replication")["role"] == "master"
        # what had reached the promoted server before the crash is still served
        assert eng.lookup(torch.arange(TOKENS)) == TOKENS

    # the CLI on the same URL sees what the current master holds
    result = CliRunner().invoke(cli, ["stats", "--url", setup.url, "--prefix", key_prefix,
                                      "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["entries"] == _chunks_on(setup.master, key_prefix) > 0
