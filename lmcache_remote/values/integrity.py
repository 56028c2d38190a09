"""The integrity key and the MAC of an authenticated value (docs/value-format.md, "Authenticated
values"; the threat model in docs/reliability.md).

Contract:

- `load_integrity_key(source)`: the key that `CacheConfig.integrity_key` names, `file:PATH`
  (the file's bytes) or `env:NAME` (the variable's value, UTF-8), leading and trailing ASCII
  whitespace removed, at least `MIN_KEY_NBYTES` bytes; None when ``source`` is None. Any
  problem is a `ConfigError` naming `integrity_key` and never holding a byte of the key. The
  key is never read from Redis, never written anywhere, and never shown: `IntegrityKey`'s repr
  hides it and it refuses to be pickled.
- `IntegrityKey(secret)`: the MAC key is derived from the configured secret (any length from
  `MIN_KEY_NBYTES` on) with BLAKE3's key derivation mode: ``K = BLAKE3-derive_key(KDF_CONTEXT,
  secret)``, 32 bytes; only ``K`` is kept.
- `IntegrityKey.tag(name, signed_header, parts)`: keyed BLAKE3 under ``K``, 32 bytes, of
  ``DOMAIN || u32le(len(name)) || name || signed_header || parts[0] || ... || parts[n-1]``,
  where ``name`` is the chunk key without its prefix (`CacheEngineKey.to_string`, UTF-8),
  ``signed_header`` the header bytes before the tag and ``parts`` the stored parts. The header
  holds the part count and every stored length, so the concatenation is unambiguous; the name
  binds the value to its key (model, world size, rank, dtype, chunk hash), so a valid value
  moved under another key, or parts mixed between chunks, do not verify.
- `IntegrityKey.verify(...)`: the same, compared in constant time.

Keyed BLAKE3 is a PRF, hence a MAC (the BLAKE3 specification's keyed mode, which it offers
as a MAC in place of HMAC; BLAKE3 targets 128-bit security in all modes; the tag is 32
bytes). It runs at 3-5.5 GB/s on one core of the benchmark box (AVX-512; HMAC-SHA256 over
OpenSSL with SHA extensions: 1.5-1.7 GB/s there), releases the GIL on large updates, and is
not made faster by its own threads (``max_threads``) on two busy cores (benchmarks/reading.md,
"The integrity key"). It needs the `blake3` package (a dependency; imported only when a key
is loaded, so an environment that lacks it still runs without a key).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import stat
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from lmcache_remote.errors import ConfigError

logger = logging.getLogger(__name__)

#: Bytes of key material a key must have at least (256 bits, BLAKE3's key size).
MIN_KEY_NBYTES = 32
#: Prefixes the MAC's input with the construction's name and version.
DOMAIN = b"LMCR-MAC-1\x00"
#: BLAKE3's key derivation context: the MAC key is ``BLAKE3-derive_key(KDF_CONTEXT, secret)``.
KDF_CONTEXT = "lmcache-remote 2026-12-02 integrity key v1: the MAC key of cached KV values"
#: The forms `integrity_key` accepts; anything else is refused (a key given inline in a config
#: would be logged with it).
SOURCE_RE = re.compile(r"^(?:file:.+|env:[A-Za-z_][A-Za-z0-9_]*)$", re.DOTALL)
_FIELD = "integrity_key"
_WHITESPACE = b" \t\r\n"


class IntegrityKey:
    """A loaded key. Never shows its bytes: not in repr, not in str, not through pickle."""

    __slots__ = ("_blake3", "_key")

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_NBYTES:
            raise ConfigError(_FIELD, f"the key must be at least {MIN_KEY_NBYTES} bytes")
        try:
            from blake3 import blake3
        except ImportError:
            raise ConfigError(_FIELD, "needs the `blake3` package (a dependency of "
                              "lmcache-remote: pip install 'blake3>=1.0')") from None
        self._blake3: Any = blake3
        self._key = blake3(bytes(key), derive_key_context=KDF_CONTEXT).digest()

    def __repr__(self) -> str:
        return "IntegrityKey(<hidden>)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("an IntegrityKey is not pickled: each process loads it from its source")

    def tag(self, name: str, signed_header: Any, parts: Sequence[Any]) -> bytes:
        """The 32-byte MAC of a value (see the module contract)."""
        encoded = name.encode("utf-8")
        mac = self._blake3(DOMAIN, key=self._key)
        mac.update(struct.pack("<I", len(encoded)))
        mac.update(encoded)
        mac.update(signed_header)
        for part in parts:
            mac.update(part)
        return bytes(mac.digest())

    def verify(self, name: str, signed_header: Any, parts: Sequence[Any], tag: bytes) -> bool:
        """Whether ``tag`` is the MAC of this value under this key (constant-time compare)."""
        return hmac.compare_digest(self.tag(name, signed_header, parts), tag)


def check_source(source: str) -> None:
    """`ConfigError` unless ``source`` is `file:PATH` or `env:NAME`; the message never repeats
    the value (it may be a key pasted inline)."""
    if not SOURCE_RE.match(source):
        raise ConfigError(_FIELD, "must be `file:PATH` (a file holding the key) or `env:NAME` "
                          "(an environment variable holding it); the key itself is never "
                          "given inline, since configurations get logged")


def load_integrity_key(source: str | None) -> IntegrityKey | None:
    """The key ``source`` names, or None for None (see the module contract)."""
    if source is None:
        return None
    check_source(source)
    kind, _, where = source.partition(":")
    if kind == "file":
        key = _read_file(Path(where))
        origin = f"the key file {where}"
    else:
        value = os.environ.get(where)
        if value is None:
            raise ConfigError(_FIELD, f"the environment variable {where} is not set")
        key = value.encode("utf-8")
        origin = f"the environment variable {where}"
    key = key.strip(_WHITESPACE)
    if len(key) < MIN_KEY_NBYTES:
        raise ConfigError(_FIELD, f"{origin} holds fewer than {MIN_KEY_NBYTES} bytes of key "
                          "(make one with `openssl rand -hex 32`)")
    return IntegrityKey(key)


def _read_file(path: Path) -> bytes:
    try:
        key = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(_FIELD, f"cannot read the key file {path}: {exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("the integrity key file %s can be read by others than its owner "
                       "(mode %o): chmod 600 it", path, stat.S_IMODE(mode))
    return key
