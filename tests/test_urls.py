"""Remote URLs: one parser for single, cluster and sentinel forms; clear errors; no leaked
passwords; make_client picks the client kind from the URL alone."""

from __future__ import annotations

import pytest
import redis
import torch
from click.testing import CliRunner
from lmcache_remote_cli.main import cli
from redis.sentinel import SentinelConnectionPool

from lmcache_remote import CacheConfig, ConfigError, PagedKV, load_config
from lmcache_remote.config import mask_url
from lmcache_remote.storage.session.client import make_client
from lmcache_remote.urls import parse_remote_url
from tests import kvutil
from tests.servers import free_port


def test_single_server_forms_stay_single() -> None:
    for url in ("redis://h:1/0", "rediss://h:1/0?ssl_cert_reqs=none", "unix:///tmp/r.sock"):
        parsed = parse_remote_url(url)
        assert parsed.kind == "single" and parsed.url == url
    assert parse_remote_url("rediss://h").tls


def test_cluster_url_lists_its_seed_nodes() -> None:
    parsed = parse_remote_url("redis+cluster://bob:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7002/")
    assert parsed.kind == "cluster" and not parsed.tls
    assert parsed.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (parsed.username, parsed.password, parsed.db) == ("bob", "s3cret", 0)
    tls = parse_remote_url("rediss+cluster://h:1?ssl_cert_reqs=none")
    assert tls.tls and tls.ssl_params == {"ssl_cert_reqs": "none"}


def test_sentinel_url_names_service_and_db() -> None:
    parsed = parse_remote_url(
        "redis+sentinel://:p%40ss@s1,s2:26380/my%2Dmaster/3?sentinel_password=sp"
    )
    assert parsed.kind == "sentinel"
    assert parsed.nodes == (("s1", 26379), ("s2", 26380))
    assert (parsed.service, parsed.db, parsed.password) == ("my-master", 3, "p@ss")
    assert parsed.param("sentinel_password") == "sp"
    assert parse_remote_url("rediss+sentinel://s1:1/m").tls


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis+cluster://", "unknown URL form"),
        ("redis+cluster:///", "at least one host"),
        ("redis+cluster://h:notaport", "bad port"),
        ("redis+cluster://h:70000", "bad port"),
        ("redis+cluster://h:1,,h:2", "empty host"),
        ("redis+cluster://h:1/2", "only database 0"),
        ("redis+cluster://h:1?db=1", "unknown query parameter 'db'"),
        ("redis+cluster://h:1?ssl_ca_certs=/ca.pem", "needs the TLS form"),
        ("redis+sentinel://h:1", "needs the service name"),
        ("redis+sentinel://h:1/", "needs the service name"),
        ("redis+sentinel://h:1/m/x", "database must be a number"),
        ("redis+sentinel://h:1/m/0/extra", "needs the service name"),
        ("redis+sentinel://[::1:1/m", "malformed host list"),
        ("redis+clustr://h:1", "unknown URL form"),
    ],
)
def test_malformed_urls_fail_naming_remote_url(url: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig(remote_url=url)
    assert info.value.field == "remote_url"
    assert words in str(info.value)


def test_errors_and_masks_never_show_passwords() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(remote_url="redis+sentinel://u:s3cret@h:1?sentinel_password=t0p")
    assert "s3cret" not in str(info.value) and "t0p" not in str(info.value)
    masked = mask_url("redis+sentinel://u:s3cret@h:1,h:2/m?sentinel_password=t0p")
    assert masked == "redis+sentinel://u:***@h:1,h:2/m?sentinel_password=***"
    assert mask_url("rediss+cluster://:s3cret@a:1,b:2") == "rediss+cluster://:***@a:1,b:2"
    assert "s3cret" not in repr(parse_remote_url("redis+cluster://:s3cret@a:1"))


def test_config_accepts_cluster_and_sentinel_urls() -> None:
    for url in ("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", "redis+sentinel://h:1/m/0"):
        assert CacheConfig(remote_url=url).remote_url == url


def test_sentinel_url_gives_a_master_client_with_bounded_timeouts() -> None:
    """Nothing listens there: building the client must not connect (it connects on use)."""
    cfg = CacheConfig(remote_url="redis+sentinel://127.0.0.1:1,127.0.0.1:2/svc/2",
                      remote_timeout=0.5)
    client = make_client(cfg)
    try:
        assert isinstance(client, redis.Redis)
        pool = client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "svc" and pool.is_master
        assert pool.connection_kwargs["db"] == 2
        assert pool.connection_kwargs["socket_timeout"] == 0.5
        with pytest.raises(redis.ConnectionError):  # no sentinel answers: a quick failure
            client.ping()
    finally:
        client.close()


def test_unreachable_sentinels_give_a_short_error_in_the_cli() -> None:
    url = f"redis+sentinel://:s3cret@127.0.0.1:{free_port()}/svc"
    result = CliRunner().invoke(cli, ["stats", "--url", url, "--json"])
    assert result.exit_code == 3
    assert result.output.count("\n") == 1 and "s3cret" not in result.output
    assert "No master found for 'svc'" in result.output
    assert len(result.output) < 200  # not redis-py's repr of every sentinel client


def test_engine_on_unreachable_sentinels_misses_without_raising(key_prefix: str) -> None:
    url = f"redis+sentinel://127.0.0.1:{free_port()}/svc"
    with kvutil.engine(url, key_prefix, chunk_size=64, store_async=False, local_cpu=False) as eng:
        tokens = torch.arange(256)
        caches, slots = kvutil.paged_cache("kv_split", torch.bfloat16, 1), kvutil.slots(256, 1)
        eng.store(tokens, PagedKV(caches, slots))
        assert eng.lookup(tokens) == 0
        assert not bool(eng.retrieve(tokens, PagedKV(caches, slots)).any())
        assert eng.stats()["remote"]["errors"] > 0
