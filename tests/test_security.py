"""Security: Redis ACL users, TLS, secrets kept out of every output, tenant isolation, and
deletion confined to the configured prefix. All against real redis-server processes."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from cliutil import run
from faultkit import check_retrieve, det_kv, sentinel_kv
from kvutil import chunk_heads, engine
from servers import RedisServer, free_port
from tlsutil import Pki, TlsRedisServer, make_pki

from lmcache_remote import (
    BackendError,
    BackendPermissionError,
    CacheConfig,
    CacheEngine,
)
from lmcache_remote.storage.session.access import ADMIN_COMMANDS, ENGINE_COMMANDS

CHUNK = 256
PASSWORD = "Sup3r-S3cret-pw"


def toks(n_chunks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CHUNK)]


def roundtrip(url: str, prefix: str, **cfg: object) -> None:
    """Store through one engine, read back exactly through another (Redis alone)."""
    t = toks(3, seed=1)
    with engine(url, prefix, store_async=False, **cfg) as w:
        w.check_remote()
        assert w.store(t, det_kv(t)) == len(t)
        assert w.stats()["remote"].get("errors", 0) == 0
    with engine(url, prefix, local_cpu=False, **cfg) as r:
        dst, read = sentinel_kv(len(t))
        assert check_retrieve(r.retrieve(t, dst), t, read) == len(t)
        stats = r.stats()["remote"]
        assert stats.get("errors", 0) == 0 and stats.get("permission_errors", 0) == 0


# -- ACL -----------------------------------------------------------------------------------------


def acl_user(server: RedisServer, name: str, keys: str, *rules: str) -> str:
    """Create ACL user `name` (password PASSWORD, key pattern `keys`); its URL."""
    admin = server.client()
    try:
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{PASSWORD}", keys,
                              "resetchannels", "-@all", *rules)
    finally:
        admin.close()
    return f"redis://{name}:{PASSWORD}@127.0.0.1:{server.port}/0"


def cache_rules() -> list[str]:
    return [f"+{cmd}" for cmd in (*ENGINE_COMMANDS, *ADMIN_COMMANDS)]


@pytest.fixture
def acl_server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_factory()


def test_acl_user_limited_to_the_prefix_and_listed_commands_can_do_everything(
        acl_server: RedisServer, key_prefix: str) -> None:
    url = acl_user(acl_server, "cache", f"~{key_prefix}:*", *cache_rules())
    roundtrip(url, key_prefix)
    # the CLI works with the same user
    for args in (["ping"], ["ls"], ["stats"], ["evict", "--all", "--yes"]):
        result = run(*args, "--url", url, "--prefix", key_prefix, "--json")
        assert result.exit_code == 0, (args, result.stdout, result.stderr)
        assert PASSWORD not in result.stdout + result.stderr


def test_the_engine_commands_alone_serve_chunks_another_writer_cut(
        acl_server: RedisServer, key_prefix: str) -> None:
    """An ACL user with `ENGINE_COMMANDS` only (no CLI rights) passes the access check, and
    its lookups read the header of a chunk cut into other parts (GETRANGE) to count it."""
    import test_foreign_writer as foreign

    url = acl_user(acl_server, "engine", f"~{key_prefix}:*",
                   *(f"+{cmd}" for cmd in ENGINE_COMMANDS))
    tokens = list(range(40, 40 + foreign.CHUNK * len(foreign.CUTS)))
    keys, values = foreign.kvutil.dense_cache(len(tokens), foreign.DTYPE, seed=9)
    with acl_server.client() as admin:
        foreign.write_foreign_chunks(admin, tokens, keys, values, key_prefix)
    with engine(url, key_prefix) as e:
        e.check_remote()
    foreign.check_lookup_is_retrieve(url, key_prefix, tokens, keys, values, len(tokens))


def test_acl_user_without_write_rights_is_reported_loudly(
        acl_server: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    url = acl_user(acl_server, "reader", f"~{key_prefix}:*", "+ping", "+get", "+exists")
    caplog.set_level(logging.WARNING)
    with engine(url, key_prefix, local_cpu=False, store_async=False) as e:
        # at start-up: one ERROR naming what Redis refused, and a counter
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors and "refused" in errors[0].getMessage()
        assert "SET" in errors[0].getMessage() and "MSET" in errors[0].getMessage()
        assert e.stats()["remote"]["permission_errors"] == 1
        # an explicit check raises, naming the refused commands
        with pytest.raises(BackendPermissionError, match="SET"):
            e.check_remote()
        # inference goes on: nothing raises, the store is dropped, and counted again
        caplog.clear()
        t = toks(2)
        assert e.store(t, det_kv(t)) == 0
        assert e.stats()["remote"]["permission_errors"] >= 2
        assert any(r.levelno >= logging.ERROR for r in caplog.records)
        dst, read = sentinel_kv(len(t))
        assert check_retrieve(e.retrieve(t, dst), t, read) == 0


@pytest.mark.parametrize("case", ["other_keys", "wrong_password", "no_such_user"])
def test_acl_refusals_raise_permission_errors_at_check(acl_server: RedisServer, key_prefix: str,
                                                       case: str) -> None:
    if case == "other_keys":
        url = acl_user(acl_server, "other", "~somebody-else:*", *cache_rules())
        match = "key"
    else:
        acl_user(acl_server, "cache", f"~{key_prefix}:*", *cache_rules())
        user = "cache" if case == "wrong_password" else "nobody"
        url = f"redis://{user}:{PASSWORD}x@127.0.0.1:{acl_server.port}/0"
        match = "password"
    with engine(url, key_prefix, local_cpu=False) as e:
        assert e.stats()["remote"]["permission_errors"] == 1
        with pytest.raises(BackendPermissionError, match=match) as info:
            e.check_remote()
        assert PASSWORD not in str(info.value) and PASSWORD not in repr(info.value)
        t = toks(1)
        assert e.store(t, det_kv(t)) == 0
        assert e.lookup(t) == 0


def test_cli_reports_a_user_without_rights(acl_server: RedisServer, key_prefix: str) -> None:
    url = acl_user(acl_server, "pinger", f"~{key_prefix}:*", "+ping", "+info")
    result = run("ls", "--url", url, "--prefix", key_prefix)
    assert result.exit_code == 1
    assert "permission denied" in result.stderr and "'scan'" in result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    # ping answers (the server is there) but says this user cannot use the cache, and exits 1
    result = run("ping", "--url", url, "--prefix", key_prefix, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["access"] != "ok" and "SET" in doc["access"]
    assert PASSWORD not in result.stdout + result.stderr


# -- TLS -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def tls_factory() -> Iterator[Callable[..., TlsRedisServer]]:
    started: list[TlsRedisServer] = []

    def start(pki: Pki, cert: Path, key: Path, auth_clients: str = "yes") -> TlsRedisServer:
        server = TlsRedisServer(pki, cert, key, auth_clients)
        started.append(server)
        return server.start()  # type: ignore[return-value]

    yield start
    for server in started:
        server.stop()


def test_tls_with_ca_and_client_certificate_from_config(
        pki: Pki, tls_factory: Callable[..., TlsRedisServer], key_prefix: str) -> None:
    server = tls_factory(pki, pki.server_cert, pki.server_key)
    roundtrip(server.tls_url(), key_prefix, ssl_ca_certs=str(pki.ca),
              ssl_certfile=str(pki.client_cert), ssl_keyfile=str(pki.client_key))


def test_tls_options_as_url_query_parameters(
        pki: Pki, tls_factory: Callable[..., TlsRedisServer], key_prefix: str) -> None:
    server = tls_factory(pki, pki.server_cert, pki.server_key)
    url = server.tls_url(host="localhost", ssl_ca_certs=str(pki.ca),
                         ssl_certfile=str(pki.client_cert), ssl_keyfile=str(pki.client_key),
                         ssl_cert_reqs="required")
    roundtrip(url, key_prefix)


def test_tls_client_certificate_required_unless_auth_clients_is_off(
        pki: Pki, tls_factory: Callable[..., TlsRedisServer], key_prefix: str) -> None:
    strict = tls_factory(pki, pki.server_cert, pki.server_key, "yes")
    refused_unless_no_errors(strict.tls_url(ssl_ca_certs=str(pki.ca)), key_prefix)
    relaxed = tls_factory(pki, pki.server_cert, pki.server_key, "no")
    roundtrip(relaxed.tls_url(ssl_ca_certs=str(pki.ca)), key_prefix)


def refused_unless_no_errors(url: str, prefix: str, **cfg: object) -> None:
    """The engine cannot use this server: the check raises, inference calls just miss."""
    with engine(url, prefix, local_cpu=False, remote_timeout=1.0, **cfg) as e:
        with pytest.raises(BackendError):
            e.check_remote()
        t = toks(2)
        assert e.store(t, det_kv(t)) == 0
        dst, read = sentinel_kv(len(t))
        assert check_retrieve(e.retrieve(t, dst), t, read) == 0
        assert e.stats()["remote"]["errors"] >= 1


@pytest.mark.parametrize("case", ["other_ca", "wrong_host_name"])
def test_a_server_whose_certificate_does_not_match_is_refused(
        pki: Pki, tls_factory: Callable[..., TlsRedisServer], key_prefix: str,
        case: str) -> None:
    cert, key = ((pki.other_server_cert, pki.other_server_key) if case == "other_ca"
                 else (pki.wrong_host_cert, pki.wrong_host_key))
    server = tls_factory(pki, cert, key, "no")
    refused_unless_no_errors(server.tls_url(), key_prefix, ssl_ca_certs=str(pki.ca))
    # the same server, told to check nothing, is reachable: the refusal was the check's
    with engine(server.tls_url(), key_prefix, ssl_cert_reqs="none") as e:
        e.check_remote()


def test_plain_client_against_a_tls_port_fails_fast(
        pki: Pki, tls_factory: Callable[..., TlsRedisServer], key_prefix: str) -> None:
    server = tls_factory(pki, pki.server_cert, pki.server_key, "no")
    refused_unless_no_errors(f"redis://127.0.0.1:{server.port}/0", key_prefix)


# -- secrets -------------------------------------------------------------------------------------


def all_text_of(exc: BaseException) -> str:
    parts = []
    seen: BaseException | None = exc
    while seen is not None:
        parts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(parts)


def exercise(url: str, prefix: str) -> tuple[str, list[str]]:
    """Run every engine entry point on `url`; the text of stats, config, metrics, exceptions."""
    texts: list[str] = []
    cfg = CacheConfig(remote_url=url, key_prefix=prefix, chunk_size=CHUNK, remote_timeout=0.5,
                      max_local_cpu_size=0.05, unhealthy_backoff=0.05)
    texts += [repr(cfg), str(cfg)]
    from kvutil import metadata
    with CacheEngine(cfg, metadata()) as e:
        t = toks(2)
        e.store(t, det_kv(t))
        e.flush(2.0)
        dst, _ = sentinel_kv(len(t))
        e.retrieve(t, dst)
        e.lookup(t)
        try:
            e.check_remote()
        except BackendError as exc:
            texts.append(all_text_of(exc))
        texts.append(json.dumps(e.stats(), default=str))
        texts.append(repr(e.storage.remote.client) if e.storage.remote is not None else "")
        texts.append(prometheus_text())
    return url, texts


def prometheus_text() -> str:
    try:
        from prometheus_client import CollectorRegistry, generate_latest

        from lmcache_remote.telemetry.prometheus import collector
    except ImportError:  # the exporter is optional; without it there is nothing to leak
        return ""
    registry = CollectorRegistry()
    registry.register(collector())
    return generate_latest(registry).decode()


def test_passwords_never_appear_in_logs_errors_stats_or_metrics(
        acl_server: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    acl_user(acl_server, "cache", f"~{key_prefix}:*", *cache_rules())
    reader = acl_user(acl_server, "reader", f"~{key_prefix}:*", "+ping", "+get", "+exists")
    port = acl_server.port
    urls = [
        f"redis://cache:{PASSWORD}@127.0.0.1:{port}/0",  # works
        f"redis://cache:{PASSWORD}x@127.0.0.1:{port}/0",  # wrong password
        reader,  # refused commands
        f"redis://:{PASSWORD}@127.0.0.1:{port}/0",  # the default user, password only
        f"redis://cache:{PASSWORD}@127.0.0.1:{free_port()}/0",  # nobody listening
        f"redis://127.0.0.1:{port}/0?password={PASSWORD}",  # password as a query parameter
    ]
    texts: list[str] = []
    for url in urls:
        texts += exercise(url, key_prefix)[1]
    texts.append(caplog.text)
    texts += [r.getMessage() for r in caplog.records]
    admin = acl_server.client()  # what the engines published to Redis (fleet stats)
    for key in admin.scan_iter(match=f"{key_prefix}:engines:*"):
        texts.append(repr(admin.hgetall(key)))
    admin.close()
    leaked = [t for t in texts if PASSWORD in t]
    assert not leaked, leaked[0][:2000]
    assert "***" in caplog.text or any("***" in t for t in texts)


def test_passwords_never_appear_in_cli_output(acl_server: RedisServer, key_prefix: str,
                                              tmp_path: Path) -> None:
    good = acl_user(acl_server, "cache", f"~{key_prefix}:*", *cache_rules())
    t = toks(2)
    with engine(good, key_prefix, store_async=False) as e:
        e.store(t, det_kv(t))
    port = acl_server.port
    urls = [good, good.replace(PASSWORD, PASSWORD + "x"),
            f"redis://cache:{PASSWORD}@127.0.0.1:{free_port()}/0"]
    snapshot = str(tmp_path / "snap.lmcr")
    commands = (["ping"], ["ls"], ["stats"], ["ping", "--json"], ["stats", "-vv"],
                ["ls", "--json"], ["evict", "--all", "--dry-run"], ["export", snapshot],
                ["import", snapshot], ["warm", "--from", snapshot])
    for url in urls:
        for args in commands:
            result = run(*args, "--url", url, "--prefix", key_prefix)
            out = result.stdout + result.stderr
            assert PASSWORD not in out, (args, out)
    result = run("ping", "--url", f"redis://127.0.0.1:{port}/0?password={PASSWORD}")
    assert PASSWORD not in result.stdout + result.stderr


# -- tenants -------------------------------------------------------------------------------------


def test_cache_salts_never_share_a_key(redis_url: str, redis_client: redis.Redis,
                                       key_prefix: str) -> None:
    t = toks(3, seed=4)
    with engine(redis_url, key_prefix, store_async=False) as e:  # one engine, local tier on
        assert e.store(t, det_kv(t), cache_salt="tenant-a") == len(t)
        keys_a = chunk_heads(redis_client.scan_iter(match=f"{key_prefix}:v1:*"))
        # another tenant (or no tenant, or the empty salt) learns nothing from hits
        for salt in ("tenant-b", None, "", "tenant-a ", "TENANT-A"):
            assert e.lookup(t, cache_salt=salt) == 0
            dst, read = sentinel_kv(len(t))
            assert check_retrieve(e.retrieve(t, dst, cache_salt=salt), t, read) == 0
        assert e.lookup(t, cache_salt="tenant-a") == len(t)
        assert e.store(t, det_kv(t), cache_salt="tenant-b") == len(t)
        keys_b = chunk_heads(redis_client.scan_iter(match=f"{key_prefix}:v1:*")) - keys_a
        assert len(keys_b) == len(keys_a) == 3 and not keys_a & keys_b


# -- deletion stays under the prefix -------------------------------------------------------------


def test_corrupt_chunk_deletion_and_cli_eviction_stay_under_the_prefix(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    t = toks(2, seed=8)
    neighbours = [f"{key_prefix}x", f"{key_prefix[:-1]}", f"{key_prefix}-other"]
    for prefix in [key_prefix, *neighbours]:
        with engine(redis_url, prefix, store_async=False, stats_publish_interval=None) as e:
            assert e.store(t, det_kv(t)) == len(t)
    strangers = {f"{key_prefix}".encode() + b"-notes", b"unrelated:" + key_prefix.encode()}
    for key in strangers:
        redis_client.set(key, b"keep me")

    def outside() -> dict[bytes, bytes]:
        keys = [k for k in redis_client.scan_iter(count=1000)
                if not k.startswith(f"{key_prefix}:".encode())
                and b":engines:" not in k]  # other tests' engine stats hashes expire any time
        return dict(zip(keys, redis_client.mget(keys), strict=True)) if keys else {}

    before = outside()
    assert strangers <= set(before) and len(before) >= 2 + 3 * 2
    # a corrupt chunk under our prefix is deleted, and nothing else
    ours = sorted(redis_client.scan_iter(match=f"{key_prefix}:v1:*"))
    for key in ours:
        redis_client.set(key, b"garbage")
    with engine(redis_url, key_prefix, local_cpu=False) as e:
        dst, read = sentinel_kv(len(t))
        assert check_retrieve(e.retrieve(t, dst), t, read) == 0
        assert e.stats()["remote"]["corrupt_chunks"] == 1
    assert outside() == before
    # the CLI's eviction of everything under the prefix
    result = run("evict", "--all", "--yes", "--url", redis_url, "--prefix", key_prefix, "--json")
    assert result.exit_code == 0, result.stderr
    assert list(redis_client.scan_iter(match=f"{key_prefix}:v1:*")) == []  # every chunk gone
    assert outside() == before


def test_check_remote_on_an_unreachable_cluster_raises_a_library_error(key_prefix: str) -> None:
    """Regression: redis-py's cluster client raises RedisClusterException (no RedisError) when
    no seed node answers; check_remote must still raise a BackendError, and start-up only log."""
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with engine(url, key_prefix, remote_timeout=0.5) as e:
        with pytest.raises(BackendError):
            e.check_remote()
        t = toks(1)
        e.store(t, det_kv(t))
        assert e.lookup(t) == len(t)  # the local tier


def test_a_user_without_touch_serves_the_cache_with_the_lru_refresh_off(
        acl_server: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """An ACL user from before the LRU refresh (no +touch): the engine still starts and serves
    the cache, says once why its refresh is off, and sends no TOUCH; `ping` warns; with
    `remote_lru_touch: false` nothing is said. With +touch the refresh stays on."""
    rules = [f"+{cmd}" for cmd in (*ENGINE_COMMANDS, *ADMIN_COMMANDS) if cmd != "touch"]
    url = acl_user(acl_server, "old", f"~{key_prefix}:*", *rules)
    caplog.set_level(logging.WARNING, logger="lmcache_remote")
    t = list(range(512))
    with engine(url, key_prefix, store_async=False) as e:
        e.check_remote()
        assert e.storage.remote is not None and e.storage.remote.toucher is None
        assert e.store(t, det_kv(t)) == len(t)
        assert e.lookup(t) == len(t)
        assert e.stats()["remote"].get("errors", 0) == 0
        assert "touched_keys" not in e.stats()["remote"]
    assert sum("may not TOUCH" not in r.getMessage() and "refuses TOUCH" in r.getMessage()
               for r in caplog.records) == 1
    result = run("ping", "--url", url, "--prefix", key_prefix, "--json")
    assert result.exit_code == 0 and "may not TOUCH" in result.stdout
    caplog.clear()
    with engine(url, key_prefix, remote_lru_touch=False) as quiet:
        quiet.check_remote()
    assert not any("TOUCH" in r.getMessage() for r in caplog.records)
    full = acl_user(acl_server, "new", f"~{key_prefix}:*", *cache_rules())
    with engine(full, key_prefix) as e:
        e.check_remote()
        assert e.storage.remote is not None and e.storage.remote.toucher is not None
