"""Cache keys: the one module that builds and parses every Redis key of the project.

A chunk is named by a `CacheEngineKey` (model, world size, worker, dtype, chunk hash). Its Redis
key is

    {key_prefix}:v1:{model_name}:{world_size}:{worker_id}:{dtype}:{{chunk_hash}}

with literal braces around the hash: a Redis Cluster hash tag, so chunks spread over the slots
while every value of one chunk (the part keys `...}#1`, `...}#2`) shares a slot. The model name
is percent-escaped (`%`, `:`, `{`, `}`), so no name can split the key or move its hash tag, and
`to_string`/`from_string` round-trip every name. Nothing else in the project may put a `:` or a
brace into a key by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable
from typing import TypeVar

from lmcache_remote.errors import KeyFormatError

KEY_VERSION = "v1"
#: The segment of admission counts (`CacheEngineKey.store_count_key`).
COUNT_KEY_VERSION = "n1"
#: The segment of the pin registry (`pins_key`).
PINS_SEGMENT = "pins1"
#: The keep policy's state (docs/key-schema.md, "Keep"): `{prefix}:keep1:{prefix}:<part>`.
KEEP_SEGMENT = "keep1"
KEEP_PARTS = ("index", "meta", "ghosts", "figures")
_K = TypeVar("_K")
PART_SEP = "#"
_HASH_RE = re.compile(r"^[0-9a-f]{32}$")
_DTYPE_RE = re.compile(r"^[a-z][a-z0-9_]{1,31}$")
_ESCAPES = {"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"}
_UNESCAPE_RE = re.compile(r"%(25|3A|7B|7D)")
_UNESCAPES = {v[1:]: k for k, v in _ESCAPES.items()}
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


@functools.lru_cache(maxsize=256)
def escape_model_name(name: str) -> str:
    """Percent-escape the characters that would break a key: `%`, `:`, `{`, `}`. Cached: every
    chunk key of an engine escapes the same name, and per character it cost more than the rest
    of the key."""
    return "".join(_ESCAPES.get(ch, ch) for ch in name)


def unescape_model_name(escaped: str) -> str:
    stray = _UNESCAPE_RE.sub("", escaped)
    if any(ch in stray for ch in "%:{}"):
        raise KeyFormatError(f"bad escaping in model name {escaped!r}")
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPES[m.group(1)], escaped)


@dataclasses.dataclass(frozen=True)
class CacheEngineKey:
    """The identity of one chunk of KV: whose model, which rank, which dtype, which tokens."""

    model_name: str
    world_size: int
    worker_id: int
    dtype: str
    chunk_hash: str

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise KeyFormatError("model_name must be a non-empty string")
        for name in ("world_size", "worker_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise KeyFormatError(f"{name} must be a non-negative int, got {value!r}")
        if self.world_size < 1 or self.worker_id >= self.world_size:
            raise KeyFormatError(
                f"need 0 <= worker_id < world_size, got {self.worker_id}/{self.world_size}"
            )
        if not isinstance(self.dtype, str) or not _DTYPE_RE.match(self.dtype):
            raise KeyFormatError(f"dtype must be a torch dtype name, got {self.dtype!r}")
        if not isinstance(self.chunk_hash, str) or not _HASH_RE.match(self.chunk_hash):
            raise KeyFormatError(f"chunk_hash must be 32 lowercase hex digits: {self.chunk_hash!r}")

    @classmethod
    def of_valid(cls, model_name: str, world_size: int, worker_id: int, dtype: str,
                 chunk_hash: str) -> CacheEngineKey:
        """The key of fields its caller has already validated, without checking them again: a
        `KeyNamespace` checked its four fields once, and a 16-byte digest's hex is always a
        valid hash. Lookups build one key per chunk, and the checks (two regex matches) were
        the largest part of that."""
        key = object.__new__(cls)
        setattr_ = object.__setattr__  # the class is frozen
        setattr_(key, "model_name", model_name)
        setattr_(key, "world_size", world_size)
        setattr_(key, "worker_id", worker_id)
        setattr_(key, "dtype", dtype)
        setattr_(key, "chunk_hash", chunk_hash)
        return key

    @property
    def hash_bytes(self) -> bytes:
        return bytes.fromhex(self.chunk_hash)

    def to_string(self) -> str:
        """`model:world_size:worker_id:dtype:hash`, the model name escaped."""
        return (
            f"{escape_model_name(self.model_name)}:{self.world_size}:{self.worker_id}:"
            f"{self.dtype}:{self.chunk_hash}"
        )

    @classmethod
    def from_string(cls, s: str) -> CacheEngineKey:
        parts = s.split(":")
        if len(parts) != 5:
            raise KeyFormatError(f"expected 5 ':'-separated fields, got {s!r}")
        model, world, worker, dtype, chunk_hash = parts
        return cls(unescape_model_name(model), _int(world), _int(worker), dtype, chunk_hash)

    def redis_key(self, prefix: str) -> str:
        """The Redis key of the chunk's first (or only) value."""
        return (
            f"{prefix}:{KEY_VERSION}:{escape_model_name(self.model_name)}:{self.world_size}:"
            f"{self.worker_id}:{self.dtype}:{{{self.chunk_hash}}}"
        )

    def part_keys(self, prefix: str, count: int) -> list[str]:
        """The keys of a chunk kept as `count` values: the chunk key, then `#1`, `#2`, ..."""
        base = self.redis_key(prefix)
        return [base] + [f"{base}{PART_SEP}{i}" for i in range(1, count)]

    def store_count_key(self, prefix: str) -> str:
        """The chunk's admission count (`store_after`): how many times the fleet tried to
        store it, `{prefix}:n1:` and the chunk key's other fields, in the same hash tag (same
        Cluster slot as its values). It never matches `scan_pattern`."""
        return (
            f"{prefix}:{COUNT_KEY_VERSION}:{escape_model_name(self.model_name)}:"
            f"{self.world_size}:{self.worker_id}:{self.dtype}:{{{self.chunk_hash}}}"
        )

    @classmethod
    def from_redis_key(cls, prefix: str, key: str | bytes) -> CacheEngineKey:
        """Parse a chunk key (not a part key) under `prefix`; `KeyFormatError` otherwise."""
        text, body, brace, chunk_hash = _key_fields(prefix, KEY_VERSION, key, "chunk")
        if not brace:
            raise KeyFormatError(f"no {{hash}} tag in {text!r}")
        return cls.from_string(f"{body}:{chunk_hash}")


