"""The integrity key (`integrity_key`): a reader holding it serves only values whose MAC verifies
for their own key; everything else is a miss, counted (`remote.unauthenticated_chunks`) and
left in place. Mixed fleets behave as docs/reliability.md ("Threat model") says, the format is
the one docs/value-format.md ("Authenticated values") gives, and the key is never shown.

Real redis-servers (the session fixture), engines as a deployment runs them. Each forgery is
made the way someone who can write to Redis but lacks the key would make it: with the public
format (checksums included), never through a stub.
"""

from __future__ import annotations

import json
import logging
import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import blake3
import kvutil
import pytest
import redis
import torch
from click.testing import CliRunner
from faultkit import check_retrieve, det_kv, sentinel_kv
from lmcache_remote_cli.main import cli

from lmcache_remote import CacheConfig, ConfigError, load_config
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.values.integrity import DOMAIN, KDF_CONTEXT, IntegrityKey, load_integrity_key
from lmcache_remote.values.serde import Serde
from lmcache_remote.values.value_format import (
    AUTHENTICATED,
    HEADER_CHECKSUM,
    HEADER_FIXED,
    PART_ENTRY,
    TAG_NBYTES,
    checksum,
)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "value-format.md"
CHUNK = 256
KEY = b"8f3a" * 16  # 64 bytes of key, as `openssl rand -hex 32` writes them
OTHER_KEY = b"1b2c" * 16


@pytest.fixture
def key_file(tmp_path: Path) -> str:
    path = tmp_path / "integrity.key"
    path.write_bytes(KEY + b"\n")
    path.chmod(0o600)
    return f"file:{path}"


@pytest.fixture
def other_key_file(tmp_path: Path) -> str:
    path = tmp_path / "other.key"
    path.write_bytes(OTHER_KEY)
    path.chmod(0o600)
    return f"file:{path}"


def _engine(url: str, prefix: str, key: str | None, model: str = "test/model", **kw: Any) -> Any:
    kw.setdefault("local_cpu", False)
    return kvutil.engine(url, prefix, kvutil.metadata(model=model), store_async=False,
                         integrity_key=key, **kw)


def _values(client: redis.Redis, prefix: str) -> dict[bytes, bytes]:
    keys = sorted(client.scan_iter(match=f"{prefix}:v1:*"))
    return dict(zip(keys, client.mget(keys), strict=True))


def _retrieve(engine: Any, toks: list[int]) -> int:
    dst, read = sentinel_kv(len(toks))
    return check_retrieve(engine.retrieve(toks, dst), toks, read)


def _chunk_keys(client: redis.Redis, prefix: str, toks: list[int], index: int,
                model: str = "test/model") -> list[str]:
    head = kvutil.reference_keys(toks, prefix, model)[index]
    return sorted(k.decode() for k in client.scan_iter(match=_glob(head) + "*"))


def _glob(key: str) -> str:
    return key.replace("{", "\\{").replace("}", "\\}").replace("[", "\\[")


def _reseal(value0: bytes, parts: list[bytes], tag: bytes | None = None) -> bytes:
    """Value 0 with every part checksum and the header checksum made right for ``parts`` (what
    anyone can compute) and, where given, another tag: a forgery without the key."""
    head = bytearray(value0)
    count = HEADER_FIXED.unpack_from(head)[-1]
    signed = HEADER_FIXED.size + PART_ENTRY.size * count
    for i, part in enumerate(parts):
        PART_ENTRY.pack_into(head, HEADER_FIXED.size + i * PART_ENTRY.size, len(part),
                             checksum(part))
    if tag is not None:
        head[signed:signed + TAG_NBYTES] = tag
    end = signed + TAG_NBYTES
    HEADER_CHECKSUM.pack_into(head, end, checksum(bytes(head[:end])) & 0xFFFFFFFF)
    header_len = end + HEADER_CHECKSUM.size
    return bytes(head[:header_len]) + parts[0]


