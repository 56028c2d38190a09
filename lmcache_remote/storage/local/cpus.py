"""How many CPUs this process may use: the number every default thread count follows.

`os.cpu_count()` counts the host's cores. A process pinned to a few of them (`taskset`,
Kubernetes' static CPU manager, `numactl`) or limited by a CPU quota (a container's
`--cpus`, a Kubernetes CPU limit) can use fewer, and threads beyond that only queue for
them. `available_cpus()` is the smaller of

- the CPUs in the process's affinity mask (`os.sched_getaffinity(0)`, where the platform has
  it; `os.cpu_count()` elsewhere), and
- the CPU quota of the process's cgroup, rounded up: cgroup v2's `cpu.max` (`max` or
  `QUOTA PERIOD`), or cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none),
  the tightest along the path from the process's cgroup (`/proc/self/cgroup`) up to the root
  of the hierarchy;

never less than 1. The cgroup files are read once per call and any that cannot be read or
parsed means no limit (a wrong guess here costs speed, never correctness).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["available_cpus", "cgroup_cpu_limit"]

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"


def available_cpus(cgroup_root: str | os.PathLike[str] = CGROUP_ROOT,
                   proc_cgroup: str | os.PathLike[str] = PROC_CGROUP) -> int:
    """The CPUs this process may use (affinity, capped by the cgroup quota); at least 1."""
    if hasattr(os, "sched_getaffinity"):
        count = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS, Windows
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(1, count)


def cgroup_cpu_limit(cgroup_root: str | os.PathLike[str] = CGROUP_ROOT,
                     proc_cgroup: str | os.PathLike[str] = PROC_CGROUP) -> float | None:
    """The CPU quota (in CPUs, e.g. 1.5) of this process's cgroup, or None without one."""
    root = Path(cgroup_root)
    paths = _cgroup_paths(Path(proc_cgroup))
    if (root / "cgroup.controllers").is_file():  # v2, the unified hierarchy
        return _tightest(root, paths.get("", "/"), _v2_limit)
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # v1: the cpu controller's mount
        if (root / name).is_dir():
            return _tightest(root / name, paths.get("cpu", "/"), _v1_limit)
    if (root / "unified" / "cgroup.controllers").is_file():  # hybrid, v2 part only
        return _tightest(root / "unified", paths.get("", "/"), _v2_limit)
    return None


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """controller -> path of this process's cgroup ("" is v2's unified hierarchy)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _tightest(mount: Path, path: str, read: Callable[[Path], float | None]) -> float | None:
    """The smallest limit on the directories from `mount/path` up to `mount` (a path that is
    not there, as inside a cgroup namespace, leaves the mount's own)."""
    limits = []
    here = mount / path.strip("/")
    while True:
        limit = read(here)
        if limit is not None:
            limits.append(limit)
        if here == mount or mount not in here.parents:
            break
        here = here.parent
    return min(limits) if limits else None


def _v2_limit(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(directory: Path) -> float | None:
    quota_text = _read(directory / "cpu.cfs_quota_us")
    period_text = _read(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    try:
        quota, period = int(quota_text), int(period_text)
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
