"""Fixtures for the tests inside vLLM: the tiny model config (once per session) and engines
(`rig.Instance`) that are closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import rig


@pytest.fixture(scope="session")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return rig.model_config(tmp_path_factory.mktemp("models") / rig.MODEL_NAME)


@pytest.fixture
def engines(model_config: Any, redis_url: str, key_prefix: str
            ) -> Iterator[Callable[..., rig.Instance]]:
    """`engines(url=..., layout=..., tp=..., windows=..., scheduling=...,
    **connector_extra_config)`: a new engine (`windows`: layer -> sliding window, a hybrid
    model; `scheduling`: more `SchedulerConfig` fields) whose
    connector uses this test's key prefix and Redis (`url`, default the session's)."""
    made: list[rig.Instance] = []

    def make(*, url: str = redis_url, layout: str = "LBNHC", mla: bool = False, tp: int = 1,
             num_blocks: int = 256, cache_dtype: str = "auto", policy: str = "recompute",
             max_batched_tokens: int = 1024, prefix_caching: bool = False,
             kv_role: str = "kv_both", log_stats: bool = False,
             windows: dict[int, int] | None = None, hma: bool = True,
             scheduling: dict[str, Any] | None = None, **extra: Any) -> rig.Instance:
        # `always` unless a case says otherwise: the rig's forward is fake, its time says
        # nothing of a prefill, and a hit must not depend on the machine's load (the load
        # decision's own cases: tests/test_load_decision.py, tests/vllm_cpu)
        config = {"remote_url": url, "key_prefix": key_prefix, "chunk_size": rig.CHUNK,
                  "max_local_cpu_size": 0.05, "remote_timeout": 1.0, "load_policy": "always",
                  **extra}
        made.append(rig.Instance(model_config, config, layout=layout, mla=mla, tp=tp,
                                 num_blocks=num_blocks, cache_dtype=cache_dtype, policy=policy,
                                 max_batched_tokens=max_batched_tokens,
                                 prefix_caching=prefix_caching, kv_role=kv_role,
                                 log_stats=log_stats, windows=windows, hma=hma,
                                 scheduling=scheduling))
        return made[-1]

    yield make
    for engine in made:
        engine.close()

