"""The value format: the header that makes each stored value of a chunk self-describing.

Contract (byte by byte in ``docs/value-format.md``):

- A chunk is stored as one or more values: ``values[0]`` is the header followed by stored
  segment 0, ``values[i]`` is stored segment ``i``. The header (`HEADER_FIXED`, then the part
  table, then a header checksum) names the codec, dtype, shape, token count, the chunk hash the
  value belongs to, the raw size, the part size and each part's stored length and xxh3-64
  checksum.
- An authenticated value (version byte ``FORMAT_VERSION | AUTHENTICATED``) also holds a
  32-byte MAC between the part table and the header checksum; `parse_header` returns it
  (`ValueHeader.tag`, with the header bytes it covers) and checking it is the caller's
  (`lmcache_remote.values.integrity`), which alone has the key.
- `parse_header` validates every header field, `check_values` every length and
  `check_identity` the chunk hash, shape and dtype. Whatever the input bytes, they raise
  `CorruptEntryError` (damage) or `ForeignEntryError` (a readable value of another release,
  chunk or geometry) and nothing else; they never unpickle or evaluate anything. A prefix of
  ``values[0]`` (as GETRANGE returns) is enough as long as it holds the whole header.
- Dtype codes and codec ids are fixed forever; `header_nbytes` gives a header's size from its
  part count alone, so sizes can be planned before anything is encoded (`sizing`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_remote.errors import CorruptEntryError, ForeignEntryError, SerdeError
from lmcache_remote.native import xxh3 as _xxh3
from lmcache_remote.values.codecs import CODECS_BY_ID, Codec

BytesLike = bytes | bytearray | memoryview

MAGIC = b"LMCR"
FORMAT_VERSION = 1
MAX_NDIM = 8
MAX_NUM_TOKENS = 2**31
MAX_PART_SIZE = 0x7E000000  # LZ4_MAX_INPUT_SIZE: the largest segment lz4 can compress

#: The fixed start of every header, little-endian, no padding, 80 bytes: magic, format version
#: (u8), codec id (u8), dtype code (u8), ndim (u8), shape (8 x u32, unused dims 0), num_tokens
#: (u32), chunk hash (16 bytes), raw_nbytes (u64), part_size (u64), part_count (u32).
HEADER_FIXED = struct.Struct("<4sBBBB8II16sQQI")
#: One part table entry, ``part_count`` of them after `HEADER_FIXED`: stored_len, xxh3-64.
PART_ENTRY = struct.Struct("<QQ")
#: Ends the header: low 32 bits of xxh3-64 over every header byte before it.
HEADER_CHECKSUM = struct.Struct("<I")
MIN_HEADER_NBYTES = HEADER_FIXED.size + PART_ENTRY.size + HEADER_CHECKSUM.size
#: Set in the version byte of an authenticated value (`FORMAT_VERSION | AUTHENTICATED`):
#: its header holds a MAC (`TAG_NBYTES`, `lmcache_remote.values.integrity`) between the part table
#: and the header checksum. A reader that knows only version 1 finds another version there
#: and leaves the value in place as foreign.
AUTHENTICATED = 0x80
TAG_NBYTES = 32

#: Makes a value's MAC: ``signer(signed_header, stored_parts)``, 32 bytes (a bound
#: `IntegrityKey.tag`); the chunk key it binds is the signer's business.
Signer = Callable[[memoryview, Sequence["BytesLike"]], bytes]


def header_nbytes(part_count: int, authenticated: bool = False) -> int:
    """Size of the header of a value with ``part_count`` parts: ``84 + 16 * part_count``, and
    `TAG_NBYTES` more for an authenticated value."""
    return (HEADER_FIXED.size + PART_ENTRY.size * part_count + HEADER_CHECKSUM.size
            + (TAG_NBYTES if authenticated else 0))


def known_version(version: int) -> bool:
    """Whether this reader knows a value of this version byte: `FORMAT_VERSION`, with or
    without `AUTHENTICATED`."""
    return version in (FORMAT_VERSION, FORMAT_VERSION | AUTHENTICATED)


# --- dtypes -------------------------------------------------------------------------------

#: Stable on-disk dtype codes. Never renumber; 0 is reserved as invalid.
_CODE_BY_DTYPE_NAME = {
    "float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "float8_e4m3fn": 5,
    "float8_e5m2": 6, "int8": 7, "uint8": 8, "int16": 9, "int32": 10, "int64": 11,
    "float8_e4m3fnuz": 12, "float8_e5m2fnuz": 13,
}  # fmt: skip
DTYPE_CODES: dict[torch.dtype, int] = {
    getattr(torch, name): code
    for name, code in _CODE_BY_DTYPE_NAME.items()
    if hasattr(torch, name)  # the fnuz types are absent from old torch releases
}
_DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as torch names it without ``torch.``: ``"bfloat16"``."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch.dtype: {dtype!r}")
    return str(dtype).removeprefix("torch.")


_DTYPES_BY_NAME = {dtype_name(dtype): dtype for dtype in DTYPE_CODES}


def dtype_from_name(name: str) -> torch.dtype:
    """The registered dtype called ``name`` (``"bfloat16"``); `ValueError` if there is none."""
    try:
        return _DTYPES_BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {name!r}") from None


# --- the header ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueHeader:
    """What the first value of a chunk says about the chunk, validated by `Serde.read_header`."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    num_tokens: int
    chunk_hash: bytes
    raw_nbytes: int
    part_size: int
    parts: tuple[tuple[int, int], ...]  # (stored_len, xxh3-64 checksum) per part
    header_nbytes: int
    tag: bytes | None = None  # an authenticated value's MAC, None for an unauthenticated one
    signed: bytes = b""  # the header bytes the MAC covers (before the tag); b"" without one

    @property
    def payload_nbytes(self) -> int:
        """Stored bytes of all parts together, the header excluded."""
        return sum(stored for stored, _ in self.parts)

    @property
    def part_count(self) -> int:
        return len(self.parts)

    @property
    def codec_name(self) -> str:
        return CODECS_BY_ID[self.codec_id].name

    def value_nbytes(self, index: int) -> int:
        """The exact length of ``values[index]`` (value 0 includes the header)."""
        stored = self.parts[index][0]
        return stored + self.header_nbytes if index == 0 else stored

    def segment(self, index: int) -> tuple[int, int]:
        """The raw byte range ``[start, end)`` of the chunk that part ``index`` decodes to."""
        start = index * self.part_size
        return start, min(start + self.part_size, self.raw_nbytes)

