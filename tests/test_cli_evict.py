"""`lmcache-remote evict`: exactly the matching chunks, only under the prefix, only when told."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from cliutil import chunk_keys, fill, run, run_json
from kvutil import tokens

from lmcache_remote.naming.keys import CacheEngineKey


def _setup(url: str, client: redis.Redis, prefix: str) -> tuple[set[bytes], set[bytes]]:
    fill(url, prefix, "org/model-x", n=800, remote_part_size=4096)  # 3 chunks, with parts
    before_x = chunk_keys(client, prefix)
    fill(url, prefix, "org/model-y", n=600, seed=2)                 # 2 chunks
    others = chunk_keys(client, prefix) - before_x
    client.set(CacheEngineKey("org/model-x", 1, 0, "bfloat16", "1" * 32).redis_key(prefix + "z"),
               b"outside")
    client.set(f"elsewhere:{prefix}:org/model-x", b"outside")
    return before_x, others


def _outside(client: redis.Redis, prefix: str) -> list[bytes | None]:
    foreign = CacheEngineKey("org/model-x", 1, 0, "bfloat16", "1" * 32).redis_key(prefix + "z")
    return client.mget([foreign, f"elsewhere:{prefix}:org/model-x"])


def test_evict_model_yes_deletes_exactly_that_model(redis_url: str, redis_client: redis.Redis,
                                                    key_prefix: str) -> None:
    x_keys, y_keys = _setup(redis_url, redis_client, key_prefix)
    out = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--model", "org/model-x",
                   "--yes")
    assert out["matched"] == 3 and out["deleted"] == 3
    assert out["bytes"] > 0
    assert chunk_keys(redis_client, key_prefix) == y_keys  # every part of x gone, y intact
    assert _outside(redis_client, key_prefix) == [b"outside", b"outside"]


def test_evict_without_yes_and_without_tty_refuses(redis_url: str, redis_client: redis.Redis,
                                                   key_prefix: str) -> None:
    x_keys, y_keys = _setup(redis_url, redis_client, key_prefix)
    result = run("evict", "--url", redis_url, "--prefix", key_prefix, "--model", "org/model-x")
    assert result.exit_code == 2
    assert "--yes" in result.stderr and "3 entries" in result.stderr
    assert chunk_keys(redis_client, key_prefix) == x_keys | y_keys
    refused_all = run("evict", "--url", redis_url, "--prefix", key_prefix, "--all", "--json")
    assert refused_all.exit_code == 2 and refused_all.stdout == ""
    assert chunk_keys(redis_client, key_prefix) == x_keys | y_keys


def test_evict_dry_run_deletes_nothing(redis_url: str, redis_client: redis.Redis,
                                       key_prefix: str) -> None:
    x_keys, y_keys = _setup(redis_url, redis_client, key_prefix)
    out = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--all", "--dry-run",
                   "--yes")
    assert out == {"matched": 5, "deleted": 0,
                   "bytes": sum(redis_client.strlen(k) for k in x_keys | y_keys)}
    human = run("evict", "--url", redis_url, "--prefix", key_prefix, "--all", "--dry-run")
    assert human.exit_code == 0 and "would delete 5 entries" in human.stdout
    assert chunk_keys(redis_client, key_prefix) == x_keys | y_keys


def test_evict_all_leaves_keys_outside_the_prefix(redis_url: str, redis_client: redis.Redis,
                                                  key_prefix: str) -> None:
    _setup(redis_url, redis_client, key_prefix)
    out = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--all", "--yes")
    assert out["matched"] == out["deleted"] == 5
    assert chunk_keys(redis_client, key_prefix) == set()
    assert _outside(redis_client, key_prefix) == [b"outside", b"outside"]


def test_evict_tokens_deletes_the_chunks_of_one_prompt(redis_url: str, redis_client: redis.Redis,
                                                       key_prefix: str, tmp_path) -> None:
    fill(redis_url, key_prefix, "org/model-x", n=800)          # tokens(800, seed 0)
    fill(redis_url, key_prefix, "org/model-y", n=800)          # the same prompt, another model
    fill(redis_url, key_prefix, "org/model-x", n=600, seed=7)  # another prompt
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(tokens(600)))                  # the first two chunks
    plan = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--tokens", str(prompt),
                    "--dry-run")
    assert plan["matched"] == 4  # 2 chunks x 2 models
    salted = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--tokens",
                      str(prompt), "--cache-salt", "tenant-1", "--dry-run")
    assert salted["matched"] == 0
    out = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--tokens", str(prompt),
                   "--model", "org/model-x", "--yes")
    assert out["deleted"] == 2
    left = run_json("stats", "--url", redis_url, "--prefix", key_prefix)
    assert {(g["model_name"], g["entries"]) for g in left["groups"]} == {
        ("org/model-x", 1 + 2), ("org/model-y", 3)}


def test_evict_older_than_uses_idle_time(redis_url: str, redis_client: redis.Redis,
                                         key_prefix: str) -> None:
    fill(redis_url, key_prefix, "org/model-x", n=512)
    none = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--older-than", "1h",
                    "--yes")
    assert none == {"matched": 0, "deleted": 0, "bytes": 0}
    every = run_json("evict", "--url", redis_url, "--prefix", key_prefix, "--older-than", "0s",
                     "--yes")
    assert every["deleted"] == 2 and chunk_keys(redis_client, key_prefix) == set()


def test_evict_usage_errors(redis_url: str, key_prefix: str) -> None:
    base = ("evict", "--url", redis_url, "--prefix", key_prefix)
    assert run(*base, "--yes").exit_code == 2                        # no filter, no --all
    assert run(*base, "--all", "--model", "m", "--yes").exit_code == 2
    bad = run(*base, "--older-than", "soon", "--yes")
    assert bad.exit_code == 2 and "duration" in bad.stderr
    assert run(*base, "--cache-salt", "s", "--yes").exit_code == 2   # salt without tokens


@pytest.mark.parametrize("answer", ["y", "n"])
def test_evict_asks_on_a_terminal(redis_url: str, redis_client: redis.Redis, key_prefix: str,
                                  answer: str) -> None:
    """With a TTY on stdin and no --yes: show the count, ask, delete only on 'y'."""
    x_keys, y_keys = _setup(redis_url, redis_client, key_prefix)
    exe = Path(sys.executable).with_name("lmcache-remote")
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen([str(exe), "evict", "--model", "org/model-x", "--url", redis_url,
                                 "--prefix", key_prefix], stdin=slave, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        os.write(master, f"{answer}\n".encode())
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    assert "delete 3 entries" in err
    if answer == "y":
        assert proc.returncode == 0 and "deleted 3 of 3 entries" in out
        assert chunk_keys(redis_client, key_prefix) == y_keys
    else:
        assert proc.returncode == 2 and "nothing deleted" in err
        assert chunk_keys(redis_client, key_prefix) == x_keys | y_keys
