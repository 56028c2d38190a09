"""docker-compose.yml keeps its promises: Redis 7 by default, Valkey 8 under its own profile,
both on 6379, health-checked, LRU-bounded, persistence off. Docker itself is not needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

COMPOSE_FILE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    with open(COMPOSE_FILE) as f:
        doc = yaml.safe_load(f)
    result: dict[str, dict[str, Any]] = doc["services"]
    return result


def _argv(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    assert isinstance(command, list), "command must be a list: no shell word splitting"
    assert all(isinstance(arg, str) for arg in command), command
    return command


def _option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} must appear exactly once in {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(
    ("name", "image", "binary"),
    [("redis", "redis:7", "redis-server"), ("valkey", "valkey/valkey:8", "valkey-server")],
)
def test_service_is_a_bounded_cache(
    services: dict[str, dict[str, Any]], name: str, image: str, binary: str
) -> None:
    service = services[name]
    assert service["image"] == image
    assert service["ports"] == ["6379:6379"]
    argv = _argv(service)
    assert argv[0] == binary
    assert _option(argv, "--maxmemory") == "4gb"
    assert _option(argv, "--maxmemory-policy") == "allkeys-lru"
    assert _option(argv, "--save") == ""
    assert _option(argv, "--appendonly") == "no"


@pytest.mark.parametrize("name", ["redis", "valkey"])
def test_service_has_a_ping_healthcheck(services: dict[str, dict[str, Any]], name: str) -> None:
    check = services[name]["healthcheck"]
    assert check["test"][0] == "CMD"
    assert check["test"][1].endswith("-cli") and check["test"][2:] == ["ping"]
    for key in ("interval", "timeout", "retries"):
        assert key in check


def test_redis_runs_by_default_and_valkey_only_in_its_profile(
    services: dict[str, dict[str, Any]],
) -> None:
    assert "profiles" not in services["redis"]
    assert services["valkey"]["profiles"] == ["valkey"]


def test_only_redis_runs_by_default(services: dict[str, dict[str, Any]]) -> None:
    """Every other service (valkey now, cluster and sentinel later) sits under a profile."""
    by_default = [name for name, service in services.items() if not service.get("profiles")]
    assert by_default == ["redis"]
