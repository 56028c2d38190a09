"""Serde: golden bytes, bit-exact round trips, and corruption that must always be caught.

Regenerate the golden files (only after a deliberate format change, with a new version) with
``.venv/bin/python tests/test_serde.py --regen``.
"""

from __future__ import annotations

import random
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmcache_remote.errors import CorruptEntryError, ForeignEntryError, SerdeError
from lmcache_remote.values.serde import (
    CODECS,
    DEFAULT_PART_SIZE,
    DTYPE_CODES,
    HEADER_CHECKSUM,
    HEADER_FIXED,
    Serde,
    ValueHeader,
    dtype_from_name,
    dtype_name,
    get_codec,
    header_nbytes,
)

GOLDEN = Path(__file__).parent / "golden"
DOC = Path(__file__).resolve().parent.parent / "docs" / "value-format.md"
HASH = bytes(range(16))
OTHER_HASH = bytes(range(16, 32))
ROUND_TRIP_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
ALL_CODECS = ["raw", "lz4", "lz4-planes", "zstd-planes", "blosc2-lz4", "blosc2-zstd"]


@dataclass(frozen=True)
class GoldenCase:
    name: str
    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    num_tokens: int
    part_size: int = DEFAULT_PART_SIZE
    modulo: int = 64

    def tensor(self) -> torch.Tensor:
        """Small integers over a power of two: exact in every dtype used here."""
        n = 1
        for dim in self.shape:
            n *= dim
        base = (torch.arange(n, dtype=torch.float32) % self.modulo - self.modulo // 2) / 4
        return base.to(self.dtype).reshape(self.shape)

    def files(self) -> list[Path]:
        return sorted(GOLDEN.glob(f"{self.name}.*.bin"), key=lambda p: int(p.suffixes[0][1:]))

    def serde(self) -> Serde:
        return Serde(self.codec, part_size=self.part_size)


GOLDEN_CASES = [
    GoldenCase("raw_bf16", "raw", torch.bfloat16, (1, 2, 2, 1, 4), 2),
    GoldenCase("lz4_bf16", "lz4", torch.bfloat16, (2, 2, 8, 2, 4), 8),
    GoldenCase("raw_f16_multipart", "raw", torch.float16, (2, 2, 4, 1, 8), 4, part_size=100),
    GoldenCase("lz4_f32_multipart", "lz4", torch.float32, (2, 2, 8, 2, 4), 8, part_size=300),
    GoldenCase("lz4_fp8_e4m3", "lz4", torch.float8_e4m3fn, (2, 2, 4, 2, 8), 4, modulo=16),
    GoldenCase("lz4planes_bf16", "lz4-planes", torch.bfloat16, (2, 2, 16, 2, 4), 16),
    GoldenCase(
        "lz4planes_f32_multipart", "lz4-planes", torch.float32, (2, 2, 8, 2, 4), 8,
        part_size=300,
    ),
    # C-Blosc2's chunk format is stable across its releases; its encoder's bytes are pinned
    # for the python-blosc2 release in pyproject (a new release that changes them shows here).
    GoldenCase("blosc2lz4_bf16", "blosc2-lz4", torch.bfloat16, (2, 2, 16, 2, 4), 16),
    GoldenCase(
        "blosc2zstd_f32_multipart", "blosc2-zstd", torch.float32, (2, 2, 8, 2, 4), 8,
        part_size=300,
    ),
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Every bit pattern possible (NaNs included), so the comparison must be bitwise."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = itemsize
    for dim in shape:
        n *= dim
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def as_bytes(values: Sequence[object]) -> list[bytes]:
    return [bytes(v) for v in values]  # type: ignore[call-overload]


#: Offset of the format version in value 0: a flipped bit there reads as another format
#: version, whose header this reader cannot check (foreign, left in place, never served),
#: except bit 7 (`serde.AUTHENTICATED`): an authenticated header of version 1, whose header
#: checksum then fails (damage).
VERSION_BYTE = 4


def assert_flip_refused(serde: Serde, values: Sequence[bytes], index: int, pos: int,
                        bit: int) -> None:
    """Bit `bit` of byte `pos` of value `index` flipped: never served; damage
    (`CorruptEntryError`) except in the version byte (`ForeignEntryError`)."""
    damaged = bytearray(values[index])
    damaged[pos] ^= 1 << bit
    flipped = [*values[:index], bytes(damaged), *values[index + 1:]]
    if index == 0 and pos == VERSION_BYTE and bit != 7:
        with pytest.raises(ForeignEntryError):
            serde.read_header(flipped[0])
    else:
        assert_corrupt(serde, flipped)


def assert_corrupt(serde: Serde, values: Sequence[object], expected_hash: bytes = HASH) -> None:
    """Whichever step notices it, a damaged value must raise CorruptEntryError."""
    with pytest.raises(CorruptEntryError):
        header = serde.read_header(values[0] if values else b"")
        out = torch.empty(header.shape, dtype=header.dtype)
        serde.decode_into(header, values, out, expected_hash)


def rewrite_header(value0: bytes, fix_checksum: bool = True, **changes: object) -> bytes:
    """value0 with fields of the fixed header replaced; the header checksum recomputed."""
    names = ["magic", "version", "codec_id", "dtype_code", "ndim"]
    names += [f"dim{i}" for i in range(8)]
    names += ["num_tokens", "chunk_hash", "raw_nbytes", "part_size", "part_count"]
    fields = dict(zip(names, HEADER_FIXED.unpack_from(value0), strict=True))
    (part_count,) = struct.unpack_from("<I", value0, HEADER_FIXED.size - 4)
    fields.update(changes)
    buf = bytearray(value0)
    HEADER_FIXED.pack_into(buf, 0, *fields.values())
    if fix_checksum:
        end = header_nbytes(part_count) - HEADER_CHECKSUM.size
        HEADER_CHECKSUM.pack_into(buf, end, xxhash.xxh3_64_intdigest(bytes(buf[:end])) & 0xFFFFFFFF)
    return bytes(buf)


# --- registry -------------------------------------------------------------------------------


def test_dtype_registry_round_trips_and_codes_are_unique() -> None:
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)
    assert 0 not in DTYPE_CODES.values()
    for dtype in DTYPE_CODES:
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    for name in ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]:
        assert dtype_name(dtype_from_name(name)) == name
    assert dtype_from_name("int8") is torch.int8 and dtype_from_name("uint8") is torch.uint8


