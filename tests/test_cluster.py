"""Redis Cluster (and Valkey Cluster): a three-master cluster on loopback, created once per
module with `redis-cli --cluster create`.

What it shows: the cluster URL alone selects the cluster client and tier; chunks spread over
every master and come back bit-exact (multi-part chunks too: their parts share a slot);
MOVED/ASK after a slot moves are followed; a killed master makes its chunks misses (the prefix
is cut at the first one) while the engine keeps serving, without raising and within bounded
time, and hits come back once it returns; a hung master costs one `remote_timeout`, not more;
the CLI's stats, ls, export, evict and import scan every master; an engine made before its
(Valkey) cluster is up starts anyway and connects once it is.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from lmcache_remote_cli.main import cli
from redis.cluster import RedisCluster

from lmcache_remote import CacheConfig, CacheEngineKey, PagedKV
from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
from lmcache_remote.naming.keys import scan_pattern, split_part_key
from lmcache_remote.storage.session.client import make_client
from lmcache_remote.storage.session.cluster_scatter import ClusterScatter
from tests import kvutil
from tests import test_foreign_writer as foreign
from tests.cluster_servers import ClusterServers
from tests.faultkit import bound
from tests.servers import RedisServer, ServerNotFoundError, ServerStartError, ValkeyServer

CHUNK = 64
TOKENS = 2560  # kvutil's paged cache holds 2560 slots: 40 chunks of 64
TIMEOUT = 1.0


def _start(server_cls: type[RedisServer], replicas: int = 0) -> ClusterServers:
    try:
        return ClusterServers(3, replicas, server_cls).start()
    except (ServerNotFoundError, ServerStartError) as exc:
        pytest.fail(f"cannot start a {server_cls.default_name} cluster for the tests:\n{exc}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterServers]:
    servers = _start(RedisServer)
    try:
        yield servers
    finally:
        servers.stop()


def _engine(url: str, prefix: str, **overrides: object):  # type: ignore[no-untyped-def]
    cfg = {"chunk_size": CHUNK, "local_cpu": False, "store_async": False,
           "remote_timeout": TIMEOUT, "unhealthy_backoff": 0.2}
    cfg.update(overrides)
    return kvutil.engine(url, prefix, **cfg)


def _kv(seed: int | None) -> list[torch.Tensor]:
    return kvutil.paged_cache("kv_split", torch.bfloat16, seed)


def _read(caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    return kvutil.token_kv_paged(caches, "kv_split", slots)


def _chunk_keys(prefix: str, tokens: torch.Tensor) -> list[str]:
    meta = kvutil.metadata()
    hashes = chunk_hashes(tokens_to_array(tokens), CHUNK)
    return [
        CacheEngineKey(meta.model_name, 1, 0, "bfloat16", h.hex()).redis_key(prefix)
        for h in hashes
    ]


def _keys_on(server: RedisServer, prefix: str) -> list[bytes]:
    """The chunk values (heads and parts) under `prefix` on one server."""
    with server.client() as client:
        return list(client.scan_iter(match=scan_pattern(prefix), count=1000))


def _owner(cluster: ClusterServers, key: str) -> RedisServer:
    for master in cluster.masters:
        with master.client() as client:
            slot = client.execute_command("CLUSTER", "KEYSLOT", key)
            owner = client.execute_command("CLUSTER", "SLOTS")
            for start, end, primary, *_ in owner:
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(m for m in cluster.masters if m.port == port)
    raise AssertionError(f"no owner for {key}")


def _store_and_check(url: str, prefix: str, **overrides: object) -> None:
    tokens = torch.arange(TOKENS)
    src, slots = _kv(1), kvutil.slots(TOKENS, 2)
    with _engine(url, prefix, **overrides) as eng:
        assert isinstance(eng.storage.remote.channel, ClusterScatter)  # chosen at build
        assert isinstance(eng.storage.remote.client, RedisCluster)  # connected at start
        assert eng.store(tokens, PagedKV(src, slots)) == TOKENS
        assert eng.lookup(tokens) == TOKENS
        dst = _kv(None)
        mask = eng.retrieve(tokens, PagedKV(dst, slots))
        assert bool(mask.all())
        assert torch.equal(_read(dst, slots), _read(src, slots))


def test_cluster_url_builds_a_cluster_client(cluster: ClusterServers) -> None:
    client = make_client(CacheConfig(remote_url=cluster.url, remote_timeout=TIMEOUT))
    try:
        assert isinstance(client, RedisCluster)
        assert {n.port for n in client.get_primaries()} == {m.port for m in cluster.masters}
    finally:
        client.close()


def test_chunks_spread_over_every_master_and_come_back_exact(
    cluster: ClusterServers, key_prefix: str
) -> None:
    _store_and_check(cluster.url, key_prefix)
    per_master = [len(kvutil.chunk_heads(_keys_on(m, key_prefix))) for m in cluster.masters]
    chunks = TOKENS // CHUNK
    assert sum(per_master) == chunks
    # 40 chunks over 3 masters: each gets some; a fair spread gives each about a third
    assert all(n >= chunks // 8 for n in per_master), per_master


def test_multi_part_chunks_keep_their_parts_on_one_node(
    cluster: ClusterServers, key_prefix: str
) -> None:
    """Small parts: every chunk is several values, written by one MSET (same slot)."""
    _store_and_check(cluster.url, key_prefix, remote_part_size=4096, serde="raw")
    for master in cluster.masters:
        keys = [k.decode() for k in _keys_on(master, key_prefix)]
        heads = {split_part_key(key_prefix, k)[0].redis_key(key_prefix) for k in keys}
        # every part of a chunk stored on this master sits on this master with its head
        assert heads <= set(keys)
        assert len(keys) > len(heads)


def test_slot_moves_are_followed(cluster: ClusterServers, key_prefix: str) -> None:
    """ASK while a slot migrates, MOVED after: the engine keeps hitting with a stale table."""
    tokens = torch.arange(TOKENS)
    src, slots = _kv(3), kvutil.slots(TOKENS, 4)
    with _engine(cluster.url, key_prefix) as eng:
        assert eng.store(tokens, PagedKV(src, slots)) == TOKENS
        first = _chunk_keys(key_prefix, tokens)[0]
        source = _owner(cluster, first)
        target = next(m for m in cluster.masters if m is not source)
        slot = cluster.start_slot_move(first, source, target)
        try:
            assert eng.lookup(tokens) == TOKENS  # ASK: the chunk now lives on the target
            dst = _kv(None)
            assert bool(eng.retrieve(tokens, PagedKV(dst, slots)).all())
            assert torch.equal(_read(dst, slots), _read(src, slots))
        finally:
            cluster.finish_slot_move(slot, target)
        assert eng.lookup(tokens) == TOKENS  # MOVED: the client's table was stale
        dst = _kv(None)
        assert bool(eng.retrieve(tokens, PagedKV(dst, slots)).all())
        assert torch.equal(_read(dst, slots), _read(src, slots))
        assert _keys_on(target, key_prefix)


def test_cli_scans_every_master(cluster: ClusterServers, key_prefix: str, tmp_path: Path) -> None:
    """stats, ls, export, evict and import on a cluster URL see the chunks of every master."""
    _store_and_check(cluster.url, key_prefix)
    chunks = TOKENS // CHUNK
    runner = CliRunner()
    base = ["--url", cluster.url, "--prefix", key_prefix, "--json"]

    def run(*args: str) -> dict[str, Any]:
        result = runner.invoke(cli, [*args, *base])
        assert result.exit_code == 0, result.output
        doc: dict[str, Any] = json.loads(result.stdout)
        return doc

    stats = run("stats")
    assert stats["entries"] == chunks and stats["bytes"] > 0
    assert run("ls", "--limit", "0")["count"] == chunks
    snapshot = str(tmp_path / "cluster.lmcr")
    assert run("export", snapshot)["entries"] == chunks
    assert run("evict", "--all", "--yes")["deleted"] == chunks
    assert all(_keys_on(m, key_prefix) == [] for m in cluster.masters)
    assert run("import", snapshot)["entries"] == chunks
    assert all(_keys_on(m, key_prefix) for m in cluster.masters)  # back on every master
    with _engine(cluster.url, key_prefix) as eng:
        assert eng.lookup(torch.arange(TOKENS)) == TOKENS


def test_a_killed_master_makes_its_chunks_misses_and_comes_back(
    cluster: ClusterServers, key_prefix: str
) -> None:
    tokens = torch.arange(TOKENS)
    src, slots = _kv(5), kvutil.slots(TOKENS, 6)
    keys = _chunk_keys(key_prefix, tokens)
    # a master that does not hold the first chunk dies: its first chunk cuts the prefix there
    owners = [_owner(cluster, k) for k in keys]
    victim = next(m for m in cluster.masters if m is not owners[0] and m in owners)
    first_lost = owners.index(victim)
    assert 0 < first_lost < len(keys)
    with _engine(cluster.url, key_prefix) as eng:
        assert eng.store(tokens, PagedKV(src, slots)) == TOKENS
        victim.kill()
        try:
            for _ in range(3):  # the first call finds it refused, the next skip it at once
                started = time.monotonic()
                assert eng.lookup(tokens) == first_lost * CHUNK
                dst = _kv(None)
                mask = eng.retrieve(tokens, PagedKV(dst, slots))
                hit = slice(0, first_lost * CHUNK)
                assert int(mask.sum()) == first_lost * CHUNK and bool(mask[hit].all())
                assert torch.equal(_read(dst, slots[hit]), _read(src, slots[hit]))
                eng.store(tokens, PagedKV(src, slots))  # writes to the others go on
                assert time.monotonic() - started < bound(3, TIMEOUT)
            assert eng.stats()["remote"]["errors"] > 0
        finally:
            victim.restart()  # same port, same nodes.conf: it rejoins with its slots, empty
            cluster.wait_ok()
        deadline = time.monotonic() + 60
        while eng.lookup(tokens) < TOKENS and time.monotonic() < deadline:
            eng.store(tokens, PagedKV(src, slots))  # refills what the restart lost
            time.sleep(0.2)
        assert eng.lookup(tokens) == TOKENS
        dst = _kv(None)
        assert bool(eng.retrieve(tokens, PagedKV(dst, slots)).all())
        assert torch.equal(_read(dst, slots), _read(src, slots))


def test_a_partly_failed_write_counts_only_what_landed(
    cluster: ClusterServers, key_prefix: str
) -> None:
    tokens = torch.arange(TOKENS) + 7  # chunks no other test stored
    src, slots = _kv(7), kvutil.slots(TOKENS, 8)
    keys = _chunk_keys(key_prefix, tokens)
    owners = [_owner(cluster, k) for k in keys]
    victim = next(m for m in cluster.masters if m is not owners[0] and m in owners)
    lost = sum(1 for o in owners if o is victim)
    with _engine(cluster.url, key_prefix) as eng:
        victim.kill()
        try:
            # held: the leading chunks that landed (no local tier here)
            assert eng.store(tokens, PagedKV(src, slots)) == owners.index(victim) * CHUNK
            remote = eng.stats()["remote"]
        finally:
            victim.restart()
            cluster.wait_ok()
    assert remote["written_chunks"] == len(keys) - lost
    assert remote["stored_tokens"] == (len(keys) - lost) * CHUNK
    assert remote["dropped_chunks"] == lost
    landed = sum(len(kvutil.chunk_heads(set(_keys_on(m, key_prefix))))
                 for m in cluster.masters if m is not victim)
    assert landed == len(keys) - lost


def test_a_hung_master_costs_one_timeout(cluster: ClusterServers, key_prefix: str) -> None:
    tokens = torch.arange(TOKENS)
    src, slots = _kv(7), kvutil.slots(TOKENS, 8)
    keys = _chunk_keys(key_prefix, tokens)
    victim = _owner(cluster, keys[0])
    with _engine(cluster.url, key_prefix) as eng:
        assert eng.store(tokens, PagedKV(src, slots)) == TOKENS
        victim.pause()
        try:
            started = time.monotonic()
            assert eng.lookup(tokens) == 0  # the first chunk's master does not answer
            assert time.monotonic() - started < bound(1, TIMEOUT)
            started = time.monotonic()
            assert not bool(eng.retrieve(tokens, PagedKV(_kv(None), slots)).any())
            assert time.monotonic() - started < bound(1, TIMEOUT)
        finally:
            victim.resume()
        deadline = time.monotonic() + 60
        while eng.lookup(tokens) < TOKENS and time.monotonic() < deadline:
            time.sleep(0.2)
        assert eng.lookup(tokens) == TOKENS


def test_a_replica_takes_over_a_killed_master(key_prefix: str) -> None:
    """Three masters with a replica each: after a master dies, its replica is promoted and the
    engine, refreshing its slot table, hits the promoted replica's copy of the chunks."""
    servers = _start(RedisServer, replicas=1)
    tokens = torch.arange(TOKENS)
    src, slots = _kv(11), kvutil.slots(TOKENS, 12)
    try:
        with _engine(servers.url, key_prefix) as eng:
            assert eng.store(tokens, PagedKV(src, slots)) == TOKENS
            for master in servers.masters:  # every chunk reached its master's replica
                with master.client(socket_timeout=10) as client:
                    assert client.execute_command("WAIT", 1, 5000) == 1
            victim = _owner(servers, _chunk_keys(key_prefix, tokens)[0])
            victim.kill()
            deadline = time.monotonic() + 60
            while eng.lookup(tokens) < TOKENS and time.monotonic() < deadline:
                time.sleep(0.2)  # misses (never raises) until the replica is promoted
            assert eng.lookup(tokens) == TOKENS
            dst = _kv(None)
            assert bool(eng.retrieve(tokens, PagedKV(dst, slots)).all())
            assert torch.equal(_read(dst, slots), _read(src, slots))
            more = tokens + 1_000_000  # and new chunks are written to it
            assert eng.store(more, PagedKV(src, slots)) == TOKENS
            assert eng.lookup(more) == TOKENS
    finally:
        servers.stop()


