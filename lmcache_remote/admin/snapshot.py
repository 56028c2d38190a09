"""The snapshot file: a portable, versioned, checksummed, streamed copy of cached chunks.

Format version 1 (byte by byte in `docs/cli.md`); all integers little-endian:

    file header   magic "LMCRSNAP" (8), version u16, flags u16 (0), created_ms u64,
                  prefix_len u16, source prefix (UTF-8), header_check u32
    record*       tag "C" (1), value_count u32, key_len u16, key (UTF-8, relative to the
                  prefix), then per value: ttl_ms i64 (-1 = no expiry), length u64, the bytes;
                  then record_check u64
    trailer       tag "E" (1), record_count u64, value_bytes u64, file_check u64,
                  end magic "LMCRSEND" (8)

`header_check` is the low 32 bits of xxh3-64 over the header bytes before it; `record_check`
the xxh3-64 of the record from its tag to its last value byte; `file_check` the xxh3-64 of
every byte before the trailer. Keys are stored without their prefix, so a snapshot can be
imported under another prefix.

`SnapshotWriter` writes `<path>.partial` and renames it to `path` on `commit()`, so an
interrupted export never leaves a file that looks whole. `SnapshotReader` streams records one
at a time (memory: the largest record) and raises `SnapshotError` with the byte offset of the
first damage: a short read (truncated), an unknown tag, a length out of bounds, a checksum
mismatch, a missing or wrong trailer, bytes after the trailer.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import xxhash

from lmcache_remote.errors import LmcrError

MAGIC = b"LMCRSNAP"
END_MAGIC = b"LMCRSEND"
VERSION = 1
RECORD_TAG = b"C"
TRAILER_TAG = b"E"
MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis's largest string
MAX_VALUES = 1 << 20
MAX_KEY_BYTES = 4096

_HEAD = struct.Struct("<8sHHQH")
_HEAD_CHECK = struct.Struct("<I")
_REC = struct.Struct("<IH")
_VAL = struct.Struct("<qQ")
_CHECK = struct.Struct("<Q")
_TRAILER = struct.Struct("<QQQ8s")


class SnapshotError(LmcrError):
    """A snapshot file is damaged or not a snapshot; `offset` is where the damage starts."""

    def __init__(self, path: str | os.PathLike[str], offset: int, message: str) -> None:
        super().__init__(f"{os.fspath(path)}: damaged at byte {offset}: {message}")
        self.path = os.fspath(path)
        self.offset = offset


@dataclasses.dataclass(frozen=True)
class SnapshotRecord:
    """One chunk: its key relative to the prefix, its values (value 0 first), their TTLs."""

    key: str
    values: list[bytes]
    ttls_ms: list[int | None]
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.values)


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    version: int
    created_ms: int
    source_prefix: str
    records: int = 0
    value_bytes: int = 0


class SnapshotWriter:
    """Streams records into a new snapshot file; `commit()` makes it appear under `path`."""

    def __init__(self, path: str | os.PathLike[str], source_prefix: str) -> None:
        self.path = Path(path)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._file: IO[bytes] = open(self._tmp, "wb")  # noqa: SIM115 - closed in commit/abort
        self._hash = xxhash.xxh3_64()
        self.records = 0
        self.value_bytes = 0
        self.offset = 0
        """Bytes written so far: where the next record starts."""
        prefix = source_prefix.encode("utf-8")
        head = _HEAD.pack(MAGIC, VERSION, 0, int(time.time() * 1000), len(prefix)) + prefix
        self._write(head + _HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(head) & 0xFFFFFFFF))

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.offset += len(data)

    def add(self, key: str, values: Sequence[bytes], ttls_ms: Sequence[int | None]) -> None:
        kb = key.encode("utf-8", "surrogateescape")
        if not values or len(values) != len(ttls_ms) or len(kb) > MAX_KEY_BYTES:
            raise ValueError("a record needs a short key and one TTL per value")
        rec = xxhash.xxh3_64()
        head = RECORD_TAG + _REC.pack(len(values), len(kb)) + kb
        rec.update(head)
        self._write(head)
        for value, ttl in zip(values, ttls_ms, strict=True):
            meta = _VAL.pack(-1 if ttl is None else int(ttl), len(value))
            rec.update(meta)
            rec.update(value)
            self._write(meta)
            self._write(value)
            self.value_bytes += len(value)
        self._write(_CHECK.pack(rec.intdigest()))
        self.records += 1

    def commit(self) -> None:
        trailer = _TRAILER.pack(self.records, self.value_bytes, self._hash.intdigest(), END_MAGIC)
        self._file.write(TRAILER_TAG + trailer)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SnapshotWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class SnapshotReader:
    """Reads a snapshot: `info` from the header, `records()` streamed and checked."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = io.BufferedReader(open(self.path, "rb"), 1 << 20)  # noqa: SIM115
        self._pos = 0
        self._hash = xxhash.xxh3_64()
        self.info = self._read_header()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, offset: int, message: str) -> SnapshotError:
        return SnapshotError(self.path, offset, message)

    def _read(self, n: int, what: str) -> bytes:
        data = self._file.read(n)
        if len(data) != n:
            raise self._fail(self._pos + len(data), f"file ends inside {what} (truncated)")
        self._pos += n
        self._hash.update(data)
        return data

    def _unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        return st.unpack(self._read(st.size, what))

    def _read_header(self) -> SnapshotInfo:
        magic = self._file.peek(len(MAGIC))[: len(MAGIC)]
        if magic != MAGIC[: len(magic)] or not magic:
            raise self._fail(0, "not an lmcache-remote snapshot (bad magic)")
        magic, version, flags, created, plen = self._unpack(_HEAD, "the file header")
        if version != VERSION:
            raise self._fail(8, f"snapshot format version {version}, this reader knows {VERSION}")
        prefix = self._read(plen, "the file header")
        start_check = self._pos
        head_bytes = _HEAD.pack(magic, version, flags, created, plen) + prefix
        (check,) = self._unpack(_HEAD_CHECK, "the file header")
        if check != xxhash.xxh3_64_intdigest(head_bytes) & 0xFFFFFFFF or flags != 0:
            raise self._fail(start_check, "file header checksum mismatch")
        return SnapshotInfo(version, created, prefix.decode("utf-8", "replace"))

    def records(self) -> Iterator[SnapshotRecord]:
        """Every record in order; the trailer is checked after the last one."""
        count = value_bytes = 0
        while True:
            start = self._pos
            digest_before = self._hash.intdigest()
            tag = self._read(1, "a record tag")
            if tag == TRAILER_TAG:
                self._check_trailer(start, count, value_bytes, digest_before)
                return
            if tag != RECORD_TAG:
                raise self._fail(start, f"unexpected byte {tag.hex()} where a record starts")
            record = self._read_record(start)
            count += 1
            value_bytes += record.nbytes
            yield record

    def _read_record(self, start: int) -> SnapshotRecord:
        rec = xxhash.xxh3_64(RECORD_TAG)
        raw = self._read(_REC.size, "a record")
        nvalues, klen = _REC.unpack(raw)
        if not 1 <= nvalues <= MAX_VALUES or not 1 <= klen <= MAX_KEY_BYTES:
            raise self._fail(start, f"record with {nvalues} values and a {klen}-byte key")
        key = self._read(klen, "a record key")
        rec.update(raw)
        rec.update(key)
        values: list[bytes] = []
        ttls: list[int | None] = []
        for _ in range(nvalues):
            meta = self._read(_VAL.size, "a record")
            ttl, length = _VAL.unpack(meta)
            if length > MAX_VALUE_BYTES:
                raise self._fail(self._pos - 8, f"value length {length} out of bounds")
            value = self._read(length, "a value")
            rec.update(meta)
            rec.update(value)
            values.append(value)
            ttls.append(None if ttl < 0 else ttl)
        at = self._pos
        (check,) = self._unpack(_CHECK, "a record checksum")
        if check != rec.intdigest():
            raise self._fail(start, f"record checksum mismatch (checksum at byte {at})")
        return SnapshotRecord(key.decode("utf-8", "surrogateescape"), values, ttls, start)

    def _check_trailer(self, start: int, count: int, value_bytes: int, expected: int) -> None:
        records, nbytes, check, end = self._unpack(_TRAILER, "the trailer")
        if end != END_MAGIC:
            raise self._fail(start, "bad trailer")
        if records != count or nbytes != value_bytes:
            raise self._fail(start, f"trailer says {records} records / {nbytes} bytes, file has "
                                    f"{count} / {value_bytes}")
        if check != expected:
            raise self._fail(start, "file checksum mismatch")
        if self._file.read(1):
            raise self._fail(self._pos, "bytes after the end of the snapshot")
        self.info = dataclasses.replace(self.info, records=count, value_bytes=value_bytes)
