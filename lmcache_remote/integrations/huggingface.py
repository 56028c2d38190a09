"""Hugging Face transformers with the cache in front of prefill.

`CachedLM(model, engine)` wraps a decoder-only causal LM (`AutoModelForCausalLM`, transformers
5.x, full attention on every layer) and a `CacheEngine` whose metadata matches the model
(`engine_metadata(model)` builds it). Per request:

1. `load(input_ids)`: `lookup` the prompt, allocate per-layer K/V tensors
   `[1, kv_heads, hit, head_dim]` on the model's device, `retrieve` the hit prefix into them
   through `DenseKV` and build a `DynamicCache` holding exactly those positions.
2. The model runs on the uncached suffix only; the cache's length gives the position ids.
3. `save(input_ids, cache, skip)`: `store` the prompt's full chunks from the model's cache
   (chunks the cache already holds cost one round trip to check, then nothing).

`prefill(input_ids)` does the three steps (the middle one is `forward_suffix`) for one
forward pass and returns the suffix's logits and the cache, ready for decoding;
`generate(input_ids, **kwargs)` does them around `model.generate` (greedy or sampling, one
sequence per prompt row) and stores the prompt's KV after it.

Rules that keep the output equal to a full recompute:

- At most `len(prompt) - 1` tokens are loaded, rounded down to a whole number of chunks: the
  model needs at least one token to run to produce the next-token logits, and a chunk is the
  unit the cache names and checks.
- A batch (`input_ids` of `[batch, T]`, no padding) loads the same number of tokens for every
  row: the shortest hit among the rows, so the `DynamicCache` stays rectangular. Each row has
  its own prefix and its own chunks. Prompts of different lengths go in separate calls.
- Only the prompt's KV is stored, never generated tokens'.

What to load is the engine's load decision (`CacheEngine.lookup`, docs/load-decision.md):
`prefill` and `generate` time the model's forward over the uncomputed part of the prompt and
report it (`CacheEngine.record_prefill`), so the decision weighs loading against this model's
own prefill speed on this device, at that context length; a hit slower to load than to
compute is computed.

Model namespace (the model field of the cache keys; `engine.metadata`): the model name, then `@` and
the fingerprint of the weights (`lmcache_remote.naming.fingerprint`, docs/key-schema.md). The name
is the `model_name` argument when given; otherwise the config's `name_or_path` (what
`from_pretrained` was called with): a local folder gives its folder name (`/models/tiny-llama` ->
`tiny-llama`), a hub id is used as is (`model_name_for`). The fingerprint is read from the files
`name_or_path` names (the folder, or the hub id's local snapshot), as vLLM's connector reads them:
the two share chunks of the same files by default. `model_fingerprint="off"` leaves the name alone,
any other string is used as the fingerprint. A model built from a config has no name and no files:
pass `model_name`; its keys then carry the name alone (a WARNING says so). Engines that share chunks
must have the same namespace, world size and KV dtype.

LoRA adapters (peft): a model with an active adapter (a `PeftModel`, or an adapter loaded
through transformers' `load_adapter`) computes other KV than its base model, so its chunks are
named by the adapter too: pass `adapter=` the adapter's folder, as `save_pretrained` wrote it.
Its files are fingerprinted as vLLM's connector fingerprints them
(`fingerprint.adapter_fingerprint`: vLLM and transformers share the adapter's chunks), and the
weights the model holds are compared with the folder's at construction: a mismatch, a model
with an active adapter and no `adapter=`, or several active adapters, is a `ValueError`.
Merged adapters (`merge_and_unload`) are new weights: save and load them as a model.

Inputs other than token ids are refused with a `ValueError`: a tensor keyword argument to
`prefill`, `forward_suffix` or `generate` besides an all-ones `attention_mask`
(`pixel_values`, `inputs_embeds`, `position_ids`, `token_type_ids`, ...) changes the KV of the
same token ids, and the keys here name token ids, the salt and the adapter only. Images and
prompt embeddings are served by the vLLM connector.

transformers is imported when a function here needs it, not at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from lmcache_remote.config import CacheConfig, load_config
from lmcache_remote.connectors import DenseKV
from lmcache_remote.engine import CacheEngine, EngineMetadata
from lmcache_remote.naming.fingerprint import (
    adapter_fingerprint,
    model_fingerprint,
    model_folder,
    model_name_of,
    namespace,
    resolve_fingerprint,
)
from lmcache_remote.naming.identity import RequestIdentity
from lmcache_remote.values.serde import dtype_name

if TYPE_CHECKING:
    from transformers import DynamicCache

logger = logging.getLogger(__name__)

__all__ = ["CachedLM", "Generation", "Prefill", "engine_metadata", "model_name_for"]


def model_name_for(config: Any) -> str:
    """The cache's model name for a transformers config (see the module docstring)."""
    name = str(getattr(config, "name_or_path", "") or "")
    if not name:
        raise ValueError(
            "the model has no name_or_path (built from a config?): pass model_name=..."
        )
    return model_name_of(name)


