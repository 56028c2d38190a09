"""Integrity: a value in Redis that is not what its key promises is detected, never served,
counted (``stats()["remote"]["corrupt_chunks"]``) and deleted; a retrieve never writes KV for
tokens it does not report as hits.

The damaged values are made here from the byte layout in docs/value-format.md (with xxhash
alone for the checksums), written under real keys of a real Redis, and read by a real engine.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct
from collections.abc import Callable

import pytest
import redis
import torch
import xxhash
from faultkit import check_retrieve, det_kv, det_planes, sentinel_kv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvutil import engine, reference_keys

from lmcache_remote import CacheEngine, CacheEngineKey, KeyFormatError
from lmcache_remote.naming.keys import split_part_key
from lmcache_remote.values.serde import Serde

CHUNK = 256
N_CHUNKS = 3
MODEL = "test/model"
Values = list[bytes]

# docs/value-format.md: offsets in the header
OFF_VERSION, OFF_DTYPE, OFF_SHAPE, OFF_TOKENS, OFF_HASH, OFF_PART_COUNT = 4, 6, 8, 40, 44, 76
CODE_FLOAT16 = 2


def header_len(value0: bytes) -> int:
    (count,) = struct.unpack_from("<I", value0, OFF_PART_COUNT)
    return 84 + 16 * count


def reseal(value0: bytearray) -> bytes:
    """Recompute the header checksum after an edit, so only the semantic checks can object."""
    end = header_len(bytes(value0)) - 4
    struct.pack_into("<I", value0, end, xxhash.xxh3_64_intdigest(bytes(value0[:end])) & 0xFFFFFFFF)
    return bytes(value0)


def edit(value0: bytes, offset: int, fmt: str, value: object) -> bytes:
    buf = bytearray(value0)
    struct.pack_into(fmt, buf, offset, value)
    return reseal(buf)


def flip(data: bytes, index: int, bit: int = 0) -> bytes:
    buf = bytearray(data)
    buf[index] ^= 1 << bit
    return bytes(buf)


class Stored:
    """Three chunks written by one engine; their good values; a reader engine."""

    def __init__(self, client: redis.Redis, url: str, prefix: str, **cfg: object) -> None:
        self.client = client
        self.prefix = prefix
        self.toks = [random.Random(31).randrange(50_000) for _ in range(N_CHUNKS * CHUNK)]
        with engine(url, prefix, store_async=False, **cfg) as w:
            assert w.store(self.toks, det_kv(self.toks)) == len(self.toks)
        self.keys = reference_keys(self.toks, prefix, MODEL, chunk=CHUNK)
        self.good = [self.read(k) for k in self.keys]
        assert all(self.good)
        self.reader: CacheEngine = engine(url, prefix, local_cpu=False, **cfg)

    def part_keys(self, key: str, count: int) -> list[str]:
        return [key] + [f"{key}#{i}" for i in range(1, count)]

    def read(self, key: str) -> Values:
        count = len(list(self.client.scan_iter(match=key.replace("{", "\\{")
                                               .replace("}", "\\}") + "*")))
        return [bytes(v) for v in self.client.mget(self.part_keys(key, count))]

    def write(self, index: int, values: list[bytes | None]) -> None:
        """Put `values` under chunk `index`'s keys (None: delete that part)."""
        keys = self.part_keys(self.keys[index], max(len(values), len(self.good[index])))
        self.client.unlink(*keys)
        for key, value in zip(keys, values, strict=False):
            if value is not None:
                self.client.set(key, value)

    def restore(self) -> None:
        for i in range(N_CHUNKS):
            self.write(i, list(self.good[i]))

    def corrupt_count(self) -> int:
        return int(self.reader.stats()["remote"].get("corrupt_chunks", 0))

    def foreign_count(self) -> int:
        return int(self.reader.stats()["remote"].get("foreign_chunks", 0))

    def expect_cut_at(self, bad: int, kind: str = "corrupt") -> None:
        """Retrieve: exactly the chunks before `bad`, exact; `bad` not served and: "corrupt":
        counted as damage and deleted; "foreign": counted apart and left as it was (DESIGN.md:
        another release's value, or not the one its key names); "missing": neither (a part
        evicted); "any": corrupt or foreign, whichever it was counted as."""
        before = self.corrupt_count(), self.foreign_count()
        keys = self.part_keys(self.keys[bad], len(self.good[bad]) + 2)
        values = self.client.mget(keys)
        dst, read = sentinel_kv(len(self.toks))
        assert check_retrieve(self.reader.retrieve(self.toks, dst), self.toks, read) == bad * CHUNK
        corrupt = self.corrupt_count() - before[0]
        foreign = self.foreign_count() - before[1]
        if kind == "any":
            kind = "foreign" if foreign else "corrupt"
        if kind == "corrupt":
            assert (corrupt, foreign) == (1, 0)
            left = self.client.exists(*self.part_keys(self.keys[bad], len(self.good[bad]) + 2))
            assert left == 0, "a corrupt chunk was left in Redis"
        elif kind == "foreign":
            assert (corrupt, foreign) == (0, 1)
            assert self.client.mget(keys) == values, "a foreign chunk was touched"
        for i in range(N_CHUNKS):  # the other chunks are untouched
            if i != bad:
                assert self.client.exists(self.keys[i]) == 1
        assert self.reader.lookup(self.toks) <= bad * CHUNK

    def close(self) -> None:
        self.reader.close()


