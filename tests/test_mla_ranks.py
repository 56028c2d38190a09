"""MLA with `save_only_first_rank`: two tensor-parallel ranks as two processes on one Redis.
Rank 0 alone stores, one copy per chunk under the single-rank key, and both ranks load it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from kvutil import chunk_heads

from lmcache_remote import CacheConfig, CacheEngine, EngineMetadata

HERE = Path(__file__).parent


def run_ranks(mode: str, url: str, prefix: str, n: int) -> list[dict]:
    """Both ranks at once, as vLLM runs its tensor-parallel workers."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    procs = [
        subprocess.Popen([sys.executable, str(HERE / "mla_rank.py"), mode, url, prefix,
                          str(rank), "2", str(n)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for rank in (0, 1)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_two_mla_ranks_share_one_copy(redis_url: str, redis_client: redis.Redis,
                                      key_prefix: str) -> None:
    n = 800
    stored = run_ranks("store", redis_url, key_prefix, n)
    assert [r["stored"] for r in stored] == [768, 0]
    assert stored[0]["keys"] == stored[1]["keys"]
    keys = {k.decode() for k in redis_client.scan_iter(match=f"{key_prefix}:v1:*", count=1000)}
    assert chunk_heads(keys) == set(stored[0]["keys"][:3])  # one copy per chunk, no rank 1
    assert all(":deepseek/tiny-mla:1:0:bfloat16:{" in k for k in keys)
    loaded = run_ranks("retrieve", redis_url, key_prefix, n)
    for result in loaded:
        assert result["lookup"] == 768
        assert result["hits"] == 768
        assert result["exact"] is True and result["rest_untouched"] is True


@pytest.mark.parametrize("use_mla", [False, True])
def test_flag_without_mla_or_without_flag_keeps_per_rank_keys(
    redis_url: str, key_prefix: str, use_mla: bool
) -> None:
    """The flag changes nothing for ordinary attention (each rank holds other heads), and MLA
    without the flag keeps one copy per rank."""
    meta = EngineMetadata("m", 2, 1, torch.bfloat16, 2, 1 if use_mla else 2, 8, use_mla=use_mla)
    config = CacheConfig(remote_url=redis_url, key_prefix=key_prefix,
                         save_only_first_rank=not use_mla)
    with CacheEngine(config, meta) as engine:
        key = engine.token_db.chunks(list(range(256)))[0].key
    assert (key.world_size, key.worker_id) == (2, 1)