def corrupt(message: str) -> CorruptEntryError:
    return CorruptEntryError(f"corrupt value: {message}")


def foreign(message: str) -> ForeignEntryError:
    return ForeignEntryError(f"foreign value: {message}")


def byte_view(value: object, what: str) -> memoryview:
    """A flat byte view of a bytes-like value; `CorruptEntryError` for anything else."""
    if value is None:
        raise corrupt(f"{what} is missing")
    try:
        return memoryview(value).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise corrupt(f"{what} is not a contiguous bytes-like object ({exc})") from exc



def check_shape(shape: tuple[int, ...], fail: Callable[[str], Exception]) -> None:
    if not 1 <= len(shape) <= MAX_NDIM:
        raise fail(f"ndim {len(shape)} outside 1..{MAX_NDIM}")
    if any(not 1 <= dim < 2**32 for dim in shape):
        raise fail(f"shape {shape} has a dimension outside 1..2**32-1")



def header_for(codec_id: int, dtype: torch.dtype, shape: tuple[int, ...], num_tokens: int,
                chunk_hash: bytes, raw_nbytes: int, part_size: int,
                parts: Sequence[tuple[int, int]], authenticated: bool) -> bytearray:
    """A header with every field but the MAC and the header checksum filled in."""
    if dtype not in DTYPE_CODES:
        raise SerdeError(f"unsupported dtype {dtype}")
    header = bytearray(header_nbytes(len(parts), authenticated))
    version = FORMAT_VERSION | (AUTHENTICATED if authenticated else 0)
    HEADER_FIXED.pack_into(
        header, 0, MAGIC, version, codec_id, DTYPE_CODES[dtype],
        len(shape), *shape, *([0] * (MAX_NDIM - len(shape))), num_tokens, bytes(chunk_hash),
        raw_nbytes, part_size, len(parts),
    )  # fmt: skip
    for i, (length, sum_) in enumerate(parts):
        PART_ENTRY.pack_into(header, HEADER_FIXED.size + i * PART_ENTRY.size, length, sum_)
    return header


def header_seal(header: bytearray, parts: Sequence[BytesLike]
                ) -> tuple[bytearray, list[BytesLike], list[int], int]:
    """What fills in the checksums of a header `Serde.encode_parts` left unsealed, as a
    `wire.Seal`: each part's XXH3-64 in its part entry, then the header's own checksum."""
    offsets = [HEADER_FIXED.size + i * PART_ENTRY.size + 8 for i in range(len(parts))]
    return header, list(parts), offsets, len(header) - HEADER_CHECKSUM.size


def checked_tag(tag: bytes) -> bytes:
    if len(tag) != TAG_NBYTES:
        raise SerdeError(f"a signer gave {len(tag)} bytes, a tag is {TAG_NBYTES}")
    return tag


def checksum(data: Any) -> int:
    """XXH3-64 of a part's stored bytes (`native.xxh3`: without giving up the GIL where the
    native module is bound)."""
    return _xxh3(data)


def header_checksum(data: Any) -> int:
    return checksum(data) & 0xFFFFFFFF


