"""CacheEngine: the library's front door for inference engines.

Who calls what, and what each call promises:

- `store(tokens, kv, mask=None, *, cache_salt=None) -> int`: cut the masked tokens into chunks,
  skip those already held (one Redis round trip to ask), copy the rest out of `kv` in one
  batch into CPU memory objects, keep them in the local tier and hand them to Redis (through
  the write-behind queue with `store_async`). Returns the number of tokens, in the masked
  range, whose chunks the cache now holds or has queued: a prefix, cut where memory ran out.
  Never raises for a remote failure (a dropped write, counted); raises `ValueError` for bad
  input (tokens, mask, a KV view that does not match the metadata).
- `retrieve(tokens, kv, mask=None, *, cache_salt=None) -> torch.Tensor`: a bool tensor of
  `len(tokens)`, True where KV was written into `kv`: always a prefix of the masked range,
  ending at the first chunk that is missing or fails a check. Tokens not reported as hits are
  never written. A remote failure is a miss.
- `lookup(tokens, *, cache_salt=None) -> int`: leading tokens retrievable now. In a fault-free
  run a `retrieve` of the same tokens that follows delivers them all, whatever the state of the
  local tier (a full one evicts for the load). When it does not (Redis evicted a chunk in
  between, a bad value, no memory), the tokens lost are counted in
  `engine.promise_broken_tokens` and logged (WARNING, rate-limited), with the counters that say
  why (`memory.no_room_chunks`, `remote.miss_chunks`, `remote.incomplete_chunks`,
  `remote.corrupt_chunks`, `remote.foreign_chunks`, `remote.unauthenticated_chunks`,
  `remote.errors`).
- `store_layer(...)` / `retrieve_layer(...)`: the same as `store` / `retrieve`, one layer per
  step (generators), so that a layer's copy overlaps the engine's compute of the next layer;
  they read and write exactly the chunks (keys and bytes) of the whole-request calls.
  The step protocol is in their docstrings.
- Each of these calls also takes `identity=` (`lmcache_remote.naming.identity.RequestIdentity`): a
  request whose KV depends on more than its tokens (a LoRA adapter, multimodal items, prompt
  embeddings; its salt too) is named by it (docs/key-schema.md). `cache_salt=` alone is
  `identity=RequestIdentity(cache_salt=...)`.
- `pin(tokens, *, seconds=None)`: pin the full chunks of `tokens` in Redis (for ever, or for
  `seconds`), within the fleet's `pin_budget`, once the writes queued before have landed:
  Redis never evicts them under a `volatile-*` policy (docs/pins.md). `store(...,
  retain=seconds)` (and `store_layer`) pins the request's prefix that way after its store,
  for at most `max_retain_seconds` (a request's ask, bounded by the operator). A
  pin the budget refuses is counted (`pins.refused_chunks`) and logged, never raised.
- `flush()`: wait (bounded) until queued Redis writes landed or were dropped.
- `freeze(True)`: no stores (each `store` returns 0) while reads go on; `freeze(False)` ends it.
- `stats()`: counters and gauges as plain dicts.
- `check_remote()`: check now that Redis answers and this client's ACL user may use the cache
  (raises `BackendPermissionError` & co.); the engine runs it once at start-up and only logs.
- `close()` (or leaving the `with` block): flush, stop the writer thread, free memory.

Thread safety: every method may be called from several threads at once; the tiers, the pool
and the counters are locked internally and a store and a retrieve of the same chunk never see
half a chunk (a chunk's buffer is filled before it is published to any tier).

MLA with `save_only_first_rank`: every tensor-parallel rank holds the same latent KV, so every
rank names chunks with world size 1 and worker 0 (the key of a single-rank engine: the latent
does not depend on the parallelism), only worker 0 stores (the others' `store` and
`store_layer` store nothing and report 0), and every rank loads that one copy.

At start-up the engine logs one INFO line (`engine.startup`, on the logger
`lmcache_remote.startup`): version, namespace, native loop, connection count and the configuration
with its secrets masked; with `require_native` a missing C extension is a `ConfigError`.

The engine starts while Redis is down: the start-up check logs a warning, redis-py connects
lazily, and a failed call only opens the health gate's back-off, after which the next call
probes Redis again. Faults, what each costs and what is counted: docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

import torch

from lmcache_remote.config import CacheConfig
from lmcache_remote.connectors import KVView
from lmcache_remote.engine import startup
from lmcache_remote.engine.decision import ChunkDecisions, LoadDecision
from lmcache_remote.engine.metadata import EngineMetadata, key_namespace
from lmcache_remote.engine.promises import PromiseLedger
from lmcache_remote.engine.reporting import EngineReporter
from lmcache_remote.engine.store_batch import StoreBatch, present
from lmcache_remote.errors import (
    BackendPermissionError,
    BackendTimeoutError,
    BackendUnavailableError,
)
from lmcache_remote.naming.hashing import ChunkSpec, TokenDatabase, tokens_to_array
from lmcache_remote.naming.identity import RequestIdentity, resolve
from lmcache_remote.storage.manager.storage_manager import StorageManager
from lmcache_remote.storage.session.connection_count import engine_connections
from lmcache_remote.storage.wire.windows import byte_windows
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

__all__ = ["CacheEngine", "EngineMetadata"]

logger = logging.getLogger(__name__)
#: Bytes of chunks a store copies before it hands them to the write-behind queue
#: (`CacheEngine.store_windows`): the writer thread writes them while the next are copied.
STORE_WINDOW_BYTES = 16 * 1024 * 1024
#: Counters that say why a retrieve delivered less than its lookup promised.
_BREAK_REASONS = ("memory.no_room_chunks", "remote.pool_full", "remote.miss_chunks",
                  "remote.incomplete_chunks", "remote.corrupt_chunks", "remote.foreign_chunks",
                  "remote.unauthenticated_chunks", "remote.errors")


class CacheEngine:
    """Stores and retrieves chunks of KV for one engine rank. Thread-safe."""

    def __init__(self, config: CacheConfig, metadata: EngineMetadata) -> None:
        startup.check_native(config)  # before any thread starts
        self.config = config
        self.metadata = metadata
        self.layout = metadata.layout
        self.metrics = Metrics()
        shared = metadata.use_mla and config.save_only_first_rank
        self._stores_here = not shared or metadata.worker_id == 0
        self.token_db = TokenDatabase(
            key_namespace(metadata, shared), config.chunk_size, config.save_unfull_chunk
        )
        self.storage = StorageManager(config, self.layout, self.metrics)
        ns = self.token_db.namespace
        self.reporter = EngineReporter(config, ns.model_name, ns.world_size, ns.worker_id,
                                       ns.dtype, self.metrics, self.storage)
        self._promises = PromiseLedger()
        #: how much of a hit to load (`engine.decision`): the link as this engine measures it,
        #: the prefill as its caller reports it (`record_prefill`)
        self.decisions = ChunkDecisions(
            LoadDecision.from_config(config, link=self.storage.link),
            self.layout.nbytes(config.chunk_size) / config.chunk_size,
            self.storage.local_prefix, self.metrics)
        self._log = RateLimitedLogger(logger)
        self._frozen = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._check_remote_at_start()
        startup.announce(config, role="engine", namespace=ns.model_name,
                         connections=engine_connections(config))

    def rename_model(self, model_name: str) -> None:
        """From now on every key names `model_name` (vLLM's connector calls it when the
        weights change under a running engine: KV computed before must not be found under the
        new name, nor the new KV under the old one). Calls already running finish under the
        old name; chunks stored under it stay there for engines that still use it."""
        namespace = dataclasses.replace(self.token_db.namespace, model_name=model_name)
        self.metadata = dataclasses.replace(self.metadata, model_name=model_name)
        self.token_db = TokenDatabase(namespace, self.config.chunk_size,
                                      self.config.save_unfull_chunk)

    # -- context manager --------------------------------------------------------------------

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- public API -------------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        return self._frozen

    def freeze(self, enabled: bool = True) -> None:
        """While frozen, `store` stores nothing (returns 0); reads are served as usual."""
        self._frozen = enabled

    def lookup(self, tokens: Any, *, cache_salt: str | None = None,
               identity: RequestIdentity | None = None, load_policy: str | None = None) -> int:
        """Leading tokens worth retrieving now: held (local tier or Redis) and, under the
        `load_policy` (`load_policy=` overrides the configuration's for this call), cheaper
        to load than to compute (`engine.decision`); the retrieve that follows loads exactly
        these. Tokens held but left to compute are counted in `engine.declined_tokens`, and
        still count as hits of the cache (`engine.lookup_hit_tokens`: what it holds)."""
        start = time.perf_counter()
        specs = self.token_db.prefix_keys(tokens, resolve(cache_salt, identity))
        held = self.storage.leading_chunks(specs)
        hits = self.decisions.cut(specs[:held], load_policy, remember=True) if held else 0
        hit_tokens = specs[hits - 1].end if hits else 0
        if hits:
            self._promises.promise(specs[hits - 1])
        self.metrics.inc("engine.lookup_requests")
        self.metrics.inc("engine.lookup_tokens", specs[-1].end if specs else 0)
        self.metrics.inc("engine.lookup_hit_tokens", specs[held - 1].end if held else 0)
        self.metrics.observe("engine.lookup_seconds", time.perf_counter() - start)
        return hit_tokens

    def store(
        self, tokens: Any, kv: KVView, mask: Any = None, *, cache_salt: str | None = None,
        identity: RequestIdentity | None = None, retain: float | None = None,
    ) -> int:
        start = time.perf_counter()
        specs = self.token_db.chunks(tokens, mask, resolve(cache_salt, identity), for_store=True)
        self.metrics.inc("engine.store_requests")
        if not specs:
            return 0
        if self._skips_store(specs):
            return 0
        self._check_view(kv)
        accepted = self._store_specs(specs, kv)
        self._retain(tokens, resolve(cache_salt, identity), specs, retain)
        self.metrics.inc("engine.store_tokens", specs[-1].end - specs[0].start)
        self.metrics.inc("engine.stored_tokens", accepted)
        self.metrics.observe("engine.store_seconds", time.perf_counter() - start)
        return accepted

    def retrieve(
        self, tokens: Any, kv: KVView, mask: Any = None, *, cache_salt: str | None = None,
        identity: RequestIdentity | None = None, load_policy: str | None = None,
    ) -> torch.Tensor:
        start = time.perf_counter()
        arr = tokens_to_array(tokens)
        specs = self.token_db.chunks(arr, mask, resolve(cache_salt, identity), for_store=False)
        ret = torch.zeros(len(arr), dtype=torch.bool)
        self.metrics.inc("engine.retrieve_requests")
        if not specs:
            return ret
        self._check_view(kv)
        wanted = self.decisions.cut(specs, load_policy, remember=False)
        objs = self.storage.fetch(specs[:wanted]) if wanted else []
        self._check_promise(specs, len(objs))
        try:
            hit = specs[: len(objs)]
            if hit:
                kv.scatter([(s.start, s.end) for s in hit], [o.tensor for o in objs])
                ret[hit[0].start: hit[-1].end] = True
        finally:
            for obj in objs:
                obj.release()
        hit_tokens = hit[-1].end - hit[0].start if hit else 0
        self.metrics.inc("engine.retrieve_tokens", specs[-1].end - specs[0].start)
        self.metrics.inc("engine.retrieved_tokens", hit_tokens)
        self.metrics.observe("engine.retrieve_seconds", time.perf_counter() - start)
        return ret

    def store_layer(
        self, tokens: Any, kv: KVView, mask: Any = None, *, cache_salt: str | None = None,
        identity: RequestIdentity | None = None, retain: float | None = None,
    ) -> Generator[int | None, None, None]:
        """`store`, one layer per step: a generator the caller advances with `next()`.

        Protocol (`L` = the number of layers):

        - the call itself validates the input (`ValueError` at once, as `store`) and copies
          nothing;
        - `next()` number `l` (0 <= l < L) copies layer `l` of every chunk that needs writing
          out of `kv` into CPU buffers and yields None; the first one also decides which
          chunks need writing (one Redis round trip, as `store`);
        - `next()` number `L` hands the complete chunks to the tiers exactly as `store` does
          (same keys, same bytes) and yields the number of tokens accepted, `store`'s result;
          the generator is then exhausted.

        Layer `l`'s KV must be final in `kv` when step `l` runs (vLLM's `save_kv_layer` is
        called right after the layer's attention wrote it). Closing the generator early
        (`close()`, or dropping it) stores nothing and frees the buffers. When nothing is to
        be stored (frozen, no full chunk, another rank stores for this one), every step is a
        no-op and the last yields 0.
        """
        start = time.perf_counter()
        specs = self.token_db.chunks(tokens, mask, resolve(cache_salt, identity), for_store=True)
        self.metrics.inc("engine.store_requests")
        if self._skips_store(specs):
            return self._idle_layers(0)
        self._check_view(kv)
        return self._store_layers(specs, kv, start,
                                  lambda: self._retain(tokens, resolve(cache_salt, identity),
                                                       specs, retain))

    def retrieve_layer(
        self, tokens: Any, kv: KVView, mask: Any = None, *, cache_salt: str | None = None,
        identity: RequestIdentity | None = None, load_policy: str | None = None,
    ) -> Generator[torch.Tensor, None, None]:
        """`retrieve`, one layer per step: a generator the caller advances with `next()`.

        Protocol (`L` = the number of layers); every step yields the same bool tensor of
        `len(tokens)` entries, True for the tokens this retrieve writes (`retrieve`'s result):

        - the call itself validates the input (`ValueError` at once, as `retrieve`);
        - `next()` number 0 fetches the chunks (local tier, then one Redis pipeline): the hit
          run is fixed from here on and the yielded mask already shows it, but nothing has been
          written into `kv` yet;
        - `next()` number `l + 1` (0 <= l < L) writes layer `l` of the hit chunks into `kv`;
          the last one (`l = L - 1`) also releases the chunk buffers, and the generator is
          then exhausted.

        Tokens that are not hits are never written. A generator closed before its last step
        has written only the layers stepped so far: the caller must treat the hit tokens as
        not loaded. A remote failure is a miss (a shorter mask), as in `retrieve`.
        """
        start = time.perf_counter()
        arr = tokens_to_array(tokens)
        specs = self.token_db.chunks(arr, mask, resolve(cache_salt, identity), for_store=False)
        self.metrics.inc("engine.retrieve_requests")
        if specs:
            self._check_view(kv)
        wanted = self.decisions.cut(specs, load_policy, remember=False)
        return self._retrieve_layers(len(arr), specs, wanted, kv, start)

    def pin(self, tokens: Any, *, cache_salt: str | None = None,
            identity: RequestIdentity | None = None, seconds: float | None = None) -> None:
        """Pin the full chunks of `tokens` in Redis for `seconds` (None: until unpinned), after
        the writes queued before (see the module doc). Nothing on a rank that stores nothing
        (MLA's other ranks) or without a remote tier."""
        specs = self.token_db.chunks(tokens, None, resolve(cache_salt, identity), for_store=True)
        if not specs or not self._stores_here:
            return
        until = None if seconds is None or math.isinf(seconds) else time.time() + seconds
        self.storage.retain(specs, until)

    def record_prefill(self, num_tokens: int, seconds: float, start: int = 0) -> None:
        """This engine computed tokens `[start, start + num_tokens)` of a prompt (their
        prefill, in one forward) in `seconds`: the load decision's figure of what computing
        costs at that context (`telemetry.figures.PrefillFigures`). Engines that never report
        it are decided with `prefill_tokens_per_s`, or the prior (docs/load-decision.md)."""
        work = num_tokens * (start + num_tokens / 2)
        self.decisions.decision.prefill.observe(num_tokens, work, seconds)
        self.decisions.publish()

    def check_remote(self) -> None:
        """Check now that Redis answers and lets this client use the cache: PING, then the
        chunk commands on a probe key under `key_prefix` (`storage.access`), on a connection of
        its own, bounded by `remote_timeout`. Returns None when all is well (or when no remote
        tier is configured); raises `BackendPermissionError` naming the refused commands (an ACL
        user without the rights, a wrong password), `BackendUnavailableError` or
        `BackendTimeoutError`. `store`/`retrieve` never raise for these; call this to fail fast.
        """
        self.storage.check_remote()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued Redis writes landed or were dropped; False if the bound ran out.

        Also publishes the engine's counters for fleet stats (`reporting.EngineReporter`)."""
        done = self.storage.flush(timeout)
        self.reporter.publish()
        return done

    @property
    def engine_id(self) -> str:
        """This engine's id in fleet stats (`{prefix}:engines:{engine_id}`) and metrics."""
        return self.reporter.engine_id

    def stats(self) -> dict[str, Any]:
        snap = self.metrics.snapshot()
        for scope, values in self.storage.gauges().items():
            snap.setdefault(scope, {}).update(values)
        snap.setdefault("engine", {})["frozen"] = self._frozen
        snap["decision"] = self.decisions.decision.snapshot()
        return snap

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.storage.flush()
        self.reporter.close()
        self.storage.close()

    # -- internals --------------------------------------------------------------------------

    def _check_remote_at_start(self) -> None:
        """One `check_remote` when the engine starts: a refused login or missing ACL rights is
        logged as an ERROR and counted (`remote.permission_errors`), never raised; Redis being
        down is a warning (the engine runs without it and probes it again later)."""
        try:
            self.storage.check_remote()
        except BackendPermissionError as exc:
            self.metrics.inc("remote.permission_errors")
            logger.error(
                "Redis refuses this client: %s. Until its ACL user has the rights listed in "
                "docs/reliability.md, every store is dropped and every retrieve misses.", exc)
        except (BackendUnavailableError, BackendTimeoutError) as exc:
            logger.warning("Redis is not usable at start-up (%s); the engine runs without it "
                           "and tries it again on the next calls.", exc)
        except Exception as exc:  # a check must never stop the engine from starting
            self.metrics.inc("remote.errors")
            logger.error("the cache cannot use Redis (%s): every store is dropped and every "
                         "retrieve misses until this is fixed.", exc)

    def _check_promise(self, specs: list[ChunkSpec], delivered: int) -> None:
        """Count and log a retrieve that delivered less than a lookup of it promised."""
        owed = self._promises.broken(specs, delivered)
        if not owed:
            return
        self.metrics.inc("engine.promise_broken_requests")
        self.metrics.inc("engine.promise_broken_tokens", owed)
        counters = self.metrics.counters()
        reasons = ", ".join(f"{n} {int(counters.get(n, 0))}" for n in _BREAK_REASONS)
        self._log.warning("promise", "a retrieve delivered %d tokens fewer than its lookup "
                          "promised (counters so far: %s)", owed, reasons)

    def _check_view(self, kv: KVView) -> None:
        if not isinstance(kv, KVView):
            raise ValueError(f"kv must be a PagedKV or DenseKV, got {type(kv).__name__}")
        want = self.layout
        got = (kv.num_layers, kv.kv_planes, kv.num_kv_heads, kv.head_size, kv.dtype)
        expected = (want.num_layers, want.kv_planes, want.num_kv_heads, want.head_size, want.dtype)
        if got != expected:
            raise ValueError(
                "KV view does not match the engine metadata: (layers, planes, heads, head_size,"
                f" dtype) {got} != {expected}"
            )

    def _skips_store(self, specs: list[ChunkSpec]) -> bool:
        """True (and counted) when a store of `specs` stores nothing by design."""
        if not specs:
            return True
        if self._frozen:
            self.metrics.inc("engine.frozen_skipped_tokens", specs[-1].end - specs[0].start)
            return True
        if not self._stores_here:
            self.metrics.inc("engine.other_rank_skipped_tokens", specs[-1].end - specs[0].start)
            return True
        return False

    def _store_specs(self, specs: list[ChunkSpec], kv: KVView) -> int:
        """Copies the chunks out of ``kv`` and hands them to the tiers, a window at a time
        when Redis is written behind (`store_windows`): the writer thread writes one window
        while this thread copies the next."""
        batch = self._prepare_store(specs)
        try:
            accepted: dict[int, bool] = {}
            for window in self.store_windows(specs, batch):
                if batch.copies_in(window):
                    kv.gather(batch.copy_ranges(specs, window), batch.copy_tensors(window))
                accepted.update(self._hand_over(specs, batch, window))
            return self._held(specs, batch, accepted)
        finally:
            batch.release()

    def store_windows(self, specs: list[ChunkSpec], batch: StoreBatch) -> list[range]:
        """The windows a store copies and hands over in turn: with the write-behind queue,
        runs of chunks of about `STORE_WINDOW_BYTES` (the writer starts on the first while
        the next is copied, docs/benchmarks.md, "Writes at the socket's limit"); else one
        window, the whole store (a synchronous write waits for its chunks anyway, and one
        put spreads them over the tier's lanes)."""
        whole = [range(len(batch.sources))] if batch.sources else []
        if self.storage.queue is None or len(batch.sources) < 2:
            return whole
        sizes = [self.layout.nbytes(specs[i].num_tokens) for i in range(len(batch.sources))]
        return byte_windows(sizes, STORE_WINDOW_BYTES)

    def _store_layers(
        self, specs: list[ChunkSpec], kv: KVView, start: float, then: Callable[[], None]
    ) -> Generator[int | None, None, None]:
        batch = self._prepare_store(specs)
        try:
            ranges, tensors = batch.copy_ranges(specs), batch.copy_tensors()
            for layer in range(self.layout.num_layers):
                if ranges:
                    kv.gather_layer(layer, ranges, tensors)
                yield None
            accepted = self._publish(specs, batch)
        finally:
            batch.release()
        then()
        self.metrics.inc("engine.store_tokens", specs[-1].end - specs[0].start)
        self.metrics.inc("engine.stored_tokens", accepted)
        self.metrics.observe("engine.store_seconds", time.perf_counter() - start)
        yield accepted

    def _retain(self, tokens: Any, identity: RequestIdentity | None,
                specs: list[ChunkSpec], retain: float | None) -> None:
        """With `retain` (seconds, at most `max_retain_seconds`), pin the request's prefix in
        Redis: every full chunk up to the end of this store, the ones stored before included."""
        if retain and specs:
            self.pin(tokens_to_array(tokens)[:specs[-1].end], identity=identity,
                     seconds=min(retain, self.config.max_retain_seconds))

    def _idle_layers(self, result: int) -> Generator[int | None, None, None]:
        for _ in range(self.layout.num_layers):
            yield None
        yield result

    def _retrieve_layers(
        self, num_tokens: int, specs: list[ChunkSpec], wanted: int, kv: KVView, start: float
    ) -> Generator[torch.Tensor, None, None]:
        ret = torch.zeros(num_tokens, dtype=torch.bool)
        objs = self.storage.fetch(specs[:wanted]) if wanted else []
        if specs:
            self._check_promise(specs, len(objs))
        hit = specs[: len(objs)]
        if hit:
            ret[hit[0].start : hit[-1].end] = True
        ranges, srcs = [(s.start, s.end) for s in hit], [o.tensor for o in objs]
        try:
            yield ret
            last = self.layout.num_layers - 1
            for layer in range(last + 1):
                if hit:
                    kv.scatter_layer(layer, ranges, srcs)
                if layer < last:
                    yield ret
        finally:
            for obj in objs:
                obj.release()
        hit_tokens = hit[-1].end - hit[0].start if hit else 0
        self.metrics.inc("engine.retrieve_tokens", specs[-1].end - specs[0].start if specs else 0)
        self.metrics.inc("engine.retrieved_tokens", hit_tokens)
        self.metrics.observe("engine.retrieve_seconds", time.perf_counter() - start)
        yield ret

    def _prepare_store(self, specs: list[ChunkSpec]) -> StoreBatch:
        """Decide what to write where and take a buffer per chunk (a prefix, while memory
        lasts); the caller fills `copies` and releases the batch."""
        plan = self.storage.plan_store(specs)
        batch = StoreBatch(plan)
        try:
            for i, spec in enumerate(specs):
                src = plan.local_objs[i]
                plan.local_objs[i] = None  # ownership moves to `sources`
                if src is None and plan.needs_write(i):
                    src = self.storage.allocate(spec.num_tokens)
                    if src is None:
                        self.metrics.inc("engine.store_out_of_memory_chunks", len(specs) - i)
                        break
                    batch.copies.append(i)
                batch.sources.append(src)
        except BaseException:
            batch.release()
            raise
        return batch

    def _publish(self, specs: list[ChunkSpec], batch: StoreBatch) -> int:
        """Hand the filled chunks to the tiers; the tokens now held (a prefix)."""
        return self._held(specs, batch,
                          self._hand_over(specs, batch, range(len(batch.sources))))

    def _hand_over(self, specs: list[ChunkSpec], batch: StoreBatch, window: range
                   ) -> dict[int, bool]:
        """Hand the filled chunks of ``window`` to the tiers; per chunk handed, whether its
        Redis write was accepted."""
        plan, sources = batch.plan, batch.sources
        idx = [i for i in window if sources[i] is not None]
        if not idx:
            return {}
        accepted = self.storage.write(
            [specs[i].key for i in idx], [present(sources[i]) for i in idx],
            [plan.need_local[i] for i in idx], [plan.need_remote[i] for i in idx],
        )
        return dict(zip(idx, accepted, strict=True))

    def _held(self, specs: list[ChunkSpec], batch: StoreBatch, remote_ok: dict[int, bool]
              ) -> int:
        """The tokens the tiers now hold or have queued (a prefix)."""
        plan, sources = batch.plan, batch.sources
        held = 0
        for i in range(len(sources)):
            local_held = sources[i] is not None and self.storage.local is not None
            remote_held = plan.remote_has[i] or remote_ok.get(i, False)
            if not (local_held or remote_held):
                break
            held = i + 1
        return specs[held - 1].end - specs[0].start if held else 0
