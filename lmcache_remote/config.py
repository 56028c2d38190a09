"""Configuration: `CacheConfig` and `load_config`.

`CacheConfig` is a frozen dataclass; building one validates every field and raises
`ConfigError` naming the first bad one, so a bad configuration fails at start-up, never in the
middle of inference. `load_config(path=None, **overrides)` merges, lowest first:

1. the defaults below;
2. a YAML file (`path`, or the file named by `LMCR_CONFIG`): a mapping of field names;
3. `LMCR_<FIELD>` environment variables (`LMCR_REMOTE_URL`, `LMCR_CHUNK_SIZE`, ...);
4. keyword overrides.

An unknown key in the file or in the overrides is a `ConfigError` too (a typo must not be
silently ignored). Environment strings are parsed by the field's type: `true/false/1/0/yes/no/
on/off` for booleans, `none`/`null`/empty for optional fields.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from lmcache_remote.errors import ConfigError
from lmcache_remote.urls import parse_remote_url
from lmcache_remote.values.integrity import check_source

GIB = 1024**3
ENV_PREFIX = "LMCR_"
ENV_CONFIG_FILE = "LMCR_CONFIG"
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CODECS = ("raw", "lz4", "lz4-planes", "zstd-planes", "blosc2-lz4", "blosc2-zstd")
_CERT_REQS = ("required", "optional", "none")
LOAD_POLICIES = ("pays", "always")
KEEP_POLICIES = ("learned", "redis")
#: Fields whose value a message never repeats: a key pasted there by mistake must not be logged.
_SECRET_FIELDS = frozenset({"integrity_key"})
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9.\-]{1,253}|[0-9A-Fa-f:.]{2,45})$")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Every knob of the cache, validated on construction. Sizes in GiB, times in seconds."""

    chunk_size: int = 256
    """Tokens per chunk; chunks are the unit of hashing, storage and hits."""
    remote_url: str | None = "redis://127.0.0.1:6379/0"
    """The Redis/Valkey URL (`redis://`, `rediss://`, `unix://`, `redis+cluster://`,
    `redis+sentinel://`; docs/deploy.md); None = no remote tier."""
    key_prefix: str = "lmcr"
    """First segment of every Redis key; the CLI touches keys under it only."""
    local_cpu: bool = True
    """Keep chunks in a local CPU tier (LRU by bytes) in front of Redis."""
    max_local_cpu_size: float = 5.0
    """GiB of CPU memory for chunks: the local tier and the write-behind queue share it."""
    serde: str = "raw"
    """Codec of values in Redis: `raw`, `lz4`, `lz4-planes` (byte planes, then lz4) or
    `zstd-planes` (byte planes, then zstd)."""
    remote_ttl: float | None = 30 * 24 * 3600.0
    """Expiry of values in Redis, in seconds (default 30 days). Beside bounding a value's life
    it lets a `volatile-lru` Redis evict it, and so pins work: under `volatile-*` a pinned
    chunk (no expiry) is never evicted (docs/pins.md). None = no expiry: then only an
    `allkeys-*` policy evicts, and pins cannot be honoured."""
    remote_lru_touch: bool = True
    """TOUCH in Redis the chunks a lookup promised or the local tier served (`storage.toucher`),
    which Redis never sees read: without it `allkeys-lru` evicts the most used prefixes first.
    False: no TOUCH is sent and no toucher thread starts (for a user without `+touch`, or to
    measure what the refresh is worth: `python -m soak --no-lru-touch`)."""
    store_after: int = 1
    """Admission: a chunk is written to Redis (and kept in the local tier) once the fleet has
    tried to store it this many times, counted in Redis beside the chunk (docs/pins.md). 1:
    every chunk is written at its first store; 2: a prompt seen once costs no write."""
    store_after_window: float = 24 * 3600.0
    """Seconds an admission count lives in Redis after its first try: a chunk tried fewer than
    `store_after` times within it starts again from zero."""
    keep_policy: str = "learned"
    """What Redis keeps (docs/keep.md): `learned` (the default) writes a chunk Redis lacks
    while there is room or while its class of chunks is read again often enough, and drops
    whole chunks itself, the one its class expects read again last first, learning both
    online from the fleet's traffic (figures kept in Redis); `redis` writes every chunk and
    leaves eviction to the server's `maxmemory-policy` (what earlier releases did)."""
    keep_budget: float | None = None
    """GiB of Redis the `learned` policy fills with chunks; None: `keep_fill` of the
    server's `maxmemory` (of every primary's, on a cluster)."""
    keep_fill: float = 0.95
    """With no `keep_budget`: the share of `maxmemory` the `learned` policy keeps Redis
    under, evicting whole chunks itself, so that the server's own eviction, which drops
    values one at a time, never has to run."""
    pin_budget: float = 1.0
    """GiB of chunks the fleet may pin (operators' pins and requests' retention together,
    counted in Redis); a pin past it is refused with a clear error."""
    max_retain_seconds: float = 24 * 3600.0
    """The longest a request may keep its prefix pinned through vLLM's `kv_transfer_params`:
    `lmcr_retain_seconds` is cut to it, and `lmcr_pin: true` asks for exactly it. Operators'
    pins (`lmcache-remote pin`) have no end."""
    save_unfull_chunk: bool = False
    """Also store the last, partial chunk of a request."""
    store_async: bool = True
    """Write to Redis from a background thread (write-behind); `flush()` drains it."""
    remote_timeout: float = 2.0
    """Bound, in seconds, on every remote call (connect, command, pipeline)."""
    unhealthy_backoff: float = 1.0
    """Seconds the remote tier is skipped after a failure (doubles up to 30 s while it fails)."""
    store_queue_size: float = 1.0
    """GiB of chunks the write-behind queue may hold; past it new writes are dropped and counted."""
    remote_part_size: int = 4 * 1024 * 1024 - 64 * 1024
    """The most raw bytes per Redis value, 4096 to 512 MiB: each chunk is cut into parts of at
    most this, sized to fill Redis's allocation size classes (`lmcache_remote.values.sizing`; the
    part plan in docs/value-format.md)."""
    serde_threads: int = 0
    """Threads for compression; 0 = one per CPU this process may use (its affinity mask,
    capped by its cgroup's CPU quota: `lmcache_remote.storage.local.cpus`), not one per core of the
    host."""
    remote_write_lanes: int = 8
    """Connections one store writes over at once on a single server (1-64). Eight, not four:
    with more connections sending at once redis-server spent 5-11% less CPU per byte written
    (docs/benchmarks.md). Each is a connection the process may hold: docs/deploy.md's
    connection count."""
    remote_read_lanes: int = 4
    """Connections one retrieve reads over at once on a single server (1-64); see
    `remote_write_lanes`."""
    require_native: bool = False
    """Fail at start-up (`ConfigError`) when the C extension `lmcache_remote.native._wire` (the
    native receive loop and row copier) is not there, instead of running the slower Python
    path; `LMCR_REQUIRE_NATIVE=1` sets it."""
    ssl_ca_certs: str | None = None
    """CA bundle for `rediss://` (also accepted as a URL query parameter)."""
    ssl_certfile: str | None = None
    """Client certificate for `rediss://`."""
    ssl_keyfile: str | None = None
    """Client key for `rediss://`."""
    ssl_cert_reqs: str = "required"
    """Server certificate check for `rediss://`: `required`, `optional` or `none`."""
    integrity_key: str | None = None
    """Where the integrity key is: `file:PATH` (a file holding it) or `env:NAME` (an
    environment variable holding it), at least 32 bytes; never the key itself (configurations
    get logged). With it values are written with a MAC (keyed BLAKE3 over header, parts and
    chunk key) and only values whose MAC verifies are served; others are misses, left in
    place (`remote.unauthenticated_chunks`). None: no MAC, Redis is trusted. The key is read
    when the remote tier starts (`lmcache_remote.values.integrity`); docs/reliability.md's threat
    model says what it protects."""
    save_only_first_rank: bool = False
    """MLA models only: every tensor-parallel rank holds the same latent KV, so rank 0 alone
    stores it (under world size 1, worker 0) and every rank loads that one copy."""
    stats_publish_interval: float | None = 5.0
    """Seconds between publishes of the engine's counters into Redis (`lmcache-remote stats`
    shows the fleet's hit rate from them); None = never publish."""
    metrics_port: int | None = None
    """Serve Prometheus metrics over HTTP on this port; None = off."""
    load_policy: str = "pays"
    """Which part of a hit is loaded: `pays` (the default) loads the prefix whose expected
    load time (the link's measured throughput and round trip) is shorter than computing it
    (this engine's measured prefill speed), nothing where computing is quicker, and probes a
    declined link now and then; `always` loads every hit (what earlier releases did).
    docs/load-decision.md."""
    link_gbps: float | None = None
    """The link's throughput to Redis in Gbit/s, when the fleet knows it: used instead of the
    measured figure. None: measured from this engine's loads."""
    link_rtt_ms: float | None = None
    """The link's round trip to Redis in milliseconds, when known; None: measured from this
    engine's lookups."""
    prefill_tokens_per_s: float | None = None
    """This engine's prefill speed in tokens a second, when known (at any context); None:
    measured from its own steps, by context length."""
    load_probe_interval: float = 10.0
    """Seconds after the last load before a declined link is probed with a one-chunk load."""
    metrics_host: str = "127.0.0.1"
    """The address the metrics endpoint listens on: loopback by default, so only this host can
    scrape it; `0.0.0.0` (or one interface's address) exposes it to the network."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), _field_types()[f.name])
        _validate(self)

    def __repr__(self) -> str:
        """The dataclass repr with the password in `remote_url` masked: configs get logged."""
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "remote_url" and value is not None:
                value = mask_url(value)
            shown.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GIB)

    @property
    def store_queue_bytes(self) -> int:
        return int(self.store_queue_size * GIB)

    @property
    def pin_budget_bytes(self) -> int:
        return int(self.pin_budget * GIB)


def _positive(cfg: CacheConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise ConfigError(name, f"must be a positive number, got {value!r}")


def _validate(cfg: CacheConfig) -> None:
    for name in ("chunk_size", "max_local_cpu_size", "remote_ttl", "remote_timeout",
                 "unhealthy_backoff", "store_queue_size", "remote_part_size"):
        _positive(cfg, name)
    _positive(cfg, "stats_publish_interval")
    for name in ("store_after_window", "pin_budget", "max_retain_seconds"):
        _positive(cfg, name)
    if cfg.store_after < 1:
        raise ConfigError("store_after", f"must be 1 or more, got {cfg.store_after}")
    for name in ("link_gbps", "link_rtt_ms", "prefill_tokens_per_s", "load_probe_interval"):
        _positive(cfg, name)
    if cfg.keep_policy not in KEEP_POLICIES:
        raise ConfigError("keep_policy", f"must be one of {', '.join(KEEP_POLICIES)}, got "
                          f"{cfg.keep_policy!r}")
    _positive(cfg, "keep_budget")
    if not 0.0 < cfg.keep_fill <= 1.0:
        raise ConfigError("keep_fill", f"must be in (0, 1], got {cfg.keep_fill!r}")
    if cfg.load_policy not in LOAD_POLICIES:
        raise ConfigError("load_policy", f"must be one of {', '.join(LOAD_POLICIES)}, got "
                          f"{cfg.load_policy!r}")
    if cfg.metrics_port is not None and not 1 <= cfg.metrics_port <= 65535:
        raise ConfigError("metrics_port", f"must be a port in 1..65535, got {cfg.metrics_port}")
    if not _HOST_RE.match(cfg.metrics_host):
        raise ConfigError("metrics_host", f"must be an IP address or host name, got "
                          f"{cfg.metrics_host!r}")
    if cfg.serde_threads < 0:
        raise ConfigError("serde_threads", f"must be >= 0, got {cfg.serde_threads}")
    for name in ("remote_write_lanes", "remote_read_lanes"):
        if not 1 <= getattr(cfg, name) <= 64:
            raise ConfigError(name, f"must be between 1 and 64, got {getattr(cfg, name)}")
    if not 4096 <= cfg.remote_part_size <= 512 * 1024 * 1024:
        raise ConfigError("remote_part_size", "must be between 4096 and 512 MiB (Redis's limit)")
    if not _PREFIX_RE.match(cfg.key_prefix):
        raise ConfigError("key_prefix", f"must match {_PREFIX_RE.pattern}, got {cfg.key_prefix!r}")
    if cfg.serde not in _CODECS:
        raise ConfigError("serde", f"must be one of {', '.join(_CODECS)}, got {cfg.serde!r}")
    if cfg.ssl_cert_reqs not in _CERT_REQS:
        raise ConfigError("ssl_cert_reqs", f"must be one of {', '.join(_CERT_REQS)}")
    if cfg.remote_url is not None:
        _check_url(cfg.remote_url)
    if cfg.integrity_key is not None:
        check_source(cfg.integrity_key)


def _check_url(url: str) -> None:
    """Validate through the one URL parser (lmcache_remote.urls); name the field, mask secrets."""
    try:
        parse_remote_url(url)
    except ConfigError as exc:
        detail = str(exc).removeprefix(f"{exc.field}: ")
        raise ConfigError("remote_url", f"{detail}; got {mask_url(url)!r}") from None


def mask_url(url: str) -> str:
    """The URL with any password replaced by `***` (for logs, errors and CLI output)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, qmark, query = rest.partition("?")
    userinfo, at, host = authority.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        authority = f"{user}:***@{host}" if colon else f"***@{host}"
    if qmark:
        query = re.sub(r"(^|&)((?:sentinel_)?password=)[^&]*", r"\1\2***", query)
    return f"{scheme}://{authority}{qmark}{query}"


