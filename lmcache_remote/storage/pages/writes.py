"""PageWrites: the page store's writes (`pages.PageStore.write`), each page whole or absent.

- `write(keys, fill, places=None)`: pages go out in windows (`WINDOW_BYTES` of raw pages over
  `remote_write_lanes` connections at once, so about `WINDOW_BYTES` of staging in flight):
  ``fill(i, staging)`` copies page i into the staging tensor of its window, which is encoded
  (raw: the values are views of it, no copy) and written in one pipelined batch, each page by
  one atomic command. Per page, whether it landed (a failed window's pages are False). With
  ``places`` (page i's bytes where they lie, in pieces) and the raw codec without an
  `integrity_key`, each value is sent from there instead (`Serde.raw_header` over the
  pieces' checksums): no staging, no copy.
- Each page is written in one atomic step, as a chunk is (`wire.commands.write_batch`: a
  multi-part page with an expiry is a transaction on a single server, a script on a
  cluster); with an `integrity_key` its value carries a MAC bound to the page key without
  its prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_remote.errors import BackendError, BackendUnavailableError
from lmcache_remote.naming.keys import PageKey
from lmcache_remote.storage.pages.base import (
    PageCopy,
    PagePlaces,
    PageStoreBase,
    cut_pieces,
    xxh3_of,
)
from lmcache_remote.storage.session.channel import write_values
from lmcache_remote.storage.wire.bulk import Seal
from lmcache_remote.storage.wire.deadline import call_deadline
from lmcache_remote.storage.wire.windows import value_nbytes
from lmcache_remote.values.value_format import header_nbytes


class PageWrites(PageStoreBase):
    """The write half of `PageStore`; see the module doc."""

    def write(self, keys: Sequence[PageKey], fill: PageCopy,
              places: PagePlaces | None = None) -> list[bool]:
        """Writes the pages; per page, whether it landed (see the module contract). With
        ``places`` (page i's bytes where they lie, in pieces) the values are sent from there,
        checksummed in place, without staging, where the bulk wire, the raw codec and no
        `integrity_key` allow it; ``fill`` is then not called."""
        landed = [False] * len(keys)
        in_place = places if self._in_place_ok() else None
        windows, results = self._windowed(
            len(keys), self.config.remote_write_lanes,
            lambda w: self._write_window(keys, w, fill, in_place), lambda ok: ok)
        for window, ok in zip(windows, results, strict=False):
            if ok:
                landed[window.start:window.stop] = [True] * len(window)
        return landed

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

    def _write_pages(self, batch: Sequence[tuple[list[str], list[Any]]],
                     seals: Sequence[Seal | None] | None) -> None:
        """One window of pages, each whole or absent (`session.channel.write_values`, as
        chunks: a multi-part page with an expiry a transaction on a single server, a script
        on a cluster); a page that did not land (its node failed) fails the window."""
        with call_deadline(self.timeout):
            landed = write_values(self.channel, batch, seals, self._ttl_ms, "pages")
        if not all(landed):
            raise BackendUnavailableError("redis cluster: a node failed in this pages batch")

    def _send_in_place(self, keys: Sequence[PageKey], window: range,
                       places: PagePlaces) -> None:
        """One window of pages sent from the caller's memory: each part the pieces of it that
        the part plan cuts, checksummed there, behind a header `Serde.raw_header` builds."""
        size = self.serde.part_size_for(self.page_nbytes)
        bounds = [(p * size, min(self.page_nbytes, (p + 1) * size)) for p in range(self.nparts)]
        batch: list[tuple[list[str], list[Any]]] = []
        for i in window:
            pieces = [cut_pieces(places(i), a, b) for a, b in bounds]
            header = self.serde.raw_header(
                self.page_shape, self.dtype, keys[i].hash_bytes, self.page_tokens, size,
                [(b - a, xxh3_of(part)) for (a, b), part in zip(bounds, pieces, strict=True)])
            values: list[Any] = [(header, *pieces[0]), *(tuple(part) for part in pieces[1:])]
            batch.append((keys[i].part_keys(self.prefix, self.nparts), values))
        self._write_pages(batch, None)
        self.metrics.inc("pages.written", len(window))
        self.metrics.inc("pages.written_bytes",
                         len(window) * (self.page_nbytes + header_nbytes(self.nparts)))

    def _send_window(self, keys: Sequence[PageKey], window: range,
                     staging: Sequence[torch.Tensor], fill: PageCopy) -> None:
        batch: list[tuple[list[str], list[Any]]] = []
        seals: list[Seal | None] = []
        nbytes = 0
        for slot, i in enumerate(window):
            fill(i, staging[slot])
            values, seal = self.values.encode(staging[slot], keys[i].relative_key(),
                                              keys[i].hash_bytes, self.page_tokens,
                                              sealed_on_wire=self.channel.bulk_path)
            seals.append(seal)
            batch.append((keys[i].part_keys(self.prefix, len(values)), values))
            nbytes += sum(value_nbytes(v) for v in values)
        self._write_pages(batch, seals if self.channel.bulk_path else None)
        self.metrics.inc("pages.written", len(window))
        self.metrics.inc("pages.written_bytes", nbytes)
