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
- `write(keys, fill, places=None)`: pages go out in windows (`WINDOW_BYTES` of raw pages over
  `remote_write_lanes` connections at once, so about `WINDOW_BYTES` of staging in flight):
  ``fill(i, staging)`` copies page i into the staging tensor of its window, which is encoded
  (raw: the values are views of it, no copy) and written in one pipelined batch, each page by
  one atomic command. Per page, whether it landed (a failed window's pages are False). With
  ``places`` (page i's bytes where they lie, in pieces) and the raw codec without an
  `integrity_key`, each value is sent from there instead (`Serde.raw_header` over the
  pieces' checksums): no staging, no copy.
- `read(keys, drain, places=None)`: the pages' values are fetched in windows the same way
  over `remote_read_lanes` connections (over the bulk wire with the raw codec, received
  straight into the staging tensor and hashed as they land), checked (header, identity,
  lengths, every checksum, the MAC) and handed to ``drain(i, staging)``. With ``places`` (the
  caller's own memory for page i, in pieces) they land there instead and are checked in
  place, without the MAC (so only without an `integrity_key`) and without staging; a page
  cut by another part plan is read apart through staging and drained. The first missing or
  bad page ends the read (the rest are False; a window read on another lane at the same time
  may still have filled later pages' places: they are not reported served). A damaged
  value (checksum, length, a part gone) is deleted and counted; a value of another release
  or another identity (foreign) is a miss left in place, counted apart.
- Bounds: every public call runs under one deadline, `remote_timeout` for the whole call
  (`storage.deadline`, honoured by the bulk wire on every wait), through `RemoteCaller` (one
  retry on a broken connection, a health gate that skips a dead server at once). Bytes in
  flight: about `WINDOW_BYTES` of staging per call, plus the encoded values for a compressing
  codec. Staging comes from one `MemoryPool` per store bounded by `max_local_cpu_size` (the
  project's memory budget; windows are never larger than it), its buffers reused call after
  call: when calls at once would pass the bound, the window that finds no room is cut short
  (a read serves the pages before it, a write reports its pages False), counted
  (`pages.budget_short`) and logged. Reads and writes in place take no staging.
- Errors: `present`, `write` and `read` never raise for a remote failure: they count it
  (`pages.errors`), log it (rate-limited) and answer 0 / all False / a shorter prefix.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
import xxhash

from lmcache_remote.buffers import address
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
from lmcache_remote.memory import MemoryObj, MemoryPool
from lmcache_remote.metrics import Metrics, RateLimitedLogger
from lmcache_remote.serde import Serde
from lmcache_remote.sizing import longest_value
from lmcache_remote.storage.bulk import BulkPipeline, Seal, supports
from lmcache_remote.storage.client import RemoteCaller, make_client
from lmcache_remote.storage.deadline import call_deadline
from lmcache_remote.storage.health import HealthGate
from lmcache_remote.storage.redis_commands import (
    IncompleteChunkError,
    byte_windows,
    chunk_write_command,
    read_ahead,
    regroup,
    value_nbytes,
)
from lmcache_remote.value_format import (
    Signer,
    ValueHeader,
    check_identity,
    checksum,
    header_nbytes,
    header_seal,
)

logger = logging.getLogger(__name__)

#: Raw page bytes per window of a read or a write: the staging memory one call holds at once.
WINDOW_BYTES = 32 * 1024 * 1024
_R = TypeVar("_R")
#: Writes the fill of page i into the staging tensor / reads page i out of it.
PageCopy = Callable[[int, torch.Tensor], None]
#: Page i's destination bytes, in order (they add up to a page): a read's places.
PagePlaces = Callable[[int], list[memoryview]]


class _Staging:
    """The staging of one window: a pool buffer per page (``objs``) and their page tensors."""

    __slots__ = ("objs", "pages")

    def __init__(self, objs: list[MemoryObj]) -> None:
        self.objs = objs
        self.pages = [obj.tensor for obj in objs]

    def release(self) -> None:
        for obj in self.objs:
            obj.release()


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
        # Staging within the budget: one pool, a window never larger than the bound.
        self.pool = MemoryPool(config.max_local_cpu_bytes)
        self._window_bytes = max(1, min(window_bytes, config.max_local_cpu_bytes))
        self._lanes: ThreadPoolExecutor | None = None
        self._lanes_lock = threading.Lock()
        self._longest = longest_value(self.page_nbytes)
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

    def write(self, keys: Sequence[PageKey], fill: PageCopy,
              places: PagePlaces | None = None) -> list[bool]:
        """Writes the pages; per page, whether it landed (see the module contract). With
        ``places`` (page i's bytes where they lie, in pieces) the values are sent from there,
        checksummed in place, without staging, where the bulk wire, the raw codec and no
        `integrity_key` allow it; ``fill`` is then not called."""
        landed = [False] * len(keys)
        lanes = self._lane_count(self.config.remote_write_lanes)
        windows = self._windows(len(keys), lanes)
        in_place = places if self._in_place_ok() else None
        with call_deadline(self.timeout):
            results = self._on_lanes(
                windows, lambda w: self._write_window(keys, w, fill, in_place), lanes,
                lambda ok: ok)
        for window, ok in zip(windows, results, strict=False):
            if ok:
                landed[window.start:window.stop] = [True] * len(window)
        return landed

    def read(self, keys: Sequence[PageKey], drain: PageCopy,
             places: PagePlaces | None = None) -> list[bool]:
        """Reads the pages; per page, whether it was served (a leading run, the rest False).
        With ``places`` (page i's destination bytes, in order) the values are received
        straight there and checked in place where the bulk wire, the raw codec and no
        `integrity_key` allow it: ``drain`` is then called only for a page that had to come
        another way (written with another part plan: decoded into staging first)."""
        served = [False] * len(keys)
        lanes = self._lane_count(self.config.remote_read_lanes)
        windows = self._windows(len(keys), lanes)
        in_place = places if self._in_place_ok() else None
        with call_deadline(self.timeout):
            results = self._on_lanes(
                windows, lambda w: self._read_window(keys, w, drain, in_place), lanes,
                lambda good: good[0] == good[1])
        for window, (good, _) in zip(windows, results, strict=False):
            served[window.start:window.start + good] = [True] * good
            if good < len(window):
                break
        return served

    def _in_place_ok(self) -> bool:
        """Whether values can go out of and come into the caller's memory as they lie: the
        bulk wire sends and receives buffers where they are, the raw codec stores bytes as
        they are, and without a MAC to compute over a whole value."""
        return (self.wire is not None and self.integrity is None
                and self.serde.codec.codec_id == 0)

    def _lane_count(self, configured: int) -> int:
        """Connections a call uses at once: the configured lanes over the bulk wire, one on a
        cluster client (redis-py's pipeline) or once the store is closed."""
        return configured if self.wire is not None and not self._closed.is_set() else 1

    def _windows(self, count: int, lanes: int) -> list[range]:
        """Consecutive runs of page indexes, each about ``WINDOW_BYTES / lanes`` of pages (at
        least one page): with every lane busy, a call holds about one `window_bytes`."""
        per_window = max(1, self._window_bytes // max(1, lanes) // max(1, self.page_nbytes))
        return byte_windows([1] * count, per_window)

    def _on_lanes(self, windows: list[range], work: Callable[[range], _R], lanes: int,
                  go_on: Callable[[_R], bool]) -> list[_R]:
        """``work(window)`` for the windows, in order, on up to ``lanes`` connections at once
        (each task in a copy of this context: the call's deadline goes with it). One at a time,
        it stops at the first result that ``go_on`` refuses; on lanes, windows not started
        by then are cancelled. The results of the windows done, in order."""
        if lanes <= 1 or len(windows) <= 1:
            results = []
            for window in windows:
                results.append(work(window))
                if not go_on(results[-1]):
                    break
            return results
        pool = self._lane_pool(lanes)
        futures = [pool.submit(contextvars.copy_context().run, work, w) for w in windows]
        results, stopped = [], False
        for future in futures:
            if stopped:
                future.cancel()
                continue
            results.append(future.result())
            stopped = not go_on(results[-1])
        for future in futures:  # every started window ends before the call returns
            if not future.cancelled():
                future.exception()
        return results

    def _lane_pool(self, lanes: int) -> ThreadPoolExecutor:
        with self._lanes_lock:
            if self._lanes is None:
                self._lanes = ThreadPoolExecutor(
                    max(lanes, self.config.remote_read_lanes, self.config.remote_write_lanes),
                    thread_name_prefix="lmcr_pages")
            return self._lanes

    def _read_window(self, keys: Sequence[PageKey], window: range, drain: PageCopy,
                     places: PagePlaces | None = None) -> tuple[int, int]:
        """(leading pages of ``window`` read, checked and drained; the window's pages)."""
        held = None
        if places is None:
            held = self._staging(len(window), "read")
            if held is None:
                return 0, len(window)
        try:
            return self._read_window_into(keys, window, drain, places, held)
        finally:
            if held is not None:
                held.release()

    def _read_window_into(self, keys: Sequence[PageKey], window: range, drain: PageCopy,
                          places: PagePlaces | None, held: _Staging | None
                          ) -> tuple[int, int]:
        staging = None if held is None else held.pages
        dests = ([places(i) for i in window] if places is not None else
                 [[obj.raw_view()] for obj in held.objs])  # type: ignore[union-attr]
        try:
            values, digests = self._fetch([keys[i] for i in window], dests)
        except BackendError as exc:
            self._failed("read", exc)
            return 0, len(window)
        for slot, i in enumerate(window):
            if staging is not None:
                ok = self._decode(keys[i], values[slot], staging[slot], digests[slot])
                if ok:
                    drain(i, staging[slot])
            else:
                done = self._check_in_place(keys[i], values[slot], digests[slot])
                ok = done if done is not None else self._read_apart(keys[i], i, drain)
            if not ok:
                return slot, len(window)
        return len(window), len(window)

    def _check_in_place(self, key: PageKey, values: list[Any], digests: list[int | None]
                        ) -> bool | None:
        """Checks a page received in its places (header, identity, plan, lengths, every
        part's checksum); False for a miss or a bad value (deleted), None when the value
        was not cut by this store's plan (or a part did not land in place) and must be read
        apart."""
        if values[0] is None:
            self.metrics.inc("pages.misses")
            return False
        head = values[0]
        if not isinstance(head, list) or not all(isinstance(v, list) for v in values):
            return None
        try:
            header = self.serde.read_header(head[0])
            if header.num_tokens != self.page_tokens:
                raise ForeignEntryError(f"value holds {header.num_tokens} tokens, a page "
                                        f"here is {self.page_tokens}")
            check_identity(header, key.hash_bytes, self.page_shape, self.dtype)
            if (header.codec_id != 0 or header.part_count != len(values)
                    or header.part_size != self.serde.part_size_for(self.page_nbytes)):
                return None
            for p, value in enumerate(values):
                pieces = value[1:] if p == 0 else value
                if sum(len(x) for x in pieces) != header.parts[p][0]:
                    raise CorruptEntryError(f"part {p} has the wrong length")
                known = digests[p] if len(pieces) == 1 else None
                if known is None:
                    known = _xxh3_of(pieces)
                if known != header.parts[p][1]:
                    raise CorruptEntryError(f"part {p} fails its checksum")
        except ForeignEntryError as exc:
            self._foreign(key, exc)
            return False
        except CorruptEntryError as exc:
            self._drop(key, exc)
            return False
        self.metrics.inc("pages.hits")
        self.metrics.inc("pages.read_bytes",
                         sum(header.value_nbytes(i) for i in range(len(values))))
        return True

    def _read_apart(self, key: PageKey, index: int, drain: PageCopy) -> bool:
        """One page the slow way: fetched into fresh buffers, decoded into staging, drained."""
        try:
            values = self._run([("GET", name) for name in
                                key.part_keys(self.prefix, self.nparts)])
        except BackendError as exc:
            self._failed("read", exc)
            return False
        held = self._staging(1, "read")
        if held is None:
            return False
        try:
            page = held.pages[0]
            if not self._decode(key, list(values), page, [None] * len(values)):
                return False
            drain(index, page)
            return True
        finally:
            held.release()

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
        with self._lanes_lock:
            lanes, self._lanes = self._lanes, None
        if lanes is not None:
            lanes.shutdown(wait=True)
        self.pool.trim()
        try:
            self.client.close()
        except Exception as exc:  # noqa: BLE001 - closing must not fail a shutdown
            logger.debug("closing the page store's client: %s", exc)

    # -- internals --------------------------------------------------------------------------

    def _staging(self, pages: int, what: str) -> _Staging | None:
        """Staging for ``pages`` pages from the budget's pool, a buffer a page (one size for
        the pool to reuse, whatever a window's page count); the caller releases it. None,
        counted and logged, when the calls in flight hold the budget already."""
        held: list[MemoryObj] = []
        for _ in range(pages):
            obj = self.pool.allocate(self.page_shape, self.dtype)
            if obj is None:
                for got in held:
                    got.release()
                self.metrics.inc("pages.budget_short")
                self._log.warning(
                    "budget", "page %s cut short: the staging of the calls in flight fills "
                    "max_local_cpu_size (%d bytes); raise it for more calls at once",
                    what, self.pool.max_bytes)
                return None
            held.append(obj)
        return _Staging(held)

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

    def _write_window(self, keys: Sequence[PageKey], window: range, fill: PageCopy,
                      places: PagePlaces | None = None) -> bool:
        """Fills, encodes and writes one window of pages in one batch (or, with ``places``,
        writes them from where they lie); whether it landed."""
        try:
            if places is not None:
                self._send_in_place(keys, window, places)
            else:
                held = self._staging(len(window), "write")
                if held is None:
                    return False
                try:
                    self._send_window(keys, window, held.pages, fill)
                finally:
                    held.release()
        except BackendError as exc:
            self._failed("write", exc)
            return False
        return True

    def _send_in_place(self, keys: Sequence[PageKey], window: range,
                       places: PagePlaces) -> None:
        """One window of pages sent from the caller's memory: each part the pieces of it that
        the part plan cuts, checksummed there, behind a header `Serde.raw_header` builds."""
        size = self.serde.part_size_for(self.page_nbytes)
        bounds = [(p * size, min(self.page_nbytes, (p + 1) * size)) for p in range(self.nparts)]
        commands: list[tuple[Any, ...]] = []
        for i in window:
            pieces = [_cut(places(i), a, b) for a, b in bounds]
            header = self.serde.raw_header(
                self.page_shape, self.dtype, keys[i].hash_bytes, self.page_tokens, size,
                [(b - a, _xxh3_of(part)) for (a, b), part in zip(bounds, pieces, strict=True)])
            values: list[Any] = [(header, *pieces[0]), *(tuple(part) for part in pieces[1:])]
            commands.append(chunk_write_command(keys[i].part_keys(self.prefix, self.nparts),
                                                values, self._ttl_ms))
        self._run(commands)
        self.metrics.inc("pages.written", len(window))
        self.metrics.inc("pages.written_bytes",
                         len(window) * (self.page_nbytes + header_nbytes(self.nparts)))

    def _send_window(self, keys: Sequence[PageKey], window: range,
                     staging: Sequence[torch.Tensor], fill: PageCopy) -> None:
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

    def _fetch(self, keys: Sequence[PageKey], dests: Sequence[Sequence[memoryview]]
               ) -> tuple[list[list[Any]], list[list[int | None]]]:
        """GETs every value of the pages in one pipeline: per page its replies and, per reply,
        its part's XXH3-64 where the receive loop computed it (else None). Over the bulk wire
        with the raw codec each value lands in its place up front (value 0's header in a
        scratch buffer, every part's bytes where ``dests[page]`` puts them: a staging slot,
        or the engine's own memory), read and hashed without the GIL, and its reply is the
        list of its buffers; a value of any other length lands in a fresh buffer and fails
        its checks. Otherwise the replies are fresh buffers, decoded afterwards."""
        key_lists = [k.part_keys(self.prefix, self.nparts) for k in keys]
        flat = [("GET", name) for names in key_lists for name in names]
        digests: list[int | None] = [None] * len(flat)
        wire = self.wire
        if wire is None or self.serde.codec.codec_id != 0:
            replies = self._run(flat)
            return regroup(replies, key_lists), regroup(digests, key_lists)
        size = self.serde.part_size_for(self.page_nbytes)
        head = header_nbytes(self.nparts, self.integrity is not None)
        heads = memoryview(bytearray(head * len(keys)))
        sink: list[Any] = []
        sizes: list[int] = []
        for slot in range(len(keys)):
            for p in range(self.nparts):
                start, end = p * size, min(self.page_nbytes, (p + 1) * size)
                pieces = _cut(dests[slot], start, end)
                sink.append([heads[slot * head:(slot + 1) * head], *pieces] if p == 0
                            else pieces)
                sizes.append(end - start + (head if p == 0 else 0))

        def op() -> list[Any]:
            return wire.execute(flat, sink, reply_sizes=sizes,
                                inflight_bytes=read_ahead([self.page_nbytes]),
                                digests=digests, max_bulk=self._longest)

        replies = [_as_received(reply, place) for reply, place in
                   zip(self.caller.call(op), sink, strict=True)]
        return regroup(replies, key_lists), regroup(digests, key_lists)

    def _decode(self, key: PageKey, values: list[Any], out: torch.Tensor,
                digests: list[int | None]) -> bool:
        """Checks one page's values and decodes them into ``out`` (values received in place
        there are only checked); False for a miss."""
        if values[0] is None:
            self.metrics.inc("pages.misses")
            return False
        try:
            head = values[0]
            header = self.serde.read_header(head[0] if isinstance(head, list) else head)
            if header.num_tokens != self.page_tokens:
                raise ForeignEntryError(f"value holds {header.num_tokens} tokens, a page "
                                        f"here is {self.page_tokens}")
            check_identity(header, key.hash_bytes, self.page_shape, self.dtype)
            fetched = self._all_parts(key, header, values)
            if fetched is not values:  # fetched again: the loop's digests are not theirs
                values, digests = fetched, [None] * len(fetched)
            stored = [_stored_part(header, i, v) for i, v in enumerate(values)]
            if self.integrity is not None:
                self._authenticate(key, header, stored, digests)
            self.serde.decode_parts_into(header, stored, out, key.hash_bytes, self.page_shape,
                                         self.dtype, digests=digests)
        except ForeignEntryError as exc:
            self._foreign(key, exc)
            return False
        except CorruptEntryError as exc:
            self._drop(key, exc)
            return False
        except BackendError as exc:
            self._failed("read", exc)
            return False
        self.metrics.inc("pages.hits")
        self.metrics.inc("pages.read_bytes",
                         sum(header.value_nbytes(i) for i in range(len(values))))
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

    def _authenticate(self, key: PageKey, header: ValueHeader, stored: Sequence[memoryview],
                      digests: Sequence[int | None]) -> None:
        """With an `integrity_key`: `UnauthenticatedEntryError` unless the value's MAC verifies
        for this key (prefix aside); a failed MAC over a part that also fails its checksum is
        damage (`CorruptEntryError`), as in the chunk tier."""
        assert self.integrity is not None
        if header.tag is None:
            raise UnauthenticatedEntryError("written without the integrity key (no MAC)")
        if self.integrity.verify(key.relative_key(), header.signed, stored, header.tag):
            return
        for i, view in enumerate(stored):
            length, expected = header.parts[i]
            known = digests[i] if i < len(digests) else None
            if len(view) != length or (known if known is not None else checksum(view)
                                       ) != expected:
                raise CorruptEntryError(f"part {i} fails its checksum (and the MAC)")
        raise UnauthenticatedEntryError("its MAC does not verify under this integrity key")

    def _foreign(self, key: PageKey, exc: ForeignEntryError) -> None:
        kind = "unauthenticated" if isinstance(exc, UnauthenticatedEntryError) else "foreign"
        self.metrics.inc(f"pages.{kind}")
        self._log.warning(kind, "%s page %s left in place, not served: %s", kind,
                          key.page_hash, exc)

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


def _stored_part(header: ValueHeader, index: int, value: Any) -> memoryview:
    """The stored bytes of part ``index`` (value 0 without its header), length-checked."""
    if isinstance(value, list):  # received in place: [header, part 0] / [part i]
        pieces = value
        if index == 0:
            if len(value[0]) != header.header_nbytes:
                raise CorruptEntryError(f"value 0 header is {len(value[0])} bytes, expected "
                                        f"{header.header_nbytes}")
            pieces = value[1:]
        return memoryview(pieces[0]) if len(pieces) == 1 else memoryview(b"".join(pieces))
    if value is None or isinstance(value, (int, Exception)):
        raise CorruptEntryError(f"value {index} is not a bulk string")
    view = memoryview(value).cast("B")
    if len(view) != header.value_nbytes(index):
        raise CorruptEntryError(f"value {index} is {len(view)} bytes, expected "
                                f"{header.value_nbytes(index)}")
    return view[header.header_nbytes:] if index == 0 else view


def _as_received(reply: Any, place: list[memoryview]) -> Any:
    """A reply as the list of its place's buffers when it landed there (the wire hands back a
    one-buffer place as the buffer itself), else as it came (a fresh buffer, None, ...)."""
    if isinstance(reply, list) or len(place) != 1 or not isinstance(reply, memoryview):
        return reply
    if len(reply) == len(place[0]) and address(reply) == address(place[0]):
        return [reply]
    return reply


def _cut(pieces: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
    """The byte range ``[start, end)`` of the pieces laid end to end, as views of them."""
    out, at = [], 0
    for piece in pieces:
        lo, hi = max(start, at), min(end, at + len(piece))
        if lo < hi:
            out.append(piece[lo - at:hi - at])
        at += len(piece)
    if sum(len(x) for x in out) != end - start:
        raise ValueError(f"the places hold {at} bytes, not the range {start}..{end}")
    return out


def _xxh3_of(pieces: Sequence[memoryview]) -> int:
    """XXH3-64 of the pieces laid end to end (a part received across several regions)."""
    if len(pieces) == 1:
        return checksum(pieces[0])
    digest = xxhash.xxh3_64()
    for piece in pieces:
        digest.update(piece)
    return int(digest.intdigest())


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
