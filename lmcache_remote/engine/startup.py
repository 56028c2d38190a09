"""The start-up line: what the cache is doing, said once when it starts.

A cache that silently runs a slow path, another namespace than the operator thinks, or more
connections than Redis allows is hard to see from the outside. So each component logs one
INFO line when it starts (`announce`), formatted here (`startup_line`) and nowhere else:

- `CacheEngine` (role `engine`), the vLLM connector's worker side (role `vllm worker`, which
  builds its engine quietly and says more: the vLLM version and the KV layout it proved) and
  the vLLM scheduler's `PrefixLookup` (role `vllm scheduler`);
- the line gives the lmcache-remote version, the role, the namespace (the model field of the
  keys), whether the native receive loop and row copier are on (and why not), the vLLM
  version where vLLM is loaded, the KV layout found (vLLM worker), the most Redis
  connections the component holds (`storage.session.connection_count`, docs/deploy.md), the
  codec threads and the CPUs they follow, and the configuration with its secrets masked: the
  URL's passwords as `***`, `integrity_key` only as `set` (never the key, nor where it is
  read from);
- once per process for each role, namespace, key prefix and Redis: an engine built again in
  the same process (vLLM re-registering its caches, tests) stays quiet.

`check_native(config)` makes a missing C extension an error (`require_native`, or the
environment variable `LMCR_REQUIRE_NATIVE=1` however the config was built), naming why it
could not be imported.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator

from lmcache_remote import native
from lmcache_remote.config import CacheConfig, mask_url
from lmcache_remote.engine.decision import LoadDecision
from lmcache_remote.errors import ConfigError
from lmcache_remote.storage.local.cpus import available_cpus
from lmcache_remote.storage.session.connection_count import ConnectionCount
from lmcache_remote.version import __version__

__all__ = ["announce", "check_native", "masked_config", "quiet", "startup_line"]

#: The logger docs/deploy.md names (this module's name before it moved into `engine/`).
logger = logging.getLogger("lmcache_remote.startup")
_ANNOUNCED: set[tuple[str, str, str, str]] = set()
_LOCK = threading.Lock()
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("lmcr_startup_quiet",
                                                              default=False)
#: Fields never shown as they are: only whether they are set.
_SECRET_FIELDS = ("integrity_key",)


def check_native(config: CacheConfig) -> None:
    """Raise `ConfigError` (field `require_native`) when the C extension is required (the
    field, or `LMCR_REQUIRE_NATIVE=1`) and could not be imported."""
    required = config.require_native or os.environ.get("LMCR_REQUIRE_NATIVE", "").strip().lower() \
        in ("1", "true", "yes", "on")
    if required and native.wire is None:
        raise ConfigError(
            "require_native", f"the C extension lmcache_remote.native._wire is not available "
            f"({native.IMPORT_ERROR}); it is compiled when the package is installed, which "
            "needs gcc and the Python headers (python3-dev): reinstall with them, or set "
            "require_native false (and unset LMCR_REQUIRE_NATIVE) to run the Python path")


def masked_config(config: CacheConfig) -> dict[str, object]:
    """Every field, safe to log: passwords in `remote_url` masked, secrets as `set`."""
    shown: dict[str, object] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "remote_url" and value is not None:
            value = mask_url(value)
        elif f.name in _SECRET_FIELDS and value is not None:
            value = "set"
        shown[f.name] = value
    return shown


def native_state() -> str:
    """``on`` or ``off (why)`` for the receive loop, and the same for the row copier."""
    from lmcache_remote import connectors
    from lmcache_remote.storage.wire import bulk

    if native.wire is None:
        return f"native loop off, native rows off (C extension not built: {native.IMPORT_ERROR})"
    loop = "on" if bulk.NATIVE else "off (LMCR_NATIVE_WIRE=0)"
    rows = "on" if connectors.NATIVE_ROWS else "off (LMCR_NATIVE_ROWS=0)"
    return f"native loop {loop}, native rows {rows}"


def vllm_version() -> str | None:
    """The version of the vLLM loaded in this process (None when none is: never imported
    here)."""
    module = sys.modules.get("vllm")
    return None if module is None else str(getattr(module, "__version__", "unknown"))


def load_decision(config: CacheConfig) -> str:
    """The load decision's policy and the figures it starts from (set or prior)."""
    decision = LoadDecision.from_config(config)
    if decision.policy == "always":
        return "load policy always (every hit loaded)"
    return f"load policy pays, from {decision.figures().describe()}"


def startup_line(config: CacheConfig, *, role: str, namespace: str,
                 connections: ConnectionCount, kv_layout: str | None = None) -> str:
    """The one line; see the module docstring."""

    threads = config.serde_threads or available_cpus()
    parts = [f"lmcache-remote {__version__} {role} started: namespace {namespace!r}",
             native_state()]
    version = vllm_version()
    if version is not None:
        parts.append(f"vLLM {version}")
    if kv_layout is not None:
        parts.append(f"KV layout {kv_layout}")
    parts.append(f"connections <= {connections.describe()}")
    parts.append(f"serde threads {threads} ({available_cpus()} CPUs available)")
    parts.append(load_decision(config))
    shown = ", ".join(f"{k}={v!r}" for k, v in masked_config(config).items())
    parts.append(f"config: {shown}")
    return "; ".join(parts)


def announce(config: CacheConfig, *, role: str, namespace: str, connections: ConnectionCount,
             kv_layout: str | None = None) -> bool:
    """Log the start-up line at INFO, once per process for this role, namespace, prefix and
    Redis; False when it was said already or inside `quiet()`."""
    if _QUIET.get():
        return False
    url = mask_url(config.remote_url) if config.remote_url is not None else ""
    key = (role, namespace, config.key_prefix, url)
    with _LOCK:
        if key in _ANNOUNCED:
            return False
        _ANNOUNCED.add(key)
    logger.info("%s", startup_line(config, role=role, namespace=namespace,
                                   connections=connections, kv_layout=kv_layout))
    return True


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Components started inside announce nothing: their owner says it (the vLLM worker
    builds its engine inside, then announces itself with the layout it proved)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)