@pytest.mark.parametrize("name", ["torch.bfloat16", "bf16", "", "complex64", "Float32"])
def test_dtype_from_name_rejects_unknown(name: str) -> None:
    with pytest.raises(ValueError):
        dtype_from_name(name)


def test_codec_registry() -> None:
    assert get_codec("raw").codec_id == 0 and get_codec("lz4").codec_id == 1
    assert get_codec("lz4-planes").codec_id == 2 and get_codec("zstd-planes").codec_id == 3
    assert get_codec("blosc2-lz4").codec_id == 4 and get_codec("blosc2-zstd").codec_id == 5
    assert set(CODECS) == set(ALL_CODECS)
    with pytest.raises(SerdeError):
        get_codec("zstd")
    with pytest.raises(SerdeError):
        Serde("snappy")


def test_raw_codec_encode_does_not_copy() -> None:
    raw = memoryview(bytearray(b"abc"))
    assert get_codec("raw").encode(raw) is raw


@pytest.mark.parametrize("codec", ["blosc2-lz4", "blosc2-zstd"])
def test_blosc2_codecs_check_the_chunk_before_decompressing(codec: str) -> None:
    """Below the checksums (a reader could meet such bytes only by a forged checksum): a
    Blosc2 chunk that is cut, padded, or not a chunk at all is damage, never a crash."""
    c = get_codec(codec)
    raw = random_tensor(torch.bfloat16, (4096,)).view(torch.uint8).numpy().data
    data = bytes(c.encode(raw, 2))
    out = memoryview(bytearray(len(raw)))
    c.decode(memoryview(data), out)
    assert bytes(out) == bytes(raw)
    for bad in (data[:-1], data + b"\0", data[:16], bytes(len(data)), b"\xff" * 64):
        with pytest.raises(CorruptEntryError):
            c.decode(memoryview(bad), memoryview(bytearray(len(raw))))


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_codec_decode_requires_the_exact_length(codec: str) -> None:
    c = get_codec(codec)
    data = memoryview(bytes(c.encode(memoryview(b"x" * 100))))
    c.decode(data, memoryview(bytearray(100)))
    for size in (99, 101):
        with pytest.raises(CorruptEntryError):
            c.decode(data, memoryview(bytearray(size)))


