"""Fixtures for the tests against SGLang's own HiCache controller (sglang 0.5.23, CPU).

Run with the sglang side environment's python (scripts/env.sh `ensure_sglang_env`; the main
suite does not collect this folder). SGLang is set up once per session (`sglang`: one gloo
rank, SGLang's `ServerArgs` published); `engine(**spec)` builds an `rig.Engine` on this test's
Redis and key prefix and detaches all of them after the test.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    # importing sglang warns about CUDA-only quantization kernels and deprecated torch.jit
    # APIs on this CPU build: noise for these tests
    warnings.simplefilter("ignore")
    from rig import Engine, save_model_dir, start_sglang


@pytest.fixture(scope="session")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = save_model_dir(tmp_path_factory.mktemp("models") / "tiny-llama")
    start_sglang(model_dir, tmp_path_factory.mktemp("dist"))
    return model_dir


@pytest.fixture
def engines(sglang: Path, redis_url: str, key_prefix: str) -> Iterator[Callable[..., Engine]]:
    """`engines(layout=..., mla=..., zero_copy=..., extra={...})`: an engine whose backend
    uses this test's Redis and key prefix and a fixed model fingerprint (the tiny model has
    no weights to fingerprint)."""
    made: list[Engine] = []

    def make(extra: dict[str, Any] | None = None, **spec: Any) -> Engine:
        config = {"remote_url": redis_url, "key_prefix": key_prefix,
                  "model_fingerprint": "test", **(extra or {})}
        made.append(Engine(config, **spec))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
