"""`lmcache-remote pin`, `unpin`, `warm --pin`, and what `ls`, `stats` and `ping` say of pins."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import redis
from cliutil import fill, run, run_json
from kvutil import reference_hashes, tokens

from lmcache_remote.naming.keys import CacheEngineKey
from tests.servers import RedisServer


def _chunk_keys(prefix: str, model: str, toks: list[int], salt: str | None = None) -> list[str]:
    return [CacheEngineKey(model, 1, 0, "bfloat16", h).redis_key(prefix)
            for h in reference_hashes(toks, 256, salt)[:len(toks) // 256]]


def test_pin_by_tokens_shows_in_ls_and_stats_and_unpin_gives_the_expiry_back(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, tmp_path: Path) -> None:
    fill(redis_url, key_prefix, "org/model-x", n=800, remote_part_size=4096)  # 3 chunks, parts
    fill(redis_url, key_prefix, "org/model-y", n=600, seed=2)
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(tokens(800, 0)))
    common = ("--url", redis_url, "--prefix", key_prefix)
    out = run_json("pin", *common, "--model", "org/model-x", "--tokens", str(prompt))
    assert out["matched"] == 3 and out["bytes"] == out["pinned_bytes"] > 3 * 32768
    pinned = _chunk_keys(key_prefix, "org/model-x", tokens(800, 0))
    for key in pinned:  # no expiry on any value of the chunk
        values = [key] + [f"{key}#{i}" for i in range(1, 16)]
        ttls = [redis_client.pttl(k) for k in values if redis_client.exists(k)]
        assert len(ttls) > 2 and set(ttls) == {-1}
    rows = run_json("ls", *common, "--limit", "0")["entries"]
    assert {r["redis_key"] for r in rows if r["pinned"]} == set(pinned)
    assert all(r["pinned_until"] is None for r in rows)
    stats = run_json("stats", *common)
    assert stats["pins"]["entries"] == 3 and stats["pins"]["bytes"] == out["pinned_bytes"]
    text = run("ls", *common).stdout
    assert "pinned" in text and "yes" in text
    gone = run_json("unpin", *common, "--all")
    assert gone["matched"] == 3 and gone["pinned_bytes"] == 0
    assert all(redis_client.pttl(k) > 0 for k in pinned)
    assert not any(r["pinned"] for r in run_json("ls", *common, "--limit", "0")["entries"])


def test_pin_needs_a_filter_and_a_pin_past_the_budget_is_refused(
        redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    fill(redis_url, key_prefix, "org/model-x", n=800)
    common = ("--url", redis_url, "--prefix", key_prefix)
    result = run("pin", *common)
    assert result.exit_code == 2 and "give a filter" in result.stderr
    cfg = tmp_path / "lmcr.yaml"
    cfg.write_text(f"pin_budget: {40000 / 2**30}\n")  # one 32 KiB chunk fits, three do not
    result = run("pin", *common, "--config", str(cfg), "--all")
    assert result.exit_code == 2
    assert "past the pin budget" in result.stderr and "unpin" in result.stderr
    assert run_json("stats", *common)["pins"]["entries"] == 0


def test_pin_for_a_time_shows_its_end(redis_url: str, key_prefix: str) -> None:
    fill(redis_url, key_prefix, "org/model-x", n=300)
    common = ("--url", redis_url, "--prefix", key_prefix)
    assert run_json("pin", *common, "--model", "org/model-x", "--for", "2h")["matched"] == 1
    (row,) = run_json("ls", *common)["entries"]
    assert row["pinned"] and row["pinned_until"] is not None
    assert "left" in run("ls", *common).stdout
    assert run("pin", *common, "--all", "--for", "soon").exit_code == 2


def test_warm_from_a_snapshot_with_pin_pins_what_it_holds(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, tmp_path: Path) -> None:
    fill(redis_url, key_prefix, "org/model-x", n=800, remote_ttl=None)  # written without expiry
    common = ("--url", redis_url, "--prefix", key_prefix)
    snapshot = tmp_path / "x.lmcr"
    run_json("export", *common, str(snapshot))
    assert run_json("evict", *common, "--all", "--yes")["deleted"] == 3
    out = run_json("warm", *common, "--from", str(snapshot), "--pin")
    assert out["entries"] == 3 and out["pinned"]
    keys = _chunk_keys(key_prefix, "org/model-x", tokens(800, 0))
    assert all(redis_client.pttl(k) == -1 for k in keys)
    assert run_json("stats", *common)["pins"]["entries"] == 3
    run_json("unpin", *common, "--all")
    # the snapshot held no expiry: the import gave the values remote_ttl (30 days)
    assert all(redis_client.pttl(k) > 29 * 86400_000 for k in keys)


def test_ping_says_whether_the_server_can_honour_pins(
        redis_factory: Callable[..., RedisServer]) -> None:
    lru = redis_factory("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    volatile = redis_factory("--maxmemory", "64mb", "--maxmemory-policy", "volatile-lru")
    warned = run_json("ping", "--url", lru.url)
    assert any("pinned chunks too" in w for w in warned["pin_warnings"])
    assert "volatile-lru" in run("ping", "--url", lru.url).stderr
    assert run_json("ping", "--url", volatile.url)["pin_warnings"] == []
