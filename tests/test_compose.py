"""docker-compose.yml keeps its promises: Redis 7 by default, Valkey 8, a six-node cluster and a
Sentinel setup under their own profiles; every server health-checked, LRU-bounded, persistence
off. Docker itself is not needed."""

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


# -- scale-out profiles: cluster and sentinel ---------------------------------------------

CLUSTER_NODES = [f"redis-node-{i}" for i in range(1, 7)]
SENTINEL_SERVERS = ["sentinel-master", "sentinel-replica"]
SENTINELS = ["sentinel-1", "sentinel-2", "sentinel-3"]


def _assert_bounded_cache(argv: list[str]) -> None:
    assert _option(argv, "--maxmemory-policy") == "allkeys-lru"
    assert _option(argv, "--maxmemory") == "4gb"
    assert _option(argv, "--save") == ""
    assert _option(argv, "--appendonly") == "no"


def _port_healthcheck(service: dict[str, Any], port: str) -> None:
    assert service["healthcheck"]["test"] == ["CMD", "redis-cli", "-p", port, "ping"]


def test_cluster_profile_has_six_bounded_cluster_nodes(
    services: dict[str, dict[str, Any]],
) -> None:
    ports = []
    for name in CLUSTER_NODES:
        service = services[name]
        assert service["profiles"] == ["cluster"]
        assert service["network_mode"] == "host"  # nodes announce 127.0.0.1 to clients
        argv = _argv(service)
        assert argv[0] == "redis-server"
        _assert_bounded_cache(argv)
        assert _option(argv, "--cluster-enabled") == "yes"
        # a shard down must not stop the others from serving their slots
        assert _option(argv, "--cluster-require-full-coverage") == "no"
        port = _option(argv, "--port")
        assert _option(argv, "--cluster-config-file") == f"nodes-{port}.conf"
        _port_healthcheck(service, port)
        ports.append(port)
    assert ports == [str(7000 + i) for i in range(1, 7)]


def test_cluster_create_step_joins_all_six_with_one_replica_each(
    services: dict[str, dict[str, Any]],
) -> None:
    create = services["cluster-create"]
    assert create["profiles"] == ["cluster"] and create["restart"] == "no"
    assert set(create["depends_on"]) == set(CLUSTER_NODES)
    assert all(d["condition"] == "service_healthy" for d in create["depends_on"].values())
    script = _argv(create)[2].split()
    assert _argv(create)[:2] == ["sh", "-c"]
    at = script.index("--cluster")
    assert script[at:at + 2] == ["--cluster", "create"]
    nodes = script[at + 2:at + 8]
    assert nodes == [f"127.0.0.1:{7000 + i}" for i in range(1, 7)]
    assert script[at + 8:] == ["--cluster-replicas", "1", "--cluster-yes"]


def test_sentinel_profile_has_master_replica_and_three_sentinels(
    services: dict[str, dict[str, Any]],
) -> None:
    master, replica = (_argv(services[name]) for name in SENTINEL_SERVERS)
    for name, argv in zip(SENTINEL_SERVERS, (master, replica), strict=True):
        assert services[name]["profiles"] == ["sentinel"]
        _assert_bounded_cache(argv)
        _port_healthcheck(services[name], _option(argv, "--port"))
    master_port = _option(master, "--port")
    at = replica.index("--replicaof")
    assert replica[at + 1:at + 3] == ["127.0.0.1", master_port]
    sentinel_ports = []
    for name in SENTINELS:
        service = services[name]
        assert service["profiles"] == ["sentinel"]
        script = _argv(service)[2]
        assert f"sentinel monitor lmcr-master 127.0.0.1 {master_port} 2" in script
        assert "--sentinel" in script.split()
        port = script.split("--port")[1].split()[0]
        _port_healthcheck(service, port)
        sentinel_ports.append(port)
    assert sentinel_ports == ["26379", "26380", "26381"]
    # the default single server keeps 6379; the sentinel setup must not collide with it
    assert master_port != "6379" and _option(replica, "--port") != "6379"