# --- golden bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda c: c.name)
def test_encode_matches_golden_bytes(case: GoldenCase) -> None:
    golden = [p.read_bytes() for p in case.files()]
    values = case.serde().encode(case.tensor(), HASH, case.num_tokens)
    assert len(golden) == len(values) == case.serde().part_count(case.tensor().nbytes)
    assert as_bytes(values) == golden


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda c: c.name)
def test_golden_bytes_decode_to_the_tensor(case: GoldenCase) -> None:
    golden = [p.read_bytes() for p in case.files()]
    serde = Serde()  # default settings: decoding follows the header, not the reader's config
    header = serde.read_header(golden[0])
    assert header.codec_id == CODECS[case.codec].codec_id
    assert (header.dtype, header.shape, header.num_tokens) == (
        case.dtype,
        case.shape,
        case.num_tokens,
    )
    assert header.chunk_hash == HASH and header.part_size == case.part_size
    assert header.header_nbytes == header_nbytes(len(golden))
    assert header.payload_nbytes == sum(len(v) for v in golden) - header.header_nbytes
    decoded = serde.decode(golden, HASH, case.shape, case.dtype)
    assert_bit_equal(decoded, case.tensor())


def test_docs_hex_dump_is_the_raw_bf16_golden_value() -> None:
    dump = DOC.read_text().split("```hexdump", 1)[1].split("```", 1)[0]
    rows = re.findall(r"^[0-9a-f]{8}  (.*?)\s+\|", dump, re.M)
    data = bytes.fromhex("".join(re.findall(r"[0-9a-f]{2}", " ".join(rows))))
    assert data == (GOLDEN / "raw_bf16.0.bin").read_bytes()


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS)
@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("part_size", [DEFAULT_PART_SIZE, 4096, 1000, 1])
def test_round_trip_is_bit_exact(codec: str, dtype: torch.dtype, part_size: int) -> None:
    shape = (2, 2, 16, 2, 8) if part_size > 1 else (1, 2, 3, 1, 2)
    tensor = random_tensor(dtype, shape)
    serde = Serde(codec, part_size=part_size)
    values = serde.encode(tensor, HASH, shape[2])
    assert len(values) == serde.part_count(tensor.nbytes)
    assert (len(values) == 1) == (part_size >= tensor.nbytes)
    header = serde.read_header(values[0])
    out = torch.empty(shape, dtype=dtype)
    serde.decode_into(header, values, out, HASH, shape, dtype)
    assert_bit_equal(out, tensor)
    assert_bit_equal(serde.decode(as_bytes(values), HASH), tensor)


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_threads_give_the_same_bytes(codec: str) -> None:
    tensor = random_tensor(torch.bfloat16, (4, 2, 64, 4, 32), seed=3)
    serial = Serde(codec, part_size=8192)
    with Serde(codec, part_size=8192, threads=4) as threaded:
        values = threaded.encode(tensor, HASH, 64)
        assert as_bytes(values) == as_bytes(serial.encode(tensor, HASH, 64))
        assert_bit_equal(threaded.decode(values, HASH), tensor)
    assert_bit_equal(threaded.decode(values, HASH), tensor)  # still works after close()


def test_compressible_data_shrinks_with_lz4() -> None:
    tensor = torch.zeros(2, 2, 256, 8, 128, dtype=torch.bfloat16)
    values = Serde("lz4").encode(tensor, HASH, 256)
    assert sum(len(v) for v in values) < tensor.nbytes // 50


