"""`export`, `import`, `warm --from`: byte-identical round trips, TTLs, damaged files."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from cliutil import chunk_keys, fill, run, run_json, values
from kvutil import engine, metadata, tokens, view


def _fill_two_models(url: str, prefix: str) -> None:
    fill(url, prefix, "org/model-x", n=800, remote_ttl=900, remote_part_size=4096)
    fill(url, prefix, "org/model-y", n=600, seed=2)


def test_export_evict_import_restores_byte_identical_values(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    _fill_two_models(redis_url, key_prefix)
    keys = chunk_keys(redis_client, key_prefix)
    before = values(redis_client, keys)
    ttls = {k: redis_client.pttl(k) for k in keys}
    snap = tmp_path / "cache.lmcr"
    base = ("--url", redis_url, "--prefix", key_prefix)

    exported = run_json("export", str(snap), *base)
    assert exported["entries"] == 5 and exported["skipped"] == 0
    assert exported["bytes"] == sum(len(v) for v in before.values())
    assert run_json("evict", "--all", "--yes", *base)["deleted"] == 5
    assert chunk_keys(redis_client, key_prefix) == set()

    imported = run_json("import", str(snap), *base)
    assert imported["entries"] == 5 and imported["bytes"] == exported["bytes"]
    assert chunk_keys(redis_client, key_prefix) == keys
    assert values(redis_client, keys) == before
    for key in keys:
        if ttls[key] < 0:
            assert redis_client.pttl(key) == -1
        else:
            assert 0 < redis_client.pttl(key) <= ttls[key]
            assert redis_client.pttl(key) > ttls[key] - 60_000

    n = 800
    dst, _ = view("kv_split", torch.bfloat16, n, seed=None)
    with engine(redis_url, key_prefix, metadata(model="org/model-x"), local_cpu=False,
                remote_part_size=4096) as e:
        assert e.retrieve(tokens(n), dst).sum().item() == 768


def test_import_under_another_prefix(redis_url: str, redis_client: redis.Redis,
                                     key_prefix: str, tmp_path: Path) -> None:
    fill(redis_url, key_prefix, "org/model-y", n=600)
    snap = tmp_path / "s.lmcr"
    run_json("export", str(snap), "--url", redis_url, "--prefix", key_prefix)
    other = key_prefix + "b"
    assert run_json("import", str(snap), "--url", redis_url, "--prefix", other)["entries"] == 2
    moved = {k.decode().replace(other, key_prefix, 1).encode() for k in
             chunk_keys(redis_client, other)}
    assert moved == chunk_keys(redis_client, key_prefix)
    run_json("evict", "--all", "--yes", "--url", redis_url, "--prefix", other)


def test_export_takes_filters(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    _fill_two_models(redis_url, key_prefix)
    snap = tmp_path / "y.lmcr"
    out = run_json("export", str(snap), "--model", "org/model-y", "--url", redis_url,
                   "--prefix", key_prefix)
    assert out["entries"] == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "trailer"])
def test_damaged_snapshot_fails_clearly_and_imports_nothing(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, tmp_path: Path, damage: str
) -> None:
    _fill_two_models(redis_url, key_prefix)
    snap = tmp_path / "cache.lmcr"
    base = ("--url", redis_url, "--prefix", key_prefix)
    run_json("export", str(snap), *base)
    run_json("evict", "--all", "--yes", *base)
    data = bytearray(snap.read_bytes())
    if damage == "truncate":
        cut = len(data) * 2 // 3
        snap.write_bytes(bytes(data[:cut]))
    elif damage == "flip":
        cut = len(data) * 2 // 3
        data[cut] ^= 0x40
        snap.write_bytes(bytes(data))
    else:
        cut = len(data) - 10
        data[cut] ^= 0x01
        snap.write_bytes(bytes(data))

    for command in ("import", "warm"):
        args = (command, str(snap), *base) if command == "import" else \
            (command, "--from", str(snap), *base)
        result = run(*args)
        assert result.exit_code == 1, result.stderr
        assert "damaged at byte" in result.stderr and str(snap) in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        offset = int(result.stderr.split("damaged at byte ")[1].split(":")[0])
        assert 0 < offset <= len(data)
        assert chunk_keys(redis_client, key_prefix) == set()
    if damage == "truncate":
        assert "truncated" in result.stderr


def test_not_a_snapshot(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"hello world")
    result = run("import", str(junk), "--url", redis_url, "--prefix", key_prefix)
    assert result.exit_code == 1 and "not an lmcache-remote snapshot" in result.stderr


def test_warm_from_file_skips_present_chunks(redis_url: str, redis_client: redis.Redis,
                                             key_prefix: str, tmp_path: Path) -> None:
    _fill_two_models(redis_url, key_prefix)
    keys = chunk_keys(redis_client, key_prefix)
    before = values(redis_client, keys)
    snap = tmp_path / "cache.lmcr"
    base = ("--url", redis_url, "--prefix", key_prefix)
    run_json("export", str(snap), *base)
    run_json("evict", "--model", "org/model-x", "--yes", *base)
    y_key = next(k for k in keys if b"model-y" in k)
    redis_client.set(y_key, b"changed since the export")

    out = run_json("warm", "--from", str(snap), *base)
    assert out["entries"] == 3 and out["skipped"] == 2
    assert chunk_keys(redis_client, key_prefix) == keys
    assert redis_client.get(y_key) == b"changed since the export"  # present: left alone
    assert {k: v for k, v in values(redis_client, keys).items() if k != y_key} == \
        {k: v for k, v in before.items() if k != y_key}
    again = run_json("warm", "--from", str(snap), *base)
    assert again["entries"] == 0 and again["skipped"] == 5
    assert run("warm", *base).exit_code == 2