def _split(value0: bytes) -> tuple[bytes, bytes]:
    count = HEADER_FIXED.unpack_from(value0)[-1]
    size = HEADER_FIXED.size + PART_ENTRY.size * count + TAG_NBYTES + HEADER_CHECKSUM.size
    return value0[:size], value0[size:]


def _counts(engine: Any) -> dict[str, int]:
    remote = engine.stats()["remote"]
    return {k: remote.get(f"{k}_chunks", 0)
            for k in ("unauthenticated", "foreign", "corrupt", "hit")}


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_keyed_writer_and_keyed_reader_round_trip_bit_exact(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str,
        codec: str) -> None:
    toks = kvutil.tokens(3 * CHUNK, 1)
    with _engine(redis_url, key_prefix, key_file, serde=codec) as writer:
        assert writer.store(toks, det_kv(toks)) == 3 * CHUNK
    values = _values(redis_client, key_prefix)
    heads = [v for k, v in values.items() if b"#" not in k]
    assert len(heads) == 3 and all(v[4] == 1 | AUTHENTICATED for v in heads)
    with _engine(redis_url, key_prefix, key_file, serde=codec) as reader:
        assert reader.lookup(toks) == 3 * CHUNK
        assert _retrieve(reader, toks) == 3 * CHUNK
        assert _counts(reader) == {"unauthenticated": 0, "foreign": 0, "corrupt": 0, "hit": 3}
        reader.storage.remote.wire.native = False  # the Python reader (TLS's path) as well
        assert _retrieve(reader, toks) == 3 * CHUNK


def test_unkeyed_writers_values_are_misses_for_a_keyed_reader_left_in_place(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str) -> None:
    toks = kvutil.tokens(3 * CHUNK, 2)
    with _engine(redis_url, key_prefix, None) as writer:
        assert writer.store(toks, det_kv(toks)) == 3 * CHUNK
    before = _values(redis_client, key_prefix)
    with _engine(redis_url, key_prefix, key_file) as reader:
        assert _retrieve(reader, toks) == 0
        assert _counts(reader) == {"unauthenticated": 1, "foreign": 0, "corrupt": 0, "hit": 0}
        assert reader.lookup(toks) == 0  # no longer promised by this process
        reader.storage.remote.wire.native = False
        reader.storage.remote._foreign.clear()
        assert _retrieve(reader, toks) == 0
        assert _counts(reader)["unauthenticated"] == 2
    assert _values(redis_client, key_prefix) == before


def _forged(redis_client: redis.Redis, keys: list[str], how: str) -> None:
    """Rewrites the chunk under ``keys`` (value 0 first) as someone without the key would."""
    values = [redis_client.get(k) for k in keys]
    assert all(v is not None for v in values)
    header, part0 = _split(values[0])  # type: ignore[arg-type]
    parts = [part0, *values[1:]]
    if how == "payload":  # other KV, checksums made right, the old tag kept
        parts[0] = bytes([parts[0][0] ^ 0x40]) + parts[0][1:]
        redis_client.set(keys[0], _reseal(header, parts))
    elif how == "tag":  # the same KV under a tag of the forger's choosing
        redis_client.set(keys[0], _reseal(header, parts, bytes(TAG_NBYTES)))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["payload", "tag", "other key"])
def test_forged_values_are_never_served_counted_and_left_in_place(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str,
        other_key_file: str, how: str) -> None:
    toks = kvutil.tokens(3 * CHUNK, 3)
    with _engine(redis_url, key_prefix, key_file) as writer:
        assert writer.store(toks, det_kv(toks)) == 3 * CHUNK
    if how == "other key":  # chunk 1 written by an engine holding another key
        prefix_toks = toks[:2 * CHUNK]
        redis_client.delete(*_chunk_keys(redis_client, key_prefix, toks, 1))
        with _engine(redis_url, key_prefix, other_key_file) as other:
            assert other.store(prefix_toks, det_kv(prefix_toks)) == 2 * CHUNK
    else:
        _forged(redis_client, _chunk_keys(redis_client, key_prefix, toks, 1), how)
    before = _values(redis_client, key_prefix)
    with _engine(redis_url, key_prefix, key_file) as reader:
        assert _retrieve(reader, toks) == CHUNK  # chunk 0, then the forged one cuts the run
        assert _counts(reader) == {"unauthenticated": 1, "foreign": 0, "corrupt": 0, "hit": 1}
    assert _values(redis_client, key_prefix) == before