def _int(text: str) -> int:
    # ASCII only: str.isdigit() also accepts "²" (int() then fails) and "١" (int() gives 1,
    # so a key that is not canonical would parse)
    if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0"):
        raise KeyFormatError(f"expected a decimal integer, got {text!r}")
    return int(text)


def split_part_key(prefix: str, key: str | bytes) -> tuple[CacheEngineKey, int]:
    """(the chunk's key, the part index) of any value key under `prefix`."""
    return _split_part(prefix, key, CacheEngineKey.from_redis_key)


def _split_part(prefix: str, key: str | bytes, parse: Callable[[str, str], _K]
                ) -> tuple[_K, int]:
    """(the key ``parse`` makes of the value's base key, the part index) of a value key:
    ``base`` is part 0, ``base#i`` part ``i`` (``i`` canonical decimal, at least 1)."""
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    base, sep, index = text.rpartition(PART_SEP)
    if sep and base.endswith("}"):
        if not (index.isascii() and index.isdigit()) or index.startswith("0"):
            raise KeyFormatError(f"bad part index in {text!r}")
        return parse(prefix, base), int(index)
    return parse(prefix, text), 0


def _key_fields(prefix: str, version: str, key: str | bytes, kind: str
                ) -> tuple[str, str, str, str]:
    """(the key as text, the fields between ``{prefix}:{version}:`` and ``:{``, the ``:{``
    found or "", the hash tag's content) of a chunk or page key; `KeyFormatError` when it
    does not start with that head or end with ``}``."""
    text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    head = f"{prefix}:{version}:"
    if not text.startswith(head) or not text.endswith("}"):
        raise KeyFormatError(f"not a {kind} key under {prefix!r}: {text!r}")
    body, brace, tag = text[len(head):-1].rpartition(":{")
    return text, body, brace, tag


