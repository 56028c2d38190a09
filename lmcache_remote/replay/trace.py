"""Request traces: what a service was asked, in order, to replay through the cache.

A trace is a list of `TraceRequest`, each a time (seconds from the trace's start), its prompt
length in tokens and the identities of its prompt's blocks, prefix-chained: block ``i`` of two
requests has the same identity exactly when their first ``(i + 1) * block_size`` tokens are
equal (`TraceRequest.blocks`, interned small integers). Only full blocks can be stored or hit
(`TraceRequest.full_blocks`), as the engine stores with `save_unfull_chunk` off.

Two formats are read, one JSON object a line (`read_trace` tells them apart by their fields):

- Mooncake's (its FAST'25 release): ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (one id per 512-token block, prefix-chained; the last block may be partial);
- the project's own (docs/replay.md), for an operator's own request log: ``timestamp`` (ms),
  and either ``tokens`` (the prompt's token ids) or ``chunks`` (its chunk hashes as hex, as
  the cache names them, with ``input_length``); optional ``cache_salt`` and ``conversation``.

Either way `TraceRequest.tokens` gives the tokens a replay hands the engine: the prompt's own
ids when the trace has them, else 512 ids per block made from the block's id, so that the
engine's chained chunk hash names two requests' blocks alike exactly when the trace does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Trace", "TraceFormatError", "TraceRequest", "read_trace"]

#: Mooncake's block size: each ``hash_ids`` entry names 512 tokens.
MOONCAKE_BLOCK = 512


class TraceFormatError(ValueError):
    """A trace line that is not one of the formats above; the message names the line."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (see the module doc)."""

    time: float
    """Seconds from the trace's start."""
    input_length: int
    """Prompt tokens."""
    blocks: tuple[int, ...]
    """The identity of each prompt block, prefix-chained and interned (a partial last block
    included)."""
    block_size: int
    token_ids: np.ndarray | None = None
    """The prompt's own token ids, when the trace holds them."""
    block_ids: tuple[int, ...] = ()
    """The trace's own id of each block (Mooncake's hash ids, or the interned chunk hashes):
    what the made-up tokens are built from."""
    cache_salt: str | None = None
    conversation: str | None = None

    @property
    def full_blocks(self) -> int:
        """How many leading blocks are whole (the only ones the engine stores)."""
        return min(len(self.blocks), self.input_length // self.block_size)

    def tokens(self) -> np.ndarray:
        """The uint32 token ids a replay hands the engine (see the module doc)."""
        if self.token_ids is not None:
            return self.token_ids
        out = np.empty(self.input_length, dtype=np.uint32)
        step = np.arange(self.block_size, dtype=np.uint32)
        for i, block_id in enumerate(self.block_ids):
            start = i * self.block_size
            end = min(start + self.block_size, self.input_length)
            if start >= end:
                break
            block = step[:end - start].copy()
            # the block's id leads it (two ids never make the same tokens), the rest a ramp
            block[0] = block_id & 0xFFFFFFFF
            if end - start > 1:
                block[1] = (block_id >> 32) & 0xFFFFFFFF
            out[start:end] = block
        return out


@dataclasses.dataclass
class Trace:
    """Requests in time order, with the block size they were cut by."""

    requests: list[TraceRequest]
    block_size: int
    source: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def span(self) -> float:
        """Seconds from the first request to the last."""
        if not self.requests:
            return 0.0
        return self.requests[-1].time - self.requests[0].time

    def split_time(self, fraction: float) -> float:
        """The time ``fraction`` of the way through the trace's span (0.5: its middle)."""
        if not self.requests:
            return 0.0
        return self.requests[0].time + fraction * self.span

    def head(self, count: int) -> Trace:
        """The first ``count`` requests, as a trace."""
        return Trace(self.requests[:count], self.block_size, self.source)

    def distinct_blocks(self) -> int:
        return len({b for r in self.requests for b in r.blocks[:r.full_blocks]})


class _Interner:
    """Small integers for prefix chains: (parent, block id) -> the block's identity."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, Any], int] = {}

    def chain(self, block_ids: Iterable[Any], salt: str | None = None) -> tuple[int, ...]:
        parent = -1 if salt is None else self.single(("salt", salt))
        out = []
        for block_id in block_ids:
            parent = self.single((parent, block_id))
            out.append(parent)
        return tuple(out)

    def single(self, key: Any) -> int:
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found


def read_trace(path: str | Path, *, block_size: int | None = None,
               limit: int | None = None) -> Trace:
    """Reads a trace file in either format (the module doc); ``limit``: its first requests
    only. ``block_size`` for the project's format with ``tokens`` (default 512: Mooncake's);
    Mooncake's is always 512. Raises `TraceFormatError` naming the line for a line of neither
    format, `FileNotFoundError` for a missing file. Requests are sorted by time (stably)."""
    path = Path(path)
    interner = _Interner()
    requests: list[TraceRequest] = []
    sizes: set[int] = set()
    with path.open("r", encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{path}:{number}: not JSON: {exc}") from exc
            request = _parse(record, interner, block_size, f"{path}:{number}")
            sizes.add(request.block_size)
            requests.append(request)
    if len(sizes) > 1:
        raise TraceFormatError(f"{path}: requests cut into blocks of {sorted(sizes)} tokens: "
                               "one trace has one block size")
    requests.sort(key=lambda r: r.time)
    size = sizes.pop() if sizes else (block_size or MOONCAKE_BLOCK)
    return Trace(requests, size, str(path))


def _parse(record: Any, interner: _Interner, block_size: int | None,
           where: str) -> TraceRequest:
    if not isinstance(record, dict) or "timestamp" not in record:
        raise TraceFormatError(f"{where}: a request needs a 'timestamp' (ms)")
    time_s = _number(record["timestamp"], "timestamp", where) / 1000.0
    salt = record.get("cache_salt")
    conversation = record.get("conversation")
    conversation = None if conversation is None else str(conversation)
    if "hash_ids" in record:
        ids = _int_list(record["hash_ids"], "hash_ids", where)
        length = int(_number(record.get("input_length", len(ids) * MOONCAKE_BLOCK),
                             "input_length", where))
        if -(-length // MOONCAKE_BLOCK) != len(ids):
            raise TraceFormatError(f"{where}: {len(ids)} hash_ids for input_length {length} "
                                   f"(Mooncake's blocks are {MOONCAKE_BLOCK} tokens)")
        return TraceRequest(time_s, length, interner.chain(ids, salt), MOONCAKE_BLOCK,
                            block_ids=tuple(ids), cache_salt=salt, conversation=conversation)
    if "tokens" in record:
        size = block_size or MOONCAKE_BLOCK
        tokens = np.asarray(_int_list(record["tokens"], "tokens", where), dtype=np.uint64)
        if tokens.size and int(tokens.max()) > 0xFFFFFFFF:
            raise TraceFormatError(f"{where}: a token id past 2**32 - 1")
        tokens32 = tokens.astype(np.uint32)
        contents = [tokens32[i:i + size].tobytes() for i in range(0, len(tokens32), size)]
        blocks = interner.chain(contents, salt)
        return TraceRequest(time_s, len(tokens32), blocks, size, token_ids=tokens32,
                            cache_salt=salt, conversation=conversation)
    if "chunks" in record:
        size = block_size or MOONCAKE_BLOCK
        hashes = record["chunks"]
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise TraceFormatError(f"{where}: 'chunks' must be a list of hex chunk hashes")
        length = int(_number(record.get("input_length", len(hashes) * size),
                             "input_length", where))
        if -(-length // size) != len(hashes):
            raise TraceFormatError(f"{where}: {len(hashes)} chunks for input_length {length} "
                                   f"with blocks of {size} tokens (--block-size)")
        # the hashes are chained already: each names its prefix, so it is its own identity
        ids = [interner.single(("hash", h.lower())) for h in hashes]
        return TraceRequest(time_s, length, tuple(interner.single(("c", i)) for i in ids),
                            size, block_ids=tuple(ids), cache_salt=salt,
                            conversation=conversation)
    raise TraceFormatError(f"{where}: a request needs 'hash_ids' (Mooncake), 'tokens' or "
                           "'chunks' (docs/replay.md)")


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise TraceFormatError(f"{where}: '{name}' must be a number >= 0, got {value!r}")
    return float(value)


def _int_list(value: Any, name: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise TraceFormatError(f"{where}: '{name}' must be a list of integers >= 0")
    return value


def block_tokens(requests: Sequence[TraceRequest]) -> int:
    """Prompt tokens of these requests (the hit rate's denominator)."""
    return sum(r.input_length for r in requests)
