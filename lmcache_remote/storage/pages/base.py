"""PageStoreBase: what the page store's reads and writes share (`pages.PageStore`).

The store's state (geometry, part plan, serde, client, health gate, staging pool), and:

- `present(keys)`: one round trip (`TOUCH` of every value key of every page: it counts them
  as EXISTS does and refreshes their LRU clock, since a hit query promises the pages to the
  read that follows); the length of the leading run of whole pages.
- `delete`, `clear` (SCAN and UNLINK of page values only, never chunk keys), `close`.
- Windows: a call's pages are cut into windows of about ``WINDOW_BYTES / lanes`` of pages,
  run over up to the configured lanes at once (`_windowed`: each window's task in a copy of
  the call's context, so its deadline goes with it), stopping at the first window refused.
- Bounds: every public call runs under one deadline, `remote_timeout` for the whole call
  (`storage.deadline`, honoured by the bulk wire on every wait), through the store's channel
  (`session.channel`, as the chunk tier's: `RemoteCaller`, one retry on a broken connection,
  a health gate that skips a dead server at once). On a Redis Cluster the channel is
  `cluster_scatter.ClusterScatter`: each call's commands go to their nodes
  as one bulk pipeline per node, concurrently, under the same deadline and each node's own
  gate; a call any of whose nodes fails fails as a whole (a miss, a write reported False). Bytes in
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
from typing import Any, TypeVar, cast

import torch
import xxhash

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import BackendError, BackendUnavailableError
from lmcache_remote.naming.keys import PageKey, page_scan_pattern
from lmcache_remote.storage.local.memory import MemoryObj, MemoryPool
from lmcache_remote.storage.session.channel import Channel, failed, open_channel
from lmcache_remote.storage.session.cluster_scatter import Receive
from lmcache_remote.storage.value.path import ValuePath, Verdicts
from lmcache_remote.storage.wire.bulk import Seal
from lmcache_remote.storage.wire.commands import ttl_ms
from lmcache_remote.storage.wire.deadline import call_deadline
from lmcache_remote.storage.wire.lanes import LaneThreads
from lmcache_remote.storage.wire.windows import PAGE_WINDOW_BYTES, byte_windows
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger
from lmcache_remote.values.integrity import IntegrityKey
from lmcache_remote.values.serde import Serde
from lmcache_remote.values.sizing import longest_value
from lmcache_remote.values.value_format import checksum

logger = logging.getLogger("lmcache_remote.storage.pages")

#: Raw page bytes per window of a read or a write: the staging memory one call holds at once
#: (`wire.windows.PAGE_WINDOW_BYTES`, where every window size is defined).
WINDOW_BYTES = PAGE_WINDOW_BYTES
_R = TypeVar("_R")
#: Writes the fill of page i into the staging tensor / reads page i out of it.
PageCopy = Callable[[int, torch.Tensor], None]
#: Page i's destination bytes, in order (they add up to a page): a read's places.
PagePlaces = Callable[[int], list[memoryview]]


class Staging:
    """The staging of one window: a pool buffer per page (``objs``) and their page tensors."""

    __slots__ = ("objs", "pages")

    def __init__(self, objs: list[MemoryObj]) -> None:
        self.objs = objs
        self.pages = [obj.tensor for obj in objs]

    def release(self) -> None:
        for obj in self.objs:
            obj.release()


class PageStoreBase:
    """Pages of one geometry (``page_shape``, ``dtype``, ``page_tokens``) under page keys: the
    state and the calls the reads and writes share."""

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
        self.serde = Serde(config.serde, config.remote_part_size, fit_size_classes=True)
        #: The value path chunks use too (`value.path`); the integrity key is read here, once.
        self.values = ValuePath.from_config(config, self.serde)
        self.nparts = self.serde.part_count(self.page_nbytes)
        self.timeout = config.remote_timeout
        self._longest = longest_value(self.page_nbytes)
        self._log = RateLimitedLogger(logger)
        #: Every batch's way to Redis, the chunk tier's kind (`session.channel`): one
        #: server's, or a cluster's (whose failed node fails the call: pages stand or fall
        #: by the batch). Chosen here, once.
        self.channel: Channel = open_channel(config, self.metrics, self._log, self._longest,
                                             client=client, name="redis pages",
                                             error_metric=None)
        self.gate = self.channel.gate
        self.caller = self.channel.caller
        self.verdicts = Verdicts(self.metrics, self._log, "page", "pages.")
        self._ttl_ms = ttl_ms(config)
        # Staging within the budget: one pool, a window never larger than the bound.
        self.pool = MemoryPool(config.max_local_cpu_bytes)
        self._window_bytes = max(1, min(window_bytes, config.max_local_cpu_bytes))
        self._lanes = LaneThreads()
        self._closed = threading.Event()

    @property
    def integrity(self) -> IntegrityKey | None:
        """The integrity key values are signed and checked with (the value path's), or None."""
        return self.values.integrity

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

    def _windowed(self, count: int, configured_lanes: int, work: Callable[[range], _R],
                  go_on: Callable[[_R], bool]) -> tuple[list[range], list[_R]]:
        """A call's ``count`` pages in windows over up to ``configured_lanes`` connections
        (`_on_lanes`), the whole call under one `remote_timeout` deadline: the windows, and
        the results of those done, in order."""
        lanes = self._lane_count(configured_lanes)
        windows = self._windows(count, lanes)
        with call_deadline(self.timeout):
            return windows, self._on_lanes(windows, work, lanes, go_on)

    def _in_place_ok(self) -> bool:
        """Whether values can go out of and come into the caller's memory as they lie: the
        bulk wire sends and receives buffers where they are, the raw codec stores bytes as
        they are, and without a MAC to compute over a whole value."""
        return (self.channel.bulk_path and self.integrity is None
                and self.serde.codec.codec_id == 0)

    def _lane_count(self, configured: int) -> int:
        """Connections a call uses at once: the configured lanes over the bulk wire (on a
        cluster, lanes per node), one once the store is closed."""
        return configured if self.channel.bulk_path and not self._closed.is_set() else 1

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
        return cast(ThreadPoolExecutor, self._lanes.get(
            "lmcr_pages",
            max(lanes, self.config.remote_read_lanes, self.config.remote_write_lanes)))

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
        client = self.channel.redis_client()
        for batch in _batches(client.scan_iter(match=pattern, count=1000), 500):
            deleted += int(self.caller.call(_unlinker(client, batch)))
        return deleted

    def close(self) -> None:
        """Closes the connections; later calls fail fast (counted misses)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.channel.stop_io()
        self.serde.close()
        self._lanes.shutdown()
        self.pool.trim()
        try:
            self.channel.close()
        except Exception as exc:  # noqa: BLE001 - closing must not fail a shutdown
            logger.debug("closing the page store's client: %s", exc)

    @property
    def client(self) -> Any:
        """The redis-py client as it is now (a cluster's: a placeholder until it answers)."""
        return self.channel.client

    def _staging(self, pages: int, what: str) -> Staging | None:
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
        return Staging(held)

    def _run(self, commands: Sequence[tuple[Any, ...]],
             seals: Sequence[Seal | None] | None = None,
             receive: Receive | None = None) -> list[Any]:
        """One batch through the channel, within `remote_timeout` or the call's deadline,
        whichever is sooner: each command's reply. A batch stands or falls whole: a cluster
        node that failed fails it (`BackendUnavailableError`)."""
        with call_deadline(self.timeout):
            replies = self.channel.run(commands, "pages", seals=seals, receive=receive)
        if any(failed(r) for r in replies):
            raise BackendUnavailableError("redis cluster: a node failed in this pages batch")
        return replies

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


def cut_pieces(pieces: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
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


def xxh3_of(pieces: Sequence[memoryview]) -> int:
    """XXH3-64 of the pieces laid end to end (a part received across several regions)."""
    if len(pieces) == 1:
        return checksum(pieces[0])
    digest = xxhash.xxh3_64()
    for piece in pieces:
        digest.update(piece)
    return int(digest.intdigest())
