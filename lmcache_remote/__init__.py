"""lmcache-remote: a Redis/Valkey-backed remote KV-cache tier for LLM inference.

The public API (fixed by DESIGN.md): `CacheConfig`, `load_config`, `EngineMetadata`,
`CacheEngine`, the KV views `PagedKV` and `DenseKV`, `CacheEngineKey`, and the errors.
Importing the package stays light: engine adapters live in `lmcache_remote.integrations` and
are imported only when used.

`from lmcache_remote import prometheus` (docs/metrics.md: the collector for your own registry)
is the documented path of `lmcache_remote.telemetry.prometheus`, imported when first asked for.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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

#: Modules documented at the package's root that live in a layer's folder: imported on first use,
#: so `import lmcache_remote` does not load prometheus_client.
_DOCUMENTED_MODULES = {"prometheus": "lmcache_remote.telemetry.prometheus"}


def __getattr__(name: str) -> ModuleType:
    if name in _DOCUMENTED_MODULES:
        return importlib.import_module(_DOCUMENTED_MODULES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
