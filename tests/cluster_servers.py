"""A Redis/Valkey Cluster and a Sentinel setup on loopback ports, for tests and benchmarks.

Contract:

- ``ClusterServers(masters=3, replicas=0, server_cls=RedisServer)`` starts ``masters * (1 +
  replicas)`` servers (``tests.servers.RedisServer`` or ``ValkeyServer``) with ``--cluster-enabled
  yes``, a short ``--cluster-node-timeout`` and ``--cluster-require-full-coverage no`` (a cache
  keeps serving the slots it has while a shard is down), then joins them with ``redis-cli
  --cluster create ... --cluster-replicas R --cluster-yes`` and returns once every node reports
  ``cluster_state:ok``, knows every node, and every replica is in sync with its master.
  ``.url`` is the ``redis+cluster://`` URL over all nodes; ``.masters`` the servers that hold
  slots (as the create step assigned them).
- A node's ``kill()``/``restart()`` keep its data directory, so a restarted node comes back on
  the same port with its ``nodes.conf`` (same node id and slots) and an empty data set.
- ``SentinelSetup(sentinels=3)`` starts a master, one replica (``--replicaof``) and the
  sentinels (``redis-server <conf> --sentinel``, quorum ``sentinels // 2 + 1``,
  ``down-after-milliseconds`` 1000, ``failover-timeout`` 3000), and returns once every
  sentinel sees the master and the replica. ``.url`` is the ``redis+sentinel://`` URL of
  service ``SERVICE``.
- ``stop()`` stops everything; both are context managers.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import redis

from tests.servers import (
    LOOPBACK,
    RedisServer,
    ServerNotFoundError,
    ServerStartError,
    free_port,
)

SERVICE = "lmcr-master"
NODE_TIMEOUT_MS = 2000
READY_TIMEOUT = 30.0


def find_redis_cli() -> str:
    found = shutil.which("redis-cli")
    if found is None:
        raise ServerNotFoundError(
            "redis-cli is not on PATH: the cluster tests create their cluster with "
            "`redis-cli --cluster create`. Install it (Debian/Ubuntu: `apt-get install -y "
            "redis-tools`, which redis-server pulls in)."
        )
    return found


def _wait(what: str, check: object, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise ServerStartError(f"{what} not ready within {timeout:g} s (last error: {last})")


class ClusterServers:
    """A cluster of ``masters`` primaries with ``replicas`` replicas each; see the module doc."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        server_cls: Callable[..., RedisServer] = RedisServer,
        *extra_args: str,
        cli_args: Sequence[str] = (),
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.replicas = replicas
        self.cli_args = tuple(cli_args)  # e.g. redis-cli's --tls options
        self.nodes = [
            server_cls(
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                "--cluster-require-full-coverage", "no",
                "--cluster-port", str(free_port()),  # port + 10000 may be taken or too high
                *extra_args,
            )
            for _ in range(masters * (1 + replicas))
        ]  # fmt: skip
        self.masters: list[RedisServer] = []

    @property
    def url(self) -> str:
        return "redis+cluster://" + self.hosts

    @property
    def hosts(self) -> str:
        """Every node's `host:port`, comma-separated (for a URL of another scheme)."""
        return ",".join(f"{n.host}:{n.port}" for n in self.nodes)

    def start(self) -> ClusterServers:
        cli = find_redis_cli()
        try:
            for node in self.nodes:
                node.start()
            argv = [
                cli, *self.cli_args, "--cluster", "create",
                *(f"{n.host}:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
            ]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
            if done.returncode != 0:
                raise ServerStartError(f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}")
            _wait("cluster", self._ready)
            self.masters = [n for n in self.nodes if self._is_master(n)]
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        for node in self.nodes:
            with node.client(decode_responses=True) as client:
                text = str(client.execute_command("CLUSTER", "INFO"))
                if "cluster_state:ok" not in text:
                    return False
                if f"cluster_known_nodes:{len(self.nodes)}" not in text:
                    return False
                replication = client.info("replication")
                if replication["role"] == "slave" and replication.get("master_link_status") != "up":
                    return False  # a replica still doing its first sync
        return True

    @staticmethod
    def _is_master(node: RedisServer) -> bool:
        with node.client() as client:
            role = client.execute_command("ROLE")
        return bool(role[0] in (b"master", "master"))

    def wait_ok(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until every running node reports ``cluster_state:ok`` again."""

        def ok() -> bool:
            for node in self.nodes:
                if not node.running:
                    continue
                with node.client() as client:
                    info = client.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text:
                    return False
            return True

        _wait("cluster state ok", ok, timeout)

    # -- resharding, as `redis-cli --cluster reshard` does it, one slot at a time ------------

    @staticmethod
    def _call(node: RedisServer, *args: object) -> object:
        with node.client() as client:
            return client.execute_command(*args)

    def start_slot_move(self, key: str, source: RedisServer, target: RedisServer) -> int:
        """Mark `key`'s slot migrating from `source` to `target` and move its keys; the slot
        stays owned by `source` (which now answers ASK) until `finish_slot_move`."""
        slot = int(self._call(source, "CLUSTER", "KEYSLOT", key))  # type: ignore[call-overload]
        source_id = self._call(source, "CLUSTER", "MYID")
        target_id = self._call(target, "CLUSTER", "MYID")
        self._call(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        self._call(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        while True:
            keys = self._call(source, "CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                break
            self._call(source, "MIGRATE", target.host, target.port, "", 0, 5000,
                       "KEYS", *keys)  # type: ignore[misc]
        return slot

    def finish_slot_move(self, slot: int, target: RedisServer) -> None:
        """Give `slot` to `target` on every master (clients asking the old owner get MOVED)."""
        target_id = self._call(target, "CLUSTER", "MYID")
        for node in [target, *(m for m in self.masters if m is not target)]:
            self._call(node, "CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> ClusterServers:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class SentinelServer(RedisServer):
    """``redis-server <conf> --sentinel`` watching ``SERVICE`` at ``master_port``."""

    default_name = "sentinel"

    def __init__(self, master_port: int, quorum: int, down_after_ms: int = 1000,
                 *extra_args: str) -> None:
        super().__init__(*extra_args)
        self.master_port = master_port
        self.quorum = quorum
        self.down_after_ms = down_after_ms

    def command(self) -> list[str]:
        assert self._dir is not None
        conf = Path(self._dir) / "sentinel.conf"
        if not conf.exists():  # the sentinel rewrites it with what it learns; keep that
            conf.write_text(
                f"sentinel monitor {SERVICE} {LOOPBACK} {self.master_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 3000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
        return [
            self.binary, str(conf), "--sentinel",
            "--port", str(self.port), "--bind", self.host, "--dir", str(self._dir),
            *self.extra_args,
        ]  # fmt: skip


class SentinelSetup:
    """A master, one replica and ``sentinels`` sentinels; see the module doc."""

    def __init__(self, sentinels: int = 3, server_cls: Callable[..., RedisServer] = RedisServer,
                 sentinel_args: Sequence[str] = ()) -> None:
        """`server_cls` makes the master and the replica (a TLS server, say);
        `sentinel_args` go to every sentinel's command line (its TLS options, say)."""
        self.master = server_cls()
        self.replica = server_cls()
        self.sentinels: list[SentinelServer] = []
        self._count = sentinels
        self._sentinel_args = tuple(sentinel_args)

    @property
    def url(self) -> str:
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> SentinelSetup:
        try:
            self.master.start()
            self.replica.extra_args += ("--replicaof", LOOPBACK, str(self.master.port))
            self.replica.start()
            quorum = self._count // 2 + 1
            self.sentinels = [
                SentinelServer(self.master.port, quorum, 1000, *self._sentinel_args)
                for _ in range(self._count)
            ]
            for sentinel in self.sentinels:
                sentinel.start()
            _wait("sentinels", self._ready)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        for sentinel in self.sentinels:
            with sentinel.client(decode_responses=True) as client:
                state = client.sentinel_master(SERVICE)
                if int(state.get("num-slaves", 0)) < 1:
                    return False
                if int(state.get("num-other-sentinels", 0)) < self._count - 1:
                    return False
        with self.replica.client(decode_responses=True) as client:
            return client.info("replication").get("master_link_status") == "up"

    def master_port(self) -> int | None:
        """The master's port as the first reachable sentinel reports it now."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            try:
                with sentinel.client(decode_responses=True) as client:
                    addr = client.sentinel_get_master_addr_by_name(SERVICE)
            except (redis.RedisError, OSError):
                continue
            return int(addr[1]) if addr else None
        return None

    def stop(self) -> None:
        for server in [*self.sentinels, self.replica, self.master]:
            server.stop()

    def __enter__(self) -> SentinelSetup:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