def test_byte_planes_beat_plain_lz4_on_normal_bf16() -> None:
    """Normal-distributed bf16: lz4 cannot use the repetitive high bytes, byte planes can."""
    gen = torch.Generator().manual_seed(3)
    tensor = torch.randn(2, 2, 256, 8, 128, generator=gen).to(torch.bfloat16)
    plain = sum(len(v) for v in Serde("lz4").encode(tensor, HASH, 256))
    planes = sum(len(v) for v in Serde("lz4-planes").encode(tensor, HASH, 256))
    assert planes < plain * 0.95
    assert_bit_equal(Serde("lz4-planes").decode(
        Serde("lz4-planes").encode(tensor, HASH, 256), HASH), tensor)
    # zstd's entropy coding takes the exponent plane further still (~0.68 of raw in all)
    zstd = sum(len(v) for v in Serde("zstd-planes").encode(tensor, HASH, 256))
    assert zstd < planes * 0.9 and zstd < tensor.nbytes * 0.72
    assert_bit_equal(Serde("zstd-planes").decode(
        Serde("zstd-planes").encode(tensor, HASH, 256), HASH), tensor)


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_default_parts_of_a_32_mib_chunk_stay_under_jemallocs_4_mib_class(codec: str) -> None:
    """Incompressible data (lz4's worst case): every value of a Llama-8B-sized chunk is under
    4 MiB, so Redis stores it in the 4 MiB size class, never the next one (5 MiB) nor at 8 MiB
    and up, where values page-fault on the server."""
    tensor = random_tensor(torch.bfloat16, (32, 2, 256, 8, 128), seed=5)
    values = Serde(codec).encode(tensor, HASH, 256)
    sizes = [len(memoryview(v)) for v in values]
    assert len(values) == 9 and max(sizes) < 4 * 1024 * 1024 - 1024, sizes


def test_part_count() -> None:
    serde = Serde(part_size=100)
    assert [serde.part_count(n) for n in (0, 1, 99, 100, 101, 200, 201)] == [1, 1, 1, 1, 2, 2, 3]
    assert Serde().part_count(4 * 1024 * 1024) == 2


def test_header_prefix_is_enough_for_read_header() -> None:
    serde = Serde("raw", part_size=64)
    values = serde.encode(random_tensor(torch.float16, (2, 2, 4, 2, 8)), HASH, 4)
    header = serde.read_header(values[0])
    assert header.part_count == len(values) == 8 and header.header_nbytes == 84 + 16 * 8
    assert serde.read_header(bytes(values[0])[: header.header_nbytes]) == header
    assert isinstance(header, ValueHeader)


def test_raw_parts_share_memory_with_the_tensor() -> None:
    tensor = torch.zeros(4, 64, dtype=torch.float32)
    values = Serde("raw", part_size=256).encode(tensor, HASH, 4)
    tensor[1, 0] = 1.0
    assert bytes(values[1])[:4] == struct.pack("<f", 1.0)


def test_decode_into_accepts_a_tensor_holder() -> None:
    tensor = random_tensor(torch.bfloat16, (2, 2, 4, 2, 8))
    serde = Serde()
    values = serde.encode(tensor, HASH, 4)

    class Holder:
        def __init__(self) -> None:
            self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype)

    holder = Holder()
    serde.decode_into(serde.read_header(values[0]), values, holder, HASH)
    assert_bit_equal(holder.tensor, tensor)


@settings(max_examples=60, deadline=None)
@given(
    codec=st.sampled_from(ALL_CODECS),
    dtype=st.sampled_from(sorted(DTYPE_CODES, key=str)),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=8).map(tuple),
    part_size=st.integers(1, 3000),
    seed=st.integers(0, 2**16),
    num_tokens=st.integers(1, 2**31),
)
def test_round_trip_property(
    codec: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    part_size: int,
    seed: int,
    num_tokens: int,
) -> None:
    tensor = random_tensor(dtype, shape, seed)
    serde = Serde(codec, part_size=part_size)
    values = serde.encode(tensor, HASH, num_tokens)
    assert len(values) == serde.part_count(tensor.nbytes)
    header = serde.read_header(values[0])
    assert header.num_tokens == num_tokens and header.raw_nbytes == tensor.nbytes
    assert_bit_equal(serde.decode(values, HASH, shape, dtype), tensor)


