"""PageReads: the page store's reads (`pages.PageStore.read`), whole pages, checked, or none.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_remote.errors import (
    BackendError,
    CorruptEntryError,
    ForeignEntryError,
)
from lmcache_remote.naming.keys import PageKey
from lmcache_remote.native.buffers import address
from lmcache_remote.storage.pages.base import (
    PageCopy,
    PagePlaces,
    PageStoreBase,
    Staging,
    cut_pieces,
    xxh3_of,
)
from lmcache_remote.storage.wire.commands import regroup
from lmcache_remote.storage.wire.deadline import call_deadline
from lmcache_remote.storage.wire.windows import read_ahead
from lmcache_remote.values.value_format import header_nbytes


class PageReads(PageStoreBase):
    """The read half of `PageStore`; see the module doc."""

    def read(self, keys: Sequence[PageKey], drain: PageCopy,
             places: PagePlaces | None = None) -> list[bool]:
        """Reads the pages; per page, whether it was served (a leading run, the rest False).
        With ``places`` (page i's destination bytes, in order) the values are received
        straight there and checked in place where the bulk wire, the raw codec and no
        `integrity_key` allow it: ``drain`` is then called only for a page that had to come
        another way (written with another part plan: decoded into staging first)."""
        served = [False] * len(keys)
        in_place = places if self._in_place_ok() else None
        windows, results = self._windowed(
            len(keys), self.config.remote_read_lanes,
            lambda w: self._read_window(keys, w, drain, in_place),
            lambda good: good[0] == good[1])
        for window, (good, _) in zip(windows, results, strict=False):
            served[window.start:window.start + good] = [True] * good
            if good < len(window):
                break
        return served

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
                          places: PagePlaces | None, held: Staging | None
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
            header = self.values.header(head[0], hash_bytes=key.hash_bytes,
                                        num_tokens=self.page_tokens, shape=self.page_shape,
                                        dtype=self.dtype)
            if (header.codec_id != 0 or header.part_count != len(values)
                    or header.part_size != self.serde.part_size_for(self.page_nbytes)):
                return None
            for p, value in enumerate(values):
                pieces = value[1:] if p == 0 else value
                if sum(len(x) for x in pieces) != header.parts[p][0]:
                    raise CorruptEntryError(f"part {p} has the wrong length")
                known = digests[p] if len(pieces) == 1 else None
                if known is None:
                    known = xxh3_of(pieces)
                if known != header.parts[p][1]:
                    raise CorruptEntryError(f"part {p} fails its checksum")
        except (ForeignEntryError, CorruptEntryError) as exc:
            self.verdicts.settle(key.page_hash, exc, lambda: self.delete([key]))
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
        if not self.channel.bulk_path or self.serde.codec.codec_id != 0:
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
                pieces = cut_pieces(dests[slot], start, end)
                sink.append([heads[slot * head:(slot + 1) * head], *pieces] if p == 0
                            else pieces)
                sizes.append(end - start + (head if p == 0 else 0))
        received = self._run(flat, receive=(sink, sizes, read_ahead([self.page_nbytes]),
                                            digests))
        replies = [_as_received(reply, place)
                   for reply, place in zip(received, sink, strict=True)]
        return regroup(replies, key_lists), regroup(digests, key_lists)

    def _decode(self, key: PageKey, values: list[Any], out: torch.Tensor,
                digests: list[int | None]) -> bool:
        """Checks one page's values and decodes them into ``out`` (`value.path.ValuePath`, as
        chunks are; values received in place there are only checked); False for a miss."""
        if values[0] is None:
            self.metrics.inc("pages.misses")
            return False

        def refetch(parts: int) -> list[Any]:
            with call_deadline(self.timeout):
                return list(self._run([("GET", name) for name in
                                       key.part_keys(self.prefix, parts)]))

        try:
            nbytes = self.values.check_and_decode(
                values, digests, name=key.relative_key(), hash_bytes=key.hash_bytes,
                num_tokens=self.page_tokens, shape=self.page_shape, dtype=self.dtype, out=out,
                refetch=refetch)
        except (ForeignEntryError, CorruptEntryError) as exc:
            self.verdicts.settle(key.page_hash, exc, lambda: self.delete([key]))
            return False
        except BackendError as exc:
            self._failed("read", exc)
            return False
        self.metrics.inc("pages.hits")
        self.metrics.inc("pages.read_bytes", nbytes)
        return True


def _as_received(reply: Any, place: list[memoryview]) -> Any:
    """A reply as the list of its place's buffers when it landed there (the wire hands back a
    one-buffer place as the buffer itself), else as it came (a fresh buffer, None, ...)."""
    if isinstance(reply, list) or len(place) != 1 or not isinstance(reply, memoryview):
        return reply
    if len(reply) == len(place[0]) and address(reply) == address(place[0]):
        return [reply]
    return reply
