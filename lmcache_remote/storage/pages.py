"""PageStore: fixed-size pages of KV bytes in Redis/Valkey, keyed by an engine's page hashes.

What SGLang's HiCache asks of an L3 store (`lmcache_remote.integrations.sglang`), kept here
apart from any engine: every page of one store has the same geometry (a `PageKey` geometry
string, a shape and a dtype), so its part count, and so every key, is known before any round
trip.

- Values: the project's value format (`lmcache_remote.serde`): a page is one tensor of shape
  ``page_shape`` (regions x elements), encoded by the configured codec, checksummed, cut into
  parts like a chunk (`remote_part_size`, planned to Redis's size classes), written by one
  atomic command (`chunk_write_command`): whole or absent. The header's chunk-hash field holds
  `PageKey.hash_bytes` (a digest of the key without its prefix), its token count the page size.
  With an `integrity_key` every value carries a MAC bound to that key, and only values whose
  MAC verifies are served.
- `present(keys)`: one round trip (`TOUCH` of every value key of every page: it counts them
  as EXISTS does and refreshes their LRU clock, since a hit query promises the pages to the
  read that follows); the length of the leading run of whole pages.
- `write(keys, fill)`: pages go out in windows of about `WINDOW_BYTES` raw bytes, one window
  in flight at a time: ``fill(i, staging)`` copies page i into a staging tensor of the window,
  which is encoded (raw: values are views of it, no copy) and written in one pipelined batch.
  Per page, whether it landed; after a failed window the rest are not tried.
- `read(keys, drain)`: the pages' values are fetched window by window, checked (header,
  identity, lengths, every checksum) and decoded into a staging tensor, then handed to
  ``drain(i, staging)``. The first missing or bad page ends the read (the rest are False). A
  damaged value (checksum, length, a part gone) is deleted and counted; a value of another
  release or another identity (foreign) is a miss left in place, counted apart.
- Bounds: every public call runs under one deadline, `remote_timeout` for the whole call
  (`storage.deadline`, honoured by the bulk wire on every wait), through `RemoteCaller` (one
  retry on a broken connection, a health gate that skips a dead server at once). Bytes in
  flight: one window of staging, plus its encoded values for a compressing codec.
- Errors: `present`, `write` and `read` never raise for a remote failure: they count it
  (`pages.errors`), log it (rate-limited) and answer 0 / all False / a shorter prefix.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import (
    BackendError,
    CorruptEntryError,
    ForeignEntryError,
    KeyFormatError,
    UnauthenticatedEntryError,
)
from lmcache_remote.integrity import IntegrityKey, load_integrity_key
from lmcache_remote.keys import PageKey, page_scan_pattern
from lmcache_remote.metrics import Metrics, RateLimitedLogger
from lmcache_remote.serde import Serde, Signer, ValueHeader, check_identity, checksum, header_seal
from lmcache_remote.storage.client import RemoteCaller, make_client
from lmcache_remote.storage.deadline import call_deadline
from lmcache_remote.storage.health import HealthGate
from lmcache_remote.storage.redis_commands import (
    IncompleteChunkError,
    byte_windows,
    chunk_write_command,
    regroup,
    value_nbytes,
)
from lmcache_remote.storage.wire import BulkPipeline, Seal, supports

logger = logging.getLogger(__name__)

#: Raw page bytes per window of a read or a write: the staging memory one call holds at once.
WINDOW_BYTES = 32 * 1024 * 1024
#: Writes the fill of page i into the staging tensor / reads page i out of it.
PageCopy = Callable[[int, torch.Tensor], None]


class PageStore:
    """Pages of one geometry (``page_shape``, ``dtype``, ``page_tokens``) under page keys."""

    def __init__(self, config: CacheConfig, page_shape: tuple[int, ...], dtype: torch.dtype,
                 page_tokens: int, *, metrics: Metrics | None = None,
                 client: Any = None, window_bytes: int = WINDOW_BYTES) -> None:
        self.config = config
        self.prefix = config.key_prefix
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self.page_tokens = page_tokens
        self.page_nbytes = int(torch.Size(self.page_shape).numel()) * dtype.itemsize
        self.metrics = metrics or Metrics()
        self.integrity: IntegrityKey | None = load_integrity_key(config.integrity_key)
        self.serde = Serde(config.serde, config.remote_part_size, fit_size_classes=True)
        self.nparts = self.serde.part_count(self.page_nbytes)
        self.client = client if client is not None else make_client(config)
        self.wire = BulkPipeline(self.client) if supports(self.client) else None
        self.gate = HealthGate(config.unhealthy_backoff)
        self.caller = RemoteCaller(config.remote_timeout, self.gate, "redis pages")
        self.timeout = config.remote_timeout
        self._ttl_ms = None if config.remote_ttl is None else int(config.remote_ttl * 1000)
        self._pages_per_window = max(1, window_bytes // max(1, self.page_nbytes))
        self._log = RateLimitedLogger(logger)
        self._closed = threading.Event()

    # -- the data path ----------------------------------------------------------------------

    def present(self, keys: Sequence[PageKey]) -> int:
        """How many leading pages are whole in Redis now (0 on any failure)."""
        if not keys:
            return 0
        commands = [("TOUCH", *k.part_keys(self.prefix, self.nparts)) for k in keys]
        try:
            with call_deadline(self.timeout):
                replies = self._run(commands)
        except BackendError as exc:
            self._failed("exists", exc)
            return 0
        run = 0
        for count in replies:
            if int(count) != self.nparts:
                break
            run += 1
        return run

    def write(self, keys: Sequence[PageKey], fill: PageCopy) -> list[bool]:
        """Writes the pages; per page, whether it landed (see the module contract)."""
        landed = [False] * len(keys)
        if not keys:
            return landed
        staging = self._staging(min(len(keys), self._pages_per_window))
        with call_deadline(self.timeout):
            for window in byte_windows([1] * len(keys), self._pages_per_window):
                try:
                    self._write_window(keys, window, staging, fill)
                except BackendError as exc:
                    self._failed("write", exc)
                    break
                landed[window.start:window.stop] = [True] * len(window)
        return landed

    def read(self, keys: Sequence[PageKey], drain: PageCopy) -> list[bool]:
        """Reads the pages; per page, whether it was served (a leading run, the rest False)."""
        served = [False] * len(keys)
        if not keys:
            return served
        staging = self._staging(min(len(keys), self._pages_per_window))
        with call_deadline(self.timeout):
            for window in byte_windows([1] * len(keys), self._pages_per_window):
                try:
                    values = self._fetch([keys[i] for i in window])
                except BackendError as exc:
                    self._failed("read", exc)
                    return served
                for slot, i in enumerate(window):
                    if not self._decode(keys[i], values[slot], staging[slot]):
                        return served
                    drain(i, staging[slot])
                    served[i] = True
        return served

    # -- housekeeping -----------------------------------------------------------------------

    def delete(self, keys: Sequence[PageKey]) -> int:
        """Deletes the pages (every part key); how many pages had a head value."""
        if not keys:
            return 0
        commands: list[tuple[str, ...]] = [("UNLINK", k.redis_key(self.prefix)) for k in keys]
        commands += [("UNLINK", *k.part_keys(self.prefix, self.nparts)[1:])
                     for k in keys if self.nparts > 1]
        with call_deadline(self.timeout):
            replies = self._run(commands)
        return sum(int(r) for r in replies[:len(keys)])

    def clear(self, model_name: str | None = None, geometry: str | None = None) -> int:
        """Deletes every page value under the prefix (narrowed by model and geometry) with SCAN
        and UNLINK; never touches chunk keys. The number of values deleted."""
        pattern = page_scan_pattern(self.prefix, model_name, geometry)
        deleted = 0
        for batch in _batches(self.client.scan_iter(match=pattern, count=1000), 500):
            deleted += int(self.caller.call(_unlinker(self.client, batch)))
        return deleted

    def close(self) -> None:
        """Closes the connections; later calls fail fast (counted misses)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.gate.close()
        self.serde.close()
        try:
            self.client.close()
        except Exception as exc:  # noqa: BLE001 - closing must not fail a shutdown
            logger.debug("closing the page store's client: %s", exc)

    # -- internals --------------------------------------------------------------------------

    def _staging(self, pages: int) -> torch.Tensor:
        return torch.empty((pages, *self.page_shape), dtype=self.dtype)

    def _run(self, commands: Sequence[Sequence[Any]], seals: Sequence[Seal | None] | None = None
             ) -> list[Any]:
        def op() -> list[Any]:
            if self.wire is not None:
                return self.wire.execute(commands, seals=seals)
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            return list(pipe.execute())

        return self.caller.call(op)

    def _write_window(self, keys: Sequence[PageKey], window: range, staging: torch.Tensor,
                      fill: PageCopy) -> None:
        commands: list[tuple[Any, ...]] = []
        seals: list[Seal | None] = []
        nbytes = 0
        for slot, i in enumerate(window):
            fill(i, staging[slot])
            signer = self._signer(keys[i])
            values: list[Any]
            if self.wire is not None:
                header, parts = self.serde.encode_parts(
                    staging[slot], keys[i].hash_bytes, self.page_tokens,
                    sealed=signer is not None, signer=signer)
                values = [(header, parts[0]), *parts[1:]]
                if signer is None:  # the wire fills in the checksums as it sends
                    assert isinstance(header, bytearray)
                    seals.append(header_seal(header, parts))
                else:  # the MAC covers the checksums: sealed before it
                    seals.append(None)
            else:
                values = list(self.serde.encode(staging[slot], keys[i].hash_bytes,
                                                self.page_tokens, signer=signer))
            keys_i = keys[i].part_keys(self.prefix, len(values))
            commands.append(chunk_write_command(keys_i, values, self._ttl_ms))
            nbytes += sum(value_nbytes(v) for v in values)
        self._run(commands, seals if self.wire is not None else None)
        self.metrics.inc("pages.written", len(window))
        self.metrics.inc("pages.written_bytes", nbytes)

    def _fetch(self, keys: Sequence[PageKey]) -> list[list[Any]]:
        key_lists = [k.part_keys(self.prefix, self.nparts) for k in keys]
        replies = self._run([("GET", name) for names in key_lists for name in names])
        return regroup(replies, key_lists)

    def _decode(self, key: PageKey, values: list[Any], out: torch.Tensor) -> bool:
        """Checks one page's values and decodes them into ``out``; False for a miss."""
        if values[0] is None:
            self.metrics.inc("pages.misses")
            return False
        try:
            header = self.serde.read_header(values[0])
            if header.num_tokens != self.page_tokens:
                raise ForeignEntryError(f"value holds {header.num_tokens} tokens, a page "
                                        f"here is {self.page_tokens}")
            check_identity(header, key.hash_bytes, self.page_shape, self.dtype)
            values = self._all_parts(key, header, values)
            if self.integrity is not None:
                self._authenticate(key, header, values)
            self.serde.decode_into(header, values, out, key.hash_bytes, self.page_shape,
                                   self.dtype)
        except ForeignEntryError as exc:
            kind = "unauthenticated" if isinstance(exc, UnauthenticatedEntryError) else "foreign"
            self.metrics.inc(f"pages.{kind}")
            self._log.warning(kind, "%s page %s left in place, not served: %s", kind,
                              key.page_hash, exc)
            return False
        except CorruptEntryError as exc:
            self._drop(key, exc)
            return False
        except BackendError as exc:
            self._failed("read", exc)
            return False
        self.metrics.inc("pages.hits")
        self.metrics.inc("pages.read_bytes", sum(len(memoryview(v)) for v in values))
        return True

    def _all_parts(self, key: PageKey, header: ValueHeader, values: list[Any]) -> list[Any]:
        """Every value the header lists (fetched again when another writer cut the page into
        another number of parts); a part missing is eviction (`IncompleteChunkError`)."""
        if header.part_count != len(values):
            with call_deadline(self.timeout):
                replies = self._run([("GET", name) for name in
                                     key.part_keys(self.prefix, header.part_count)])
            values = list(replies)
            if any(v is None for v in values):
                raise CorruptEntryError("the header lists parts that are not there")
        elif any(v is None for v in values):
            raise IncompleteChunkError("a part of the page is missing (evicted or expired)")
        return values

    def _signer(self, key: PageKey) -> Signer | None:
        integrity = self.integrity
        if integrity is None:
            return None
        name = key.relative_key()
        return lambda signed, parts: integrity.tag(name, signed, parts)

    def _authenticate(self, key: PageKey, header: ValueHeader, values: list[Any]) -> None:
        assert self.integrity is not None
        if header.tag is None:
            raise UnauthenticatedEntryError("written without the integrity key (no MAC)")
        stored = [memoryview(v)[header.header_nbytes:] if i == 0 else memoryview(v)
                  for i, v in enumerate(values)]
        if self.integrity.verify(key.relative_key(), header.signed, stored, header.tag):
            return
        for i, view in enumerate(stored):
            length, expected = header.parts[i]
            if len(view) != length or checksum(view) != expected:
                raise CorruptEntryError(f"part {i} fails its checksum (and the MAC)")
        raise UnauthenticatedEntryError("its MAC does not verify under this integrity key")

    def _drop(self, key: PageKey, exc: CorruptEntryError) -> None:
        kind = "incomplete" if isinstance(exc, IncompleteChunkError) else "corrupt"
        self.metrics.inc(f"pages.{kind}")
        self._log.warning(kind, "dropping %s page %s: %s", kind, key.page_hash, exc)
        try:
            self.delete([key])
        except (BackendError, KeyFormatError) as err:
            self._log.warning("corrupt-delete", "could not delete a bad page: %s", err)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.metrics.inc("pages.errors")
        self._log.warning(f"{what}-failed", "page %s failed: %s", what, exc)


def _unlinker(client: Any, names: list[Any]) -> Callable[[], Any]:
    return lambda: client.unlink(*names)


def _batches(items: Any, size: int) -> Any:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