def engine_metadata(
    model: Any,
    *,
    model_name: str | None = None,
    model_fingerprint: str = "auto",
    dtype: torch.dtype | None = None,
    world_size: int = 1,
    worker_id: int = 0,
) -> EngineMetadata:
    """`EngineMetadata` for a transformers model (or its config, then `dtype` is required).

    Layers: `num_hidden_layers`; KV heads: `num_key_value_heads` (default
    `num_attention_heads`); head size: `head_dim` when the config has one, else
    `hidden_size // num_attention_heads`; KV dtype: the model's dtype. Model field: the
    namespace of the module docstring (`model_fingerprint`: "auto", "off" or a string).
    """
    config = getattr(model, "config", model)
    if dtype is None:
        dtype = getattr(model, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError("pass dtype= when giving a config rather than a model")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    name = model_name or model_name_for(config)
    return EngineMetadata(
        namespace(name, _fingerprint(config, dtype, model_fingerprint, name)), world_size,
        worker_id, dtype, int(text.num_hidden_layers), kv_heads, head_dim,
    )


def _fingerprint(config: Any, dtype: torch.dtype, setting: str, name: str) -> str | None:
    if setting != "auto":  # "off" or an explicit string: no files are looked for
        return resolve_fingerprint(setting, lambda: "")
    source = str(getattr(config, "name_or_path", "") or "")
    folder = model_folder(source) if source else None
    if folder is None:
        logger.warning("model %s has no files to fingerprint (built from a config?): its "
                       "cache keys name it by model_name alone", name)
        return None
    # (loaded from files: quantization applied at load time shows in the config, which the
    # fingerprint covers; bitsandbytes keeps a quantization_config there too)
    return model_fingerprint(folder, kv_dtype=dtype_name(dtype))


@dataclasses.dataclass
class Prefill:
    """What `CachedLM.prefill` computed.

    `logits` covers positions `hit_tokens..T-1` only (`[batch, T - hit_tokens, vocab]`; the
    last one predicts the next token); `cache` holds all T positions; `stored_tokens[b]` is
    `CacheEngine.store`'s answer for row b: its tokens past `hit_tokens` whose chunks the
    cache now holds, whole chunks only (0 when storing is off).
    """

    logits: torch.Tensor
    cache: DynamicCache
    hit_tokens: int
    stored_tokens: list[int]


@dataclasses.dataclass
class Generation:
    """What `CachedLM.generate` returned: `sequences` (prompt + new tokens, as
    `model.generate` gives them), `output` (its full return value), `hit_tokens` (prompt
    tokens loaded from the cache, the same for every row) and `stored_tokens` per row (as in
    `Prefill`)."""

    sequences: torch.Tensor
    output: Any
    hit_tokens: int
    stored_tokens: list[int]


class CachedLM:
    """A transformers causal LM whose prompts' prefill goes through a `CacheEngine`.

    Not thread-safe (the model is not). `store=False` loads hits but never stores;
    `cache_salt` namespaces the chunks (the same salt must be used to hit them); `adapter`:
    the folder of the model's active LoRA adapter (module docstring).
    """

    def __init__(
        self,
        model: Any,
        engine: CacheEngine,
        *,
        store: bool = True,
        cache_salt: str | None = None,
        owns_engine: bool = False,
        adapter: str | None = None,
    ) -> None:
        self.model = model
        self.engine = engine
        self.store_enabled = store
        self.cache_salt = cache_salt
        self.identity = RequestIdentity(cache_salt=cache_salt,
                                        adapter=_adapter_identity(model, adapter))
        self._owns_engine = owns_engine
        want = engine_metadata(model, model_name=engine.metadata.model_name,
                               model_fingerprint="off")  # the geometry is what is checked
        got = engine.metadata
        if (got.num_layers, got.num_kv_heads, got.head_size, got.kv_dtype) != (
            want.num_layers, want.num_kv_heads, want.head_size, want.kv_dtype
        ):
            raise ValueError(f"engine metadata {got} does not match the model ({want})")
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters
            else "past_key_values"
        )
        self._new_cache()  # fails early for models this wrapper cannot serve

    @classmethod
    def open(
        cls,
        model: Any,
        config: CacheConfig | None = None,
        *,
        model_name: str | None = None,
        model_fingerprint: str = "auto",
        **kwargs: Any,
    ) -> CachedLM:
        """A `CachedLM` with its own engine (`load_config()` when `config` is None), closed
        with it; `model_name` and `model_fingerprint` as `engine_metadata`'s."""
        meta = engine_metadata(model, model_name=model_name, model_fingerprint=model_fingerprint)
        engine = CacheEngine(config or load_config(), meta)
        return cls(model, engine, owns_engine=True, **kwargs)

    def __enter__(self) -> CachedLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the engine if this object opened it."""
        if self._owns_engine:
            self.engine.close()

    # -- the three steps ----------------------------------------------------------------------

    def load(self, input_ids: Any) -> tuple[DynamicCache, int]:
        """A `DynamicCache` holding the KV of the first `hit` tokens of every row, and `hit`
        (a multiple of `chunk_size`, at most `T - 1`; 0 and an empty cache on a miss)."""
        ids = self._batch(input_ids)
        rows = ids.cpu()
        chunk = self.engine.config.chunk_size
        limit = (rows.shape[1] - 1) // chunk * chunk
        hit = limit
        for row in rows:
            if hit == 0:
                break
            hit = min(hit, self.engine.lookup(row[:hit], identity=self.identity))
        cache = self._new_cache()
        if hit == 0:
            return cache, 0
        per_row: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        for row in rows:
            keys, values = self._empty_kv(hit)
            got = self.engine.retrieve(row[:hit], DenseKV(keys, values), identity=self.identity)
            hit = min(hit, int(got.sum()))
            per_row.append((keys, values))
            if hit == 0:
                return cache, 0
        for layer in range(self.engine.metadata.num_layers):
            k = torch.cat([keys[layer][:, :, :hit] for keys, _ in per_row])
            v = torch.cat([values[layer][:, :, :hit] for _, values in per_row])
            cache.update(k, v, layer)
        return cache, hit

    def save(self, input_ids: Any, cache: DynamicCache, skip: int = 0) -> list[int]:
        """Store every row's prompt KV from `cache` (positions `0..T-1` of each row), skipping
        the first `skip` tokens (a multiple of `chunk_size`: what `load` brought). Returns
        what `CacheEngine.store` accepted per row."""
        ids = self._batch(input_ids)
        rows = ids.cpu()
        length = rows.shape[1]
        layers: list[Any] = list(cache.layers[: self.engine.metadata.num_layers])
        mask = None
        if skip:
            mask = torch.ones(length, dtype=torch.bool)
            mask[:skip] = False
        stored = []
        for b, row in enumerate(rows):
            keys = [layer.keys[b : b + 1, :, :length] for layer in layers]
            values = [layer.values[b : b + 1, :, :length] for layer in layers]
            stored.append(
                self.engine.store(row, DenseKV(keys, values), mask, identity=self.identity)
            )
        return stored

    # -- whole requests -----------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: Any, **model_kwargs: Any) -> Prefill:
        """One forward pass over the prompt, the cached prefix loaded instead of computed."""
        ids = self._batch(input_ids)
        _only_token_ids(model_kwargs)
        cache, hit = self.load(ids)
        with self._timed_prefill(ids, hit):
            out = self.forward_suffix(ids, cache, hit, **model_kwargs)
        stored = self.save(ids, cache, skip=hit) if self.store_enabled else [0] * len(ids)
        return Prefill(out.logits, cache, hit, stored)

    @torch.no_grad()
    def forward_suffix(
        self, input_ids: Any, cache: DynamicCache, hit: int, **model_kwargs: Any
    ) -> Any:
        """The model on positions `hit..T-1` of `input_ids`, attending to `cache` (which
        holds positions `0..hit-1`, as `load` returned it) and extending it. Returns the
        model's output (`.logits` of the suffix)."""
        ids = self._batch(input_ids)
        _only_token_ids(model_kwargs)
        return self.model(input_ids=ids[:, hit:], use_cache=True, **{self._cache_kw: cache},
                          **model_kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Any, **generate_kwargs: Any) -> Generation:
        """`model.generate` with the cached prefix loaded; the prompt's KV stored after.

        `generate_kwargs` go to `model.generate` (`max_new_tokens`, `do_sample`, ...); an
        `attention_mask` must be all ones (no padding)."""
        ids = self._batch(input_ids)
        mask = generate_kwargs.pop("attention_mask", None)
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("padded batches are not supported: pass prompts without padding")
        _only_token_ids(generate_kwargs)
        cache, hit = self.load(ids)
        with self._timed_prefill(ids, hit):
            output = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), **{self._cache_kw: cache},
                **generate_kwargs,
            )
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        stored = [0] * len(ids)
        if self.store_enabled:
            first: Any = cache.layers[0] if cache.layers else None
            if first is not None and first.keys.shape[0] == len(ids):
                stored = self.save(ids, cache, skip=hit)
            else:  # beams or several sequences per prompt reorder the cache's rows
                logger.info("not storing: the cache's rows no longer match the prompts")
        return Generation(sequences, output, hit, stored)

    # -- helpers ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _timed_prefill(self, ids: torch.Tensor, hit: int) -> Iterator[None]:
        """The model's first forward inside (the prefill of positions `hit..T-1`), timed and
        reported to the engine's load decision as one row's prefill (`record_prefill`);
        on CUDA the device is synchronised around it so that the time is the kernels'."""
        started: list[float] = []
        timed: list[float] = []
        cuda = ids.is_cuda or next(self.model.parameters()).is_cuda

        def before(module: Any, args: Any, kwargs: Any = None) -> None:
            if not started:
                if cuda:
                    torch.cuda.synchronize()
                started.append(time.perf_counter())

        def after(module: Any, args: Any, output: Any, kwargs: Any = None) -> None:
            if started and not timed:
                if cuda:
                    torch.cuda.synchronize()
                timed.append(time.perf_counter() - started[0])

        pre = self.model.register_forward_pre_hook(before)
        post = self.model.register_forward_hook(after)
        try:
            yield
        finally:
            pre.remove()
            post.remove()
        rows, length = ids.shape
        if timed and length > hit:
            self.engine.record_prefill(length - hit, timed[0] / max(1, rows), start=hit)

    def _batch(self, input_ids: Any) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [T] or [batch, T] with T >= 1, got {ids.shape}")
        return ids.to(self.model.device)

    def _empty_kv(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        meta = self.engine.metadata
        shape = (1, meta.num_kv_heads, length, meta.head_size)
        device = self.model.device

        def make() -> torch.Tensor:
            return torch.empty(shape, dtype=meta.kv_dtype, device=device)

        return [make() for _ in range(meta.num_layers)], [make() for _ in range(meta.num_layers)]

    def _new_cache(self) -> DynamicCache:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        layers = self.engine.metadata.num_layers
        if len(cache.layers) not in (0, layers) or any(
            type(layer) is not DynamicLayer for layer in cache.layers
        ):
            raise ValueError(
                "only models with full attention on every layer are supported "
                "(sliding-window, linear-attention and shared-KV layers are not)"
            )
        return cache


def _only_token_ids(kwargs: dict[str, Any]) -> None:
    """Refuse inputs that change the KV of the same token ids (module docstring)."""
    tensors = sorted(name for name, value in kwargs.items() if isinstance(value, torch.Tensor))
    if tensors:
        raise ValueError(
            f"CachedLM names KV by token ids (and salt and adapter) only; {', '.join(tensors)} "
            "would change the KV of the same ids (images, prompt embeddings, positions): "
            "not served here (the vLLM connector serves images and prompt embeddings)")


def _active_adapters(model: Any) -> list[str]:
    """The LoRA adapters active on `model` (peft's `PeftModel` or transformers' integration)."""
    if getattr(model, "peft_config", None) is None:
        return []
    if getattr(model, "disable_adapters", False) is True:
        return []
    active = getattr(model, "active_adapters", None)
    names = active() if callable(active) else active
    if names is None:
        names = [getattr(model, "active_adapter", None)]
    if isinstance(names, str):
        names = [names]
    return [str(n) for n in names if n]


def _adapter_identity(model: Any, folder: str | None) -> str | None:
    """The fingerprint of the model's active adapter, from `folder`, after checking that the
    model holds the folder's weights; None for a model without adapter."""
    active = _active_adapters(model)
    if not active:
        if folder is not None:
            raise ValueError(f"adapter={folder!r} given, but the model has no active LoRA "
                             "adapter")
        return None
    if len(active) > 1:
        raise ValueError(f"several active adapters ({', '.join(active)}): not served (one "
                         "adapter per CachedLM)")
    if folder is None:
        raise ValueError(f"the model runs LoRA adapter {active[0]!r}, whose KV is not the base "
                         "model's: pass adapter= its folder (as save_pretrained wrote it) so "
                         "its chunks are named by the adapter's files")
    _check_adapter_weights(model, active[0], folder)
    return adapter_fingerprint(folder)


def _check_adapter_weights(model: Any, name: str, folder: str) -> None:
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors adapter weights to check against")
    on_disk: dict[str, torch.Tensor] = {}
    for path in files:
        on_disk.update(load_file(str(path)))
    from peft import PeftModel, get_peft_model_state_dict

    if isinstance(model, PeftModel):
        held = get_peft_model_state_dict(model, adapter_name=name)
    else:  # an adapter loaded through transformers' own integration (`load_adapter`)
        held = model.get_adapter_state_dict(adapter_name=name)
    if set(held) != set(on_disk) or any(
            not torch.equal(held[k].detach().cpu().to(on_disk[k].dtype), on_disk[k])
            for k in held):
        raise ValueError(f"the weights of adapter {name!r} in the model are not the files in "
                         f"{folder}: its chunks would be named by other weights")
