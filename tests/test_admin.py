"""The admin library without Click: SCAN, durations, the snapshot file format."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import redis

from lmcache_remote.admin import parse_duration
from lmcache_remote.admin.snapshot import SnapshotError, SnapshotReader, SnapshotWriter
from lmcache_remote.naming.keys import engine_stats_key, scan_pattern
from lmcache_remote.storage.session.scan import scan_batches, scan_keys


def test_scan_streams_every_key_in_pages(redis_client: redis.Redis, key_prefix: str) -> None:
    names = {f"{key_prefix}:k{i}".encode() for i in range(2500)}
    redis_client.mset(dict.fromkeys(names, b"v"))
    pages = list(scan_batches(redis_client, f"{key_prefix}:*", count=100))
    assert len(pages) > 10 and all(node is redis_client for node, _ in pages)
    assert set(scan_keys(redis_client, f"{key_prefix}:*", count=100)) == names
    redis_client.unlink(*names)


def test_engine_stats_key_is_not_a_chunk_key(redis_client: redis.Redis, key_prefix: str) -> None:
    key = engine_stats_key(key_prefix, "host-1-abc")
    redis_client.hset(key, "lookup_tokens", 1)
    assert list(scan_keys(redis_client, scan_pattern(key_prefix))) == []
    redis_client.unlink(key)
    with pytest.raises(ValueError):
        engine_stats_key(key_prefix, "a:b")


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900),
                                               ("2h", 7200), ("1d12h", 129600), ("1w", 604800),
                                               ("0.5s", 0.5)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5x", "h", "1h 2m", "-1s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def _write(path: Path) -> list[int]:
    """Three records; returns each record's start offset, then the trailer's."""
    offsets = []
    with SnapshotWriter(path, "src") as w:
        for i in range(3):
            offsets.append(w.offset)
            w.add(f"v1:m:1:0:bfloat16:{{{i:032x}}}", [b"a" * 100, b"b" * (i + 1)], [None, 5000])
        offsets.append(w.offset)
    return offsets


def test_snapshot_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _write(path)
    with SnapshotReader(path) as r:
        records = list(r.records())
        assert r.info.source_prefix == "src" and r.info.records == 3
    assert [rec.values[1] for rec in records] == [b"b", b"bb", b"bbb"]
    assert records[0].ttls_ms == [None, 5000]
    assert not path.with_name("s.partial").exists()


def test_an_aborted_export_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with pytest.raises(RuntimeError), SnapshotWriter(path, "p") as w:
        w.add("v1:m:1:0:bfloat16:{" + "0" * 32 + "}", [b"x"], [None])
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_damage_is_reported_at_the_damaged_record(tmp_path: Path) -> None:
    path = tmp_path / "s"
    offsets = _write(path)
    data = path.read_bytes()
    for rec, (start, end) in enumerate(zip(offsets, offsets[1:], strict=False)):
        for delta in (0, 5, 30, 60, end - start - 1):  # inside record `rec`
            bad = bytearray(data)
            bad[start + delta] ^= 0x01
            path.write_bytes(bytes(bad))
            with pytest.raises(SnapshotError) as err, SnapshotReader(path) as r:
                list(r.records())
            assert start <= err.value.offset < end, (rec, delta, str(err.value))


def test_every_truncation_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _write(path)
    data = path.read_bytes()
    for cut in range(0, len(data), 7):
        path.write_bytes(data[:cut])
        with pytest.raises(SnapshotError) as err, SnapshotReader(path) as r:
            list(r.records())
        assert 0 <= err.value.offset <= cut


def test_trailer_and_trailing_bytes_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "s"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data + b"\0")
    with pytest.raises(SnapshotError, match="after the end"), SnapshotReader(path) as r:
        list(r.records())
    count_at = len(data) - struct.calcsize("<QQQ8s")
    bad = bytearray(data)
    bad[count_at] += 1
    path.write_bytes(bytes(bad))
    with pytest.raises(SnapshotError, match="trailer says"), SnapshotReader(path) as r:
        list(r.records())
