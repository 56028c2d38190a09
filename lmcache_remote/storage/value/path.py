"""ValuePath: one value out (encode and seal) and in (check and decode), chunks and pages alike.

A value is stored as `docs/value-format.md` says: value 0 is the header and part 0, value i
part i, every part with its XXH3-64 in the header and, with an `integrity_key`, a MAC over
them bound to the value's name (a chunk's key; a page's key without its prefix).

- `encode(tensor, name, hash_bytes, num_tokens)`: the values to send and their `Seal`. Over
  a wire that seals (`sealed_on_wire`: the bulk wire computes the checksums as it sends each
  part, so the kernel's copy finds the bytes still in the CPU cache) value 0 goes as
  (header, part 0) without joining them and the header is sealed by the wire; with a MAC the
  checksums are computed before it (no seal). Otherwise the values leave sealed and joined.
- `check_and_decode(values, digests, ...)`: the header first (the token count and the
  identity its key names: anything else is foreign, whatever its parts), then every part the
  header lists (fetched again through ``refetch`` when another writer cut the value into
  another number of parts: a part missing then is damage; a part missing where the counts
  agree was evicted or expired, `IncompleteChunkError`), lengths, the MAC (`checks.
  authenticate`), and the checksums as the parts are decoded into ``out``. ``digests``: each
  part's XXH3-64 where the receive loop computed it. Raises `ForeignEntryError` (left in
  place) or `CorruptEntryError` (deleted); returns the stored bytes read.
- `Verdicts`: a foreign value (another release, another identity, one this reader's key does
  not vouch for) is a miss left in place, counted `<prefix>foreign<suffix>` or
  `<prefix>unauthenticated<suffix>` and logged (rate-limited); a damaged one is deleted and
  counted `<prefix>corrupt<suffix>` (logged) or, a part evicted, `<prefix>incomplete<suffix>`
  (DEBUG: eviction is no fault). A failed delete is logged, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_remote.config import CacheConfig
from lmcache_remote.errors import (
    CorruptEntryError,
    ForeignEntryError,
    UnauthenticatedEntryError,
)
from lmcache_remote.storage.value.checks import authenticate, signer_for, stored_part
from lmcache_remote.storage.wire.bulk import Seal
from lmcache_remote.storage.wire.commands import IncompleteChunkError
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger
from lmcache_remote.values.integrity import IntegrityKey, load_integrity_key
from lmcache_remote.values.serde import Serde
from lmcache_remote.values.value_format import ValueHeader, check_identity, header_seal

__all__ = ["UNVERIFIED", "ValuePath", "Verdicts"]

logger = logging.getLogger(__name__)
#: Why a value whose MAC does not verify over intact parts is not served.
UNVERIFIED = ("its MAC does not verify under this integrity key (forged, moved from another "
              "key, or another key's)")


class ValuePath:
    """Encode-and-seal and check-and-decode of one tier's or store's values; see the module
    doc. ``integrity``: read from the configuration once, here, never logged."""

    def __init__(self, serde: Serde, integrity: IntegrityKey | None) -> None:
        self.serde = serde
        self.integrity = integrity

    @classmethod
    def from_config(cls, config: CacheConfig, serde: Serde) -> ValuePath:
        return cls(serde, load_integrity_key(config.integrity_key))

    def encode(self, tensor: Any, name: str, hash_bytes: bytes, num_tokens: int, *,
               sealed_on_wire: bool) -> tuple[list[Any], Seal | None]:
        """The values of one chunk or page written under ``name``, and the seal the wire
        fills in as it sends them (None: sealed already)."""
        signer = signer_for(self.integrity, name)
        if not sealed_on_wire:
            return list(self.serde.encode(tensor, hash_bytes, num_tokens, signer=signer)), None
        header, parts = self.serde.encode_parts(tensor, hash_bytes, num_tokens,
                                                sealed=signer is not None, signer=signer)
        values: list[Any] = [(header, parts[0]), *parts[1:]]
        if signer is not None:  # the MAC covers the checksums: sealed before it
            return values, None
        assert isinstance(header, bytearray)
        return values, header_seal(header, parts)

    def header(self, value0: Any, *, hash_bytes: bytes, num_tokens: int,
               shape: tuple[int, ...], dtype: torch.dtype) -> ValueHeader:
        """The header at the start of value 0, checked to name this value before anything
        else is (another token count, hash, shape or dtype is foreign, whatever its parts)."""
        header = self.serde.read_header(value0)
        if header.num_tokens != num_tokens:
            raise ForeignEntryError(
                f"value holds {header.num_tokens} tokens, its key names {num_tokens}")
        check_identity(header, hash_bytes, shape, dtype)
        return header

    def check_and_decode(self, values: list[Any], digests: Sequence[int | None], *,
                         name: str, hash_bytes: bytes, num_tokens: int,
                         shape: tuple[int, ...], dtype: torch.dtype, out: Any,
                         refetch: Callable[[int], list[Any]]) -> int:
        """Checks one value's replies and decodes them into ``out``; the stored bytes read.
        ``refetch(part_count)``: every value of that many parts, fetched again."""
        head = values[0]
        header = self.header(head[0] if isinstance(head, list) else head,
                             hash_bytes=hash_bytes, num_tokens=num_tokens, shape=shape,
                             dtype=dtype)
        if header.part_count != len(values):
            values, digests = list(refetch(header.part_count)), [None] * header.part_count
            if any(v is None for v in values):
                raise CorruptEntryError("the header lists parts that are not there")
        elif any(v is None for v in values):
            raise IncompleteChunkError("a part of the value is missing (evicted or expired)")
        stored = [stored_part(header, i, v) for i, v in enumerate(values)]
        if self.integrity is not None:
            authenticate(self.integrity, name, header, stored, digests, UNVERIFIED)
        self.serde.decode_parts_into(header, stored, out, hash_bytes, shape, dtype,
                                     digests=digests)
        return sum(header.value_nbytes(i) for i in range(len(values)))


class Verdicts:
    """What a foreign or damaged value costs, counted under ``<prefix><kind><suffix>``
    (``what``: "chunk" or "page", in the log); see the module doc."""

    def __init__(self, metrics: Metrics, log: RateLimitedLogger, what: str, prefix: str,
                 suffix: str = "") -> None:
        self.metrics = metrics
        self._log = log
        self._what = what
        self._prefix = prefix
        self._suffix = suffix

    def settle(self, name: str, exc: ForeignEntryError | CorruptEntryError,
               delete: Callable[[], Any]) -> bool:
        """A value a check refused: `foreign` (left in place: True) or `damaged` (deleted:
        False)."""
        if isinstance(exc, ForeignEntryError):
            self.foreign(name, exc)
            return True
        self.damaged(name, exc, delete)
        return False

    def foreign(self, name: str, exc: ForeignEntryError) -> None:
        """A value of another release, or not the one its key names, or one this reader's
        `integrity_key` does not vouch for: a miss, left in place (DESIGN.md, "Redis
        layout": evolution), counted apart from damage."""
        kind = "unauthenticated" if isinstance(exc, UnauthenticatedEntryError) else "foreign"
        self.metrics.inc(f"{self._prefix}{kind}{self._suffix}")
        self._log.warning(kind, "%s %s %s left in place, not served: %s", kind, self._what,
                          name, exc)

    def damaged(self, name: str, exc: CorruptEntryError, delete: Callable[[], Any]) -> None:
        """A value with a part evicted (incomplete) or damaged (corrupt): counted and deleted,
        so that nobody trips on it again."""
        if isinstance(exc, IncompleteChunkError):
            self.metrics.inc(f"{self._prefix}incomplete{self._suffix}")
            logger.debug("dropping incomplete %s %s: %s", self._what, name, exc)
        else:
            self.metrics.inc(f"{self._prefix}corrupt{self._suffix}")
            self._log.warning("corrupt", "dropping corrupt %s %s: %s", self._what, name, exc)
        try:
            delete()
        except Exception as err:  # noqa: BLE001 - a failed clean-up must not turn a miss into an error
            self._log.warning("corrupt-delete", "could not delete a bad %s: %s", self._what,
                              err)