# --- bad input to encode --------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor, chunk_hash, num_tokens",
    [
        (torch.zeros(4, 4).t(), HASH, 4),  # not contiguous
        (torch.zeros(4, 4, dtype=torch.complex64), HASH, 4),  # no dtype code
        (torch.zeros(()), HASH, 1),  # 0-d
        (torch.zeros(0, 4), HASH, 1),  # empty
        (torch.zeros([1] * 9), HASH, 1),  # 9-d
        (torch.zeros(4, 4), HASH[:15], 4),
        (torch.zeros(4, 4), HASH, 0),
        (torch.zeros(4, 4), HASH, 2**31 + 1),
    ],
)
def test_encode_rejects_bad_arguments(
    tensor: torch.Tensor, chunk_hash: bytes, num_tokens: int
) -> None:
    with pytest.raises(SerdeError):
        Serde().encode(tensor, chunk_hash, num_tokens)


@pytest.mark.parametrize("kwargs", [{"part_size": 0}, {"part_size": 2**40}, {"threads": -1}])
def test_serde_rejects_bad_settings(kwargs: dict[str, int]) -> None:
    with pytest.raises(SerdeError):
        Serde(**kwargs)  # type: ignore[arg-type]


# --- corruption -----------------------------------------------------------------------------


def tiny_values(codec: str, part_size: int = DEFAULT_PART_SIZE) -> tuple[Serde, list[bytes]]:
    serde = Serde(codec, part_size=part_size)
    tensor = random_tensor(torch.bfloat16, (1, 2, 2, 1, 4), seed=1)
    return serde, as_bytes(serde.encode(tensor, HASH, 2))


@pytest.mark.parametrize("codec", ALL_CODECS)
@pytest.mark.parametrize("part_size", [DEFAULT_PART_SIZE, 12])
def test_every_bit_flip_is_caught_on_a_tiny_value(codec: str, part_size: int) -> None:
    serde, values = tiny_values(codec, part_size)
    serde.decode(values, HASH)  # the undamaged value is fine
    for index, value in enumerate(values):
        for pos in range(len(value)):
            for bit in range(8):
                assert_flip_refused(serde, values, index, pos, bit)


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_sampled_bit_flips_are_caught_on_a_large_value(codec: str) -> None:
    serde = Serde(codec, part_size=64 * 1024)
    tensor = random_tensor(torch.bfloat16, (4, 2, 64, 8, 64), seed=2)
    tensor[:2] = 0  # half compressible, half not
    values = as_bytes(serde.encode(tensor, HASH, 64))
    assert len(values) == 8
    rng = random.Random(7)
    for _ in range(300):
        index = rng.randrange(len(values))
        assert_flip_refused(serde, values, index, rng.randrange(len(values[index])),
                            rng.randrange(8))


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_truncated_and_extended_values_are_caught(codec: str) -> None:
    serde, values = tiny_values(codec, part_size=12)
    for index, value in enumerate(values):
        for cut in range(len(value)):
            assert_corrupt(serde, [*values[:index], value[:cut], *values[index + 1 :]])
        for tail in (b"\x00", b"\xff" * 17):
            assert_corrupt(serde, [*values[:index], value + tail, *values[index + 1 :]])


@pytest.mark.parametrize(
    "changes",
    [
        {"magic": b"LMCX"},
        {"version": 0},
        {"version": 2},
        {"codec_id": 7},
        {"dtype_code": 0},
        {"dtype_code": 200},
        {"dtype_code": DTYPE_CODES[torch.float32]},  # itemsize 4: raw size no longer matches
        {"ndim": 0},
        {"ndim": 9},
        {"ndim": 4},
        {"dim7": 1},  # unused dims must be zero
        {"dim1": 3},
        {"dim0": 0},
        {"num_tokens": 0},
        {"num_tokens": 2**31 + 1},
        {"raw_nbytes": 31},
        {"part_size": 0},
        {"part_size": 10},
        {"part_count": 0},
        {"part_count": 4},
        {"part_count": 2**32 - 1},
    ],
    ids=repr,
)
@pytest.mark.parametrize("fix_checksum", [True, False])
def test_header_field_edits_are_caught(changes: dict[str, object], fix_checksum: bool) -> None:
    """Damage, except what reads as another release's value: another format version (whose
    header this reader cannot check), or, with a valid header checksum, a codec or dtype this
    reader does not know: foreign (a miss left in place, DESIGN.md "Redis layout")."""
    serde, values = tiny_values("raw", part_size=12)
    edited = [rewrite_header(values[0], fix_checksum, **changes), *values[1:]]
    unknown = changes.get("codec_id") == 7 or changes.get("dtype_code") in (0, 200)
    foreign = "version" in changes or (fix_checksum and unknown)
    if foreign:
        with pytest.raises(ForeignEntryError):
            serde.read_header(edited[0])
    else:
        assert_corrupt(serde, edited)


