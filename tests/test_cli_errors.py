"""Exit codes and error lines: unreachable Redis (3), passwords never shown, Ctrl-C (130)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from cliutil import fill, run, run_json
from faultkit import wait_for
from servers import unread_bytes

SECRET = "s3cret-Pa55"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args", [["ping"], ["stats"], ["ls"], ["evict", "--all", "--yes"],
                                  ["inspect", f"m:1:0:bfloat16:{'0' * 32}"],
                                  ["export", "OUT"], ["import", "IN"]])
def test_unreachable_redis_exits_3_with_one_line(args: list[str], tmp_path: Path) -> None:
    url = f"redis://user:{SECRET}@127.0.0.1:{_closed_port()}/0"
    snap = tmp_path / "in.lmcr"
    if "IN" in args:  # a valid (empty) snapshot, so that import gets as far as Redis
        from lmcache_remote.admin.snapshot import SnapshotWriter

        with SnapshotWriter(snap, "lmcr"):
            pass
    args = [str(snap) if a == "IN" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    for extra in ([], ["--json"]):
        result = run(*args, "--url", url, *extra)
        assert result.exit_code == 3, (result.stdout, result.stderr)
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "unreachable" in lines[0] and "Traceback" not in lines[0]
        assert SECRET not in result.stderr and "***" in result.stderr


def test_password_in_url_is_never_printed(private_redis, tmp_path: Path) -> None:
    with redis.Redis.from_url(private_redis.url) as admin:  # the fixture's PING needs no auth
        admin.config_set("requirepass", SECRET)
    url = private_redis.url.replace("redis://", f"redis://:{SECRET}@")
    fill(url, "lmcr")
    outputs = []
    for args in (["ping"], ["stats"], ["ls"], ["export", str(tmp_path / "s")]):
        for extra in ([], ["--json"]):
            result = run(*args, "--url", url, *extra)
            assert result.exit_code == 0, result.stderr
            outputs.append(result.stdout + result.stderr)
    assert run_json("stats", "--url", url)["entries"] == 2
    wrong = run("stats", "--url", url.replace(SECRET, "nope-" + SECRET[::-1]))
    assert wrong.exit_code == 1 and len(wrong.stderr.strip().splitlines()) == 1
    outputs.append(wrong.stdout + wrong.stderr)
    assert all(SECRET not in o and SECRET[::-1] not in o for o in outputs)


def test_bad_configuration_is_a_usage_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk_size: -1\n")
    result = run("stats", "--config", str(cfg))
    assert result.exit_code == 2 and "chunk_size" in result.stderr
    assert run("stats", "--url", "http://nope").exit_code == 2
    assert run("nosuchcommand").exit_code == 2


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C as an interactive shell gives it. A job started in
    the background by a non-interactive shell (`cmd &`: how long test runs are often started)
    ignores SIGINT, the child inherits that, and Python then installs no KeyboardInterrupt
    handler: the signal would be lost and the command would wait for its Redis call."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupt_exits_130(private_redis) -> None:
    exe = Path(sys.executable).with_name("lmcache-remote")
    private_redis.pause()  # the command blocks in a Redis call until interrupted
    try:
        proc = subprocess.Popen([str(exe), "stats", "-v", "--url", private_redis.url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={"LMCR_REMOTE_TIMEOUT": "60", "PATH": "/usr/bin:/bin"},
                                preexec_fn=_default_sigint)
        assert proc.stderr is not None
        first = proc.stderr.readline()  # logged right before the first Redis call
        assert "Redis at" in first
        # the command has sent its first request to the hung server and waits for the reply
        assert wait_for(lambda: unread_bytes(private_redis.port) > 0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        private_redis.resume()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
