"""SGLang HiCache: an L3 storage backend on Redis/Valkey (sglang 0.5.23).

SGLang's hierarchical cache keeps KV in the GPU (L1) and a host pool (L2); an L3 backend keeps
host-pool pages for other requests, processes and engines. This module is the only one that
imports SGLang (its base class, at import time). SGLang loads it without patches through its
`dynamic` backend factory:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "lmcache-remote",
        "module_path": "lmcache_remote.integrations.sglang", "class_name": "RedisHiCacheStorage",
        "interface_v1": 1, "remote_url": "redis://host:6379/0"}'

How SGLang drives it (its `HiCacheController`/`HybridCacheController`):

- `RedisHiCacheStorage(storage_config, kwargs)`: built once per rank. The extra config, less
  the keys SGLang or the factory use, configures it: `config_file` (a YAML file of `CacheConfig`
  fields, as `load_config`), any `CacheConfig` field (`remote_url`, `key_prefix`, `serde`,
  `remote_timeout`, `remote_ttl`, `integrity_key`, ...), `model_name` and `model_fingerprint`
  (as the vLLM connector's: docs/key-schema.md). A bad value raises `ConfigError` here, at
  start-up.
- `register_mem_pool_host(pool)`: the host pool whose pages the v1 calls name. It fixes the
  page geometry (attention kind, layout, dtype, page size, this rank's share, the page's memory
  regions as `get_page_buffer_meta` lists them) and with it the key family
  `{prefix}:hc1:{model}:{geometry}:{{page_hash}}` (`keys.PageKey`).
- `register_mem_host_pool_v2(pool, name)`: every host pool; a hybrid model's other pools
  (sliding window, Mamba, ...) are not served (SGLang's v2 calls are not implemented: such a
  model gets no reuse from Redis, never wrong KV): one WARNING says so at start-up.
- `batch_exists(keys)`: how many leading pages are in Redis (one round trip). SGLang takes the
  minimum over its ranks.
- `batch_set_v1(keys, host_indices)` / `batch_get_v1(keys, host_indices)` (`interface_v1` on):
  writes send the pages' values straight from the host pool's regions, reads receive them
  straight into the regions and check them there (the raw codec without an `integrity_key`;
  otherwise through a window of staging memory: `storage.pages.PageStore`); per page True or
  False, reads a leading run.
- `get`/`set`/`batch_get`/`batch_set`/`exists` (`interface_v1` off): SGLang's flat page
  tensors, under keys whose geometry says `flat` (their byte order differs from the regions').
- `clear()`: deletes this backend's pages (this model and geometry) with SCAN/UNLINK;
  `get_stats()`: SGLang's `StorageMetrics` of the calls since the last one; `close()`.

Never raises into SGLang from a data call: a failure (Redis down or slow past
`remote_timeout`, a damaged value, an unknown key) is a miss or a failed write, counted
(`stats()`) and logged at most every 10 s. Pages are never shared with the vLLM connector's
chunks: SGLang hashes pages (SHA-256, page by page) where the connector hashes 256-token chunks.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from lmcache_remote.config import CacheConfig, load_config, mask_url
from lmcache_remote.engine.reporting import new_engine_id
from lmcache_remote.errors import ConfigError, KeyFormatError
from lmcache_remote.naming.fingerprint import (
    FingerprintError,
    model_fingerprint,
    model_folder,
    model_name_of,
    namespace,
    resolve_fingerprint,
)
from lmcache_remote.naming.keys import PageKey, engine_stats_key
from lmcache_remote.storage.pages import PageStore
from lmcache_remote.storage.session.publisher import FieldValue, StatsPublisher
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger
from lmcache_remote.values.serde import dtype_name

logger = logging.getLogger(__name__)

#: Extra-config keys that SGLang's factory or controller reads, not this backend.
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1",
                "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                "hicache_storage_pass_prefix_keys", "tp_lcm_size")
_GB = 1e9
#: Fields this backend publishes for `lmcache-remote stats` (`{prefix}:engines:{id}`), and the
#: counters they copy: the fleet view's names, in tokens (pages x page size) and pages.
PUBLISHED = {
    "lookup_requests": "sglang.lookup_requests", "lookup_tokens": "sglang.lookup_tokens",
    "hit_tokens": "sglang.hit_tokens", "retrieve_tokens": "sglang.retrieve_tokens",
    "retrieved_tokens": "sglang.retrieved_tokens", "remote_hit_tokens": "sglang.retrieved_tokens",
    "store_tokens": "sglang.store_tokens", "stored_tokens": "sglang.stored_tokens",
    "remote_errors": "pages.errors", "remote_hit_chunks": "pages.hits",
    "remote_read_bytes": "pages.read_bytes", "remote_written_bytes": "pages.written_bytes",
    "remote_incomplete_chunks": "pages.incomplete", "remote_corrupt_chunks": "pages.corrupt",
    "remote_foreign_chunks": "pages.foreign",
    "remote_unauthenticated_chunks": "pages.unauthenticated",
}


class RedisHiCacheStorage(HiCacheStorage):
    """SGLang's `HiCacheStorage` on Redis/Valkey; see the module contract."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.zero_copy = bool(extra.get("interface_v1"))
        for name in _SGLANG_KEYS:
            extra.pop(name, None)
        self.storage_config = storage_config
        self.model_name_setting = _optional_str(extra.pop("model_name", None), "model_name")
        fingerprint = extra.pop("model_fingerprint", "auto")
        if not isinstance(fingerprint, str) or not fingerprint or any(
                c.isspace() for c in fingerprint):
            raise ConfigError("model_fingerprint", f"must be 'auto', 'off' or a string "
                              f"without spaces, got {fingerprint!r}")
        self.fingerprint_setting = fingerprint
        self.config: CacheConfig = load_config(extra.pop("config_file", None), **extra)
        if self.config.remote_url is None:
            raise ConfigError("remote_url", "the SGLang backend needs a Redis/Valkey URL")
        self.source = _model_source(storage_config)
        if not self.source and self.model_name_setting is None:
            raise ConfigError("model_name", "SGLang named no model: set model_name")
        if fingerprint == "auto" and model_folder(self.source) is None:
            raise ConfigError("model_fingerprint", f"cannot find the files of model "
                              f"{self.source!r} to fingerprint them: set model_fingerprint to "
                              "a string that names these weights, or to 'off'")
        self.metrics = Metrics()
        self.engine_id = new_engine_id()
        self._publisher: StatsPublisher | None = None
        self._started = time.time()
        self._log = RateLimitedLogger(logger)
        self._lock = threading.Lock()
        self._model: str | None = None
        self._pages: PageStore | None = None  # v1: the host pool's regions
        self._flat: PageStore | None = None  # interface_v1 off: SGLang's flat pages
        self.mem_pool_host: Any = None
        self._regions: _Regions | None = None
        self._window: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                                "prefetch_bandwidth": [],
                                                "backup_bandwidth": []}
        logger.info("lmcache-remote SGLang backend: %s, prefix %s, rank %s/%s%s",
                    mask_url(self.config.remote_url), self.config.key_prefix,
                    getattr(storage_config, "tp_rank", 0), getattr(storage_config, "tp_size", 1),
                    " (MLA)" if getattr(storage_config, "is_mla_model", False) else "")

    # -- registration -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Fixes the page geometry from the host pool (its first page's regions)."""
        super().register_mem_pool_host(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        self._regions = _Regions(mem_pool_host)
        model = self._model_namespace(mem_pool_host.dtype)
        if self.zero_copy:
            regions = self._regions
            self._pages = PageStore(self.config, (regions.count, regions.elements),
                                    mem_pool_host.dtype, mem_pool_host.page_size,
                                    metrics=self.metrics)
            self._pages_geometry = self._geometry(f"r{regions.count}x{regions.nbytes}")
            logger.info("lmcache-remote SGLang pages: %s:hc1:%s:%s:{page hash}",
                        self.config.key_prefix, model, self._pages_geometry)
        self._start_publisher()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers every host pool here (the KV pool too). A hybrid model's other pools
        (sliding window, Mamba/linear attention, indexer, draft) go to SGLang's v2 calls, which
        this backend does not implement: said once, at start-up (SGLang then writes nothing
        and hits nothing for requests that carry such a pool, and logs each failure)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name != "kv" and not getattr(self, "_warned_sidecar", False):
            self._warned_sidecar = True
            logger.warning(
                "lmcache-remote SGLang backend: this model has a %r host pool (a hybrid "
                "model): the backend stores and loads the KV pool only, not SGLang's "
                "sliding-window, Mamba/linear-attention, indexer or draft pools, so SGLang "
                "writes and hits nothing for this model's requests that carry one (it logs "
                "each as a failed backup or query). No wrong KV is served; this model gets "
                "no reuse from Redis. See docs/integrations.md.", name)

    def _start_publisher(self) -> None:
        """Publishes this backend's counters for `lmcache-remote stats` (fleet stats), unless
        `stats_publish_interval` is null; on its own thread, never in SGLang's way."""
        interval = self.config.stats_publish_interval
        store = self._pages or self._flat_store()
        if interval is None or store is None or self._publisher is not None:
            return
        key = engine_stats_key(self.config.key_prefix, self.engine_id)
        self._publisher = StatsPublisher(store, key, interval, self.published_fields,
                                         self.metrics)

    def published_fields(self) -> dict[str, FieldValue]:
        """The hash this backend publishes: its identity (role `sglang`) and counters."""
        cfg, pool = self.storage_config, self.mem_pool_host
        counters = self.metrics.counters()
        fields: dict[str, FieldValue] = {
            "engine_id": self.engine_id, "role": "sglang", "model_name": self._model or "?",
            "world_size": int(getattr(cfg, "tp_size", 1) or 1),
            "worker_id": int(getattr(cfg, "tp_rank", 0) or 0),
            "dtype": dtype_name(pool.dtype) if pool is not None else "?",
            "host": socket.gethostname(), "pid": os.getpid(),
            "started_at": round(self._started, 3), "updated_at": round(time.time(), 3)}
        for field, name in PUBLISHED.items():
            value = counters.get(name, 0)
            fields[field] = int(value) if float(value).is_integer() else value
        return fields

    def _model_namespace(self, dtype: torch.dtype) -> str:
        if self._model is None:
            name = self.model_name_setting or model_name_of(self.source)

            def compute() -> str:
                folder = model_folder(self.source)
                if folder is None:
                    raise FingerprintError(f"cannot find the files of model {self.source!r}")
                return model_fingerprint(folder, kv_dtype=dtype_name(dtype))

            try:
                fingerprint = resolve_fingerprint(self.fingerprint_setting, compute)
            except FingerprintError as exc:  # at start-up: SGLang's attach fails, naming it
                raise ConfigError("model_fingerprint", str(exc)) from exc
            self._model = namespace(name, fingerprint)
            logger.info("lmcache-remote: model namespace %s (model %s, model_fingerprint %s)",
                        self._model, self.source, self.fingerprint_setting)
        return self._model

    def _geometry(self, form: str) -> str:
        """The geometry field of this backend's page keys: what decides a page's bytes."""
        pool, cfg = self.mem_pool_host, self.storage_config
        mla = bool(getattr(cfg, "is_mla_model", False))
        fields = ["mla" if mla else "mha", str(pool.layout).replace("_", "-"),
                  dtype_name(pool.dtype), f"p{pool.page_size}"]
        tag = getattr(pool, "storage_format_tag", None)
        if tag:  # a host pool with a page format of its own (SGLang tags its model name)
            fields.append(re.sub(r"[^a-z0-9-]+", "-", str(tag).lower()))
        if not mla:
            fields.append(f"tp{cfg.tp_rank}of{cfg.tp_size}")
        for name, rank, size in (("pp", "pp_rank", "pp_size"), ("cp", "attn_cp_rank",
                                 "attn_cp_size"), ("dcp", "dcp_rank", "dcp_size")):
            if int(getattr(cfg, size, 1) or 1) > 1:
                fields.append(f"{name}{getattr(cfg, rank)}of{getattr(cfg, size)}")
        fields.append(form)
        return ".".join(fields)

    def _keys(self, hashes: Sequence[str], geometry: str) -> list[PageKey] | None:
        assert self._model is not None
        try:
            return [PageKey(self._model, geometry, str(h)) for h in hashes]
        except KeyFormatError as exc:
            self.metrics.inc("pages.bad_keys")
            self._log.warning("bad-key", "page key refused: %s", exc)
            return None

    # -- v1: zero-copy into the host pool ---------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        try:
            if self.zero_copy:
                store, geometry = self._pages, getattr(self, "_pages_geometry", "")
            else:
                store, geometry = self._flat_store(), getattr(self, "_flat_geometry", "")
            if store is None:
                return 0
            page_keys = self._keys(keys, geometry)
            found = store.present(page_keys) if page_keys else 0
            self._count("lookup", len(keys), found, store.page_tokens)
            return found
        except Exception as exc:  # noqa: BLE001 - never into SGLang
            return self._error("exists", exc, 0)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        return self._v1(False, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        return self._v1(True, keys, host_indices)

    def _v1(self, write: bool, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """`batch_set_v1` (`write`) or `batch_get_v1`: the pages' host pool regions straight to
        or from Redis; per page, whether it landed / was served."""
        start = time.perf_counter()
        try:
            store, regions = self._pages, self._regions
            page_keys = self._keys(keys, getattr(self, "_pages_geometry", ""))
            if store is None or regions is None or page_keys is None:
                return [False] * len(keys)
            pages = regions.pages(host_indices, len(keys))
            places = lambda i: [r.numpy().data for r in pages[i]]  # noqa: E731
            if write:
                done = store.write(page_keys, lambda i, page: regions.gather(pages[i], page),
                                   places=places)
            else:
                done = store.read(page_keys, lambda i, page: regions.scatter(pages[i], page),
                                  places=places)
        except Exception as exc:  # noqa: BLE001 - never into SGLang
            return self._error("set" if write else "get", exc, [False] * len(keys))
        self._note("backup" if write else "prefetch", sum(done), start, store.page_nbytes)
        self._count("store" if write else "retrieve", len(keys), sum(done), store.page_tokens)
        return done

    # -- the generic interface (interface_v1 off): flat page tensors ------------------------

    def _flat_store(self) -> PageStore | None:
        pool = self.mem_pool_host
        if pool is None:
            return None
        with self._lock:
            if self._flat is None:
                dummy = pool.get_dummy_flat_data_page()
                self._flat_geometry = self._geometry(f"flat{dummy.numel()}")
                self._flat = PageStore(self.config, (int(dummy.numel()),), dummy.dtype,
                                       pool.page_size, metrics=self.metrics)
            return self._flat

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        start = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * len(keys)
        try:
            store = self._flat_store()
            page_keys = self._keys(keys, getattr(self, "_flat_geometry", ""))
            if store is None or page_keys is None:
                return out
            targets = list(target_locations) if target_locations is not None else [
                torch.empty(store.page_shape, dtype=store.dtype) for _ in keys]

            def drain(i: int, page: torch.Tensor) -> None:
                targets[i].view(-1).copy_(page.view(-1))
                out[i] = targets[i]

            served = store.read(page_keys, drain)
            self._count("retrieve", len(keys), sum(served), store.page_tokens)
        except Exception as exc:  # noqa: BLE001
            return self._error("get", exc, [None] * len(keys))
        self._note("prefetch", sum(x is not None for x in out), start,
                   self._flat.page_nbytes if self._flat else 0)
        return out

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        start = time.perf_counter()
        try:
            store = self._flat_store()
            page_keys = self._keys(keys, getattr(self, "_flat_geometry", ""))
            if store is None or page_keys is None or values is None:
                return False
            pages = list(values)

            def fill(i: int, page: torch.Tensor) -> None:
                page.view(-1).copy_(pages[i].reshape(-1))

            landed = store.write(page_keys, fill)
            self._count("store", len(keys), sum(landed), store.page_tokens)
        except Exception as exc:  # noqa: BLE001
            return self._error("set", exc, False)
        self._note("backup", sum(landed), start, store.page_nbytes)
        return all(landed)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping -----------------------------------------------------------------------

    def clear(self) -> None:
        """Deletes this backend's pages (its model and geometries) under the prefix."""
        for store, geometry in ((self._pages, getattr(self, "_pages_geometry", None)),
                                (self._flat, getattr(self, "_flat_geometry", None))):
            if store is None or geometry is None:
                continue
            try:
                deleted = store.clear(self._model, geometry)
                logger.info("lmcache-remote: cleared %d page values of %s", deleted, geometry)
            except Exception as exc:  # noqa: BLE001
                self._error("clear", exc, None)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` of the calls since the last `get_stats`."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            window = {k: list(v) for k, v in self._window.items()}
            for values in self._window.values():
                values.clear()
        return StorageMetrics(prefetch_pgs=[int(x) for x in window["prefetch_pgs"]],
                              backup_pgs=[int(x) for x in window["backup_pgs"]],
                              prefetch_bandwidth=window["prefetch_bandwidth"],
                              backup_bandwidth=window["backup_bandwidth"])

    def stats(self) -> dict[str, Any]:
        """This backend's counters (`pages.*`: hits, misses, written, corrupt, errors, ...)."""
        return self.metrics.snapshot()

    def close(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close()  # a last publish, bounded by remote_timeout
        for store in (self._pages, self._flat):
            if store is not None:
                store.close()

    # -- internals --------------------------------------------------------------------------

    def _count(self, what: str, asked: int, done: int, page_tokens: int) -> None:
        """The fleet counters of one call, in tokens (pages x page size)."""
        m = self.metrics
        if what == "lookup":
            m.inc("sglang.lookup_requests")
            m.inc("sglang.lookup_tokens", asked * page_tokens)
            m.inc("sglang.hit_tokens", done * page_tokens)
        elif what == "retrieve":
            m.inc("sglang.retrieve_tokens", asked * page_tokens)
            m.inc("sglang.retrieved_tokens", done * page_tokens)
        else:
            m.inc("sglang.store_tokens", asked * page_tokens)
            m.inc("sglang.stored_tokens", done * page_tokens)

    def _note(self, what: str, pages: int, start: float, page_nbytes: int) -> None:
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._lock:
            self._window[f"{what}_pgs"].append(pages)
            self._window[f"{what}_bandwidth"].append(pages * page_nbytes / seconds / _GB)

    def _error(self, what: str, exc: BaseException, result: Any) -> Any:
        self.metrics.inc("pages.errors")
        self._log.warning(f"sglang-{what}", "lmcache-remote SGLang %s failed: %s: %s", what,
                          type(exc).__name__, exc)
        return result


class _Regions:
    """The host pool's page regions as byte views of its buffer (bounds-checked), from the
    pointers `get_page_buffer_meta` gives: every page has ``count`` regions of ``nbytes``."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.page_size = int(pool.page_size)
        buffer = pool.kv_buffer
        if not buffer.is_contiguous() or buffer.device.type != "cpu":
            raise ConfigError("hicache", "the host pool's buffer is not contiguous CPU memory")
        self.bytes = buffer.reshape(-1).view(torch.uint8)
        self.base = int(buffer.data_ptr())
        ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        if not ptrs or len(set(sizes)) != 1:
            raise ConfigError("hicache", f"unexpected page regions: {len(ptrs)} of {set(sizes)}")
        self.count = len(ptrs)
        self.nbytes = int(sizes[0])
        itemsize = pool.dtype.itemsize
        if self.nbytes % itemsize:
            raise ConfigError("hicache", f"a region of {self.nbytes} bytes is not whole values")
        self.elements = self.nbytes // itemsize

    def pages(self, host_indices: torch.Tensor, count: int) -> list[list[torch.Tensor]]:
        """Per page, its regions as uint8 views into the pool."""
        if len(host_indices) != count * self.page_size:
            raise ValueError(f"{len(host_indices)} host slots for {count} pages")
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != count * self.count or any(int(s) != self.nbytes for s in sizes):
            raise ValueError(f"the pool gave {len(ptrs)} regions for {count} pages")
        total = self.bytes.numel()
        views = []
        for ptr in ptrs:
            offset = int(ptr) - self.base
            if offset < 0 or offset + self.nbytes > total:
                raise ValueError("a page region lies outside the host pool")
            views.append(self.bytes[offset:offset + self.nbytes])
        return [views[i * self.count:(i + 1) * self.count] for i in range(count)]

    def gather(self, regions: list[torch.Tensor], page: torch.Tensor) -> None:
        out = page.view(-1).view(torch.uint8).view(self.count, self.nbytes)
        for r, region in enumerate(regions):
            out[r].copy_(region)

    def scatter(self, regions: list[torch.Tensor], page: torch.Tensor) -> None:
        src = page.view(-1).view(torch.uint8).view(self.count, self.nbytes)
        for r, region in enumerate(regions):
            region.copy_(src[r])


def _model_source(storage_config: Any) -> str:
    """Where the model comes from: SGLang's `--model-path` (its server arguments, published
    in every scheduler process), else the served model name the storage config carries
    (which SGLang suffixes with a host pool's format tag)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        path = getattr(get_server_args(), "model_path", None)
        if path:
            return str(path)
    except Exception:  # noqa: BLE001 - not published (a bare controller): the config's name
        pass
    return str(getattr(storage_config, "model_name", None) or "")


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(name, f"must be a non-empty string, got {value!r}")
    return value

