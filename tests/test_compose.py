"""docker-compose.yml keeps its promises: Redis 7 by default, Valkey 8, a six-node cluster and a
Sentinel setup under their own profiles; every server health-checked, LRU-bounded, persistence
off; nothing reachable beyond this host unless `LMCR_BIND` says so; one optional password
(`LMCR_REDIS_PASSWORD`) for every server of every profile.

Docker itself does not run here: the file is parsed, its `${VAR:-default}` interpolation done
as Compose does it, and the redis and sentinel commands it holds are run with the local
redis-server (ports swapped for free ones). What this cannot show: Docker's own port
publishing and the images' entrypoints."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from lmcache_remote.config import CacheConfig
from lmcache_remote.storage.session.client import make_client
from tests.servers import RedisServer

COMPOSE_FILE = Path(__file__).resolve().parents[1] / "docker-compose.yml"
PASSWORD = "c0mpose5ecret"
_VAR_RE = re.compile(r"\$\$|\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: `${VAR:-default}`, `${VAR}`, `$VAR`, and `$$` for a `$`."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(3)
        return env.get(name) or (m.group(2) or "")

    return _VAR_RE.sub(one, value)


def _load(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    with open(COMPOSE_FILE) as f:
        doc = yaml.safe_load(f)
    result: dict[str, dict[str, Any]] = _interpolate(doc["services"], env)
    return result


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    """The services as `docker compose` sees them with nothing set in the environment."""
    return _load({})


#: The images' own entrypoint: it starts the server it is given as the image's unprivileged
#: user (what a service without `entrypoint` gets too).
IMAGE_ENTRYPOINT = "docker-entrypoint.sh"


def _argv(service: dict[str, Any]) -> list[str]:
    """What the container runs: `entrypoint` (the image's entrypoint script left out) then
    `command`, as Docker joins them."""
    argv = []
    for field in ("entrypoint", "command"):
        words = service.get(field, [])
        assert isinstance(words, list), f"{field} must be a list: no shell word splitting"
        assert all(isinstance(arg, str) for arg in words), words
        argv += words
    return argv[1:] if argv[:1] == [IMAGE_ENTRYPOINT] else argv


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
    assert service["ports"] == ["127.0.0.1:6379:6379"]
    argv = _argv(service)
    assert argv[0] == binary
    assert _option(argv, "--maxmemory") == "4gb"
    assert _option(argv, "--maxmemory-policy") == "volatile-lru"  # pins hold (docs/pins.md)
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
    assert _option(argv, "--maxmemory-policy") == "volatile-lru"  # pins hold (docs/pins.md)
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
        # the default nodes.conf, in each container's own /data: nodes share no folder
        assert "--cluster-config-file" not in argv and "volumes" not in service
        _port_healthcheck(service, port)
        ports.append(port)
    assert ports == [str(7000 + i) for i in range(1, 7)]


def test_every_server_shares_the_one_list_of_cache_options(
    services: dict[str, dict[str, Any]],
) -> None:
    """The cache options (password, bound, policy, no disk) are written once for the single
    servers and the sentinel profile's (`x-cache-args`) and once more inside the cluster nodes'
    shared command (`x-cluster-node`): the two lists say the same."""
    cache = services["redis"]["command"]
    assert _argv(services["redis"]) == ["redis-server", *cache]
    for name in ["valkey", *SENTINEL_SERVERS]:
        assert services[name]["command"] == cache, name
    for name in CLUSTER_NODES:
        assert _argv(services[name])[-len(cache):] == cache, name


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
        assert script.split("--port")[1].split()[0] == "$SENTINEL_PORT"
        port = service["environment"]["SENTINEL_PORT"]
        _port_healthcheck(service, port)
        sentinel_ports.append(port)
    assert sentinel_ports == ["26379", "26380", "26381"]
    # the default single server keeps 6379; the sentinel setup must not collide with it
    assert master_port != "6379" and _option(replica, "--port") != "6379"


# -- reachability and the optional password ------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _published_hosts(service: dict[str, Any]) -> list[str]:
    """The host address of every port the service publishes ("" when it names none, which
    Docker reads as every interface)."""
    hosts = []
    for port in service.get("ports", []):
        if isinstance(port, dict):  # the long syntax
            hosts.append(str(port.get("host_ip", "")))
            continue
        parts = str(port).rsplit(":", 2)
        hosts.append(parts[0] if len(parts) == 3 else "")
    return hosts


def _server_words(service: dict[str, Any]) -> list[list[str]]:
    """The argv of every redis-/valkey-server the service starts (from a `sh -c` script too)."""
    argv = _argv(service)
    if argv[0].endswith("-server"):
        return [argv]
    if argv[:2] == ["sh", "-c"]:
        words = argv[2].split()
        return [words[i:] for i, w in enumerate(words) if w.endswith("-server")]
    return []


def _binds(argv: list[str]) -> list[str]:
    """The addresses after `--bind` (one option may list several)."""
    if "--bind" not in argv:
        return []
    rest = argv[argv.index("--bind") + 1:]
    return [" ".join(rest[: next((i for i, w in enumerate(rest) if w.startswith("--")),
                                 len(rest))])][0].split()


@pytest.mark.parametrize("env", [{}, {"LMCR_REDIS_PASSWORD": PASSWORD}], ids=["plain", "password"])
def test_nothing_is_reachable_beyond_this_host_by_default(env: dict[str, str]) -> None:
    """Every published port binds loopback; every server on the host network binds loopback;
    a service is on one of the two or on neither (then only other containers reach it)."""
    for name, service in _load(env).items():
        for host in _published_hosts(service):
            assert _is_loopback(host), f"{name} publishes a port on {host or 'every interface'}"
        servers = _server_words(service)
        if service.get("network_mode") == "host":
            assert not service.get("ports"), f"{name}: host network publishes nothing"
            for argv in servers:
                binds = _binds(argv)
                assert binds, f"{name} starts {argv[0]} on the host network without --bind"
                assert all(_is_loopback(b) for b in binds), f"{name} binds {binds}"
        else:
            assert service.get("network_mode") in (None, "bridge"), name


def test_lmcr_bind_is_the_one_switch_that_exposes_the_single_server() -> None:
    exposed = _load({"LMCR_BIND": "0.0.0.0"})
    for name in ("redis", "valkey"):
        assert _published_hosts(exposed[name]) == ["0.0.0.0"]
    default = _load({})
    changed = {n for n in exposed if exposed[n] != default[n]}
    assert changed == {"redis", "valkey"}


def test_the_password_reaches_every_server_and_health_check() -> None:
    with_password = _load({"LMCR_REDIS_PASSWORD": PASSWORD})
    plain = _load({})
    for name, service in with_password.items():
        assert service["environment"]["REDISCLI_AUTH"] == PASSWORD, name  # health checks
        assert plain[name]["environment"]["REDISCLI_AUTH"] == "", name
        for argv in _server_words(service):
            if argv[0].endswith("-server") and "--sentinel" not in argv:
                assert _option(argv, "--requirepass") == PASSWORD, name
                assert _option(argv, "--masterauth") == PASSWORD, name  # replicas log in
        for argv in _server_words(plain[name]):
            if "--sentinel" not in argv:
                assert _option(argv, "--requirepass") == "", name  # "" = no password


class _PasswordServer(RedisServer):
    """A RedisServer whose readiness PING (and `url`) logs in with `password` when set."""

    def __init__(self, password: str, *extra_args: str) -> None:
        super().__init__(*extra_args)
        self.password = password

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"


@pytest.mark.parametrize("password", ["", PASSWORD], ids=["plain", "password"])
def test_the_redis_service_runs_as_written(password: str) -> None:
    """The `redis` command, resolved with and without `LMCR_REDIS_PASSWORD`, on a real
    redis-server (a free port, 64 MB): the password is required exactly when set, and the URL
    the compose file documents (`redis://:<password>@127.0.0.1:6379/0`) logs in."""
    service = _load({"LMCR_REDIS_PASSWORD": password})["redis"]
    with _PasswordServer(password, *_argv(service)[1:], "--maxmemory", "64mb") as server:
        client = make_client(CacheConfig(remote_url=server.url))
        try:
            assert client.ping()
        finally:
            client.close()
        anonymous = redis.Redis(host="127.0.0.1", port=server.port)
        try:
            if password:
                with pytest.raises(redis.AuthenticationError):
                    anonymous.ping()
            else:
                assert anonymous.ping()
        finally:
            anonymous.close()


class _ComposeSentinel(_PasswordServer):
    """A sentinel service's own `sh -c` script, with its ports and config path swapped."""

    default_name = "sentinel"

    def __init__(self, password: str, service: dict[str, Any], master_port: int) -> None:
        super().__init__(password)
        self.master_port = master_port
        self.environment = dict(service["environment"])  # the service's environment
        self.script = _argv(service)[2]

    def command(self) -> list[str]:
        assert self._dir is not None
        env = {**self.environment, "SENTINEL_PORT": str(self.port)}
        script = (self.script.replace("/tmp/sentinel.conf", str(Path(self._dir) / "s.conf"))
                  .replace("127.0.0.1 6380 ", f"127.0.0.1 {self.master_port} ")
                  .replace("--sentinel", f"--sentinel --dir {self._dir}"))
        exports = " ".join(f"{k}={v}" for k, v in env.items())
        return ["sh", "-c", f"export {exports}; {script}"]


def test_the_sentinel_profile_runs_as_written_with_a_password() -> None:
    """The sentinel profile's master and first sentinel, resolved with a password, on real
    servers: the documented URL (password for the master, `sentinel_password` for the
    sentinels) reaches the master, and the sentinel refuses anyone without it."""
    services = _load({"LMCR_REDIS_PASSWORD": PASSWORD})
    master_argv = _argv(services["sentinel-master"])
    at = master_argv.index("--port")  # a free port instead of 6380
    master_args = master_argv[1:at] + master_argv[at + 2:]
    master = _PasswordServer(PASSWORD, *master_args, "--maxmemory", "64mb")
    with master:
        sentinel = _ComposeSentinel(PASSWORD, services["sentinel-1"], master.port)
        with sentinel:
            url = (f"redis+sentinel://:{PASSWORD}@127.0.0.1:{sentinel.port}/lmcr-master"
                   f"?sentinel_password={PASSWORD}")
            client = make_client(CacheConfig(remote_url=url, remote_timeout=5.0))
            try:
                client.set("lmcr:compose", b"1")
                assert master.client().get("lmcr:compose") == b"1"
            finally:
                client.close()
            anonymous = redis.Redis(host="127.0.0.1", port=sentinel.port)
            try:
                with pytest.raises(redis.AuthenticationError):
                    anonymous.execute_command("SENTINEL", "MASTERS")
            finally:
                anonymous.close()
