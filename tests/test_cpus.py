"""available_cpus: the affinity mask, capped by the cgroup's CPU quota (v2 and v1 files)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_remote.storage.local.cpus import available_cpus, cgroup_cpu_limit


def _v2(root: Path, files: dict[str, str], own: str = "/") -> Path:
    """A cgroup v2 tree under `root` with `cpu.max` files at the given relative dirs; the
    /proc/self/cgroup that puts the process at `own`."""
    (root / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for rel, text in files.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text)
    proc = root.parent / "proc_cgroup"
    proc.write_text(f"0::{own}\n")
    return proc


@pytest.mark.parametrize(("text", "want"), [
    ("max 100000\n", None), ("150000 100000\n", 1.5), ("50000 100000", 0.5),
    ("400000 100000", 4.0), ("garbage", None), ("", None), ("-1 100000", None),
])
def test_v2_cpu_max(tmp_path: Path, text: str, want: float | None) -> None:
    proc = _v2(tmp_path / "cg", {".": text})
    assert cgroup_cpu_limit(tmp_path / "cg", proc) == want


def test_v2_tightest_limit_on_the_path_wins(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    proc = _v2(root, {".": "max 100000", "kubepods": "300000 100000",
                      "kubepods/pod1": "max 100000", "kubepods/pod1/c1": "800000 100000"},
               own="/kubepods/pod1/c1")
    assert cgroup_cpu_limit(root, proc) == 3.0
    # a namespaced view: the process's path is not under the mount, the mount's own counts
    proc.write_text("0::/elsewhere/not/here\n")
    assert cgroup_cpu_limit(root, proc) is None


def test_v1_quota_and_period(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    cpu = root / "cpu,cpuacct" / "docker" / "abc"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("250000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_limit(root, proc) == 2.5
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(root, proc) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path, tmp_path / "missing") is None
    assert available_cpus(tmp_path, tmp_path / "missing") == len(os.sched_getaffinity(0))


def test_quota_caps_affinity_rounded_up_never_below_one(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    proc = _v2(tmp_path / "cg", {".": "10000 100000"})
    assert available_cpus(tmp_path / "cg", proc) == 1  # 0.1 CPU: still one thread
    (tmp_path / "cg" / "cpu.max").write_text("100001 100000")
    assert available_cpus(tmp_path / "cg", proc) == min(affinity, 2)
    (tmp_path / "cg" / "cpu.max").write_text("max 100000")
    assert available_cpus(tmp_path / "cg", proc) == affinity


def test_affinity_of_a_pinned_process(tmp_path: Path) -> None:
    """A process pinned to one CPU gets one, whatever the host has; the serde threads of its
    remote tier follow."""
    code = (
        "import os, sys\n"
        "os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "from lmcache_remote.storage.local.cpus import available_cpus\n"
        f"print(available_cpus({str(tmp_path)!r}, {str(tmp_path / 'none')!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "1"


def test_serde_threads_zero_follows_available_cpus(redis_url: str, key_prefix: str) -> None:
    from kvutil import engine

    with engine(redis_url, key_prefix) as e:
        remote = e.storage.remote
        assert remote is not None
        assert remote.serde.threads == available_cpus()
    with engine(redis_url, key_prefix, serde_threads=3) as e:
        assert e.storage.remote is not None and e.storage.remote.serde.threads == 3
