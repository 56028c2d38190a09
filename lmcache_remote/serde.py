"""Serialization of one KV chunk into self-describing values, and back.

Contract:

- A chunk (one contiguous CPU tensor) becomes ``Serde.part_count(tensor.nbytes)`` values. Its
  bytes are cut into segments of ``part_size_for(tensor.nbytes)`` raw bytes (``part_size``, or
  with ``fit_size_classes`` a size planned to fill Redis's allocations; the last segment
  shorter), and each
  segment is encoded on its own by a `Codec` (``raw``, ``lz4``, ``lz4-planes``; module
  `lmcache_remote.codecs`, re-exported here). ``values[0]`` is the header followed by
  stored segment 0, in one contiguous buffer; ``values[i]`` is stored segment ``i``.
  The storage tier puts ``values[0]`` under the chunk key and ``values[i]`` under ``key#i``.
- The header (`HEADER_FIXED`, then the part table, then a header checksum; byte by byte in
  ``docs/value-format.md``) names the codec, dtype, shape, token count, the chunk hash the value
  belongs to, the raw size, the part size and each part's stored length and xxh3-64 checksum.
- An authenticated value (``encode(..., signer=...)``: version byte ``FORMAT_VERSION |
  AUTHENTICATED``) also holds a 32-byte MAC between the part table and the header checksum;
  ``read_header`` returns it (`ValueHeader.tag`, with the header bytes it covers) and checking
  it is the caller's (`lmcache_remote.integrity`), which alone has the key.
- `Serde.read_header` validates every header field and `Serde.decode_into` every length, the
  chunk hash and every part checksum. Whatever the input bytes, both raise `CorruptEntryError`
  on any problem and nothing else; they never unpickle or evaluate anything. ``read_header``
  accepts a prefix of ``values[0]`` (as GETRANGE returns) as long as it holds the whole header.
- Bad arguments from the caller (an unknown codec, a GPU tensor, a 15-byte hash) raise
  `SerdeError`. With ``threads > 1`` the parts of one chunk are compressed and decompressed on
  a thread pool (lz4 releases the GIL); ``close()`` stops it.
- ``encode`` avoids copies: with the raw codec ``values[1:]`` are memoryviews into the tensor's
  storage, so the tensor must stay unchanged until those values are written.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from lmcache_remote.codecs import CODECS as CODECS
from lmcache_remote.codecs import CODECS_BY_ID, Codec, RawCodec
from lmcache_remote.codecs import get_codec as get_codec
from lmcache_remote.errors import CorruptEntryError, ForeignEntryError, SerdeError
from lmcache_remote.native import wire as _native  # `address` of a buffer, cheaply (C)
from lmcache_remote.native import xxh3 as _xxh3
from lmcache_remote.sizing import plan_part_size

BytesLike = bytes | bytearray | memoryview
_T = TypeVar("_T")
_R = TypeVar("_R")

MAGIC = b"LMCR"
FORMAT_VERSION = 1
MAX_NDIM = 8
MAX_NUM_TOKENS = 2**31
DEFAULT_PART_SIZE = 4 * 1024 * 1024 - 64 * 1024
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
#: its header holds a MAC (`TAG_NBYTES`, `lmcache_remote.integrity`) between the part table
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


def _corrupt(message: str) -> CorruptEntryError:
    return CorruptEntryError(f"corrupt value: {message}")


def _foreign(message: str) -> ForeignEntryError:
    return ForeignEntryError(f"foreign value: {message}")


def _byte_view(value: object, what: str) -> memoryview:
    """A flat byte view of a bytes-like value; `CorruptEntryError` for anything else."""
    if value is None:
        raise _corrupt(f"{what} is missing")
    try:
        return memoryview(value).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise _corrupt(f"{what} is not a contiguous bytes-like object ({exc})") from exc


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat, writable memoryview, without a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise SerdeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise SerdeError(
            f"tensor must be contiguous on the CPU, got {tensor.device} "
            f"contiguous={tensor.is_contiguous()}"
        )
    flat = tensor.detach().reshape(-1).view(torch.uint8)  # uint8 first: numpy lacks bfloat16
    return flat.numpy().data


def _check_shape(shape: tuple[int, ...], fail: Callable[[str], Exception]) -> None:
    if not 1 <= len(shape) <= MAX_NDIM:
        raise fail(f"ndim {len(shape)} outside 1..{MAX_NDIM}")
    if any(not 1 <= dim < 2**32 for dim in shape):
        raise fail(f"shape {shape} has a dimension outside 1..2**32-1")


def _check_setting(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SerdeError(f"{name} must be an int in {low}..{high}, got {value!r}")


class TensorHolder(Protocol):
    """Anything that owns a chunk tensor, such as a ``MemoryObj``: `decode_into` accepts it."""

    @property
    def tensor(self) -> torch.Tensor: ...


class Serde:
    """Encodes chunks into values and decodes them, with one codec and one part size.

    Decoding follows the codec and part size written in the header, so a value written by a
    `Serde` with other settings still decodes.
    """

    def __init__(self, codec: str = "lz4", part_size: int = DEFAULT_PART_SIZE, threads: int = 0,
                 *, fit_size_classes: bool = False):
        self.codec = get_codec(codec)
        _check_setting("part_size", part_size, 1, MAX_PART_SIZE)
        _check_setting("threads", threads, 0, 1024)
        self.part_size = part_size
        self.fit_size_classes = fit_size_classes
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def close(self) -> None:
        """Stops the thread pool, if one was started; the `Serde` still works, serially."""
        with self._pool_lock:
            pool, self._pool, self.threads = self._pool, None, 0
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> Serde:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def part_size_for(self, raw_nbytes: int) -> int:
        """The part size a chunk of ``raw_nbytes`` bytes is cut with: ``part_size``, or with
        ``fit_size_classes`` the size (at most ``part_size``) whose values waste the least of
        Redis's allocations (`lmcache_remote.sizing.plan_part_size`)."""
        if raw_nbytes < 0:
            raise SerdeError(f"raw_nbytes must be >= 0, got {raw_nbytes}")
        if not self.fit_size_classes:
            return self.part_size
        return plan_part_size(raw_nbytes, self.part_size)

    def part_count(self, raw_nbytes: int) -> int:
        """How many values a chunk of ``raw_nbytes`` bytes becomes: ``max(1, ceil(n / p))``
        with ``p = part_size_for(n)``."""
        return max(1, -(-raw_nbytes // self.part_size_for(raw_nbytes)))

    # --- encode ---------------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor | TensorHolder, chunk_hash: bytes, num_tokens: int,
               *, signer: Signer | None = None) -> list[BytesLike]:
        """The values of one chunk: ``values[0]`` header + part 0, then parts 1..n-1."""
        header, parts = self.encode_parts(tensor, chunk_hash, num_tokens, signer=signer)
        return [b"".join((header, parts[0])), *parts[1:]]

    def encode_parts(
        self, tensor: torch.Tensor | TensorHolder, chunk_hash: bytes, num_tokens: int,
        *, sealed: bool = True, signer: Signer | None = None,
    ) -> tuple[bytes | bytearray, list[BytesLike]]:
        """`encode` without joining the header to part 0 (which copies part 0): the header and
        the stored parts; value 0 is ``header + parts[0]``, value i is ``parts[i]``. A
        `MemoryObj` may stand for its tensor: its kept byte view is used (no torch call).
        With ``sealed=False`` nothing is hashed: the header comes back as a `bytearray` with
        its checksums zero, and is valid only once `header_seal`'s seal has been applied
        (by the wire as it sends the value, `wire.apply_seals` otherwise). With a ``signer``
        the value is authenticated: version byte `FORMAT_VERSION | AUTHENTICATED`, the MAC of
        the checksummed header and the parts before the header checksum (so it is always
        sealed here)."""
        if signer is not None and not sealed:
            raise SerdeError("an authenticated value is sealed as it is encoded")
        raw_of = getattr(tensor, "raw_view", None)
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.tensor
        raw = raw_of() if raw_of is not None else _tensor_bytes(tensor)
        shape = tuple(tensor.shape)
        _check_shape(shape, SerdeError)
        if tensor.dtype not in DTYPE_CODES:
            raise SerdeError(f"unsupported dtype {tensor.dtype}")
        if not isinstance(chunk_hash, (bytes, bytearray, memoryview)) or len(chunk_hash) != 16:
            raise SerdeError(f"chunk_hash must be 16 bytes, got {chunk_hash!r}")
        _check_setting("num_tokens", num_tokens, 1, MAX_NUM_TOKENS)
        size = self.part_size_for(len(raw))
        segments = [raw[i * size : (i + 1) * size] for i in range(self.part_count(len(raw)))]
        itemsize = tensor.dtype.itemsize
        stored = self._map(self.codec, lambda seg: self._encode_part(seg, itemsize, sealed),
                           segments)
        header = _header_for(self.codec.codec_id, tensor.dtype, shape, num_tokens, chunk_hash,
                             len(raw), size, [(len(data), sum_) for data, sum_ in stored],
                             signer is not None)
        parts = [data for data, _ in stored]
        if not sealed:
            return header, parts
        end = len(header) - HEADER_CHECKSUM.size
        if signer is not None:
            signed = end - TAG_NBYTES
            header[signed:end] = _checked_tag(signer(memoryview(header)[:signed], parts))
        HEADER_CHECKSUM.pack_into(header, end, _header_checksum(memoryview(header)[:end]))
        return bytes(header), parts

    def raw_header(self, shape: tuple[int, ...], dtype: torch.dtype, chunk_hash: bytes,
                   num_tokens: int, part_size: int, parts: Sequence[tuple[int, int]]) -> bytes:
        """The sealed header of an unauthenticated raw-codec value whose bytes the caller
        sends from where they lie (the SGLang backend's host-pool regions) instead of from one
        tensor: segments of ``part_size`` raw bytes, each given as (length, XXH3-64 of its
        bytes). Value 0 is this header followed by segment 0, value i segment i, exactly as
        `encode` would make them with the raw codec."""
        _check_shape(tuple(shape), SerdeError)
        raw_nbytes = sum(length for length, _ in parts)
        if raw_nbytes != math.prod(shape) * dtype.itemsize or not parts or any(
                length != min(part_size, raw_nbytes - i * part_size)
                for i, (length, _) in enumerate(parts)):
            raise SerdeError(f"{len(parts)} parts of {part_size} bytes do not hold "
                             f"{dtype} {tuple(shape)}")
        header = _header_for(RawCodec.codec_id, dtype, tuple(shape), num_tokens, chunk_hash,
                             raw_nbytes, part_size, parts, False)
        end = len(header) - HEADER_CHECKSUM.size
        HEADER_CHECKSUM.pack_into(header, end, _header_checksum(memoryview(header)[:end]))
        return bytes(header)

    def _encode_part(self, segment: memoryview, itemsize: int, sealed: bool = True
                     ) -> tuple[BytesLike, int]:
        data = self.codec.encode(segment, itemsize)
        return data, checksum(data) if sealed else 0

    # --- decode ---------------------------------------------------------------------------

    def read_header(self, value0: object) -> ValueHeader:
        """Parses and validates the header at the start of ``value0``; see the module contract."""
        buf = _byte_view(value0, "value 0")
        try:
            return _parse_header(buf)
        except (struct.error, ValueError, TypeError, OverflowError, KeyError) as exc:
            raise _corrupt(f"unreadable header ({exc})") from exc

    def decode_into(
        self,
        header: ValueHeader,
        values: Sequence[object],
        out: torch.Tensor | TensorHolder,
        expected_hash: bytes,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
    ) -> None:
        """Checks ``values`` against ``header`` and the caller's expectations and decodes them
        into ``out`` (a contiguous CPU tensor of the header's shape and dtype, or an object with
        such a ``tensor``). On error the content of ``out`` is unspecified."""
        stored = _check_values(header, values, expected_hash, expected_shape, expected_dtype)
        self.decode_parts_into(header, stored, out, expected_hash, expected_shape, expected_dtype)

    def decode_parts_into(
        self,
        header: ValueHeader,
        stored: Sequence[object],
        out: torch.Tensor | TensorHolder,
        expected_hash: bytes,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
        digests: Sequence[int | None] | None = None,
    ) -> None:
        """`decode_into` for callers that received the parts apart: ``stored[i]`` is the stored
        bytes of part ``i`` (value 0 without its header). Every check still runs. A part that
        already lies in its place in ``out`` (received there, raw codec) is checksummed and not
        copied; for any other codec such a part is copied aside before decoding. ``digests[i]``,
        where not None, is the XXH3-64 of exactly ``stored[i]``'s bytes, already computed (by
        the receive loop, as they arrived): it is compared with the header instead of hashing
        them again."""
        raw = getattr(out, "raw_view", None)  # a MemoryObj keeps its bytes' view made
        if not isinstance(out, torch.Tensor):
            out = out.tensor
        check_identity(header, expected_hash, expected_shape, expected_dtype)
        if len(stored) != header.part_count:
            raise _corrupt(f"{len(stored)} parts, the header has {header.part_count}")
        views = [_byte_view(part, f"part {i}") for i, part in enumerate(stored)]
        for i, view in enumerate(views):
            if len(view) != header.parts[i][0]:
                raise _corrupt(f"part {i} is {len(view)} bytes, expected {header.parts[i][0]}")
        if tuple(out.shape) != header.shape or out.dtype != header.dtype:
            raise _corrupt(
                f"value holds {header.dtype} {header.shape}, destination is "
                f"{out.dtype} {tuple(out.shape)}"
            )
        dst = raw() if raw is not None else _tensor_bytes(out)
        codec = CODECS_BY_ID[header.codec_id]
        if digests is not None and len(digests) != len(views):
            raise ValueError(f"{len(digests)} digests for {len(views)} parts")
        jobs = []
        for i, data in enumerate(views):
            start, end = header.segment(i)
            known = digests[i] if digests is not None else None
            if known is not None and known != header.parts[i][1]:
                raise _corrupt(f"part {i} fails its checksum")
            jobs.append((i, data, dst[start:end], header.parts[i][1] if known is None else None))

        def decode_part(job: tuple[int, memoryview, memoryview, int | None]) -> None:
            index, data, out_part, expected = job
            if expected is not None and checksum(data) != expected:
                raise _corrupt(f"part {index} fails its checksum")
            at, out_at = _address(data), _address(out_part)
            if len(data) and len(out_part) and (
                    at < out_at + len(out_part) and out_at < at + len(data)):  # they overlap
                if codec.codec_id == RawCodec.codec_id and at == out_at:
                    return  # received in place: checked above, nothing to copy
                data = memoryview(bytes(data))
            codec.decode(data, out_part)

        self._map(codec, decode_part, jobs)

    def decode(
        self,
        values: Sequence[object],
        expected_hash: bytes,
        expected_shape: tuple[int, ...] | None = None,
        expected_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Reads the header, checks the values, allocates the tensor and decodes into it."""
        if not values:
            raise _corrupt("no values")
        header = self.read_header(values[0])
        _check_values(header, values, expected_hash, expected_shape, expected_dtype)
        out = torch.empty(header.shape, dtype=header.dtype)
        self.decode_into(header, values, out, expected_hash, expected_shape, expected_dtype)
        return out

    def _map(self, codec: Codec, fn: Callable[[_T], _R], items: list[_T]) -> list[_R]:
        """``[fn(x) for x in items]``, on the pool when there is one and it pays off."""
        if self.threads <= 1 or len(items) <= 1 or not codec.releases_gil:
            return [fn(item) for item in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lmcr-serde")
            pool = self._pool
        return list(pool.map(fn, items))


def _header_for(codec_id: int, dtype: torch.dtype, shape: tuple[int, ...], num_tokens: int,
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


def _checked_tag(tag: bytes) -> bytes:
    if len(tag) != TAG_NBYTES:
        raise SerdeError(f"a signer gave {len(tag)} bytes, a tag is {TAG_NBYTES}")
    return tag


def checksum(data: Any) -> int:
    """XXH3-64 of a part's stored bytes (`native.xxh3`: without giving up the GIL where the
    native module is bound)."""
    return _xxh3(data)


def _header_checksum(data: Any) -> int:
    return checksum(data) & 0xFFFFFFFF


def _parse_header(buf: memoryview) -> ValueHeader:
    if len(buf) < MIN_HEADER_NBYTES:
        raise _corrupt(f"{len(buf)} bytes, shorter than the smallest header ({MIN_HEADER_NBYTES})")
    fields = HEADER_FIXED.unpack_from(buf)
    magic, version, codec_id, dtype_code, ndim = fields[:5]
    dims = fields[5 : 5 + MAX_NDIM]
    num_tokens, chunk_hash, raw_nbytes, part_size, part_count = fields[5 + MAX_NDIM :]
    if magic != MAGIC:
        raise _corrupt(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if not known_version(version):  # its header may be laid out otherwise: not checkable here
        raise _foreign(f"format version {version}, this reader knows {FORMAT_VERSION} and "
                       f"{FORMAT_VERSION | AUTHENTICATED} (authenticated) only")
    if part_count < 1:
        raise _corrupt("part count 0")
    authenticated = bool(version & AUTHENTICATED)
    size = header_nbytes(part_count, authenticated)
    if len(buf) < size:
        raise _corrupt(f"header of {part_count} parts needs {size} bytes, value has {len(buf)}")
    (stored_checksum,) = HEADER_CHECKSUM.unpack_from(buf, size - HEADER_CHECKSUM.size)
    if _header_checksum(buf[: size - HEADER_CHECKSUM.size]) != stored_checksum:
        raise _corrupt("header checksum mismatch")
    codec = CODECS_BY_ID.get(codec_id)
    if codec is None:  # the header checksum holds: a codec of a newer release
        raise _foreign(f"unknown codec id {codec_id}")
    dtype = _DTYPES_BY_CODE.get(dtype_code)
    if dtype is None:
        raise _foreign(f"unknown dtype code {dtype_code}")
    if not 1 <= ndim <= MAX_NDIM or any(dims[ndim:]):
        raise _corrupt(f"ndim {ndim} outside 1..{MAX_NDIM} or unused dims not zero: {dims}")
    shape = tuple(dims[:ndim])
    _check_shape(shape, _corrupt)
    if math.prod(shape) * dtype.itemsize != raw_nbytes:
        raise _corrupt(f"{dtype_name(dtype)} {shape} is not {raw_nbytes} bytes")
    if not 0 < num_tokens <= MAX_NUM_TOKENS:
        raise _corrupt(f"num_tokens {num_tokens} outside 1..2**31")
    if not 1 <= part_size <= MAX_PART_SIZE:
        raise _corrupt(f"part size {part_size} outside 1..{MAX_PART_SIZE}")
    if part_count != max(1, -(-raw_nbytes // part_size)):
        raise _corrupt(f"{part_count} parts cannot hold {raw_nbytes} bytes in parts of {part_size}")
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
            raise _corrupt(f"part {i} stored length {stored_len} impossible for {raw_len} bytes")
    return parts


def _address(view: memoryview) -> int:
    """Where a byte view's memory starts (0 for an empty one): to tell a part received in
    place in the output, or overlapping it, from one received elsewhere."""
    if not len(view):
        return 0
    if _native is not None:
        return _native.address(view)
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def check_identity(
    header: ValueHeader,
    expected_hash: bytes,
    expected_shape: tuple[int, ...] | None,
    expected_dtype: torch.dtype | None,
) -> None:
    """`ForeignEntryError` unless the header names this chunk hash, shape and dtype (a
    readable value of another chunk or geometry is foreign, not damage)."""
    if bytes(expected_hash) != header.chunk_hash:
        raise _foreign(
            f"value belongs to chunk {header.chunk_hash.hex()}, not {bytes(expected_hash).hex()}"
        )
    if expected_shape is not None and tuple(expected_shape) != header.shape:
        raise _foreign(f"shape {header.shape}, expected {tuple(expected_shape)}")
    if expected_dtype is not None and expected_dtype != header.dtype:
        raise _foreign(f"dtype {header.dtype}, expected {expected_dtype}")


def _check_values(
    header: ValueHeader,
    values: Sequence[object],
    expected_hash: bytes,
    expected_shape: tuple[int, ...] | None,
    expected_dtype: torch.dtype | None,
) -> list[memoryview]:
    """Checks identity and lengths; returns the stored bytes of every part, headers cut off."""
    check_identity(header, expected_hash, expected_shape, expected_dtype)
    if len(values) != header.part_count:
        raise _corrupt(f"{len(values)} values, the header has {header.part_count} parts")
    stored = []
    for i, value in enumerate(values):
        view = _byte_view(value, f"value {i}")
        if len(view) != header.value_nbytes(i):
            raise _corrupt(f"value {i} is {len(view)} bytes, expected {header.value_nbytes(i)}")
        stored.append(view[header.header_nbytes :] if i == 0 else view)
    return stored