def parse_header(buf: memoryview) -> ValueHeader:
    if len(buf) < MIN_HEADER_NBYTES:
        raise corrupt(f"{len(buf)} bytes, shorter than the smallest header ({MIN_HEADER_NBYTES})")
    fields = HEADER_FIXED.unpack_from(buf)
    magic, version, codec_id, dtype_code, ndim = fields[:5]
    dims = fields[5 : 5 + MAX_NDIM]
    num_tokens, chunk_hash, raw_nbytes, part_size, part_count = fields[5 + MAX_NDIM :]
    if magic != MAGIC:
        raise corrupt(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if not known_version(version):  # its header may be laid out otherwise: not checkable here
        raise foreign(f"format version {version}, this reader knows {FORMAT_VERSION} and "
                       f"{FORMAT_VERSION | AUTHENTICATED} (authenticated) only")
    if part_count < 1:
        raise corrupt("part count 0")
    authenticated = bool(version & AUTHENTICATED)
    size = header_nbytes(part_count, authenticated)
    if len(buf) < size:
        raise corrupt(f"header of {part_count} parts needs {size} bytes, value has {len(buf)}")
    (stored_checksum,) = HEADER_CHECKSUM.unpack_from(buf, size - HEADER_CHECKSUM.size)
    if header_checksum(buf[: size - HEADER_CHECKSUM.size]) != stored_checksum:
        raise corrupt("header checksum mismatch")
    codec = CODECS_BY_ID.get(codec_id)
    if codec is None:  # the header checksum holds: a codec of a newer release
        raise foreign(f"unknown codec id {codec_id}")
    dtype = _DTYPES_BY_CODE.get(dtype_code)
    if dtype is None:
        raise foreign(f"unknown dtype code {dtype_code}")
    if not 1 <= ndim <= MAX_NDIM or any(dims[ndim:]):
        raise corrupt(f"ndim {ndim} outside 1..{MAX_NDIM} or unused dims not zero: {dims}")
    shape = tuple(dims[:ndim])
    check_shape(shape, corrupt)
    if math.prod(shape) * dtype.itemsize != raw_nbytes:
        raise corrupt(f"{dtype_name(dtype)} {shape} is not {raw_nbytes} bytes")
    if not 0 < num_tokens <= MAX_NUM_TOKENS:
        raise corrupt(f"num_tokens {num_tokens} outside 1..2**31")
    if not 1 <= part_size <= MAX_PART_SIZE:
        raise corrupt(f"part size {part_size} outside 1..{MAX_PART_SIZE}")
    if part_count != max(1, -(-raw_nbytes // part_size)):
        raise corrupt(f"{part_count} parts cannot hold {raw_nbytes} bytes in parts of {part_size}")
    signed = HEADER_FIXED.size + PART_ENTRY.size * part_count  # the tag's offset
    parts = _part_table(buf[HEADER_FIXED.size : signed], codec, raw_nbytes, part_size)
    tag = bytes(buf[signed : signed + TAG_NBYTES]) if authenticated else None
    return ValueHeader(
        codec_id, dtype, shape, num_tokens, bytes(chunk_hash), raw_nbytes, part_size, parts, size,
        tag, bytes(buf[:signed]) if authenticated else b"",
    )


def _part_table(
    table: memoryview, codec: Codec, raw_nbytes: int, part_size: int
) -> tuple[tuple[int, int], ...]:
    """(stored_len, checksum) per part, each length possible for its segment under the codec."""
    parts = tuple(PART_ENTRY.iter_unpack(table))
    for i, (stored_len, _) in enumerate(parts):
        raw_len = min(part_size, raw_nbytes - i * part_size)
        if not 1 <= stored_len <= codec.max_encoded_nbytes(raw_len):
            raise corrupt(f"part {i} stored length {stored_len} impossible for {raw_len} bytes")
    return parts

def check_identity(
    header: ValueHeader,
    expected_hash: bytes,
    expected_shape: tuple[int, ...] | None,
    expected_dtype: torch.dtype | None,
) -> None:
    """`ForeignEntryError` unless the header names this chunk hash, shape and dtype (a
    readable value of another chunk or geometry is foreign, not damage)."""
    if bytes(expected_hash) != header.chunk_hash:
        raise foreign(
            f"value belongs to chunk {header.chunk_hash.hex()}, not {bytes(expected_hash).hex()}"
        )
    if expected_shape is not None and tuple(expected_shape) != header.shape:
        raise foreign(f"shape {header.shape}, expected {tuple(expected_shape)}")
    if expected_dtype is not None and expected_dtype != header.dtype:
        raise foreign(f"dtype {header.dtype}, expected {expected_dtype}")


def check_values(
    header: ValueHeader,
    values: Sequence[object],
    expected_hash: bytes,
    expected_shape: tuple[int, ...] | None,
    expected_dtype: torch.dtype | None,
) -> list[memoryview]:
    """Checks identity and lengths; returns the stored bytes of every part, headers cut off."""
    check_identity(header, expected_hash, expected_shape, expected_dtype)
    if len(values) != header.part_count:
        raise corrupt(f"{len(values)} values, the header has {header.part_count} parts")
    stored = []
    for i, value in enumerate(values):
        view = byte_view(value, f"value {i}")
        if len(view) != header.value_nbytes(i):
            raise corrupt(f"value {i} is {len(view)} bytes, expected {header.value_nbytes(i)}")
        stored.append(view[header.header_nbytes :] if i == 0 else view)
    return stored
