"""`lmcache-remote stats`, `ls`, `inspect`, `ping` against real servers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import redis
import torch
from click.testing import CliRunner
from cliutil import chunk_keys, fill, run, run_json
from kvutil import engine, metadata, tokens, view
from lmcache_remote_cli.main import cli

from lmcache_remote.naming.keys import CacheEngineKey

ROOT = Path(__file__).resolve().parent.parent


def test_stats_counts_entries_and_bytes_per_group(redis_url: str, redis_client: redis.Redis,
                                                  key_prefix: str) -> None:
    a = fill(redis_url, key_prefix, "org/model-a", n=700)
    b = fill(redis_url, key_prefix, "org/model-b", n=1100, seed=3, dtype=torch.float16,
             remote_part_size=4096)  # several values per chunk
    c = fill(redis_url, key_prefix, "org/model-a", n=300, seed=5, worker=1, world=2)
    # keys that are not the prefix's chunks: another prefix, an unrelated key
    foreign = CacheEngineKey("org/model-a", 1, 0, "bfloat16", "0" * 32)
    redis_client.set(foreign.redis_key(key_prefix + "x"), b"x" * 1000)
    redis_client.set(f"unrelated:{key_prefix}", b"y" * 1000)

    out = run_json("stats", "--url", redis_url, "--prefix", key_prefix)

    groups = {(g["model_name"], g["world_size"], g["worker_id"], g["dtype"]): g
              for g in out["groups"]}
    assert set(groups) == {("org/model-a", 1, 0, "bfloat16"), ("org/model-b", 1, 0, "float16"),
                           ("org/model-a", 2, 1, "bfloat16")}
    assert groups["org/model-a", 1, 0, "bfloat16"]["entries"] == a == 2
    assert groups["org/model-b", 1, 0, "float16"]["entries"] == b == 4
    assert groups["org/model-a", 2, 1, "bfloat16"]["entries"] == c == 1
    assert out["entries"] == a + b + c
    keys = chunk_keys(redis_client, key_prefix)
    assert len(keys) > a + b + c  # model-b's chunks have part keys
    assert out["bytes"] == sum(redis_client.strlen(k) for k in keys)
    for (model, world, worker, dtype), g in groups.items():
        mine = [k for k in keys
                if k.decode().startswith(f"{key_prefix}:v1:{model}:{world}:{worker}:{dtype}:")]
        assert g["bytes"] == sum(redis_client.strlen(k) for k in mine)
    assert out["redis"]["used_memory"] > 0 and "maxmemory_policy" in out["redis"]
    assert out["engines"]["count"] == 0


def test_stats_shows_the_fleet_hit_rate(redis_url: str, key_prefix: str) -> None:
    n = 1024
    kv, _ = view("kv_split", torch.bfloat16, n, seed=1)
    with engine(redis_url, key_prefix, store_async=False) as a, \
            engine(redis_url, key_prefix, metadata(worker=0), local_cpu=False) as b:
        a.store(tokens(n), kv)
        a.lookup(tokens(n))                           # 1024 of 1024
        b.lookup(tokens(n)[:512] + tokens(512, 9))    # 512 of 1024
        b.lookup(tokens(700, 4))                      # 0 of 700
        a.flush()
        b.flush()
        own = [e.stats()["engine"] for e in (a, b)]
        out = run_json("stats", "--url", redis_url, "--prefix", key_prefix)
    fleet = out["engines"]
    assert fleet["count"] == 2
    assert fleet["lookup_tokens"] == sum(s["lookup_tokens"] for s in own) == 2748
    assert fleet["hit_tokens"] == sum(s["lookup_hit_tokens"] for s in own) == 1536
    assert abs(fleet["hit_rate"] - 1536 / 2748) < 1e-6
    assert fleet["models"] == ["test/model"]
    assert out["entries"] == 4  # the engines' hashes are not chunks


def test_stats_shows_broken_lookup_promises(redis_url: str, redis_client: redis.Redis,
                                            key_prefix: str) -> None:
    n = 1024
    kv, _ = view("kv_split", torch.bfloat16, n, seed=1)
    with engine(redis_url, key_prefix, store_async=False, local_cpu=False) as e:
        e.store(tokens(n), kv)
        assert e.lookup(tokens(n)) == n
        third = e.token_db.chunks(tokens(n))[2].key.redis_key(key_prefix)
        assert redis_client.unlink(third) == 1  # gone between the lookup and the retrieve
        dst, _ = view("kv_split", torch.bfloat16, n, seed=None)
        assert int(e.retrieve(tokens(n), dst).sum()) == 512
        e.flush()
        out = run_json("stats", "--url", redis_url, "--prefix", key_prefix)
        human = run("stats", "--url", redis_url, "--prefix", key_prefix)
    assert out["engines"]["promise_broken_tokens"] == 512
    assert human.exit_code == 0
    assert "lookup promises broken: 512 tokens" in human.stdout


def test_stats_human_output_is_a_table(redis_url: str, key_prefix: str) -> None:
    fill(redis_url, key_prefix, "org/model-a")
    result = run("stats", "--url", redis_url, "--prefix", key_prefix)
    assert result.exit_code == 0
    assert "org/model-a" in result.stdout and "total" in result.stdout


def test_ls_lists_entries_with_filters_and_limit(redis_url: str, key_prefix: str) -> None:
    fill(redis_url, key_prefix, "org/model-a", n=800, remote_ttl=600)
    fill(redis_url, key_prefix, "org/model-b", n=600, seed=2, remote_ttl=None)  # no expiry
    out = run_json("ls", "--url", redis_url, "--prefix", key_prefix, "--limit", "0")
    assert out["count"] == 5
    assert not any(r["pinned"] for r in out["entries"])
    a_rows = [r for r in out["entries"] if r["model_name"] == "org/model-a"]
    assert len(a_rows) == 3
    assert all(r["num_tokens"] == 256 and r["dtype"] == "bfloat16" for r in out["entries"])
    assert all(500 < r["ttl_seconds"] <= 600 for r in a_rows)
    assert all(r["ttl_seconds"] is None for r in out["entries"] if r not in a_rows)
    assert all(r["idle_seconds"] is not None and r["bytes"] > 0 for r in out["entries"])
    only_b = run_json("ls", "--url", redis_url, "--prefix", key_prefix, "--model", "org/model-b")
    assert {r["model_name"] for r in only_b["entries"]} == {"org/model-b"}
    assert only_b["count"] == 2
    limited = run_json("ls", "--url", redis_url, "--prefix", key_prefix, "--limit", "2")
    assert limited["count"] == 2
    human = run("ls", "--url", redis_url, "--prefix", key_prefix)
    assert human.exit_code == 0 and "org/model-b" in human.stdout


def test_inspect_decodes_the_header_and_verifies(redis_url: str, redis_client: redis.Redis,
                                                 key_prefix: str) -> None:
    fill(redis_url, key_prefix, "org/model-a", n=300)
    row = run_json("ls", "--url", redis_url, "--prefix", key_prefix)["entries"][0]
    info = run_json("inspect", row["redis_key"], "--url", redis_url, "--prefix", key_prefix)
    assert info["codec"] == "raw" and info["num_tokens"] == 256  # the default codec
    assert info["shape"] == [2, 2, 256, 2, 8] and info["value_dtype"] == "bfloat16"
    assert info["raw_bytes"] == 2 * 2 * 256 * 2 * 8 * 2
    assert info["checksum_ok"] is True and info["error"] is None
    part_keys = [row["redis_key"], *(f"{row['redis_key']}#{i}" for i in range(1, info["parts"]))]
    assert info["bytes"] == sum(redis_client.strlen(k) for k in part_keys)
    assert redis_client.exists(*part_keys) == info["parts"]
    short = f"org/model-a:1:0:bfloat16:{row['chunk_hash']}"
    assert run_json("inspect", short, "--url", redis_url, "--prefix", key_prefix)["bytes"] \
        == info["bytes"]
    # damage one payload byte: the header still decodes, the checksum does not match
    redis_client.setrange(row["redis_key"], info["header_bytes"] + 5, b"\xff\x00")
    bad = run_json("inspect", row["redis_key"], "--url", redis_url, "--prefix", key_prefix)
    assert bad["checksum_ok"] is False and "checksum" in bad["error"]
    human = run("inspect", row["redis_key"], "--url", redis_url, "--prefix", key_prefix)
    assert human.exit_code == 0 and "FAILED" in human.stdout
    missing = run("inspect", f"org/model-a:1:0:bfloat16:{'0' * 32}", "--url", redis_url,
                  "--prefix", key_prefix)
    assert missing.exit_code == 1 and "no chunk" in missing.stderr


def test_ping_names_the_server_and_warns_on_noeviction(backend_url: str, redis_factory) -> None:
    start = time.perf_counter()
    out = run_json("ping", "--url", backend_url)
    elapsed_ms = (time.perf_counter() - start) * 1000
    expected = "valkey" if "valkey" in run("ping", "--url", backend_url).stdout else "redis"
    assert out["server"] == expected and out["version"][0].isdigit()
    # a measured round trip in milliseconds: more than nothing (one in seconds, rounded to
    # 3 decimals, is 0), and less than the whole command took
    assert isinstance(out["latency_ms"], float) and 0 < out["latency_ms"] < elapsed_ms
    assert out["maxmemory_policy"] == "noeviction"  # the test servers' default
    assert any("noeviction" in w for w in out["warnings"])
    human = run("ping", "--url", backend_url)
    assert human.exit_code == 0 and "noeviction" in human.stderr
    needed = redis_factory("--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru")
    ok = run_json("ping", "--url", needed.url)
    assert ok["maxmemory_policy"] == "volatile-lru" and ok["warnings"] == []
    lru = redis_factory("--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    warned = run_json("ping", "--url", lru.url)["warnings"]  # it defeats the keep policy
    assert any("keep policy" in w and "volatile-lru" in w for w in warned)


def test_ping_tells_valkey_from_redis(redis_url: str, valkey_server) -> None:
    assert run_json("ping", "--url", redis_url)["server"] == "redis"
    assert run_json("ping", "--url", valkey_server.url)["server"] == "valkey"


def test_console_script_runs(redis_url: str, key_prefix: str) -> None:
    exe = Path(sys.executable).with_name("lmcache-remote")
    helped = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "evict" in helped.stdout
    fill(redis_url, key_prefix)
    done = subprocess.run([str(exe), "stats", "--json", "--url", redis_url, "--prefix",
                           key_prefix], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["entries"] == 2


def test_url_and_prefix_from_config_file_and_environment(redis_url: str, key_prefix: str,
                                                         tmp_path: Path) -> None:
    fill(redis_url, key_prefix)
    cfg = tmp_path / "lmcr.yaml"
    cfg.write_text(f"remote_url: {redis_url}\nkey_prefix: {key_prefix}\n")
    assert run_json("stats", "--config", str(cfg))["entries"] == 2
    env = {"LMCR_REMOTE_URL": redis_url, "LMCR_KEY_PREFIX": key_prefix}
    result = CliRunner().invoke(cli, ["stats", "--json"], env=env)
    assert result.exit_code == 0 and json.loads(result.stdout)["entries"] == 2
    # options win over the environment
    other = CliRunner().invoke(cli, ["stats", "--json", "--prefix", key_prefix + "none"], env=env)
    assert json.loads(other.stdout)["entries"] == 0


def test_stats_shows_where_a_vllm_fleets_prompt_tokens_came_from(
        redis_url: str, key_prefix: str) -> None:
    """The vLLM scheduler side's own publisher (`vllm_core.fleet`, vLLM-free: its lookup and
    plans as vLLM's scheduler drives them) beside a worker engine of the same namespace that
    loads from Redis: `stats` says per namespace how many prompt tokens came from vLLM's own
    cache, the local tier, Redis, and were computed. (Inside vLLM: tests/vllm_real.)"""
    from lmcache_remote import CacheConfig
    from lmcache_remote.integrations.vllm_core import PrefixLookup, SchedulerSide
    from lmcache_remote.integrations.vllm_core.fleet import SchedulerPublisher

    n = 1024
    kv, _ = view("kv_split", torch.bfloat16, n, seed=1)
    meta = metadata(model="org/served")
    with engine(redis_url, key_prefix, meta, store_async=False) as writer:
        writer.store(tokens(n), kv)
    config = CacheConfig(remote_url=redis_url, key_prefix=key_prefix, chunk_size=256,
                         stats_publish_interval=60.0)
    lookup = PrefixLookup(config, meta.layout, [meta.namespace])
    side = SchedulerSide(lookup, 256, 16)
    publisher = SchedulerPublisher(config, lookup.remote, [side.metrics, lookup.metrics],
                                   lambda: "org/served", 1)
    prompt = [*tokens(n), *tokens(100, 7)]
    assert side.num_new_matched_tokens("r1", prompt, 256) == n - 256  # vLLM held a chunk
    side.after_alloc("r1", n - 256, list(range(70)), len(prompt))
    side.after_alloc("r1", n - 256, list(range(70)), len(prompt))  # counted once
    publisher.close()  # the last publish
    lookup.close()
    with engine(redis_url, key_prefix, meta, local_cpu=False) as worker:
        dst, _ = view("kv_split", torch.bfloat16, n, seed=None)
        mask = torch.ones(n, dtype=torch.bool)
        mask[:256] = False  # vLLM's own cache held these: the load skips them
        assert int(worker.retrieve(tokens(n), dst, mask).sum()) == n - 256
        worker.flush()
        out = run_json("stats", "--url", redis_url, "--prefix", key_prefix)
        human = run("stats", "--url", redis_url, "--prefix", key_prefix)
    view_ = out["engines"]["by_model"]["org/served"]
    assert (view_["prompt_tokens"], view_["device_cached_tokens"], view_["promised_tokens"]) \
        == (n + 100, 256, n - 256)
    assert view_["remote_hit_tokens"] == n - 256 and view_["local_hit_tokens"] == 0
    assert view_["computed_tokens"] == 100
    assert view_["cache_hit_rate"] == round((n - 256) / (n + 100), 6)
    assert (view_["schedulers"], view_["engines"]) >= (1, 1)
    assert human.exit_code == 0 and "prompt tokens by source" in human.stdout
    assert "org/served" in human.stdout


def test_stats_counts_declined_tokens_apart_and_shows_the_decision_figures(
        redis_url: str, key_prefix: str) -> None:
    """A vLLM scheduler side whose link is measured slow (its workers' report) declines a
    hit: `stats` counts those tokens as declined, not computed, and shows the figures the
    decision used (link, round trip, prefill)."""
    from lmcache_remote import CacheConfig
    from lmcache_remote.engine.decision import LoadDecision
    from lmcache_remote.integrations.vllm_core import PrefixLookup, SchedulerSide
    from lmcache_remote.integrations.vllm_core.fleet import SchedulerPublisher

    n = 1024
    kv, _ = view("kv_split", torch.bfloat16, n, seed=2)
    meta = metadata(model="org/declined")
    with engine(redis_url, key_prefix, meta, store_async=False) as writer:
        writer.store(tokens(n, 3), kv)
    config = CacheConfig(remote_url=redis_url, key_prefix=key_prefix, chunk_size=256,
                         stats_publish_interval=60.0)
    lookup = PrefixLookup(config, meta.layout, [meta.namespace])
    decision = LoadDecision.from_config(config, link=lookup.link)
    side = SchedulerSide(lookup, 256, 16, decision=decision,
                         bytes_per_token=lookup.bytes_per_token)
    side.worker_report(set(), False, 1000.0, (512, 512 * 256, 0.01))  # 1 kB/s, 51k tok/s
    decision.load_ended()  # a load just went out: no probe due
    publisher = SchedulerPublisher(config, lookup.remote, [side.metrics, lookup.metrics],
                                   lambda: "org/declined", 1)
    prompt = [*tokens(n, 3), *tokens(100, 9)]
    assert side.num_new_matched_tokens("r1", prompt, 0) == 0
    side.after_alloc("r1", 0, list(range(70)), len(prompt))
    publisher.close()
    lookup.close()
    out = run_json("stats", "--url", redis_url, "--prefix", key_prefix)
    human = run("stats", "--url", redis_url, "--prefix", key_prefix)
    view_ = out["engines"]["by_model"]["org/declined"]
    assert view_["declined_tokens"] == n and view_["computed_tokens"] == 100
    assert view_["link_bytes_per_s"] == 1000.0 and view_["prefill_tokens_per_s"] > 10_000
    assert 0 < view_["link_rtt_s"] < 1.0  # measured by the lookup
    assert human.exit_code == 0 and "declined" in human.stdout and "tok/s" in human.stdout