@pytest.fixture(params=["raw", "lz4"])
def serde(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[None, 4096], ids=["default_parts", "multipart"])
def stored(request: pytest.FixtureRequest, redis_client: redis.Redis, redis_url: str,
           key_prefix: str, serde: str) -> Stored:
    cfg = {"serde": serde}
    if request.param is not None:
        cfg["remote_part_size"] = request.param
    s = Stored(redis_client, redis_url, key_prefix, **cfg)
    yield s
    s.close()


def value0_mutations(good: Values, other: Values) -> dict[str, bytes]:
    v0 = good[0]
    h = header_len(v0)
    shape = struct.unpack_from("<8I", v0, OFF_SHAPE)
    swapped = (shape[0], shape[1], shape[2], shape[4], shape[3], *shape[5:])
    out = {
        "empty": b"",
        "magic_only": b"LMCR",
        "random_same_length": os.urandom(len(v0)),
        "header_only": v0[:h],
        "cut_last_byte": v0[:-1],
        "cut_in_header": v0[:50],
        "appended_byte": v0 + b"\0",
        "appended_copy": v0 + v0,
        "version_2": edit(v0, OFF_VERSION, "<B", 2),
        "dtype_float16": edit(v0, OFF_DTYPE, "<B", CODE_FLOAT16),
        "shape_swapped": reseal(bytearray(v0[:OFF_SHAPE] + struct.pack("<8I", *swapped)
                                          + v0[OFF_SHAPE + 32:])),
        "tokens_255": edit(v0, OFF_TOKENS, "<I", CHUNK - 1),
        "tokens_512": edit(v0, OFF_TOKENS, "<I", CHUNK * 2),
        "hash_of_other_chunk": reseal(bytearray(v0[:OFF_HASH] + other[0][OFF_HASH:OFF_HASH + 16]
                                                + v0[OFF_HASH + 16:])),
        "other_chunks_value": other[0],
    }
    middle = (h + len(v0)) // 2
    for offset in sorted({0, 4, 5, 6, 7, 9, 41, 45, 61, 69, 77, 81, 89, h - 1, h, middle,
                          len(v0) - 1}):
        if offset < len(v0):
            out[f"bit_flip_at_{offset}"] = flip(v0, offset, offset % 8)
    return out


#: value0_mutations whose header is intact but names what this reader cannot or must not serve:
#: foreign (left in place), not damage. A flipped bit in the version byte reads as another
#: format version, whose header this reader cannot check.
FOREIGN_VALUE0 = {"version_2", "dtype_float16", "shape_swapped", "tokens_255", "tokens_512",
                  "hash_of_other_chunk", "other_chunks_value", "bit_flip_at_4"}


