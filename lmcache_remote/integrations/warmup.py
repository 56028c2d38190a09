"""Warm the cache from a model: compute and store the KV of known prompts before traffic.

`warm_from_model(config, model_path, prompts_path)` loads a local Hugging Face model folder
(`AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")`), reads the prompts, and for
each one runs `CachedLM.prefill`: chunks already cached are loaded, the rest is computed and
stored. A prompt whose storable chunks are all cached already is skipped without running the
model; a prompt shorter than one chunk is counted as too short (nothing to store, unless
`save_unfull_chunk`). Stores are flushed to Redis before it returns.

Prompts file (`read_prompts`):
- a name ending in `.jsonl`: one JSON value per non-empty line, either a list of token ids
  (used as is) or a string (tokenized like a text line);
- anything else: one prompt per non-empty line, text, tokenized with the folder's tokenizer
  as `tokenizer(line)["input_ids"]` (special tokens added as that tokenizer does by default;
  pre-render chat templates, or give token ids, to match what the serving engine sends).

Model namespace: as `huggingface.engine_metadata` makes it: the folder's name (e.g.
`/models/tiny-llama` -> `tiny-llama`) unless `model_name` is given, then `@` and the
fingerprint of the folder's weights (`model_fingerprint`: "auto", "off" or a string); an engine
hits these chunks only under the same namespace, dtype and chunk size (vLLM's connector,
loading the same folder, makes the same one).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmcache_remote.config import CacheConfig
from lmcache_remote.engine import CacheEngine
from lmcache_remote.errors import LmcrError
from lmcache_remote.integrations.huggingface import CachedLM, engine_metadata

__all__ = ["PromptFileError", "WarmResult", "read_prompts", "warm_from_model"]


class PromptFileError(LmcrError, ValueError):
    """The prompts file has an entry that is neither token ids nor text (names the line)."""


@dataclasses.dataclass
class WarmResult:
    """Counts of one warm-up run; `to_dict()` is JSON-ready."""

    model_name: str
    prompts: int = 0
    warmed: int = 0
    skipped: int = 0
    too_short: int = 0
    computed_tokens: int = 0
    loaded_tokens: int = 0
    flushed: bool = True
    pinned_chunks: int = 0
    refused_pin_chunks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_prompts(path: str | Path, tokenizer: Callable[[], Any] | None = None
                 ) -> list[list[int]]:
    """The prompts of `path` as token id lists (see the module doc for the format).

    `tokenizer` is called once, only if some prompt is text, and returns a transformers
    tokenizer. Raises `PromptFileError` naming the line for a malformed entry."""
    path = Path(path)
    tok: Any = None
    out: list[list[int]] = []
    jsonl = path.name.endswith(".jsonl")
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            text = line.rstrip("\n")
            if not text.strip():
                continue
            item: Any = text
            if jsonl:
                try:
                    item = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise PromptFileError(f"{path}:{number}: not JSON: {exc.msg}") from None
            if isinstance(item, str):
                if tok is None:
                    if tokenizer is None:
                        raise PromptFileError(f"{path}:{number}: text prompt but no tokenizer")
                    tok = tokenizer()
                out.append([int(t) for t in tok(item)["input_ids"]])
            elif isinstance(item, list) and item and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item
            ):
                out.append(item)
            else:
                raise PromptFileError(
                    f"{path}:{number}: expected a list of token ids or a string"
                )
    return out


def warm_from_model(
    config: CacheConfig,
    model_path: str | Path,
    prompts_path: str | Path,
    *,
    model_name: str | None = None,
    model_fingerprint: str = "auto",
    device: str | None = None,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    pin: bool = False,
) -> WarmResult:
    """Store the KV of every prompt of `prompts_path` as computed by the model in
    `model_path`; `on_start(total)` is called once the prompts are read, `progress(1)` after
    each prompt. With `pin`, every prompt's chunks (warmed or already there) are then pinned
    (`CacheEngine.pin`; `pinned_chunks` and `refused_pin_chunks` count them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def tokenizer() -> Any:
        return AutoTokenizer.from_pretrained(str(model_path))

    prompts = read_prompts(prompts_path, tokenizer)
    if on_start is not None:
        on_start(len(prompts))
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype="auto").eval()
    if device is not None:
        model = model.to(device)
    meta = engine_metadata(model, model_name=model_name, model_fingerprint=model_fingerprint)
    result = WarmResult(meta.model_name, prompts=len(prompts))
    extra = ({"logits_to_keep": 1}
             if "logits_to_keep" in inspect.signature(model.forward).parameters else {})
    with CacheEngine(config, meta) as engine:
        lm = CachedLM(model, engine)
        for ids in prompts:
            _warm_one(lm, torch.tensor(ids), result, extra)
            if pin:
                engine.pin(ids)
            if progress is not None:
                progress(1)
        result.flushed = engine.flush()
        result.pinned_chunks = int(engine.metrics.get("pins.pinned_chunks"))
        result.refused_pin_chunks = int(engine.metrics.get("pins.refused_chunks"))
    return result


def _warm_one(lm: CachedLM, ids: torch.Tensor, result: WarmResult, extra: dict[str, Any]
              ) -> None:
    config = lm.engine.config
    storable = len(ids) if config.save_unfull_chunk else len(ids) // config.chunk_size * (
        config.chunk_size)
    if storable == 0:
        result.too_short += 1
        return
    if lm.engine.lookup(ids) >= storable:
        result.skipped += 1
        return
    out = lm.prefill(ids, **extra)
    result.warmed += 1
    result.loaded_tokens += out.hit_tokens
    result.computed_tokens += len(ids) - out.hit_tokens
