"""lmcache-remote: a Redis/Valkey-backed remote KV-cache tier for LLM inference.

The public API (fixed by DESIGN.md): `CacheConfig`, `load_config`, `EngineMetadata`,
`CacheEngine`, the KV views `PagedKV` and `DenseKV`, `CacheEngineKey`, and the errors.
Importing the package stays light: engine adapters live in `lmcache_remote.integrations` and
are imported only when used.
"""

from __future__ import annotations

from lmcache_remote.config import CacheConfig, load_config
from lmcache_remote.connectors import DenseKV, KVView, PagedKV
from lmcache_remote.engine import CacheEngine, EngineMetadata
from lmcache_remote.errors import (
    BackendError,
    BackendPermissionError,
    BackendTimeoutError,
    BackendUnavailableError,
    ConfigError,
    CorruptEntryError,
    ForeignEntryError,
    KeyFormatError,
    LmcrError,
    SerdeError,
    UnauthenticatedEntryError,
)
from lmcache_remote.naming.keys import CacheEngineKey
from lmcache_remote.version import __version__

__all__ = [
    "BackendError",
    "BackendPermissionError",
    "BackendTimeoutError",
    "BackendUnavailableError",
    "CacheConfig",
    "CacheEngine",
    "CacheEngineKey",
    "ConfigError",
    "CorruptEntryError",
    "ForeignEntryError",
    "DenseKV",
    "EngineMetadata",
    "KVView",
    "KeyFormatError",
    "LmcrError",
    "PagedKV",
    "SerdeError",
    "UnauthenticatedEntryError",
    "__version__",
    "load_config",
]
