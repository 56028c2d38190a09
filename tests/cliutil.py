"""Helpers for CLI tests: run `lmcache-remote` in-process with Click's CliRunner, fill a
cache with engines, and read Redis independently of the code under test."""

from __future__ import annotations

import json
from typing import Any

import redis
import torch
from click.testing import CliRunner, Result
from kvutil import engine, metadata, tokens, view
from lmcache_remote_cli.main import cli


def run(*args: str, input: str | None = None) -> Result:
    """`lmcache-remote ARGS...`, without a TTY on stdin (CliRunner's stdin is not one)."""
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def run_json(*args: str) -> Any:
    result = run(*args, "--json")
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


def fill(url: str, prefix: str, model: str = "test/model", n: int = 700, seed: int = 0,
         dtype: torch.dtype = torch.bfloat16, worker: int = 0, world: int = 1,
         **overrides: Any) -> int:
    """Store `n` tokens (seeded) through an engine; the number of chunks it wrote to Redis."""
    kv, _ = view("kv_split", dtype, n, seed=seed + 1)
    meta = metadata(dtype, model=model, worker=worker, world=world)
    with engine(url, prefix, meta, store_async=False, stats_publish_interval=None,
                **overrides) as e:
        assert e.store(tokens(n, seed), kv) == n - n % 256
        return int(e.stats()["remote"]["written_chunks"])


def chunk_keys(client: redis.Redis, prefix: str) -> set[bytes]:
    """Every value key under `prefix:v1:` (chunk and part keys)."""
    return set(client.scan_iter(match=f"{prefix}:v1:*", count=1000))


def values(client: redis.Redis, keys: set[bytes]) -> dict[bytes, bytes]:
    ordered = sorted(keys)
    return dict(zip(ordered, client.mget(ordered), strict=True))