def test_valkey_cluster_works_the_same_even_when_it_starts_after_the_engine(
    key_prefix: str,
) -> None:
    """An engine made before its cluster exists starts, misses, then connects on its own."""
    servers = ClusterServers(3, 0, ValkeyServer)
    tokens = torch.arange(TOKENS)
    src, slots = _kv(9), kvutil.slots(TOKENS, 10)
    try:
        with _engine(servers.url, key_prefix) as eng:  # nothing listens on these ports yet
            started = time.monotonic()
            assert eng.lookup(tokens) == 0
            eng.store(tokens, PagedKV(src, slots))
            assert not bool(eng.retrieve(tokens, PagedKV(_kv(None), slots)).any())
            assert time.monotonic() - started < bound(3, TIMEOUT)
            try:
                servers.start()
            except (ServerNotFoundError, ServerStartError) as exc:
                pytest.fail(f"cannot start a valkey cluster for the tests:\n{exc}")
            deadline = time.monotonic() + 60
            while eng.lookup(tokens) < TOKENS and time.monotonic() < deadline:
                eng.store(tokens, PagedKV(src, slots))
                time.sleep(0.2)
            assert eng.lookup(tokens) == TOKENS
            dst = _kv(None)
            assert bool(eng.retrieve(tokens, PagedKV(dst, slots)).all())
            assert torch.equal(_read(dst, slots), _read(src, slots))
        assert all(_keys_on(m, key_prefix) for m in servers.masters)
    finally:
        servers.stop()


