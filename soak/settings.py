"""What one soak run is: its length, its mode, its engines and their sizes.

`SoakSettings` is built from the command line (`soak.cli`) and handed to each engine process
as JSON (`EngineSpec`), so the controller and the workers agree on every size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

MODES = ("fault-free", "faults", "both")
ROLES = {
    "rw": "read-write: lookup, retrieve, store the rest",
    "ro": "read-only: lookup and retrieve only",
    "nolocal": "read-write with no local tier (local_cpu=False)",
}
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class SoakSettings:
    """A run's knobs; the defaults are the documented soak (docs/reliability.md)."""

    minutes: float = 2.0
    mode: str = "fault-free"
    engines: tuple[str, ...] = ("rw", "rw", "ro", "nolocal")
    window: float = 10.0
    local_mib: float = 8.0
    redis_maxmemory_mib: int = 128
    remote_timeout: float = 1.0
    remote_part_size: int = 24 * 1024
    rate: float = 4.0
    """Requests per second per engine at most (a real engine is paced by its GPU)."""
    fault_interval: float = 6.0
    rss_slack_mib: float = 48.0
    """The documented constant: RSS may exceed the warm-up baseline by the budget plus this."""
    min_ratio: float = 0.99
    seed: int = 1
    lru_touch: bool = True
    """The engines' `remote_lru_touch`: False measures Redis's LRU without the refresh."""
    restart_every: float | None = None
    """Each engine with a local tier closes its `CacheEngine` and opens a fresh one (an empty
    local tier: an engine restarting, or a new one joining) every this many seconds, the
    engines staggered over the period; None = never."""
    top_docs: int = 5
    """The popularity report's "top" group: the documents of Zipf ranks 1..top_docs."""
    integrity_key: str | None = None
    """The engines' `integrity_key` (a source: ``file:PATH`` or ``env:NAME``); None = none."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        bad = [r for r in self.engines if r not in ROLES]
        if bad or not self.engines:
            raise ValueError(f"engine roles must be among {', '.join(ROLES)}, got {bad}")
        if self.minutes <= 0 or self.window <= 0 or self.rate <= 0:
            raise ValueError("minutes, window and rate must be > 0")
        if self.restart_every is not None and self.restart_every <= 0:
            raise ValueError("restart_every must be > 0")
        if self.top_docs < 1:
            raise ValueError("top_docs must be >= 1")

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0

    @property
    def call_bound(self) -> float:
        """No library call may take longer than this (issue 11: 3 x remote_timeout + 1 s)."""
        return 3 * self.remote_timeout + 1.0

    @property
    def fault_start(self) -> float:
        """Seconds into the run when faults begin (mode `faults`: after a fill period;
        mode `both`: the second half of the run is the fault phase)."""
        if self.mode == "both":
            return self.seconds / 2
        return min(20.0, self.seconds / 4)

    def engine_config(self, role: str, url: str, prefix: str) -> dict[str, Any]:
        """The `CacheConfig` fields of an engine of `role`."""
        return {
            "remote_url": url,
            "key_prefix": prefix,
            "chunk_size": 64,
            "local_cpu": role != "nolocal",
            "max_local_cpu_size": self.local_mib / 1024,
            "remote_timeout": self.remote_timeout,
            "remote_part_size": self.remote_part_size,
            "stats_publish_interval": None,
            "remote_lru_touch": self.lru_touch,
            "integrity_key": self.integrity_key,
            # the soak's server evicts by itself (allkeys-lru, squeezes of maxmemory): what it
            # judges is the cache under Redis's own eviction; the keep policy (docs/keep.md)
            # is not soaked yet
            "keep_policy": "redis",
        }

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["engines"] = list(self.engines)
        return out
