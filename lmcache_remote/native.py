"""The optional C extension `lmcache_remote._wire` (lmcache_remote/_wire.c), imported in one
place: `wire` is the module, or None where it was not built (no compiler at install), and its
users (storage/wire.py's receive loop, serde's buffer addresses) then run their Python code."""

from __future__ import annotations

try:
    from lmcache_remote import _wire as wire
except ImportError:
    wire = None  # type: ignore[assignment]
