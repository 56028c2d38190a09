"""`lmcache-remote stats --watch`: the fleet view refreshed in place (rich Live), bounded here by
the hidden `--count`; against a real redis-server with an engine's counters published."""

from __future__ import annotations

import torch
from cliutil import run
from kvutil import engine, tokens, view


def test_watch_refreshes_the_fleet_view(redis_url: str, key_prefix: str) -> None:
    n = 512
    kv, _ = view("kv_split", torch.bfloat16, n, seed=1)
    with engine(redis_url, key_prefix, store_async=False) as e:
        e.store(tokens(n), kv)
        e.lookup(tokens(n))
        e.flush()  # publishes its counters
        result = run("stats", "--watch", "--interval", "0.1", "--count", "3",
                     "--url", redis_url, "--prefix", key_prefix)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    out = result.stdout
    assert "refresh 3 at " in out and "every 0.1 s (Ctrl-C to stop)" in out
    assert "engines: 1 publishing, lookups 512 tokens, hits 512 tokens, hit rate 100.0%" in out
    assert "test/model" in out and "total" in out  # the same table as `stats`


def test_watch_with_json_is_a_usage_error(redis_url: str, key_prefix: str) -> None:
    result = run("stats", "--watch", "--json", "--url", redis_url, "--prefix", key_prefix)
    assert result.exit_code == 2
    assert "--watch" in result.stderr


def test_count_is_hidden_from_help() -> None:
    out = run("stats", "--help").stdout
    assert "--watch" in out and "--interval" in out and "--count" not in out
