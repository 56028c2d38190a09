"""Serialization of one KV chunk into self-describing values, and back.

Contract:

- A chunk (one contiguous CPU tensor) becomes ``Serde.part_count(tensor.nbytes)`` values. Its
  bytes are cut into segments of ``part_size_for(tensor.nbytes)`` raw bytes (``part_size``, or
  with ``fit_size_classes`` a size planned to fill Redis's allocations; the last segment
  shorter), and each
  segment is encoded on its own by a `Codec` (``raw``, ``lz4``, ``lz4-planes``; module
  `lmcache_remote.values.codecs`, re-exported here). ``values[0]`` is the header followed by
  stored segment 0, in one contiguous buffer; ``values[i]`` is stored segment ``i``.
  The storage tier puts ``values[0]`` under the chunk key and ``values[i]`` under ``key#i``.
- The header is `lmcache_remote.values.value_format`'s (the names other modules take from here are
  re-exported): it names the codec, dtype, shape, token count, the chunk hash, the raw size,
  the part size and each part's stored length and xxh3-64 checksum; an authenticated value
  (``encode(..., signer=...)``) also holds a MAC, which ``read_header`` returns and the
  caller checks (`lmcache_remote.values.integrity`).
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
from typing import Protocol, TypeVar

import torch

from lmcache_remote.errors import SerdeError
from lmcache_remote.native.buffers import address
from lmcache_remote.values.codecs import CODECS as CODECS
from lmcache_remote.values.codecs import CODECS_BY_ID, Codec, RawCodec
from lmcache_remote.values.codecs import get_codec as get_codec
from lmcache_remote.values.sizing import plan_part_size
from lmcache_remote.values.value_format import AUTHENTICATED as AUTHENTICATED
from lmcache_remote.values.value_format import DTYPE_CODES as DTYPE_CODES
from lmcache_remote.values.value_format import HEADER_CHECKSUM as HEADER_CHECKSUM
from lmcache_remote.values.value_format import HEADER_FIXED as HEADER_FIXED
from lmcache_remote.values.value_format import MAGIC as MAGIC
from lmcache_remote.values.value_format import (
    MAX_NUM_TOKENS,
    MAX_PART_SIZE,
    TAG_NBYTES,
    BytesLike,
    byte_view,
    check_identity,
    check_shape,
    check_values,
    checked_tag,
    checksum,
    corrupt,
    header_checksum,
    header_for,
    parse_header,
)
from lmcache_remote.values.value_format import Signer as Signer
from lmcache_remote.values.value_format import ValueHeader as ValueHeader
from lmcache_remote.values.value_format import dtype_from_name as dtype_from_name
from lmcache_remote.values.value_format import dtype_name as dtype_name
from lmcache_remote.values.value_format import header_nbytes as header_nbytes

_T = TypeVar("_T")
_R = TypeVar("_R")

DEFAULT_PART_SIZE = 4 * 1024 * 1024 - 64 * 1024

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
        Redis's allocations (`lmcache_remote.values.sizing.plan_part_size`)."""
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
        (by the wire as it sends the value, `bulk.apply_seals` otherwise). With a ``signer``
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
        check_shape(shape, SerdeError)
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
        header = header_for(self.codec.codec_id, tensor.dtype, shape, num_tokens, chunk_hash,
                             len(raw), size, [(len(data), sum_) for data, sum_ in stored],
                             signer is not None)
        parts = [data for data, _ in stored]
        if not sealed:
            return header, parts
        end = len(header) - HEADER_CHECKSUM.size
        if signer is not None:
            signed = end - TAG_NBYTES
            header[signed:end] = checked_tag(signer(memoryview(header)[:signed], parts))
        HEADER_CHECKSUM.pack_into(header, end, header_checksum(memoryview(header)[:end]))
        return bytes(header), parts

    def raw_header(self, shape: tuple[int, ...], dtype: torch.dtype, chunk_hash: bytes,
                   num_tokens: int, part_size: int, parts: Sequence[tuple[int, int]]) -> bytes:
        """The sealed header of an unauthenticated raw-codec value whose bytes the caller
        sends from where they lie (the SGLang backend's host-pool regions) instead of from one
        tensor: segments of ``part_size`` raw bytes, each given as (length, XXH3-64 of its
        bytes). Value 0 is this header followed by segment 0, value i segment i, exactly as
        `encode` would make them with the raw codec."""
        check_shape(tuple(shape), SerdeError)
        raw_nbytes = sum(length for length, _ in parts)
        if raw_nbytes != math.prod(shape) * dtype.itemsize or not parts or any(
                length != min(part_size, raw_nbytes - i * part_size)
                for i, (length, _) in enumerate(parts)):
            raise SerdeError(f"{len(parts)} parts of {part_size} bytes do not hold "
                             f"{dtype} {tuple(shape)}")
        header = header_for(RawCodec.codec_id, dtype, tuple(shape), num_tokens, chunk_hash,
                             raw_nbytes, part_size, parts, False)
        end = len(header) - HEADER_CHECKSUM.size
        HEADER_CHECKSUM.pack_into(header, end, header_checksum(memoryview(header)[:end]))
        return bytes(header)

    def _encode_part(self, segment: memoryview, itemsize: int, sealed: bool = True
                     ) -> tuple[BytesLike, int]:
        data = self.codec.encode(segment, itemsize)
        return data, checksum(data) if sealed else 0

    # --- decode ---------------------------------------------------------------------------

    def read_header(self, value0: object) -> ValueHeader:
        """Parses and validates the header at the start of ``value0``; see the module contract."""
        buf = byte_view(value0, "value 0")
        try:
            return parse_header(buf)
        except (struct.error, ValueError, TypeError, OverflowError, KeyError) as exc:
            raise corrupt(f"unreadable header ({exc})") from exc

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
        stored = check_values(header, values, expected_hash, expected_shape, expected_dtype)
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
            raise corrupt(f"{len(stored)} parts, the header has {header.part_count}")
        views = [byte_view(part, f"part {i}") for i, part in enumerate(stored)]
        for i, view in enumerate(views):
            if len(view) != header.parts[i][0]:
                raise corrupt(f"part {i} is {len(view)} bytes, expected {header.parts[i][0]}")
        if tuple(out.shape) != header.shape or out.dtype != header.dtype:
            raise corrupt(
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
                raise corrupt(f"part {i} fails its checksum")
            jobs.append((i, data, dst[start:end], header.parts[i][1] if known is None else None))

        def decode_part(job: tuple[int, memoryview, memoryview, int | None]) -> None:
            index, data, out_part, expected = job
            if expected is not None and checksum(data) != expected:
                raise corrupt(f"part {index} fails its checksum")
            at, out_at = address(data), address(out_part)
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
            raise corrupt("no values")
        header = self.read_header(values[0])
        check_values(header, values, expected_hash, expected_shape, expected_dtype)
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


