"""TLS on the scale-out deployments, against real servers: a Redis Cluster whose nodes speak TLS
only (clients, the cluster bus and replication), reached by `rediss+cluster://`, and a
Sentinel-managed master and replica that speak TLS only, reached by `rediss+sentinel://`
(the sentinels listen in plain text, as the URL form documents; they reach the servers over
TLS). Every server checks the client certificate and the client checks the servers' against
the test CA.

What it shows: the URL's `ssl_*` parameters reach every node connection a cluster client opens
(the seed and the nodes it discovers) and every master connection a Sentinel client opens,
also after a fail-over; chunks round-trip bit-exact; a client that does not trust the CA gets
nothing, counted, never raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import kvutil
import pytest
import torch
from cluster_servers import SERVICE, ClusterServers, SentinelSetup
from faultkit import wait_for
from servers import ServerNotFoundError, ServerStartError
from tlsutil import (
    Pki,
    cli_tls_args,
    client_tls_query,
    make_pki,
    sentinel_tls_args,
    tls_node_maker,
)

from lmcache_remote import PagedKV
from lmcache_remote.storage.session.cluster_scatter import ClusterScatter

CHUNK = 64
TOKENS = 1024


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _started(setup: ClusterServers | SentinelSetup) -> None:
    try:
        setup.start()
    except (ServerNotFoundError, ServerStartError) as exc:
        pytest.fail(f"cannot start the TLS servers for the tests:\n{exc}")


@pytest.fixture(scope="module")
def tls_cluster(pki: Pki) -> Iterator[ClusterServers]:
    servers = ClusterServers(3, 0, tls_node_maker(pki), cli_args=cli_tls_args(pki))
    _started(servers)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def tls_sentinel(pki: Pki) -> Iterator[SentinelSetup]:
    setup = SentinelSetup(1, tls_node_maker(pki), sentinel_args=sentinel_tls_args(pki))
    _started(setup)
    try:
        yield setup
    finally:
        setup.stop()


def _engine(url: str, prefix: str):  # type: ignore[no-untyped-def]
    return kvutil.engine(url, prefix, chunk_size=CHUNK, local_cpu=False, store_async=False,
                         remote_timeout=2.0, unhealthy_backoff=0.2, stats_publish_interval=None)


def _round_trip(url: str, prefix: str, tokens: torch.Tensor, seed: int) -> int:
    """Store `tokens` through one engine, read them back through another: the tokens that
    came back (bit-exact, or the assertion fails)."""
    src, slots = kvutil.paged_cache("kv_split", torch.bfloat16, seed), kvutil.slots(TOKENS, seed)
    with _engine(url, prefix) as writer:
        writer.store(tokens, PagedKV(src, slots))
    with _engine(url, prefix) as reader:
        dst = kvutil.paged_cache("kv_split", torch.bfloat16, None)
        hit = reader.retrieve(tokens, PagedKV(dst, slots))
        n = int(hit.sum())
        if n == 0:
            return 0
        read = kvutil.token_kv_paged
        assert torch.equal(read(dst, "kv_split", slots[:n]), read(src, "kv_split", slots[:n]))
        return n


def test_rediss_cluster_round_trip_on_every_node(tls_cluster: ClusterServers, pki: Pki,
                                                 key_prefix: str) -> None:
    url = f"rediss+cluster://{tls_cluster.hosts}?{client_tls_query(pki)}"
    with _engine(url, key_prefix) as eng:
        assert isinstance(eng.storage.remote.channel, ClusterScatter)  # chosen at build
        eng.check_remote()
    assert _round_trip(url, key_prefix, torch.arange(TOKENS), seed=1) == TOKENS
    for master in tls_cluster.masters:  # the chunks spread over every node, all over TLS
        with master.client() as client:
            assert any(True for _ in client.scan_iter(match=f"{key_prefix}:v1:*"))


def test_rediss_cluster_refuses_a_client_that_does_not_trust_the_ca(
        tls_cluster: ClusterServers, pki: Pki, key_prefix: str, tmp_path: Path) -> None:
    other = f"ssl_ca_certs={pki.other_ca}&ssl_certfile={pki.client_cert}" \
            f"&ssl_keyfile={pki.client_key}"
    url = f"rediss+cluster://{tls_cluster.hosts}?{other}"
    tokens = torch.arange(TOKENS) + 50_000
    src, slots = kvutil.paged_cache("kv_split", torch.bfloat16, 2), kvutil.slots(TOKENS, 2)
    with _engine(url, key_prefix) as eng:  # starts; every call is a counted miss or drop
        assert eng.store(tokens, PagedKV(src, slots)) == 0
        assert eng.lookup(tokens) == 0
        assert eng.stats()["remote"]["errors"] >= 1


def test_rediss_sentinel_round_trip_and_fail_over(tls_sentinel: SentinelSetup, pki: Pki,
                                                  key_prefix: str) -> None:
    sentinels = ",".join(f"{s.host}:{s.port}" for s in tls_sentinel.sentinels)
    url = f"rediss+sentinel://{sentinels}/{SERVICE}/0?{client_tls_query(pki)}"
    with _engine(url, key_prefix) as eng:
        eng.check_remote()
    assert _round_trip(url, key_prefix, torch.arange(TOKENS), seed=3) == TOKENS
    with tls_sentinel.master.client() as client:
        assert client.execute_command("WAIT", 1, 5000) == 1  # the replica has it, over TLS
    with tls_sentinel.sentinels[0].client() as client:
        client.execute_command("SENTINEL", "FAILOVER", SERVICE)
    assert wait_for(lambda: tls_sentinel.master_port() == tls_sentinel.replica.port)

    requests = iter(range(10_000_000, 100_000_000, 100_000))  # fresh tokens every try

    def served_by_the_new_master() -> bool:
        tokens = torch.arange(TOKENS) + next(requests)
        if _round_trip(url, key_prefix, tokens, seed=4) != TOKENS:
            return False  # no master yet: a miss, never an exception
        first_key = kvutil.reference_keys(tokens.tolist(), key_prefix, chunk=CHUNK)[0]
        with tls_sentinel.replica.client() as client:  # written to the promoted replica
            return bool(client.execute_command("ROLE")[0] == b"master"
                        and client.exists(first_key))

    assert wait_for(served_by_the_new_master, limit=60, poll=0.2)
    # what had reached the replica before the fail-over is served by it now, over TLS
    with _engine(url, key_prefix) as eng:
        assert eng.lookup(torch.arange(TOKENS)) == TOKENS