def test_codec_swap_is_caught() -> None:
    serde, values = tiny_values("lz4", part_size=12)
    assert_corrupt(serde, [rewrite_header(values[0], codec_id=0), *values[1:]])
    serde, values = tiny_values("raw", part_size=12)
    assert_corrupt(serde, [rewrite_header(values[0], codec_id=1), *values[1:]])


def test_semantic_edits_with_a_valid_checksum_are_caught_by_expectations() -> None:
    serde, values = tiny_values("raw")
    same_size = rewrite_header(values[0], dtype_code=DTYPE_CODES[torch.float16])
    with pytest.raises(ForeignEntryError, match="dtype"):  # readable, not this chunk's: foreign
        serde.decode([same_size], HASH, expected_dtype=torch.bfloat16)
    reshaped = rewrite_header(values[0], dim1=1, dim2=4)
    with pytest.raises(ForeignEntryError, match="shape"):
        serde.decode([reshaped], HASH, expected_shape=(1, 2, 2, 1, 4))
    out = torch.empty(1, 2, 2, 1, 4, dtype=torch.bfloat16)
    with pytest.raises(CorruptEntryError, match="destination"):
        serde.decode_into(serde.read_header(reshaped), [reshaped], out, HASH)
    rehashed = rewrite_header(values[0], chunk_hash=OTHER_HASH)
    with pytest.raises(ForeignEntryError, match="chunk"):
        serde.decode([rehashed], HASH)
    assert serde.decode([rewrite_header(values[0], num_tokens=3)], HASH).shape == (1, 2, 2, 1, 4)
    with pytest.raises(CorruptEntryError, match="checksum"):
        serde.read_header(rewrite_header(values[0], fix_checksum=False, num_tokens=3))


@pytest.mark.parametrize("junk", [b"", b"\x00", b"LMCR", b"LMCR\x01" + bytes(200), None, "LMCR"])
def test_junk_is_corrupt(junk: object) -> None:
    with pytest.raises(CorruptEntryError):
        Serde().read_header(junk)


def test_random_bytes_are_corrupt() -> None:
    rng = random.Random(1)
    for size in (1, 50, 99, 100, 132, 1000, 100_000):
        with pytest.raises(CorruptEntryError):
            Serde().read_header(rng.randbytes(size))
        with pytest.raises(CorruptEntryError):
            Serde().read_header(b"LMCR\x01" + rng.randbytes(size))


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_a_value_under_another_chunks_key_is_not_served(codec: str) -> None:
    serde, values = tiny_values(codec)
    with pytest.raises(ForeignEntryError, match="belongs to chunk"):
        serde.decode(values, OTHER_HASH)


@pytest.mark.parametrize("codec", ALL_CODECS)
def test_missing_and_misplaced_parts_are_caught(codec: str) -> None:
    serde = Serde(codec, part_size=128)
    a = as_bytes(serde.encode(random_tensor(torch.float16, (2, 2, 8, 2, 4), seed=5), HASH, 8))
    b = as_bytes(serde.encode(random_tensor(torch.float16, (2, 2, 8, 2, 4), seed=6), HASH, 8))
    assert len(a) == len(b) == 4
    assert_corrupt(serde, a[:-1])
    assert_corrupt(serde, a[:1])
    assert_corrupt(serde, [*a, a[-1]])
    assert_corrupt(serde, [a[0], None, a[2], a[3]])
    assert_corrupt(serde, [a[0], b[1], a[2], a[3]])  # a part of another value
    assert_corrupt(serde, [b[0], *a[1:]])  # another value's header and part 0
    assert_corrupt(serde, [a[0], a[2], a[1], a[3]])  # parts swapped within one value
    assert_corrupt(serde, [])


