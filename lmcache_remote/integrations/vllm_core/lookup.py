"""The scheduler side's lookup: how many leading prompt tokens every rank can load from Redis.

vLLM asks `get_num_new_matched_tokens` for every waiting request, again and again while it
waits, in the scheduler's own thread: the answer must cost one round trip and nothing else.
`PrefixLookup` promises:

- one Redis round trip per call, whatever the number of rank namespaces (tensor-parallel
  ranks each store their own chunks under their own `worker_id`): the chunk keys of every
  namespace go out in one pipeline of `EXISTS` (one per chunk, part keys included, as
  `RedisTier.contains` sends them; on a cluster one pipeline per node, concurrently);
- a token counts only when every namespace holds its chunk, and only up to the first chunk
  some namespace lacks (a prefix, as `CacheEngine.lookup`);
- it is light: a Redis client and the key builders, no `CacheEngine`. No local CPU tier (the
  workers' tiers are in other processes), no write-behind queue, no codec threads, no stats
  publisher, no entry in fleet stats or the Prometheus registry: it is not an engine;
- it never promises more than a worker can load in one retrieve: the leading chunks whose bytes
  fit in each rank's read share of `max_local_cpu_size` (`storage.budget.read_share_bytes`,
  the cap `CacheEngine.lookup` applies too); the tokens left out are counted in
  `lookup.capped_tokens`;
- a remote failure is a miss (0), counted in `metrics` and logged rate-limited, never raised;
  with no remote tier configured every lookup is 0;
- each round trip is timed into `link` (`telemetry.figures.LinkFigures`): the load decision's
  round-trip figure; `bytes_per_token` is what a token of the hit weighs to load.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from lmcache_remote.config import CacheConfig
from lmcache_remote.engine import startup
from lmcache_remote.errors import BackendError
from lmcache_remote.integrations.vllm_core.groups import KVGroup, group_namespace
from lmcache_remote.naming.hashing import ChunkSpec, KeyNamespace, chunk_hashes, tokens_to_array
from lmcache_remote.naming.identity import RequestIdentity
from lmcache_remote.storage.chunks.factory import make_remote_lookup
from lmcache_remote.storage.chunks.lookup import RemoteLookup
from lmcache_remote.storage.local.memory import ChunkLayout
from lmcache_remote.storage.manager.budget import (
    fetchable_chunks,
    read_share_bytes,
    within_read_share,
)
from lmcache_remote.storage.session.connection_count import lookup_connections
from lmcache_remote.telemetry.figures import LinkFigures
from lmcache_remote.telemetry.metrics import Metrics, RateLimitedLogger

logger = logging.getLogger(__name__)


class PrefixLookup:
    """Remote-only prefix lookup over several key namespaces; see the module docstring."""

    def __init__(self, config: CacheConfig, layout: ChunkLayout,
                 namespaces: Sequence[KeyNamespace]) -> None:
        if not namespaces:
            raise ValueError("need at least one key namespace")
        startup.check_native(config)
        self.metrics = Metrics()
        self.chunk_size = config.chunk_size
        self._layout = layout
        self._read_share = read_share_bytes(config)
        self._namespaces = list(namespaces)
        # A lookup never reads a value: keys and `contains` only, no memory, no lanes.
        self._remote: RemoteLookup | None = (
            make_remote_lookup(config, layout, self.metrics)
            if config.remote_url is not None else None
        )
        if self._remote is not None and self._remote.toucher is not None:
            self._remote.toucher.inline = True  # the scheduler's thread sends them: no thread
        if self._remote is not None and self._remote.keep is not None:
            self._remote.keep.inline = True  # its hits noted, sent the same way
        self._log = RateLimitedLogger(logger)
        self.link = LinkFigures()
        startup.announce(config, role="vllm scheduler", namespace=namespaces[0].model_name,
                         connections=lookup_connections(config))

    @property
    def remote(self) -> RemoteLookup | None:
        """The lookup's remote lookup (None without a `remote_url`)."""
        return self._remote

    @property
    def namespaces(self) -> list[KeyNamespace]:
        return list(self._namespaces)

    @property
    def bytes_per_token(self) -> float:
        """Bytes a rank loads per hit token (its chunk layout's)."""
        return self._layout.nbytes(self.chunk_size) / self.chunk_size

    def rename_model(self, model_name: str) -> None:
        """Look up under `model_name` from now on (every rank's namespace)."""
        self._namespaces = [dataclasses.replace(ns, model_name=model_name)
                            for ns in self._namespaces]

    def __call__(self, tokens: Sequence[int], identity: RequestIdentity | None = None) -> int:
        """Leading tokens whose chunks every namespace holds now (0 on any remote failure)."""
        start = time.perf_counter()
        try:
            return self._lookup(tokens, identity)
        finally:
            self.metrics.observe("lookup.seconds", time.perf_counter() - start)

    def _lookup(self, tokens: Sequence[int], identity: RequestIdentity | None) -> int:
        self.metrics.inc("lookup.requests")
        if self._remote is None:
            return 0
        arr = tokens_to_array(tokens)
        hashes = chunk_hashes(arr, self.chunk_size, identity, partial=True)
        if not hashes:
            return 0
        bounds = [(i * self.chunk_size, min((i + 1) * self.chunk_size, len(arr)))
                  for i in range(len(hashes))]
        # The chained hashes do not depend on the namespace: hashed once, keyed per rank.
        per_ns = [[ChunkSpec(start, end, ns.key(digest))
                   for (start, end), digest in zip(bounds, hashes, strict=True)]
                  for ns in self._namespaces]
        present = self._contains([spec for specs in per_ns for spec in specs])
        if present is None:
            return 0
        hits = len(per_ns[0])
        pos = 0
        for specs in per_ns:
            found = present[pos:pos + len(specs)]
            pos += len(specs)
            hits = min(hits, next((i for i, ok in enumerate(found) if not ok), len(specs)))
        hits = self._within_read_share(per_ns[0], hits)
        if hits:  # promised: Redis's LRU must see them used (EXISTS does not refresh it)
            self._remote.touch_later([spec for specs in per_ns for spec in specs[:hits]],
                                     len(arr) // self.chunk_size)
        hit_tokens = per_ns[0][hits - 1].end if hits else 0
        self.metrics.inc("lookup.hit_tokens", hit_tokens)
        return hit_tokens

    def _contains(self, specs: list[ChunkSpec]) -> list[bool] | None:
        """Which of `specs` Redis holds, in one round trip; None (counted, logged) when the
        call failed: a miss."""
        assert self._remote is not None
        start = time.perf_counter()
        try:
            found = self._remote.contains(specs)
            self.link.round_trip(time.perf_counter() - start)
            return found
        except BackendError as exc:
            self.metrics.inc("lookup.remote_errors")
            self._log.warning("lookup", "lookup failed, counted as a miss: %s", exc)
            return None

    def _within_read_share(self, specs: Sequence[ChunkSpec], hits: int) -> int:
        return within_read_share(specs, hits, self._layout, self._read_share, self.metrics,
                                 "lookup.capped_tokens")

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()


class GroupLookup(PrefixLookup):
    """The lookup of a model of several KV cache groups, or of a sliding-window one
    (`vllm_core.groups`): every group's chunk keys, every rank's, in the same one round trip.
    The hit is the longest chunk boundary `h` below the prompt's last token such that every
    full group holds every chunk below `h` and every SWA group the chunks from its first
    kept token at `h` (`KVGroup.first_kept`): vLLM's own rule, one hit for all groups. Only
    whole chunks count; the read-share cap applies to each group's chunks to load."""

    def __init__(self, config: CacheConfig, groups: Sequence[KVGroup],
                 layouts: Sequence[ChunkLayout],
                 namespaces: Sequence[Sequence[KeyNamespace]]) -> None:
        if not groups or len(groups) != len(namespaces) or len(groups) != len(layouts):
            raise ValueError("need one layout and one list of namespaces per group")
        super().__init__(config, layouts[0], namespaces[0])
        self._groups = list(groups)
        self._layouts = list(layouts)
        self._group_namespaces = [list(ns) for ns in namespaces]

    @property
    def bytes_per_token(self) -> float:
        """Bytes a rank loads per hit token, every group's chunk layout together."""
        return sum(layout.nbytes(self.chunk_size) for layout in self._layouts) / self.chunk_size

    def rename_model(self, model_name: str) -> None:
        """Look up under `model_name` from now on (each group's field is `model_name` and the
        group's tag, as `groups.group_namespace` makes it)."""
        self._group_namespaces = [
            [dataclasses.replace(ns, model_name=group_namespace(model_name, group, self._groups))
             for ns in spaces]
            for group, spaces in zip(self._groups, self._group_namespaces, strict=True)]

    def _lookup(self, tokens: Sequence[int], identity: RequestIdentity | None) -> int:
        self.metrics.inc("lookup.requests")
        if self._remote is None:
            return 0
        arr = tokens_to_array(tokens)
        cs = self.chunk_size
        whole = (len(arr) - 1) // cs  # chunks a hit may cover: one token is left to compute
        if whole <= 0:
            return 0
        hashes = chunk_hashes(arr[: whole * cs], cs, identity, partial=False)
        specs = [[[ChunkSpec(i * cs, (i + 1) * cs, ns.key(digest))
                   for i, digest in enumerate(hashes)] for ns in spaces]
                 for spaces in self._group_namespaces]
        present = self._contains(
            [spec for per_group in specs for per_ns in per_group for spec in per_ns])
        if present is None:
            return 0
        held: list[list[bool]] = []  # per group: chunk i held by every rank
        pos = 0
        for per_group in specs:
            ok = [True] * whole
            for _ in per_group:
                for i in range(whole):
                    ok[i] = ok[i] and present[pos + i]
                pos += whole
            held.append(ok)
        served = next((k for k in range(whole, 0, -1) if self._serves(held, k)), 0)
        hits = next((k for k in range(served, 0, -1)
                     if self._serves(held, k) and self._fits(specs, k)), 0)
        if hits < served:
            self.metrics.inc("lookup.capped_tokens", (served - hits) * cs)
        if hits:  # promised: Redis's LRU must see them used (EXISTS does not refresh it)
            self._remote.touch_later([
                spec for g, per_group in enumerate(specs) for per_ns in per_group
                for spec in per_ns[self._first_chunk(g, hits):hits]], len(arr) // cs)
        hit_tokens = hits * cs
        self.metrics.inc("lookup.hit_tokens", hit_tokens)
        return hit_tokens

    def _first_chunk(self, group: int, hits: int) -> int:
        return self._groups[group].first_kept(hits * self.chunk_size) // self.chunk_size

    def _serves(self, held: list[list[bool]], hits: int) -> bool:
        return all(all(held[g][self._first_chunk(g, hits):hits])
                   for g in range(len(self._groups)))

    def _fits(self, specs: list[list[list[ChunkSpec]]], hits: int) -> bool:
        """Whether one read of each group can hold the chunks it loads for `hits`."""
        for g, layout in enumerate(self._layouts):
            first = self._first_chunk(g, hits)
            chunks = specs[g][0][first:hits]
            if fetchable_chunks(chunks, len(chunks), layout, self._read_share) < len(chunks):
                return False
        return True


class BackgroundLookup:
    """A lookup that never holds vLLM's scheduler longer than `wait_s`: it runs on one thread
    of its own, and a call that finds its request's lookup still running after `wait_s`
    answers None (vLLM then asks again on a later step, the connector contract's "not known
    yet"). A Redis that stops answering costs each step at most `wait_s`, not
    `remote_timeout`. The next call after an answer starts a new lookup: hits are never
    served from a cache."""

    def __init__(self, lookup: Callable[[Sequence[int], RequestIdentity | None], int],
                 wait_s: float) -> None:
        self._lookup = lookup
        self.wait_s = wait_s
        self._pending: dict[str, Future[int]] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lmcr-vllm-lookup")

    def __call__(self, req_id: str, tokens: Sequence[int],
                 identity: RequestIdentity | None) -> int | None:
        future = self._pending.get(req_id)
        if future is None:
            future = self._executor.submit(self._lookup, list(tokens), identity)
            self._pending[req_id] = future
        try:
            hits = future.result(timeout=self.wait_s)
        except FutureTimeout:
            return None
        del self._pending[req_id]
        return hits

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
