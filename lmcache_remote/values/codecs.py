"""Codecs: how one raw segment of a chunk becomes its stored bytes, and back.

Each codec has a name (what `CacheConfig.serde` names) and a codec id written into every value
header (docs/value-format.md); ids are fixed forever. `serde.Serde` cuts a chunk into segments
and runs a codec on each, on several threads when the codec releases the GIL.

- ``raw`` (id 0): the bytes as they are; ``encode`` returns its argument without copying.
- ``lz4`` (id 1): one lz4 block without a size prefix.
- ``lz4-planes`` (id 2): the segment's bytes regrouped into byte planes (plane ``j`` holds byte
  ``j`` of every element, for 2-, 4- and 8-byte dtypes), each plane an lz4 block or, when lz4
  does not shrink it, stored raw. On KV the high bytes (sign and exponent) compress well and
  the low bytes (mantissa) not at all, which plain lz4 cannot exploit because they interleave.
- ``zstd-planes`` (id 3): the same planes, each a zstd frame (level 1) or raw: zstd's entropy
  coding takes the exponent plane much further than lz4 does, at about the same speed.
- ``blosc2-lz4`` (id 4) and ``blosc2-zstd`` (id 5): one C-Blosc2 chunk per segment
  (python-blosc2), byte shuffle with the dtype's element size, then lz4 (clevel 9) or zstd
  (clevel 1) per block and byte stream: the same idea as the planes, in C, block by block.

Decoding never trusts its input: a codec raises `CorruptEntryError` for anything that does not
decode to exactly the segment's length. lz4 blocks are decompressed straight into the output
through the system's liblz4 (``LZ4_decompress_safe``, bounds-checked) when it is installed,
otherwise through python-lz4 and one copy; the output bytes are the same either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
import threading
from typing import Any, Protocol

import blosc2
import lz4.block
import numpy as np
import zstandard

from lmcache_remote.errors import CorruptEntryError, SerdeError
from lmcache_remote.native.buffers import address

BytesLike = bytes | bytearray | memoryview


class Codec(Protocol):
    """Turns one raw segment into its stored bytes and back; the plug point for compression.

    ``encode`` gets the element size of the chunk's dtype (segments are whole elements when the
    part size is a multiple of it). ``decode`` must fill ``out`` exactly and raise
    `CorruptEntryError` when ``data`` does not decode to exactly ``len(out)`` bytes.
    ``releases_gil`` tells `Serde` that running parts on threads pays off.
    ``max_encoded_nbytes`` bounds a sane stored length.
    """

    name: str
    codec_id: int
    releases_gil: bool

    def encode(self, raw: memoryview, itemsize: int = 1) -> BytesLike: ...

    def decode(self, data: memoryview, out: memoryview) -> None: ...

    def max_encoded_nbytes(self, raw_nbytes: int) -> int: ...


# --- lz4 blocks ---------------------------------------------------------------------------


def _load_liblz4() -> ctypes.CDLL | None:
    for name in ("liblz4.so.1", ctypes.util.find_library("lz4")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)  # CDLL (not PyDLL): calls release the GIL
            fn = lib.LZ4_decompress_safe
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        return lib
    return None


_LIBLZ4 = _load_liblz4()
_INT_MAX = 2**31 - 1


def lz4_compress(raw: memoryview) -> bytes:
    return lz4.block.compress(raw, mode="default", store_size=False)


def lz4_decompress_into(data: memoryview, out: memoryview) -> None:
    """Decompresses one lz4 block into exactly ``out``; `CorruptEntryError` otherwise."""
    if not len(out) or not len(data) or len(data) > _INT_MAX or len(out) > _INT_MAX:
        raise CorruptEntryError(f"lz4 block of {len(data)} bytes cannot fill {len(out)} bytes")
    if _LIBLZ4 is not None and not out.readonly:
        got = _LIBLZ4.LZ4_decompress_safe(address(data), address(out), len(data), len(out))
        if got != len(out):
            raise CorruptEntryError(f"lz4 part does not decompress to {len(out)} bytes ({got})")
        return
    try:
        plain = lz4.block.decompress(data, uncompressed_size=len(out))
    except lz4.block.LZ4BlockError as exc:
        raise CorruptEntryError(f"lz4 part does not decompress: {exc}") from exc
    if len(plain) != len(out):  # uncompressed_size is only an upper bound for lz4
        raise CorruptEntryError(f"lz4 part decompresses to {len(plain)} bytes, not {len(out)}")
    out[:] = plain


def _lz4_bound(raw_nbytes: int) -> int:
    return raw_nbytes + raw_nbytes // 255 + 16  # LZ4_compressBound


# --- codecs -------------------------------------------------------------------------------


class RawCodec:
    """Stores the bytes as they are; ``encode`` returns its argument without copying."""

    name = "raw"
    codec_id = 0
    releases_gil = False

    def encode(self, raw: memoryview, itemsize: int = 1) -> BytesLike:
        return raw

    def decode(self, data: memoryview, out: memoryview) -> None:
        if len(data) != len(out):
            raise CorruptEntryError(f"raw part holds {len(data)} bytes, expected {len(out)}")
        out[:] = data

    def max_encoded_nbytes(self, raw_nbytes: int) -> int:
        return raw_nbytes


class Lz4Codec:
    """lz4 block format without a stored size (the header has it); releases the GIL."""

    name = "lz4"
    codec_id = 1
    releases_gil = True

    def encode(self, raw: memoryview, itemsize: int = 1) -> BytesLike:
        return lz4_compress(raw)

    def decode(self, data: memoryview, out: memoryview) -> None:
        lz4_decompress_into(data, out)

    def max_encoded_nbytes(self, raw_nbytes: int) -> int:
        return _lz4_bound(raw_nbytes)


#: Stored part of ``lz4-planes``: plane count (u8), then per plane its mode (u8: 0 raw, 1 lz4)
#: and stored length (u32), then the planes' bytes in order, plane 0 (lowest byte) first.
PLANES_HEAD = struct.Struct("<B")
PLANE_ENTRY = struct.Struct("<BI")
_PLANE_COUNTS = (1, 2, 4, 8)
_WORDS: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8"),
}


def _merge_plane(words: np.ndarray, plane: np.ndarray, j: int) -> None:
    """Puts byte plane ``j`` into little-endian ``words`` (plane 0 first overwrites them)."""
    if j == 0:
        np.copyto(words, plane, casting="unsafe")
        return
    wide = plane.astype(words.dtype)
    np.left_shift(wide, 8 * j, out=wide)
    np.bitwise_or(words, wide, out=words)


class _PlanesCodec:
    """Byte planes, each compressed (or kept raw when compression does not shrink it)."""

    name = ""
    codec_id = -1
    releases_gil = True
    _mode = 1  # the plane mode of a compressed plane (0 is raw)

    def _compress(self, plane: memoryview) -> bytes:
        raise NotImplementedError

    def _decompress_into(self, body: memoryview, out: memoryview) -> None:
        raise NotImplementedError

    def encode(self, raw: memoryview, itemsize: int = 1) -> BytesLike:
        planes = itemsize if itemsize in _PLANE_COUNTS and len(raw) % itemsize == 0 else 1
        words = np.frombuffer(raw, dtype=_WORDS[planes])
        table = bytearray(PLANES_HEAD.pack(planes))
        bodies: list[BytesLike] = []
        for j in range(planes):
            plane = (words >> (8 * j)).astype(np.uint8).data if planes > 1 else raw
            packed = self._compress(plane)
            if len(packed) < len(plane):
                table += PLANE_ENTRY.pack(self._mode, len(packed))
                bodies.append(packed)
            else:
                table += PLANE_ENTRY.pack(0, len(plane))
                bodies.append(plane)
        return b"".join([table, *bodies])

    def decode(self, data: memoryview, out: memoryview) -> None:
        name = self.name
        if len(data) < PLANES_HEAD.size:
            raise CorruptEntryError(f"{name} part is empty")
        (planes,) = PLANES_HEAD.unpack_from(data)
        if planes not in _PLANE_COUNTS or len(out) % planes:
            raise CorruptEntryError(f"{name}: {planes} planes for {len(out)} bytes")
        pos = PLANES_HEAD.size + PLANE_ENTRY.size * planes
        if len(data) < pos:
            raise CorruptEntryError(f"{name} part is shorter than its plane table")
        plane_len = len(out) // planes
        words = np.frombuffer(out, dtype=_WORDS[planes])
        scratch = memoryview(bytearray(plane_len)) if planes > 1 else out
        for j in range(planes):
            mode, stored = PLANE_ENTRY.unpack_from(data, PLANES_HEAD.size + PLANE_ENTRY.size * j)
            body = data[pos:pos + stored]
            pos += stored
            if len(body) != stored or mode not in (0, self._mode):
                raise CorruptEntryError(f"{name}: plane {j} is cut or has mode {mode}")
            if mode == 0:
                if stored != plane_len:
                    raise CorruptEntryError(f"{name}: raw plane {j} is {stored} bytes")
                scratch[:] = body
            else:
                self._decompress_into(body, scratch)
            if planes > 1:
                _merge_plane(words, np.frombuffer(scratch, dtype=np.uint8), j)
        if pos != len(data):
            raise CorruptEntryError(f"{name}: bytes left over after the last plane")


class Lz4PlanesCodec(_PlanesCodec):
    """Byte planes, each lz4-compressed (or kept raw when lz4 does not shrink it)."""

    name = "lz4-planes"
    codec_id = 2
    _mode = 1

    def _compress(self, plane: memoryview) -> bytes:
        return lz4_compress(plane)

    def _decompress_into(self, body: memoryview, out: memoryview) -> None:
        lz4_decompress_into(body, out)

    def max_encoded_nbytes(self, raw_nbytes: int) -> int:
        head = PLANES_HEAD.size + PLANE_ENTRY.size * max(_PLANE_COUNTS)
        return head + _lz4_bound(raw_nbytes) + 16 * max(_PLANE_COUNTS)


class ZstdPlanesCodec(_PlanesCodec):
    """Byte planes, each a zstd frame at level 1 (or kept raw when zstd does not shrink it).

    zstd's entropy coding gets a bfloat16 exponent plane (~2.6 bits of information per byte)
    to ~0.37 of its size where lz4 gets 0.67, at about lz4's speed on that plane."""

    name = "zstd-planes"
    codec_id = 3
    _mode = 2

    def __init__(self) -> None:
        self._local = threading.local()  # zstandard's (de)compressors are one per thread

    def _compress(self, plane: memoryview) -> bytes:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(level=1)
        return compressor.compress(plane)

    def _decompress_into(self, body: memoryview, out: memoryview) -> None:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        try:
            plain = decompressor.decompress(body, max_output_size=len(out))
        except zstandard.ZstdError as exc:
            raise CorruptEntryError(f"zstd-planes: bad zstd frame ({exc})") from None
        if len(plain) != len(out):
            raise CorruptEntryError(f"zstd frame holds {len(plain)} bytes, not {len(out)}")
        out[:] = plain

    def max_encoded_nbytes(self, raw_nbytes: int) -> int:
        # a plane is kept raw unless its frame is smaller: never more than the plane table
        return PLANES_HEAD.size + PLANE_ENTRY.size * max(_PLANE_COUNTS) + raw_nbytes


