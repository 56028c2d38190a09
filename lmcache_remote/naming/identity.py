"""What a chunk's KV depends on beyond its tokens: the request's identity in its keys.

Token ids name the KV of a text request on one model. They do not name it when a request
carries a cache salt, a LoRA adapter (other weights), multimodal items (an image's placeholder
tokens are alike for every image) or prompt embeddings (the token ids are zeros). A
`RequestIdentity` holds those, and `hashing.chunk_hashes` folds them into the chained hash
(docs/key-schema.md, "Request identity", specifies it language-neutrally with golden vectors):

- the **salt** and the **adapter** seed the chain: `seed()` is 16 zero bytes (neither), the
  BLAKE2b-128 of the salt (a salt alone: as ever), or with an adapter
  `blake2b(salt_seed + adapter_fingerprint_ascii, digest_size=16, person=b"lmcr-adapter1")`;
- a chunk that overlaps a **multimodal item** or holds **prompt embeddings** gets *extras*
  (`extras(start, end)`): per overlapping item its modality, full identifier and its first
  placeholder's offset from the chunk's start (negative when the item began in an earlier
  chunk); the BLAKE2b-128 digest of its embedding rows. Such a chunk is hashed with a
  personalised BLAKE2b (`person=b"lmcr-chunk-x1"`) over `prev`, its token count, its tokens
  and the extras, so it can never share a hash with a text chunk; a chunk without extras is
  hashed exactly as a text chunk. Identity flows forward through `prev`.

A `RequestIdentity` is plain data (picklable): vLLM's scheduler builds it from the request and
sends it to the workers in the plan, so both derive the same keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import struct
from collections.abc import Sequence
from typing import Any

HASH_BYTES = 16
ZERO_SEED = bytes(HASH_BYTES)
EXTRAS_PERSON = b"lmcr-chunk-x1"
ADAPTER_PERSON = b"lmcr-adapter1"
EMBEDS_PERSON = b"lmcr-embeds1"
#: an adapter fingerprint (`fingerprint.adapter_fingerprint`) or one given by a setting
_ADAPTER_RE = re.compile(r"[\x21-\x7e]{1,128}")


def field_header(name: bytes, length: int) -> bytes:
    """What precedes a field's data: `len(name)` (uint64 LE), name, `length` (uint64 LE). The
    framing of every field here and in the fingerprints (`lmcache_remote.naming.fingerprint`)."""
    return struct.pack("<Q", len(name)) + name + struct.pack("<Q", length)


def field(name: bytes, data: bytes) -> bytes:
    """One framed field: `len(name)` (uint64 LE), name, `len(data)` (uint64 LE), data."""
    return field_header(name, len(data)) + data


def salt_seed(cache_salt: str | None) -> bytes:
    """The chain's starting `prev` of a request without adapter: zeros, or the BLAKE2b-128 of
    the salt's UTF-8 bytes."""
    if cache_salt is None:
        return ZERO_SEED
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=HASH_BYTES).digest()


@dataclasses.dataclass(frozen=True)
class MMItem:
    """One multimodal item of a request: its placeholders are tokens `[offset, offset +
    length)`; `identifier` names its content: with `kind` "identifier", vLLM's
    `MultiModalFeatureSpec.identifier`; with "content", a digest of its processed inputs."""

    modality: str
    identifier: str
    offset: int
    length: int
    kind: str = "identifier"

    def __post_init__(self) -> None:
        if not self.identifier or not self.modality:
            raise ValueError("a multimodal item needs a modality and an identifier")
        if self.kind not in ("identifier", "content"):
            raise ValueError(f"kind must be 'identifier' or 'content', got {self.kind!r}")
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"bad placeholder range: offset {self.offset}, "
                             f"length {self.length}")


@dataclasses.dataclass(frozen=True)
class EmbedsDigests:
    """The digests of a request's prompt-embedding rows, one per chunk of `chunk_size` rows
    (the last one of the rows left): `blake2b(rows_bytes, digest_size=16,
    person=b"lmcr-embeds1")`, the rows as stored, C order, little-endian, in `dtype`."""

    chunk_size: int
    dtype: str
    digests: tuple[bytes, ...]
    masks: tuple[bytes, ...] | None = None
    """A mixed prompt's positions per chunk, one byte each: 1 a token id, 0 an embedding."""


