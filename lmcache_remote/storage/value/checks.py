"""The checks a read applies to the values it received, and the MAC a write signs, used by
`path.ValuePath` (and so by chunks and pages alike).

- `stored_part`: the stored bytes of one part of a value as it was received (a fresh buffer,
  or in place as the list of its place's buffers), its length checked against the header;
  `CorruptEntryError` for anything else.
- `authenticate`: with an `integrity_key`, `UnauthenticatedEntryError` unless the value
  carries a MAC that verifies under the key for its name (the chunk key, or the page key
  without its prefix), header and parts. A failed MAC over a part that also fails its
  checksum (or length) is damage, `CorruptEntryError`; one over intact checksums was written
  without this key, or for another name: left in place by the caller.
- `signer_for`: what makes the MAC of a value written under a name (None without a key).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_remote.errors import CorruptEntryError, UnauthenticatedEntryError
from lmcache_remote.values.integrity import IntegrityKey
from lmcache_remote.values.value_format import Signer, ValueHeader, checksum


def stored_part(header: ValueHeader, index: int, value: Any) -> memoryview:
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


def authenticate(integrity: IntegrityKey, name: str, header: ValueHeader,
                 stored: Sequence[memoryview], digests: Sequence[int | None],
                 unverified: str) -> None:
    """Passes when the value's MAC verifies for ``name``; see the module doc. ``digests``:
    each part's checksum where already known, else None; ``unverified``: the message of the
    error for a MAC that does not verify over intact parts."""
    if header.tag is None:
        raise UnauthenticatedEntryError("written without the integrity key (no MAC)")
    if integrity.verify(name, header.signed, stored, header.tag):
        return
    for i, view in enumerate(stored):
        length, expected = header.parts[i]
        known = digests[i] if i < len(digests) else None
        if len(view) != length or (known if known is not None else checksum(view)
                                   ) != expected:
            raise CorruptEntryError(f"part {i} fails its checksum (and the MAC)")
    raise UnauthenticatedEntryError(unverified)


def signer_for(integrity: IntegrityKey | None, name: str) -> Signer | None:
    """What makes the MAC of the value written under ``name`` (bound to it), None without an
    `integrity_key`."""
    if integrity is None:
        return None
    return lambda signed, parts: integrity.tag(name, signed, parts)