def _glob_escape(text: str) -> str:
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def scan_pattern(
    prefix: str,
    model_name: str | None = None,
    world_size: int | None = None,
    worker_id: int | None = None,
    dtype: str | None = None,
) -> str:
    """A SCAN MATCH pattern for chunk values under `prefix`, narrowed by the given fields.

    It matches part keys too; callers that count chunks keep the keys whose part index is 0.
    """
    fields = [
        escape_model_name(model_name) if model_name is not None else None,
        str(world_size) if world_size is not None else None,
        str(worker_id) if worker_id is not None else None,
        dtype,
    ]
    body = ":".join("*" if f is None else _glob_escape(f) for f in fields)
    return f"{_glob_escape(prefix)}:{KEY_VERSION}:{body}:{{*"


def prefix_pattern(prefix: str) -> str:
    """A SCAN MATCH pattern for every key the project writes under `prefix`."""
    return f"{_glob_escape(prefix)}:*"


ENGINES_SEGMENT = "engines"
_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


def engine_stats_key(prefix: str, engine_id: str) -> str:
    """The hash where engine `engine_id` publishes its counters: `{prefix}:engines:{id}`.

    It never matches `scan_pattern` (chunk keys are `{prefix}:v1:...`), so tools that count
    chunks never count it. `engine_id` is restricted to `[A-Za-z0-9_.-]`.
    """
    if not _ENGINE_ID_RE.match(engine_id):
        raise KeyFormatError(f"engine id must match {_ENGINE_ID_RE.pattern}, got {engine_id!r}")
    return f"{prefix}:{ENGINES_SEGMENT}:{engine_id}"


def engine_stats_pattern(prefix: str) -> str:
    """A SCAN MATCH pattern for every engine's published-counters hash under `prefix`."""
    return f"{_glob_escape(prefix)}:{ENGINES_SEGMENT}:*"


def relative_key(prefix: str, key: str | bytes) -> str:
    """`key` without its `{prefix}:` head (snapshots store keys relative to the prefix)."""
    text = key.decode("utf-8", "surrogateescape") if isinstance(key, bytes) else key
    head = f"{prefix}:"
    if not text.startswith(head):
        raise KeyFormatError(f"key {text!r} is not under prefix {prefix!r}")
    return text[len(head):]


def absolute_key(prefix: str, relative: str) -> str:
    """The inverse of `relative_key`: the key of `relative` under `prefix`."""
    return f"{prefix}:{relative}"


def pins_key(prefix: str) -> str:
    """The pin registry, a hash: `{prefix}:pins1` (docs/key-schema.md, "Pins"). It never
    matches `scan_pattern`."""
    return f"{prefix}:{PINS_SEGMENT}"


def keep_key(prefix: str, part: str) -> str:
    """One of the keep policy's keys: `{prefix}:keep1:{{prefix}}:<part>`, ``part`` one of
    `KEEP_PARTS` (the index of chunks held, their meta, the ghosts, the learned figures). The
    hash tag holds them all on one Cluster slot (its scripts touch several at once). They
    never match `scan_pattern`."""
    if part not in KEEP_PARTS:
        raise KeyFormatError(f"keep part must be one of {KEEP_PARTS}, got {part!r}")
    return f"{prefix}:{KEEP_SEGMENT}:{{{prefix}}}:{part}"


def keep_pattern(prefix: str) -> str:
    """A SCAN MATCH pattern for every key of the keep policy under `prefix`."""
    return f"{_glob_escape(prefix)}:{KEEP_SEGMENT}:*"


def store_count_pattern(prefix: str) -> str:
    """A SCAN MATCH pattern for every admission count under `prefix`."""
    return f"{_glob_escape(prefix)}:{COUNT_KEY_VERSION}:*"


PROBE_SEGMENT = "probe"


def probe_key(prefix: str, token: str) -> str:
    """A short-lived key under `prefix` that the access check writes and deletes at once:
    `{prefix}:probe:{token}` (a hash tag, so a cluster pipeline stays on one slot). It never
    matches `scan_pattern`. `token` is restricted to `[A-Za-z0-9_.-]`."""
    if not _ENGINE_ID_RE.match(token):
        raise KeyFormatError(f"probe token must match {_ENGINE_ID_RE.pattern}, got {token!r}")
    return f"{prefix}:{PROBE_SEGMENT}:{{{token}}}"