# --- property: nothing but CorruptEntryError, whatever the bytes ----------------------------


def _decode_all(serde: Serde, values: list[bytes]) -> None:
    try:
        header = serde.read_header(values[0])
        out = torch.empty(header.shape, dtype=header.dtype)
        serde.decode_into(header, values, out, HASH)
    except (CorruptEntryError, ForeignEntryError):
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_corrupt_or_foreign_entry_errors(data: bytes) -> None:
    _decode_all(Serde(), [data])
    _decode_all(Serde(), [b"LMCR\x01" + data])


_BASE = {codec: tiny_values(codec, part_size=12) for codec in ALL_CODECS}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec=st.sampled_from(ALL_CODECS),
    index=st.integers(0, 2),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1),
    tail=st.binary(max_size=8),
    cut=st.integers(0, 8),
)
def test_mutated_values_raise_only_corrupt_or_foreign_entry_errors(
    codec: str, index: int, edits: list[tuple[int, int]], tail: bytes, cut: int
) -> None:
    serde, values = _BASE[codec]
    damaged = bytearray(values[index])
    for pos, byte in edits:
        damaged[pos % len(damaged)] = byte
    mutated = bytes(damaged[: len(damaged) - cut]) + tail
    _decode_all(serde, [*values[:index], mutated, *values[index + 1 :]])


# --- golden file generation -----------------------------------------------------------------


def write_golden() -> None:
    GOLDEN.mkdir(exist_ok=True)
    for old in GOLDEN.glob("*.bin"):
        old.unlink()
    for case in GOLDEN_CASES:
        for i, value in enumerate(case.serde().encode(case.tensor(), HASH, case.num_tokens)):
            (GOLDEN / f"{case.name}.{i}.bin").write_bytes(bytes(value))
            print(f"{case.name}.{i}.bin  {len(value)} bytes")


def test_digests_given_stand_in_for_hashing_and_are_checked() -> None:
    """`decode_parts_into` with ``digests`` (what the receive loop hashed as the bytes came
    in): a right digest decodes without hashing again, a wrong one is a corrupt part even
    when the bytes are right, and None hashes as before; so a digest can never let bytes in
    that the header's checksum would turn away."""
    serde = Serde("raw", part_size=4096)
    tensor = torch.arange(4 * 2 * 256 * 8, dtype=torch.bfloat16).reshape(4, 2, 256, 8)
    header_bytes, parts = serde.encode_parts(tensor, HASH, 256)
    header = serde.read_header(header_bytes)
    assert header.part_count >= 3
    stored = [bytes(p) for p in parts]
    sums = [xxhash.xxh3_64_intdigest(p) for p in stored]
    out = torch.empty_like(tensor)
    serde.decode_parts_into(header, stored, out, HASH, digests=sums)
    assert torch.equal(out, tensor)
    damaged = [stored[0], bytes([stored[1][0] ^ 1]) + stored[1][1:], *stored[2:]]
    with pytest.raises(CorruptEntryError, match="part 1 fails its checksum"):
        serde.decode_parts_into(header, damaged, torch.empty_like(tensor), HASH,
                                digests=[sums[0], None, *sums[2:]])  # None: hashed here
    with pytest.raises(CorruptEntryError, match="part 2 fails its checksum"):
        serde.decode_parts_into(header, stored, torch.empty_like(tensor), HASH,
                                digests=[*sums[:2], sums[2] ^ 1, *sums[3:]])
    with pytest.raises(ValueError, match="digests"):
        serde.decode_parts_into(header, stored, torch.empty_like(tensor), HASH, digests=sums[:1])


if __name__ == "__main__":
    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: python tests/test_serde.py --regen")
    write_golden()