def test_every_damaged_value0_is_deleted_and_every_foreign_one_left(stored: Stored) -> None:
    cases = value0_mutations(stored.good[1], stored.good[0])
    assert set(cases) >= FOREIGN_VALUE0
    for name, bad in cases.items():
        stored.write(1, [bad, *stored.good[1][1:]])
        try:
            stored.expect_cut_at(1, "foreign" if name in FOREIGN_VALUE0 else "corrupt")
        except AssertionError as exc:
            raise AssertionError(f"case {name}: {exc}") from exc
        stored.restore()
    # the first chunk damaged: nothing at all is served
    stored.write(0, [flip(stored.good[0][0], len(stored.good[0][0]) - 1), *stored.good[0][1:]])
    stored.expect_cut_at(0)


@pytest.fixture
def multipart(redis_client: redis.Redis, redis_url: str, key_prefix: str, serde: str) -> Stored:
    s = Stored(redis_client, redis_url, key_prefix, serde=serde, remote_part_size=4096)
    yield s
    s.close()


def test_damaged_and_foreign_parts_are_detected(multipart: Stored) -> None:
    stored = multipart
    good, other = stored.good[1], stored.good[0]
    assert len(good) >= 4
    cases: dict[str, list[bytes | None]] = {
        "part_from_other_chunk": [good[0], other[1], *good[2:]],
        "all_parts_from_other_chunk": [good[0], *other[1:]],
        "header_of_other_chunk": [other[0], *good[1:]],
        "part_bit_flip": [good[0], flip(good[1], len(good[1]) // 2), *good[2:]],
        "last_part_cut": [*good[:-1], good[-1][:-1]],
        "last_part_appended": [*good[:-1], good[-1] + b"\0"],
        "parts_swapped": [good[0], good[2], good[1], *good[3:]],
        "part_empty": [good[0], b"", *good[2:]],
    }
    for name, values in cases.items():
        stored.write(1, values)
        try:  # another chunk's header names another chunk: foreign, not damage
            stored.expect_cut_at(1, "foreign" if name == "header_of_other_chunk" else "corrupt")
        except AssertionError as exc:
            raise AssertionError(f"case {name}: {exc}") from exc
        stored.restore()
    # a part evicted (missing) is not served either; it is a miss (whether or not it is also
    # counted as damage is the tier's choice), and the chunks after it are not served
    stored.write(1, [good[0], None, *good[2:]])
    stored.expect_cut_at(1, "missing")


def test_a_value_written_with_another_codec_is_served(stored: Stored, redis_client: redis.Redis
                                                      ) -> None:
    """Not damage: decoding follows the header, so a value in the other codec is fine."""
    other = "lz4" if stored.reader.config.serde == "raw" else "raw"
    key = CacheEngineKey.from_redis_key(stored.prefix, stored.keys[1])
    tensor = det_planes(stored.toks)[:, :, CHUNK:2 * CHUNK].contiguous()
    values = [bytes(v) for v in Serde(other, stored.reader.config.remote_part_size)
              .encode(tensor, key.hash_bytes, CHUNK)]
    stored.write(1, values)
    dst, read = sentinel_kv(len(stored.toks))
    assert check_retrieve(stored.reader.retrieve(stored.toks, dst), stored.toks, read) == 3 * CHUNK
    assert stored.corrupt_count() == 0


# -- property-based: whatever bytes sit under a real key ----------------------------------------


@pytest.fixture
def default_parts(redis_client: redis.Redis, redis_url: str, key_prefix: str) -> Stored:
    s = Stored(redis_client, redis_url, key_prefix)
    yield s
    s.close()


FIXTURE_CHECK = HealthCheck.function_scoped_fixture  # one Redis prefix for all examples


def _check_arbitrary(stored: Stored, bad: bytes) -> None:
    if bad == stored.good[1][0]:
        return
    stored.write(1, [bad, *stored.good[1][1:]])  # value 0 replaced, the other parts kept
    stored.expect_cut_at(1, "any")
    stored.write(1, list(stored.good[1]))


@settings(max_examples=60, deadline=None, suppress_health_check=[FIXTURE_CHECK])
@given(st.binary(max_size=300))
def test_arbitrary_bytes_under_a_real_key_are_never_served(default_parts: Stored, bad: bytes
                                                           ) -> None:
    _check_arbitrary(default_parts, bad)


@settings(max_examples=80, deadline=None, suppress_health_check=[FIXTURE_CHECK])
@given(st.data())
def test_mutated_values_under_a_real_key_are_never_served(default_parts: Stored,
                                                          data: st.DataObject) -> None:
    good = default_parts.good[1][0]
    kind = data.draw(st.sampled_from(["xor", "cut", "append", "splice"]))
    if kind == "xor":
        index = data.draw(st.integers(0, len(good) - 1))
        bad = flip(good, index, data.draw(st.integers(0, 7)))
    elif kind == "cut":
        bad = good[:data.draw(st.integers(0, len(good) - 1))]
    elif kind == "append":
        bad = good + data.draw(st.binary(min_size=1, max_size=64))
    else:
        start = data.draw(st.integers(0, len(good) - 1))
        junk = data.draw(st.binary(min_size=1, max_size=32))
        bad = good[:start] + junk + good[start + len(junk):]
    _check_arbitrary(default_parts, bad)


# -- a retrieve writes only what it reports ------------------------------------------------------


def retrieve_by_layers(e: CacheEngine, toks: list[int], dst: object, mask: torch.Tensor
                       ) -> torch.Tensor:
    steps = list(e.retrieve_layer(toks, dst, mask))  # type: ignore[arg-type]
    assert all(torch.equal(s, steps[0]) for s in steps)  # the hit mask is fixed at step 0
    return steps[-1]


@pytest.mark.parametrize("layerwise", [False, True], ids=["retrieve", "retrieve_layer"])
@pytest.mark.parametrize("damaged", [None, 0, 1, 2])
@pytest.mark.parametrize("mask_chunks", [0, 1])
def test_retrieve_writes_kv_only_for_reported_hits(default_parts: Stored, damaged: int | None,
                                                   mask_chunks: int, layerwise: bool) -> None:
    toks = default_parts.toks + [7] * 100  # a partial tail chunk that is never stored
    if damaged is not None:
        good = default_parts.good[damaged]
        default_parts.write(damaged, [flip(good[0], 3), *good[1:]])
    mask = torch.ones(len(toks), dtype=torch.bool)
    mask[:mask_chunks * CHUNK] = False
    dst, read = sentinel_kv(len(toks))
    start = mask_chunks * CHUNK
    get = retrieve_by_layers if layerwise else CacheEngine.retrieve
    n = check_retrieve(get(default_parts.reader, toks, dst, mask), toks, read, start=start)
    end = N_CHUNKS if damaged is None or damaged < mask_chunks else damaged
    assert n == max(0, end - mask_chunks) * CHUNK


# -- key parsing ---------------------------------------------------------------------------------


@given(st.one_of(st.text(max_size=120), st.binary(max_size=120)))
def test_parsing_any_redis_key_raises_only_key_errors(key: str | bytes) -> None:
    parsers: list[Callable[[], object]] = [
        lambda: split_part_key("lmcr", key),
        lambda: CacheEngineKey.from_redis_key("lmcr", key),
    ]
    for parse in parsers:
        with contextlib.suppress(KeyFormatError):
            parse()


@given(st.text(max_size=40), st.integers(0, 99), st.text(max_size=12))
def test_parsing_keys_near_real_ones_raises_only_key_errors(model: str, index: int,
                                                           tail: str) -> None:
    h = "0" * 32
    for key in (f"lmcr:v1:{model}:1:0:bfloat16:{{{h}}}#{index}{tail}",
                f"lmcr:v1:{model}:1:0:bfloat16:{{{h}{tail}}}",
                f"lmcr:v1:{model}:{tail}:0:bfloat16:{{{h}}}"):
        with contextlib.suppress(KeyFormatError):
            parsed, part = split_part_key("lmcr", key)
            assert parsed.redis_key("lmcr") in key and part >= 0


@pytest.mark.parametrize("digits", ["²", "١", "１", "2²"])
def test_non_ascii_digits_are_not_key_numbers(digits: str) -> None:
    """Regression: `str.isdigit` accepts these; `int()` then failed ("²") or parsed a key that
    is not canonical ("١" as 1)."""
    h = "0" * 32
    for key in (f"lmcr:v1:m:{digits}:0:bfloat16:{{{h}}}",
                f"lmcr:v1:m:1:0:bfloat16:{{{h}}}#{digits}"):
        with pytest.raises(KeyFormatError):
            split_part_key("lmcr", key)