class _Blosc2Codec:
    """One C-Blosc2 chunk per segment: byte shuffle by the element size, then ``_codec``.

    The stored part is exactly what ``blosc2.compress2`` returns (C-Blosc2's chunk format:
    its own 32-byte header, then the blocks). A reader checks the chunk's own sizes (raw size
    equal to the segment, stored size equal to the part) before decompressing into the
    output, and that decompression fills it exactly. One thread per call: `Serde` runs the
    parts of a chunk on its pool (the calls release the GIL)."""

    name = ""
    codec_id = -1
    releases_gil = True
    _codec = blosc2.Codec.LZ4
    _clevel = 9

    def encode(self, raw: memoryview, itemsize: int = 1) -> BytesLike:
        typesize = itemsize if 1 <= itemsize <= 255 and len(raw) % itemsize == 0 else 1
        out: bytes = blosc2.compress2(
            raw, codec=self._codec, clevel=self._clevel, typesize=typesize, nthreads=1,
            filters=[blosc2.Filter.SHUFFLE], filters_meta=[0],
        )
        return out

    def decode(self, data: memoryview, out: memoryview) -> None:
        name = self.name
        if len(data) < blosc2.MAX_OVERHEAD:
            raise CorruptEntryError(f"{name} part of {len(data)} bytes is shorter than a header")
        try:
            nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(data)
        except Exception as exc:  # blosc2 raises plain errors for a bad header
            raise CorruptEntryError(f"{name}: unreadable chunk header ({exc})") from None
        if nbytes != len(out) or cbytes != len(data):
            raise CorruptEntryError(
                f"{name}: chunk of {nbytes} raw / {cbytes} stored bytes, expected {len(out)} "
                f"/ {len(data)}"
            )
        try:  # fills exactly len(out) bytes (the chunk's own size, checked above) or raises
            blosc2.decompress2(data, dst=out, nthreads=1)
        except Exception as exc:
            raise CorruptEntryError(f"{name}: chunk does not decompress ({exc})") from None

    def max_encoded_nbytes(self, raw_nbytes: int) -> int:
        return raw_nbytes + int(blosc2.MAX_OVERHEAD)


class Blosc2Lz4Codec(_Blosc2Codec):
    """Byte shuffle + lz4 (clevel 9: lz4 at acceleration 1 on blocks of Blosc2's choosing)."""

    name = "blosc2-lz4"
    codec_id = 4
    _codec = blosc2.Codec.LZ4
    _clevel = 9


class Blosc2ZstdCodec(_Blosc2Codec):
    """Byte shuffle + zstd at clevel 1 (zstd level 1)."""

    name = "blosc2-zstd"
    codec_id = 5
    _codec = blosc2.Codec.ZSTD
    _clevel = 1


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (RawCodec(), Lz4Codec(), Lz4PlanesCodec(), ZstdPlanesCodec(), Blosc2Lz4Codec(),
              Blosc2ZstdCodec())
}
CODECS_BY_ID: dict[int, Codec] = {codec.codec_id: codec for codec in CODECS.values()}


def get_codec(name: str) -> Codec:
    """The codec registered as ``name``; `SerdeError` for an unknown name."""
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise SerdeError(f"unknown codec {name!r}, expected one of {sorted(CODECS)}") from None
