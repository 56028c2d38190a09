"""The native layer: the optional C extension `lmcache_remote.native._wire` (the `_wire*.c`
sources in this folder, one module), imported in one place, and `buffers` (a byte view's
address). `wire` is the module, or None where it was not built (no compiler at install), and
its users (storage/wire/bulk.py's receive loop, connectors' row copies, serde's buffer addresses)
then run their Python code.
`xxh3` is the one XXH3-64 every Python caller uses (serde's checksums, the wire's seals).

`DIGESTS` says whether the receive loop's checksums can stand in for serde's: the loop hashes
with the `xxhash` package's own XXH3 (its extension's exported function, found by path), which
must be there and give exactly what the package gives (checked here once, on inputs of every
length class XXH3 treats apart)."""

from __future__ import annotations

import xxhash

#: Why the extension could not be imported (None when it was): for the start-up line and for
#: `require_native`'s error.
IMPORT_ERROR: str | None = None
try:
    from lmcache_remote.native import _wire as wire
except ImportError as _exc:
    wire = None  # type: ignore[assignment]
    IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"


def _digests_agree() -> bool:
    if wire is None:
        return False
    try:
        import xxhash._xxhash as extension
    except ImportError:
        return False
    path = getattr(extension, "__file__", None)
    if not path or not wire.bind_xxh3(str(path)):
        return False
    sample = bytes(range(256)) * 17  # 4352 bytes: every length below takes another XXH3 path
    return all(wire.xxh3(sample[:n]) == xxhash.xxh3_64_intdigest(sample[:n])
               for n in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4352))


DIGESTS = _digests_agree()


def xxh3(data: object) -> int:
    """XXH3-64 (seed 0) of a buffer's bytes: the bound native function where `DIGESTS` (it
    keeps the GIL, about 20 us per MiB), else the xxhash package's (which gives the GIL up for
    big inputs: with another busy Python thread in the process each such call waited up to
    the 5 ms switch interval to get it back)."""
    if DIGESTS:
        return wire.xxh3(data)
    return xxhash.xxh3_64_intdigest(data)  # type: ignore[arg-type]
