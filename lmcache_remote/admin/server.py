"""Who answers at the URL: server name and version (Redis or Valkey), latency, eviction policy.

What the cache needs of the server, stated once here (`REQUIRED_POLICY`, `keep_warnings`;
docker-compose.yml and docs/deploy.md say the same, tests/test_keep.py holds them together):
a `maxmemory` and `maxmemory-policy volatile-lru`. With `keep_policy: learned` (the default)
the cache drops whole chunks itself under `keep_fill` of `maxmemory` (docs/keep.md), so the
server's own eviction is a backstop that should never run; `volatile-lru` keeps that backstop
away from pinned chunks and from the keep policy's own state (neither has an expiry).
`allkeys-*` would evict both, and pieces of chunks one value at a time; `noeviction` makes a
full Redis refuse writes (every store a dropped write); `volatile-*` evicts only keys with a
TTL, which is `noeviction` for a cache without `remote_ttl`. `server_info` returns those
findings as warnings.

Pins (`storage.pins`) hold only where Redis evicts keys with an expiry alone (`volatile-lru`,
`volatile-lfu`, `volatile-random`, `volatile-ttl`), or evicts nothing: under an `allkeys-*`
policy a pinned chunk is evicted like any other. `pin_warnings` says so.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from lmcache_remote.storage.session.scan import scan_nodes

_PINGS = 3
#: The `maxmemory-policy` the cache needs (see the module doc).
REQUIRED_POLICY = "volatile-lru"


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    server: str
    """`redis` or `valkey`."""
    version: str
    latency_ms: float
    """Median round trip of three PINGs."""
    mode: str
    """`standalone`, `cluster` or `sentinel`, as INFO reports it."""
    maxmemory: int
    maxmemory_policy: str | None
    warnings: tuple[str, ...]
    access: str = "ok"
    """`ok`, or why this user may not use the cache (the commands Redis refused)."""
    pin_warnings: tuple[str, ...] = ()
    """Why the server's settings cannot honour pins, if they cannot."""


def eviction_warnings(policy: str | None, maxmemory: int, ttl: float | None) -> list[str]:
    """Plain-language warnings about a `maxmemory-policy` that would refuse writes."""
    out = []
    if policy == "noeviction":
        out.append(
            "maxmemory-policy is noeviction: when Redis is full it refuses writes instead of "
            f"evicting old chunks; set it to {REQUIRED_POLICY} (docs/deploy.md)"
        )
    elif policy and policy.startswith("volatile-") and ttl is None:
        out.append(
            f"maxmemory-policy is {policy}: only keys with a TTL are evicted and remote_ttl is "
            "not set, so a full Redis refuses writes; set remote_ttl (the default is 30 days)"
        )
    if maxmemory == 0 and policy != "noeviction":
        out.append("maxmemory is 0 (no limit): Redis grows until the machine runs out of memory")
    return out


def keep_warnings(policy: str | None, maxmemory: int, keep_policy: str,
                  keep_budget: float | None) -> list[str]:
    """Plain-language reasons the server defeats the `learned` keep policy (none where it
    does not, or with `keep_policy: redis`)."""
    if keep_policy != "learned":
        return []
    out = []
    if policy and policy.startswith("allkeys-"):
        out.append(f"maxmemory-policy is {policy}: Redis may evict the keep policy's own state "
                   "and single values of chunks; the learned keep policy needs "
                   f"{REQUIRED_POLICY} (docs/keep.md)")
    if maxmemory == 0 and keep_budget is None:
        out.append("maxmemory is 0 and keep_budget is not set: the learned keep policy has no "
                   "budget to keep Redis under, so it writes every chunk and drops none; set "
                   "maxmemory (or keep_budget)")
    return out


def pin_warnings(policy: str | None, maxmemory: int, ttl: float | None) -> list[str]:
    """Plain-language reasons the server cannot honour pins (none where it can)."""
    if policy and policy.startswith("allkeys-") and maxmemory:
        return [f"maxmemory-policy is {policy}: Redis evicts any key when full, pinned chunks "
                "too; pins need volatile-lru (or volatile-lfu), see docs/pins.md"]
    if policy and policy.startswith("volatile-") and ttl is None:
        return ["remote_ttl is not set: chunks are written without an expiry, so pinned and "
                "unpinned chunks look the same to Redis; set remote_ttl"]
    return []


def server_info(client: Any, remote_ttl: float | None = None, keep_policy: str = "redis",
                keep_budget: float | None = None) -> ServerInfo:
    rtts = []
    for _ in range(_PINGS):
        start = time.perf_counter()
        client.ping()
        rtts.append((time.perf_counter() - start) * 1000)
    node = scan_nodes(client)[0]
    info = node.info("server")
    mem = node.info("memory")
    name = str(info.get("server_name") or "redis").lower()
    version = str(info.get(f"{name}_version") or info.get("redis_version") or "?")
    policy = mem.get("maxmemory_policy")
    maxmemory = int(mem.get("maxmemory", 0))
    return ServerInfo(
        server=name,
        version=version,
        latency_ms=round(statistics.median(rtts), 3),
        mode=str(info.get("redis_mode", "standalone")),
        maxmemory=maxmemory,
        maxmemory_policy=policy,
        warnings=tuple(eviction_warnings(policy, maxmemory, remote_ttl)
                       + keep_warnings(policy, maxmemory, keep_policy, keep_budget)),
        pin_warnings=tuple(pin_warnings(policy, maxmemory, remote_ttl)),
    )