def test_chunks_cut_by_another_writer_count_as_they_read(cluster: ClusterServers,
                                                         key_prefix: str) -> None:
    """test_foreign_writer's check on the cluster tier: chunks written from the docs alone,
    cut every which way, spread over the masters; lookup == retrieve, bit-exact, and a chunk
    missing a listed part is absent to both."""
    tokens = list(range(300, 300 + foreign.CHUNK * len(foreign.CUTS)))
    keys, values = kvutil.dense_cache(len(tokens), foreign.DTYPE, seed=8)
    client = make_client(CacheConfig(remote_url=cluster.url))
    try:
        names = foreign.write_foreign_chunks(client, tokens, keys, values, key_prefix)
        foreign.check_lookup_is_retrieve(cluster.url, key_prefix, tokens, keys, values,
                                         len(tokens))
        assert client.unlink(f"{names[1]}#1") == 1  # chunk 1: 4 parts, the plan names 2
        foreign.check_lookup_is_retrieve(cluster.url, key_prefix, tokens, keys, values,
                                         foreign.CHUNK)
    finally:
        client.close()


def test_a_chunk_found_foreign_is_not_promised_again(cluster: ClusterServers, key_prefix: str,
                                                     tmp_path: Path) -> None:
    """The cluster's lookup keeps RemoteLookup's rule: a chunk a read of this process found
    it would not serve (here an unkeyed writer's value, for a reader holding an
    `integrity_key`) is not promised by the next lookup, which would only make vLLM wait on a
    load that comes back empty."""
    from tests.faultkit import check_retrieve, det_kv, sentinel_kv

    key = tmp_path / "integrity.key"
    key.write_bytes(b"8f3a" * 16)
    key.chmod(0o600)
    toks = kvutil.tokens(3 * CHUNK, 21)
    with _engine(cluster.url, key_prefix) as writer:
        assert writer.store(toks, det_kv(toks)) == 3 * CHUNK
    with _engine(cluster.url, key_prefix, integrity_key=f"file:{key}") as reader:
        assert reader.lookup(toks) == 3 * CHUNK  # there, and not read yet
        dst, read = sentinel_kv(len(toks))
        assert check_retrieve(reader.retrieve(toks, dst), toks, read) == 0
        assert reader.stats()["remote"]["unauthenticated_chunks"] == 1
        assert reader.lookup(toks) == 0