# --- pages: SGLang HiCache's page store -------------------------------------------------------

PAGE_KEY_VERSION = "hc1"
#: SGLang's page hashes are 64 lowercase hex digits (SHA-256); other engines' ids are allowed
#: as long as they stay inside a hash tag and a key field.
_PAGE_HASH_RE = re.compile(r"^[0-9A-Za-z_.\-]{1,128}$")
_GEOMETRY_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,199}$")


@dataclasses.dataclass(frozen=True)
class PageKey:
    """The identity of one page of an engine's host KV pool (SGLang HiCache): whose model, which
    page geometry, which page hash. Its Redis key is

        {key_prefix}:hc1:{model_name}:{geometry}:{{page_hash}}

    `geometry` names everything that decides a page's bytes besides its tokens (attention kind,
    host layout, dtype, page size, the rank's share, the regions of a page), so engines that lay
    pages out differently never read each other's bytes. The model name is escaped as in chunk
    keys; the page hash is the engine's own (SGLang's SHA-256 chain, 64 hex digits), in a
    Redis Cluster hash tag like a chunk hash. A page kept as several values uses the part keys
    `...}#1`, `...}#2` exactly as a chunk does."""

    model_name: str
    geometry: str
    page_hash: str

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise KeyFormatError("model_name must be a non-empty string")
        if not isinstance(self.geometry, str) or not _GEOMETRY_RE.match(self.geometry):
            raise KeyFormatError(f"bad page geometry {self.geometry!r}")
        if not isinstance(self.page_hash, str) or not _PAGE_HASH_RE.match(self.page_hash):
            raise KeyFormatError(f"bad page hash {self.page_hash!r}")

    def relative_key(self) -> str:
        """The key without its prefix: what a page value's identity digest covers."""
        return (f"{PAGE_KEY_VERSION}:{escape_model_name(self.model_name)}:{self.geometry}:"
                f"{{{self.page_hash}}}")

    def redis_key(self, prefix: str) -> str:
        return f"{prefix}:{self.relative_key()}"

    def part_keys(self, prefix: str, count: int) -> list[str]:
        base = self.redis_key(prefix)
        return [base] + [f"{base}{PART_SEP}{i}" for i in range(1, count)]

    @property
    def hash_bytes(self) -> bytes:
        """The 16 bytes a page value's header carries in its chunk-hash field: BLAKE2b-128 of
        `relative_key()`, so a value is served only under the key (prefix aside) it was
        written for (docs/value-format.md, "Pages")."""
        return hashlib.blake2b(self.relative_key().encode("utf-8"), digest_size=16).digest()

    @classmethod
    def from_redis_key(cls, prefix: str, key: str | bytes) -> PageKey:
        """Parse a page key (not a part key) under `prefix`; `KeyFormatError` otherwise."""
        text, body, brace, page_hash = _key_fields(prefix, PAGE_KEY_VERSION, key, "page")
        model, sep, geometry = body.rpartition(":")
        if not brace or not sep:
            raise KeyFormatError(f"not a page key: {text!r}")
        return cls(unescape_model_name(model), geometry, page_hash)


def page_scan_pattern(prefix: str, model_name: str | None = None,
                      geometry: str | None = None) -> str:
    """A SCAN MATCH pattern for page values under `prefix` (part keys included), narrowed by
    model and geometry. It never matches a chunk key (`scan_pattern`), nor the reverse."""
    fields = [escape_model_name(model_name) if model_name is not None else None, geometry]
    body = ":".join("*" if f is None else _glob_escape(f) for f in fields)
    return f"{_glob_escape(prefix)}:{PAGE_KEY_VERSION}:{body}:{{*"


def split_page_part_key(prefix: str, key: str | bytes) -> tuple[PageKey, int]:
    """(the page's key, the part index) of any page value key under `prefix`."""
    return _split_part(prefix, key, PageKey.from_redis_key)
