"""The admin API: what the `lmcache-remote` CLI does, as a library, tested without Click.

`CacheAdmin(config)` opens its Redis client lazily (`storage.client.make_client`: bounded
timeouts, no retries, TLS options) and offers:

- `ping()` -> `ServerInfo`: name and version (Redis or Valkey), latency, eviction warnings;
- `stats()` -> `{"entries", "bytes", "groups", "pages", "redis", "engines"}` (see
  `docs/cli.md`; `pages`: the SGLang backend's pages per model and geometry);
- `entries(filter, limit)` -> `Entry` per chunk, streamed; `inspect(key)` -> one decoded entry;
- `plan_eviction(filter)` / `evict(filter)` -> `EvictResult(matched, deleted, bytes)`;
  `plan_page_eviction(model)` / `evict_pages(model)` the same for the SGLang backend's pages;
- `export(path, filter)`, `verify(path)`, `import_(path, skip_existing=...)`: snapshot files;
- `pin(filter)` / `unpin(filter)` -> `PinResult(matched, bytes, pinned_bytes)`, `pins()` ->
  every pin by chunk key (`storage.pins`: Redis never evicts a pinned chunk under a
  `volatile-*` policy; a pin past `pin_budget` raises `PinRefused`, nothing pinned).

It touches keys under `config.key_prefix` only and lists keys with SCAN through
`storage.scan.scan_batches` (every primary of a cluster). Every redis-py exception leaves as a
`BackendError` from `storage.client.translate` (no password in the message); damaged
snapshot files raise `SnapshotError` with the byte offset; file-system errors stay `OSError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import redis

from lmcache_remote.admin.entries import Entry, iter_entries, iter_page_entries, load_entries
from lmcache_remote.admin.evict import (
    EvictResult,
    evict,
    evict_pages,
    plan_eviction,
    plan_page_eviction,
)
from lmcache_remote.admin.filters import EntryFilter, parse_duration, prompt_chunk_hashes
from lmcache_remote.admin.fleet import fleet_stats
from lmcache_remote.admin.notouch import ReadPipeline
from lmcache_remote.admin.server import (
    ServerInfo,
    eviction_warnings,
    keep_warnings,
    server_info,
)
from lmcache_remote.admin.snapshot import SnapshotError, SnapshotInfo
from lmcache_remote.admin.stats import (
    GroupStats,
    group_stats,
    keep_state,
    memory_info,
    page_stats,
)
from lmcache_remote.admin.transfer import (
    TransferResult,
    export_pages,
    export_snapshot,
    import_snapshot,
    verify_snapshot,
)
from lmcache_remote.config import CacheConfig, mask_url
from lmcache_remote.errors import (
    BackendPermissionError,
    CorruptEntryError,
    ForeignEntryError,
    KeyFormatError,
    LmcrError,
)
from lmcache_remote.naming.keys import CacheEngineKey, PageKey, split_page_part_key, split_part_key
from lmcache_remote.storage.session.access import check_access
from lmcache_remote.storage.session.client import make_client, translate
from lmcache_remote.storage.session.pins import Pin, PinRefused, Pins, PinTarget
from lmcache_remote.values.serde import Serde, dtype_name

__all__ = [
    "CacheAdmin",
    "Entry",
    "EntryFilter",
    "EvictResult",
    "GroupStats",
    "Pin",
    "PinRefused",
    "PinResult",
    "ServerInfo",
    "SnapshotError",
    "SnapshotInfo",
    "TransferResult",
    "describe",
    "parse_duration",
    "prompt_chunk_hashes",
]

Progress = Callable[[int], None] | None


@dataclasses.dataclass(frozen=True)
class PinResult:
    """What a pin or unpin did: the chunks it matched, the bytes it pinned anew (unpin: the
    bytes it unpinned), and the fleet's pinned bytes after it."""

    matched: int
    bytes: int
    pinned_bytes: int


class EntryNotFoundError(LmcrError):
    """`inspect` was asked for a key that holds no chunk."""


@contextlib.contextmanager
def _translated(where: str) -> Iterator[None]:
    try:
        yield
    except redis.RedisError as exc:
        raise translate(exc, where) from exc