def test_runs_checked_while_the_next_one_arrives_keep_the_prefix_rule(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyed read receives each window in runs (`chunks.reads.VERIFY_RUN_BYTES`), checking
    one run's MACs while the next one comes in on a receiver thread: with one chunk a run and
    one lane, every chunk after the first arrives that way. All six come back exact; a forged
    fourth cuts the run there, the chunk being received behind it is released with the rest,
    and nothing stays held in the tier's pool."""
    import threading

    from lmcache_remote.storage.chunks import reads as remote_reads

    monkeypatch.setattr(remote_reads, "VERIFY_RUN_BYTES", 1)
    toks = kvutil.tokens(6 * CHUNK, 9)
    with _engine(redis_url, key_prefix, key_file) as writer:
        assert writer.store(toks, det_kv(toks)) == 6 * CHUNK
    with _engine(redis_url, key_prefix, key_file, remote_read_lanes=1) as reader:
        assert _retrieve(reader, toks) == 6 * CHUNK
        assert any(t.name.startswith("lmcr_receiver") for t in threading.enumerate())
        _forged(redis_client, _chunk_keys(redis_client, key_prefix, toks, 3), "payload")
        assert _retrieve(reader, toks) == 3 * CHUNK
        assert _counts(reader) == {"unauthenticated": 1, "foreign": 0, "corrupt": 0, "hit": 9}
        assert reader.storage.remote.pool.used_bytes == 0


def test_values_moved_under_another_key_or_mixed_between_chunks_are_never_served(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str) -> None:
    """Same tokens under two model names (same chunk hashes, same geometry): each chunk's
    header names the hash the other model's key carries too; only the MAC tells them apart."""
    toks = kvutil.tokens(2 * CHUNK, 4)
    with _engine(redis_url, key_prefix, key_file, model="model/a") as a:
        assert a.store(toks, det_kv(toks)) == 2 * CHUNK
    other = [t ^ 1 for t in toks]
    with _engine(redis_url, key_prefix, key_file, model="model/b") as b:
        assert b.store(other, det_kv(other)) == 2 * CHUNK
    a0 = _chunk_keys(redis_client, key_prefix, toks, 0, "model/a")
    b0 = [k.replace("model/a", "model/b") for k in a0]
    for src, dst in zip(a0, b0, strict=True):  # model a's valid chunk 0 under model b's key
        redis_client.set(dst, redis_client.get(src))  # type: ignore[arg-type]
    # model a's chunk 1: part 1 taken from its chunk 0, checksums made right (a forger's mix)
    a1 = _chunk_keys(redis_client, key_prefix, toks, 1, "model/a")
    assert len(a1) == len(a0) >= 2, "the test's chunks must be cut in parts"
    header, part0 = _split(redis_client.get(a1[0]))  # type: ignore[arg-type]
    mixed = [part0, *[redis_client.get(k) for k in a0[1:]]]
    redis_client.set(a1[0], _reseal(header, mixed))  # type: ignore[arg-type]
    redis_client.set(a1[1], mixed[1])  # type: ignore[arg-type]
    before = _values(redis_client, key_prefix)
    with _engine(redis_url, key_prefix, key_file, model="model/b") as b:
        assert _retrieve(b, toks) == 0
        assert _counts(b)["unauthenticated"] == 1
    with _engine(redis_url, key_prefix, key_file, model="model/a") as a:
        assert _retrieve(a, toks) == CHUNK
        assert _counts(a) == {"unauthenticated": 1, "foreign": 0, "corrupt": 0, "hit": 1}
    assert _values(redis_client, key_prefix) == before


def test_damage_under_a_key_is_still_deleted(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str) -> None:
    """A flipped bit in a part (its checksum fails) is damage, as without a key: deleted."""
    toks = kvutil.tokens(2 * CHUNK, 5)
    with _engine(redis_url, key_prefix, key_file) as writer:
        assert writer.store(toks, det_kv(toks)) == 2 * CHUNK
    keys = _chunk_keys(redis_client, key_prefix, toks, 1)
    part = bytearray(redis_client.get(keys[-1]))  # type: ignore[arg-type]
    part[len(part) // 2] ^= 1
    redis_client.set(keys[-1], bytes(part))
    with _engine(redis_url, key_prefix, key_file) as reader:
        assert _retrieve(reader, toks) == CHUNK
        assert _counts(reader) == {"unauthenticated": 0, "foreign": 0, "corrupt": 1, "hit": 1}
    assert not any(redis_client.exists(k) for k in keys)


_V1_ONLY = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import lmcache_remote.values.value_format as value_format
    value_format.AUTHENTICATED = 0  # a release that knows format version 1 only (before the MAC)
    import faultkit, kvutil
    url, prefix, seed = sys.argv[1:4]
    toks = kvutil.tokens(2 * 256, int(seed))
    with kvutil.engine(url, prefix, local_cpu=False) as engine:
        dst, read = faultkit.sentinel_kv(len(toks))
        done = faultkit.check_retrieve(engine.retrieve(toks, dst), toks, read)
        remote = engine.stats()["remote"]
    print(json.dumps({{"tokens": done, "foreign": remote.get("foreign_chunks", 0),
                      "corrupt": remote.get("corrupt_chunks", 0)}}))
""")


def test_mixed_fleet_keyed_writer_unkeyed_readers(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str) -> None:
    """This release without the key reads authenticated values unchanged (it trusts Redis; the
    tag is not checked); a release that knows only format version 1 finds another version: a
    foreign value, a miss left in place (DESIGN.md's evolution rule)."""
    toks = kvutil.tokens(2 * CHUNK, 6)
    with _engine(redis_url, key_prefix, key_file) as writer:
        assert writer.store(toks, det_kv(toks)) == 2 * CHUNK
    before = _values(redis_client, key_prefix)
    with _engine(redis_url, key_prefix, None) as reader:
        assert reader.lookup(toks) == 2 * CHUNK
        assert _retrieve(reader, toks) == 2 * CHUNK
        assert _counts(reader)["hit"] == 2
        reader.storage.remote.wire.native = False
        assert _retrieve(reader, toks) == 2 * CHUNK
    script = _V1_ONLY.format(root=str(ROOT), tests=str(ROOT / "tests"))
    out = subprocess.run([sys.executable, "-c", script, redis_url, key_prefix, "6"],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "tokens": 0, "foreign": 1, "corrupt": 0}
    assert _values(redis_client, key_prefix) == before


def test_mixed_fleet_converges_on_authenticated_values(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, key_file: str) -> None:
    """A keyed engine that missed on an unkeyed value stores that chunk again when it computed
    it (the chunk found unauthenticated counts as absent to its stores): the MACed value
    replaces the unkeyed one, one chunk per miss (the first unauthenticated chunk cuts the
    run), and both kinds of engine of this release serve it from then on."""
    toks = kvutil.tokens(2 * CHUNK, 7)
    with _engine(redis_url, key_prefix, None) as plain:
        assert plain.store(toks, det_kv(toks)) == 2 * CHUNK
    with _engine(redis_url, key_prefix, key_file) as keyed:
        for served in (0, CHUNK):
            assert _retrieve(keyed, toks) == served
            keyed.store(toks, det_kv(toks))
        assert _retrieve(keyed, toks) == 2 * CHUNK
        assert _counts(keyed)["unauthenticated"] == 2
    heads = [v for k, v in _values(redis_client, key_prefix).items() if b"#" not in k]
    assert len(heads) == 2 and all(v[4] == 1 | AUTHENTICATED for v in heads)
    with _engine(redis_url, key_prefix, None) as plain:
        assert _retrieve(plain, toks) == 2 * CHUNK


def test_the_mac_is_the_documented_construction() -> None:
    """Keyed BLAKE3, under the key BLAKE3's derive_key makes of the secret with the documented
    context, of DOMAIN, the key name's length and bytes, the header up to the tag, the stored
    parts (docs/value-format.md): computed here from those words alone."""
    serde = Serde("raw", part_size=32)
    tensor = torch.arange(40, dtype=torch.float32).view(1, 2, 2, 1, 10)
    key = CacheEngineKey("m:x", 1, 0, "float32", "00" * 16)
    name = key.to_string()
    mac = IntegrityKey(KEY)
    values = serde.encode(tensor, key.hash_bytes, 2,
                          signer=lambda signed, parts: mac.tag(name, signed, parts))
    value0 = bytes(values[0])
    assert value0[4] == 0x81 and len(values) == 5
    signed = HEADER_FIXED.size + PART_ENTRY.size * 5
    header_len = signed + TAG_NBYTES + 4
    parts = [value0[header_len:], *map(bytes, values[1:])]
    encoded = name.encode()
    context = "lmcache-remote 2026-12-02 integrity key v1: the MAC key of cached KV values"
    assert context == KDF_CONTEXT and f'context = "{context}"' in DOC.read_text()
    derived = blake3.blake3(KEY, derive_key_context=context).digest()
    want = blake3.blake3(b"LMCR-MAC-1\x00" + struct.pack("<I", len(encoded)) + encoded
                         + value0[:signed] + b"".join(parts), key=derived).digest()
    assert DOMAIN == b"LMCR-MAC-1\x00" and len(want) == TAG_NBYTES
    assert value0[signed:signed + TAG_NBYTES] == want
    assert struct.unpack_from("<I", value0, signed + TAG_NBYTES)[0] == (
        checksum(value0[:signed + TAG_NBYTES]) & 0xFFFFFFFF)
    header = serde.read_header(value0)
    assert header.tag == want and header.header_nbytes == header_len
    out = serde.decode(values, key.hash_bytes)
    assert torch.equal(out, tensor)


def test_the_documented_example_is_what_the_code_writes() -> None:
    """docs/value-format.md's authenticated example, byte for byte: the golden chunk, the
    documented key and name."""
    golden = (ROOT / "tests" / "golden" / "raw_bf16.0.bin").read_bytes()
    serde = Serde("raw")
    header = serde.read_header(golden)
    tensor = serde.decode([golden], header.chunk_hash)
    mac = IntegrityKey(b"0123456789abcdef0123456789abcdef")
    name = "m:1:0:bfloat16:" + header.chunk_hash.hex()
    value = bytes(serde.encode(tensor, header.chunk_hash, header.num_tokens,
                               signer=lambda signed, parts: mac.tag(name, signed, parts))[0])
    dump = DOC.read_text().split("## Authenticated values", 1)[1]
    dump = dump.split("```hexdump", 1)[1].split("```", 1)[0]
    documented = bytes.fromhex("".join(line[10:58] for line in dump.strip().splitlines()))
    assert value == documented and len(value) == 164
    derived = blake3.blake3(b"0123456789abcdef0123456789abcdef",
                            derive_key_context=KDF_CONTEXT).hexdigest()
    assert f"`K` =\n`{derived}`" in DOC.read_text()
    assert value[:4] + value[5:0x60] == golden[:4] + golden[5:0x60]


def test_without_blake3_a_key_is_refused_and_no_key_still_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`blake3` is imported only when a key is loaded: an environment without it refuses the
    key with a clear error (naming the package, never the key) and runs without one."""
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 -> ImportError
    with pytest.raises(ConfigError, match="integrity_key.*blake3") as info:
        IntegrityKey(KEY)
    assert KEY.decode() not in str(info.value)
    assert load_integrity_key(None) is None


def test_integrity_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
    inline = KEY.decode()
    for bad in (inline, "file:", "env:", "env:1NAME", "vault:x"):
        with pytest.raises(ConfigError, match="integrity_key") as info:
            CacheConfig(integrity_key=bad)
        assert inline not in str(info.value)
    with pytest.raises(ConfigError, match="not shown"):
        CacheConfig(integrity_key=KEY)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot read"):
        load_integrity_key(f"file:{tmp_path / 'missing'}")
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 31 + b"\n")
    with pytest.raises(ConfigError, match="fewer than 32 bytes"):
        load_integrity_key(f"file:{short}")
    monkeypatch.delenv("LMCR_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="LMCR_TEST_KEY is not set"):
        load_integrity_key("env:LMCR_TEST_KEY")
    monkeypatch.setenv("LMCR_TEST_KEY", f"  {inline}\n")
    from_env = load_integrity_key("env:LMCR_TEST_KEY")
    assert from_env is not None and from_env.verify("n", b"", [], IntegrityKey(KEY).tag(
        "n", b"", []))
    loose = tmp_path / "loose.key"
    loose.write_bytes(KEY)
    loose.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="lmcache_remote.values.integrity"):
        assert load_integrity_key(f"file:{loose}") is not None
    assert "chmod 600" in caplog.text
    monkeypatch.setenv("LMCR_INTEGRITY_KEY", "env:LMCR_TEST_KEY")
    assert load_config(remote_url=None).integrity_key == "env:LMCR_TEST_KEY"


def test_a_bad_key_source_fails_the_engine_at_start_up(
        redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="integrity_key"):
        _engine(redis_url, key_prefix, f"file:{tmp_path / 'missing.key'}")


def test_the_key_is_never_shown(
        redis_url: str, redis_client: redis.Redis, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Not in a log line (at DEBUG, a forged value read included), a repr, the engine's stats,
    the counters it publishes into Redis, `lmcache-remote stats`; and never pickled."""
    monkeypatch.setenv("LMCR_TEST_KEY", KEY.decode())
    toks = kvutil.tokens(2 * CHUNK, 8)
    shown: list[str] = []
    with caplog.at_level(logging.DEBUG):
        with _engine(redis_url, key_prefix, None) as plain:
            assert plain.store(toks[:CHUNK], det_kv(toks[:CHUNK])) == CHUNK
        with _engine(redis_url, key_prefix, "env:LMCR_TEST_KEY",
                     stats_publish_interval=60.0) as engine:
            assert _retrieve(engine, toks) == 0  # an unauthenticated value: logged
            assert engine.store(toks, det_kv(toks)) == 2 * CHUNK
            remote = engine.storage.remote
            shown += [repr(engine.config), str(engine.config), repr(remote.integrity),
                      str(remote.integrity), json.dumps(engine.stats(), default=str)]
            with pytest.raises(TypeError):
                pickle.dumps(remote.integrity)
            engine.flush()  # publishes the counters into Redis
        for key in redis_client.scan_iter(match=f"{key_prefix}:*"):
            if redis_client.type(key) == b"hash":
                shown.append(repr(redis_client.hgetall(key)))
        result = CliRunner().invoke(cli, ["stats", "--url", redis_url, "--prefix",
                                          key_prefix, "--json"])
        shown.append(result.output)
    shown.append(caplog.text)
    assert "unauthenticated" in caplog.text
    for text in shown:
        assert KEY.decode() not in text and KEY[:16].decode() not in text
