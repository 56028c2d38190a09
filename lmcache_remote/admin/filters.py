"""Which entries an admin operation touches: `EntryFilter`, durations, prompt chunk hashes.

A filter narrows by the key's fields (model, world size, worker, dtype: these also narrow the
SCAN MATCH pattern), by chunk hash (the chunks of one prompt, in any namespace unless the
fields say otherwise) and by idle time (`OBJECT IDLETIME`, seconds since the last access).
An empty filter matches every chunk under the prefix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
from lmcache_remote.naming.keys import CacheEngineKey, scan_pattern, split_part_key

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds in `90`, `90s`, `15m`, `2h`, `1d12h`, `1w`; `ValueError` for anything else."""
    s = text.strip().lower()
    pos, total = 0, 0.0
    for match in _DURATION_RE.finditer(s):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if not s or pos != len(s):
        raise ValueError(f"not a duration: {text!r} (examples: 90s, 15m, 2h, 1d12h)")
    return total


def prompt_chunk_hashes(tokens: Iterable[int], chunk_size: int,
                        cache_salt: str | None = None) -> frozenset[str]:
    """The hex chunk hashes of a prompt's chunks, the last partial one included."""
    arr = tokens_to_array(list(tokens))
    return frozenset(h.hex() for h in chunk_hashes(arr, chunk_size, cache_salt, partial=True))


@dataclasses.dataclass(frozen=True)
class EntryFilter:
    """Selects chunks by key fields, chunk hash and idle time; None means 'any'."""

    model_name: str | None = None
    world_size: int | None = None
    worker_id: int | None = None
    dtype: str | None = None
    older_than: float | None = None
    """Only chunks idle (not read or written) for at least this many seconds."""
    chunk_hashes: frozenset[str] | None = None
    """Only chunks with one of these hashes (32 hex digits)."""

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    @property
    def needs_idle(self) -> bool:
        return self.older_than is not None

    def pattern(self, prefix: str) -> str:
        return scan_pattern(prefix, self.model_name, self.world_size, self.worker_id, self.dtype)

    def matches_key(self, key: CacheEngineKey) -> bool:
        """Whether the key's fields and hash pass (idle time is checked separately)."""
        return (
            (self.model_name is None or key.model_name == self.model_name)
            and (self.world_size is None or key.world_size == self.world_size)
            and (self.worker_id is None or key.worker_id == self.worker_id)
            and (self.dtype is None or key.dtype == self.dtype)
            and (self.chunk_hashes is None or key.chunk_hash in self.chunk_hashes)
        )

    def matching_values(self, prefix: str, raw_keys: Iterable[bytes]
                        ) -> list[tuple[bytes, CacheEngineKey, int]]:
        """(raw key, chunk key, part index) of every value key that parses under `prefix` and
        whose chunk passes the key filter; foreign and malformed keys are left out."""
        out = []
        for raw in raw_keys:
            try:
                key, index = split_part_key(prefix, raw)
            except ValueError:  # KeyFormatError, or a malformed number in a foreign key
                continue
            if self.matches_key(key):
                out.append((raw, key, index))
        return out

    def matches_idle(self, idle_seconds: int | None) -> bool:
        """With `older_than`, an unknown idle time (LFU policy) never matches."""
        if self.older_than is None:
            return True
        return idle_seconds is not None and idle_seconds >= self.older_than