def embeds_digests(rows: Any, chunk_size: int, mask: Any = None) -> EmbedsDigests:
    """The per-chunk digests of a 2-D embeddings tensor (rows = positions); `mask` (a mixed
    prompt's: True where a token id stands) is kept per chunk beside them."""
    import torch  # the identity of a text request never needs it

    if not isinstance(rows, torch.Tensor) or rows.ndim != 2:
        raise ValueError("prompt embeddings must be a 2-D tensor (positions x hidden)")
    flat = rows.detach().to("cpu").contiguous()
    raw = flat.reshape(-1).view(torch.uint8).numpy()
    row_bytes = flat.shape[1] * flat.element_size()
    view = memoryview(raw).cast("B")  # type: ignore[arg-type]
    digests = []
    for start in range(0, flat.shape[0], chunk_size):
        end = min(start + chunk_size, flat.shape[0])
        digests.append(hashlib.blake2b(view[start * row_bytes:end * row_bytes],
                                       digest_size=HASH_BYTES, person=EMBEDS_PERSON).digest())
    masks = None
    if mask is not None:
        bits = bytes(1 if bool(m) else 0 for m in mask)
        if len(bits) != flat.shape[0]:
            raise ValueError(f"the token-id mask has {len(bits)} entries for "
                             f"{flat.shape[0]} embedding rows")
        masks = tuple(bits[i:i + chunk_size] for i in range(0, len(bits), chunk_size))
    return EmbedsDigests(chunk_size, str(rows.dtype).removeprefix("torch."), tuple(digests),
                         masks)


@dataclasses.dataclass(frozen=True)
class RequestIdentity:
    """Everything beyond token ids that a request's chunk keys bind (module docstring).

    `adapter` is the fingerprint of the adapter's files (`fingerprint.adapter_fingerprint`),
    never its name or path; `mm_items` sorted by offset; `embeds` the per-chunk digests of
    the prompt's embedding rows (its chunk size must be the one the chunks are cut with)."""

    cache_salt: str | None = None
    adapter: str | None = None
    mm_items: tuple[MMItem, ...] = ()
    embeds: EmbedsDigests | None = None

    def __post_init__(self) -> None:
        if self.adapter is not None and not _ADAPTER_RE.fullmatch(self.adapter):
            raise ValueError(f"adapter fingerprint {self.adapter!r}: 1-128 printable ASCII "
                             "characters, no spaces")
        offsets = [item.offset for item in self.mm_items]
        if offsets != sorted(offsets):
            raise ValueError("multimodal items must be sorted by offset")

    @property
    def plain(self) -> bool:
        """True when no chunk gets extras (a salt or adapter only seeds the chain)."""
        return not self.mm_items and self.embeds is None

    def seed(self) -> bytes:
        seed = salt_seed(self.cache_salt)
        if self.adapter is None:
            return seed
        return hashlib.blake2b(seed + self.adapter.encode("ascii"), digest_size=HASH_BYTES,
                               person=ADAPTER_PERSON).digest()

    def extras(self, start: int, end: int, chunk_size: int) -> bytes:
        """The framed extras of the chunk of tokens `[start, end)` (empty: none)."""
        out = []
        for item in self.mm_items:
            if item.offset >= end:
                break
            if item.offset + item.length > start:
                out.append(field(b"mm_modality", item.modality.encode("utf-8")))
                out.append(field(b"mm_" + item.kind.encode(), item.identifier.encode("utf-8")))
                out.append(field(b"mm_offset", struct.pack("<q", item.offset - start)))
        if self.embeds is not None:
            if self.embeds.chunk_size != chunk_size or start % chunk_size:
                raise ValueError(f"embeddings digested in chunks of {self.embeds.chunk_size}, "
                                 f"hashed in chunks of {chunk_size}")
            index = start // chunk_size
            if index >= len(self.embeds.digests):
                raise ValueError("more tokens than prompt embedding rows")
            out.append(field(b"embeds_dtype", self.embeds.dtype.encode("ascii")))
            out.append(field(b"embeds", self.embeds.digests[index]))
            if self.embeds.masks is not None:
                out.append(field(b"embeds_mask", self.embeds.masks[index]))
        return b"".join(out)


def as_identity(cache_salt: str | RequestIdentity | None) -> RequestIdentity | None:
    """A salt (or nothing) as a `RequestIdentity`; an identity as is."""
    if cache_salt is None or isinstance(cache_salt, RequestIdentity):
        return cache_salt
    return RequestIdentity(cache_salt=cache_salt)


def resolve(cache_salt: str | None, identity: RequestIdentity | None) -> RequestIdentity | None:
    """The identity of an engine call given `cache_salt=` and/or `identity=`."""
    if identity is None:
        return as_identity(cache_salt)
    if not isinstance(identity, RequestIdentity):
        raise ValueError(f"identity must be a RequestIdentity, got {type(identity).__name__}")
    if cache_salt is not None and cache_salt != identity.cache_salt:
        raise ValueError("cache_salt differs from identity.cache_salt: give one of them")
    return identity


def sorted_items(items: Sequence[MMItem]) -> tuple[MMItem, ...]:
    return tuple(sorted(items, key=lambda item: (item.offset, item.identifier)))