class CacheAdmin:
    """Admin operations on the chunks under one prefix of one Redis (or cluster)."""

    def __init__(self, config: CacheConfig, client: Any = None) -> None:
        self.config = config
        self.prefix = config.key_prefix
        self._client = client
        self._pins: Pins | None = None

    @property
    def url(self) -> str:
        """The configured URL with any password masked."""
        return mask_url(self.config.remote_url or "")

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client(self.config)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> CacheAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ------------------------------------------------------------------------------

    def ping(self) -> ServerInfo:
        """The server, and whether this user may use the cache (`storage.access`): a refused
        command is reported in `access`, not raised, since the server itself answered."""
        with _translated(self.url):
            info = server_info(self.client, self.config.remote_ttl, self.config.keep_policy,
                               self.config.keep_budget)
        try:
            optional = check_access(self.config)
        except BackendPermissionError as exc:
            return dataclasses.replace(info, access=mask_url(str(exc)))
        if "touch" in optional:
            info = dataclasses.replace(info, warnings=(
                *info.warnings, "this user may not TOUCH: engines turn their LRU refresh off "
                "(add +touch to the ACL user, or set remote_lru_touch: false)"))
        return info

    def stats(self, flt: EntryFilter | None = None, progress: Progress = None) -> dict[str, Any]:
        with _translated(self.url):
            groups = group_stats(self.client, self.prefix, flt, progress)
            pages = page_stats(self.client, self.prefix, progress) if flt is None else []
            mem = memory_info(self.client)
            engines = fleet_stats(self.client, self.prefix)
            pins = self.pin_registry.entries()
            pinned_bytes = self.pin_registry.pinned_bytes()
            keep = keep_state(self.client, self.prefix)
        warnings = (eviction_warnings(mem["maxmemory_policy"], mem["maxmemory"],
                                      self.config.remote_ttl)
                    + keep_warnings(mem["maxmemory_policy"], mem["maxmemory"],
                                    self.config.keep_policy, self.config.keep_budget))
        return {
            "prefix": self.prefix,
            "entries": sum(g.entries for g in groups),
            "bytes": sum(g.bytes for g in groups),
            "groups": [vars(g) for g in groups],
            "pages": {"entries": sum(g.entries for g in pages),
                      "bytes": sum(g.bytes for g in pages),
                      "groups": [vars(g) for g in pages]},
            "redis": mem,
            "engines": engines,
            "pins": {"entries": len(pins), "bytes": pinned_bytes,
                     "budget_bytes": self.config.pin_budget_bytes,
                     "timed": sum(1 for p in pins.values() if p.until is not None)},
            "keep": {"policy": self.config.keep_policy, **keep},
            "warnings": warnings,
        }

    def entries(self, flt: EntryFilter | None = None, limit: int | None = None) -> Iterator[Entry]:
        """Matching chunks in SCAN order, at most `limit`."""
        with _translated(self.url):
            it = iter_entries(self.client, self.prefix, flt or EntryFilter())
            yield from itertools.islice(it, limit)

    def page_entries(self, model_name: str | None = None,
                     limit: int | None = None) -> Iterator[dict[str, Any]]:
        """The SGLang backend's pages (all, or one model namespace's) in SCAN order, at most
        `limit`, as rows (`admin.entries.iter_page_entries`)."""
        with _translated(self.url):
            it = iter_page_entries(self.client, self.prefix, model_name)
            yield from itertools.islice(it, limit)

    def resolve_key(self, text: str) -> CacheEngineKey:
        """A chunk key from a Redis key (chunk or part key) or `model:world:worker:dtype:hash`."""
        try:
            return split_part_key(self.prefix, text)[0]
        except KeyFormatError:
            return CacheEngineKey.from_string(text)

    def inspect(self, text: str, verify: bool = True) -> dict[str, Any]:
        """The decoded header of one chunk (or of one SGLang page, given its Redis key), and
        whether its values pass every check."""
        try:
            page = split_page_part_key(self.prefix, text)[0]
        except KeyFormatError:
            page = None
        if page is not None:
            return self._inspect_page(page, verify)
        key = self.resolve_key(text)
        raw = key.redis_key(self.prefix).encode()
        with _translated(self.url):
            found = load_entries(self.client, self.prefix, [(raw, key)])
            if not found:
                raise EntryNotFoundError(f"no chunk under {key.redis_key(self.prefix)}")
            entry = found[0]
            values = None
            if verify and entry.header:
                # MGET would refresh the keys' LRU clocks
                reads = ReadPipeline(self.client, entry.redis_key)
                reads.pipe.mget(entry.keys)
                values = reads.execute()[0]
        return describe(entry, values)

    def _inspect_page(self, key: PageKey, verify: bool) -> dict[str, Any]:
        """`inspect` of a page: its header, idle time and TTL, and with `verify` every value
        checked against the page key (read under `CLIENT NO-TOUCH`)."""
        name = key.redis_key(self.prefix)
        with _translated(self.url):
            reads = ReadPipeline(self.client, name)
            reads.pipe.get(name)
            reads.pipe.object("idletime", name)
            reads.pipe.pttl(name)
            head, idle, pttl = reads.execute(raise_on_error=False)
            if head is None:
                raise EntryNotFoundError(f"no page under {name}")
            out: dict[str, Any] = {
                "redis_key": name, "kind": "page", "model_name": key.model_name,
                "geometry": key.geometry, "page_hash": key.page_hash,
                "idle_seconds": None if isinstance(idle, Exception) else int(idle),
                "ttl_seconds": None if int(pttl) < 0 else int(pttl) / 1000,
                "parts": None, "bytes": len(head), "checksum_ok": None, "error": None,
            }
            try:
                header = Serde("raw").read_header(head)
            except (CorruptEntryError, ForeignEntryError) as exc:
                out.update(checksum_ok=False, error=str(exc))
                return out
            names = key.part_keys(self.prefix, header.part_count)
            reads = ReadPipeline(self.client, name)
            reads.pipe.mget(names)
            values = reads.execute()[0]
        out.update(
            parts=header.part_count, codec=header.codec_name,
            value_dtype=dtype_name(header.dtype), shape=list(header.shape),
            num_tokens=header.num_tokens, raw_bytes=header.raw_nbytes,
            stored_bytes=header.payload_nbytes, header_bytes=header.header_nbytes,
            part_size=header.part_size, header_hash_matches_key=header.chunk_hash == key.hash_bytes,
            bytes=sum(len(v) for v in values if v is not None))
        if verify:
            try:
                Serde("raw").decode(values, key.hash_bytes)
                out["checksum_ok"] = True
            except (CorruptEntryError, ForeignEntryError) as exc:
                out.update(checksum_ok=False, error=str(exc))
        return out

    # -- deleting -----------------------------------------------------------------------------

    def plan_eviction(self, flt: EntryFilter, progress: Progress = None) -> EvictResult:
        with _translated(self.url):
            return plan_eviction(self.client, self.prefix, flt, progress)

    def evict(self, flt: EntryFilter, progress: Progress = None) -> EvictResult:
        with _translated(self.url):
            return evict(self.client, self.prefix, flt, progress)

    def plan_page_eviction(self, model_name: str | None = None,
                           progress: Progress = None) -> EvictResult:
        """The SGLang backend's pages `evict_pages` would delete (all, or one model's)."""
        with _translated(self.url):
            return plan_page_eviction(self.client, self.prefix, model_name, progress)

    def evict_pages(self, model_name: str | None = None,
                    progress: Progress = None) -> EvictResult:
        """Deletes the SGLang backend's pages under the prefix (all, or one model's)."""
        with _translated(self.url):
            return evict_pages(self.client, self.prefix, model_name, progress)

    # -- pins ---------------------------------------------------------------------------------

    @property
    def pin_registry(self) -> Pins:
        """The fleet's pin registry under the prefix (`storage.pins.Pins`)."""
        if self._pins is None:
            ttl = self.config.remote_ttl
            self._pins = Pins(lambda: self.client, self.prefix, self.config.pin_budget_bytes,
                              None if ttl is None else int(ttl * 1000))
        return self._pins

    def pins(self) -> dict[str, Pin]:
        """Every pin, by chunk key; pins whose time has passed are ended first."""
        with _translated(self.url):
            self.pin_registry.sweep()
            return self.pin_registry.entries()

    def pin(self, flt: EntryFilter, until: float | None = None) -> PinResult:
        """Pin the matching chunks (for ever, or until the wall-clock time `until`): Redis
        never evicts them while pinned. All or nothing: `PinRefused` when the chunks not yet
        pinned would take the pinned bytes past `pin_budget`."""
        with _translated(self.url):
            self.pin_registry.sweep()
            targets = [PinTarget(e.redis_key, e.part_count, e.nbytes)
                       for e in iter_entries(self.client, self.prefix, flt)]
            added = self.pin_registry.pin(targets, until)
            return PinResult(len(targets), added, self.pin_registry.pinned_bytes())

    def unpin(self, flt: EntryFilter | None = None) -> PinResult:
        """Unpin the pinned chunks that match (every pin with an empty filter): their values
        get `remote_ttl` again, and Redis may evict them."""
        flt = flt or EntryFilter()
        with _translated(self.url):
            pinned = self.pin_registry.entries()
            keys = [k for k, p in pinned.items()
                    if flt.matches_key(split_part_key(self.prefix, k)[0])]
            if flt.needs_idle and keys:
                idle = {e.redis_key for e in load_entries(
                    self.client, self.prefix,
                    [(k.encode(), split_part_key(self.prefix, k)[0]) for k in keys])
                    if flt.matches_idle(e.idle_seconds)}
                keys = [k for k in keys if k in idle]
            removed = self.pin_registry.unpin(keys)
            return PinResult(len(removed), sum(t.nbytes for t in removed),
                             self.pin_registry.pinned_bytes())

    # -- snapshots ----------------------------------------------------------------------------

    def export(self, path: str, flt: EntryFilter | None = None,
               progress: Progress = None) -> TransferResult:
        with _translated(self.url):
            return export_snapshot(self.client, self.prefix, path, flt, progress)

    def export_pages(self, path: str, model_name: str | None = None,
                     progress: Progress = None) -> TransferResult:
        """The SGLang backend's pages (all, or one model namespace's) into a snapshot file;
        `import_` restores them like chunks."""
        with _translated(self.url):
            return export_pages(self.client, self.prefix, path, model_name, progress)

    def verify(self, path: str, progress: Progress = None) -> SnapshotInfo:
        return verify_snapshot(path, self.prefix, progress)

    def import_(self, path: str, *, skip_existing: bool = False, verify: bool = True,
                progress: Progress = None, pin: bool = False) -> TransferResult:
        """Import a snapshot (chunks it holds without an expiry get `remote_ttl`); with `pin`,
        then pin every chunk of it, imported or already there (`PinRefused` past the
        budget: the chunks stay imported, unpinned)."""
        ttl = self.config.remote_ttl
        handled: list[tuple[str, int, int]] | None = [] if pin else None
        with _translated(self.url):
            self.client.ping()  # fail before reading a large file when Redis is not there
            result = import_snapshot(self.client, self.prefix, path,
                                     skip_existing=skip_existing, verify=verify,
                                     progress=progress,
                                     default_ttl_ms=None if ttl is None else int(ttl * 1000),
                                     handled=handled)
            if handled:
                self.pin_registry.pin([PinTarget(k, n, b) for k, n, b in handled])
            return result