@typing.no_type_check
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(CacheConfig)


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(the concrete type, whether None is allowed) of a field annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        concrete = [a for a in args if a is not type(None)]
        return concrete[0], True
    return annotation, False


def _check_type(name: str, value: Any, annotation: Any) -> None:
    typ, optional = _base_type(annotation)
    if value is None:
        if not optional:
            raise ConfigError(name, "must not be empty")
        return
    ok = isinstance(value, typ) and not (typ is not bool and isinstance(value, bool))
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        shown = "a value that is not shown" if name in _SECRET_FIELDS else repr(value)
        raise ConfigError(name, f"must be of type {typ.__name__}, got {shown}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_env(name: str, raw: str) -> Any:
    typ, optional = _base_type(_field_types()[name])
    text = raw.strip()
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        if typ is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(text)
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
    except ValueError:
        raise ConfigError(name, f"cannot parse {raw!r} as {typ.__name__}") from None
    return text


def _coerce(name: str, value: Any) -> Any:
    """YAML gives ints where floats are meant; accept those, keep everything else as is."""
    typ, _ = _base_type(_field_types()[name])
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(CacheConfig))


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config_file", f"cannot read {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("config_file", f"{path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError("config_file", f"{path} must hold a mapping of field names")
    return dict(data)


def _check_known(values: Mapping[str, Any], where: str) -> None:
    known = set(field_names())
    for key in values:
        if key not in known:
            raise ConfigError(str(key), f"unknown configuration key ({where})")


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> CacheConfig:
    """Defaults < YAML file < `LMCR_*` environment < `overrides`; validated."""
    merged: dict[str, Any] = {}
    path = path if path is not None else os.environ.get(ENV_CONFIG_FILE) or None
    if path is not None:
        from_file = _read_yaml(path)
        _check_known(from_file, f"in {path}")
        merged.update({k: _coerce(k, v) for k, v in from_file.items()})
    for name in field_names():
        raw = os.environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            merged[name] = _parse_env(name, raw)
    _check_known(overrides, "override")
    merged.update({k: _coerce(k, v) for k, v in overrides.items()})
    return CacheConfig(**merged)
