"""The admin commands leave Redis's LRU clock alone (DESIGN.md, "Redis layout").

On a server with `CLIENT NO-TOUCH` (Valkey here; Redis 7.2 and newer) `ls`, `stats`, `inspect`
(which reads every value to verify it) and `export` touch no key: every chunk keeps its idle
time, and `evict --older-than` then matches exactly the chunks idle that long. On Redis 7.0
(this machine's redis-server) the command does not exist: there the admin reads take each
key's idle time before anything else of it, so what `ls` reports and what `evict
--older-than` selects is the idle time before the command; their own reads still refresh the
clock there (docs/cli.md). Idle times are seconds (Redis's LRU clock): the test waits, polling
with a deadline, until the chunks have been idle for 2 s.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis
from cliutil import chunk_keys, fill, run_json

IDLE = 2


def _wait_idle(client: redis.Redis, keys: set[bytes], seconds: int) -> None:
    deadline = time.monotonic() + 60
    while min(int(client.object("idletime", k)) for k in keys) < seconds:
        assert time.monotonic() < deadline, "keys never became idle"
        time.sleep(0.2)


def _no_touch(client: redis.Redis) -> bool:
    try:
        client.execute_command("CLIENT", "NO-TOUCH", "OFF")
    except redis.ResponseError:
        return False
    return True


def test_admin_reads_leave_the_lru_clock_alone(backend_url: str, key_prefix: str,
                                               tmp_path: Path) -> None:
    client = redis.Redis.from_url(backend_url)
    fill(backend_url, key_prefix, "org/a", n=800, remote_part_size=4096)  # 3 chunks, with parts
    keys = chunk_keys(client, key_prefix)
    _wait_idle(client, keys, IDLE)
    base = ("--url", backend_url, "--prefix", key_prefix)
    listed = run_json("ls", *base, "--limit", "0")
    assert listed["count"] == 3
    assert all(row["idle_seconds"] >= IDLE for row in listed["entries"])
    if not _no_touch(client):  # Redis 7.0: ls read the headers, and so refreshed the clocks
        matched = run_json("evict", *base, "--older-than", f"{IDLE}s", "--dry-run")
        assert matched["matched"] == 0
        return
    run_json("stats", *base)
    assert run_json("inspect", listed["entries"][0]["redis_key"], *base)["checksum_ok"] is True
    run_json("export", *base, str(tmp_path / "snapshot"))
    assert min(int(client.object("idletime", k)) for k in keys) >= IDLE  # nothing touched
    again = run_json("ls", *base, "--limit", "0")
    assert all(row["idle_seconds"] >= IDLE for row in again["entries"])
    matched = run_json("evict", *base, "--older-than", f"{IDLE}s", "--dry-run")
    assert matched["matched"] == 3
    client.get(sorted(keys)[0])  # a real read refreshes its chunk: evict then leaves it
    matched = run_json("evict", *base, "--older-than", f"{IDLE}s", "--dry-run")
    assert matched["matched"] == 2