def describe(entry: Entry, values: list[bytes | None] | None = None) -> dict[str, Any]:
    """A JSON-ready view of an entry; `values` (all of them) adds the checksum verdict."""
    key = entry.key
    out: dict[str, Any] = {
        "redis_key": entry.redis_key,
        "model_name": key.model_name,
        "world_size": key.world_size,
        "worker_id": key.worker_id,
        "dtype": key.dtype,
        "chunk_hash": key.chunk_hash,
        "parts": entry.part_count,
        "bytes": entry.nbytes,
        "idle_seconds": entry.idle_seconds,
        "ttl_seconds": None if entry.ttl_ms is None else entry.ttl_ms / 1000,
        "error": entry.error,
    }
    header = entry.header
    if header is not None:
        out.update(
            codec=header.codec_name,
            value_dtype=dtype_name(header.dtype),
            shape=list(header.shape),
            num_tokens=header.num_tokens,
            raw_bytes=header.raw_nbytes,
            stored_bytes=header.payload_nbytes,
            header_bytes=header.header_nbytes,
            part_size=header.part_size,
            header_hash_matches_key=header.chunk_hash.hex() == key.chunk_hash,
        )
    if values is not None:
        out["checksum_ok"], out["error"] = _verify(entry, values)
    else:
        out["checksum_ok"] = None
    return out


def _verify(entry: Entry, values: list[bytes | None]) -> tuple[bool, str | None]:
    try:
        Serde("raw").decode(values, entry.key.hash_bytes)
    except (CorruptEntryError, ForeignEntryError) as exc:
        return False, str(exc)
    return True, None
