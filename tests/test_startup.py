"""The start-up line (`lmcache_remote.engine.startup`): one INFO line per process and component,
with the version, namespace, native loop, connection count and the configuration, no secret in it;
`require_native` makes a missing C extension an error that says why."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kvutil import engine, packed_writer

from lmcache_remote import CacheConfig, ConfigError, __version__
from lmcache_remote.engine import startup
from lmcache_remote.integrations.vllm_core import KVGeometry, PrefixLookup, load_settings
from lmcache_remote.integrations.vllm_core.worker import WorkerSide
from lmcache_remote.naming.hashing import KeyNamespace
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cretPassw0rdXYZ"
KEY = "9f" * 32  # 64 bytes of integrity key, held in an environment variable


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "lmcache_remote.startup" and r.levelno == logging.INFO]


def test_one_line_with_what_the_cache_does_and_no_secret(
        private_redis: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = private_redis
    with server.client() as admin:
        admin.config_set("requirepass", PASSWORD)
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    monkeypatch.setenv("LMCR_TEST_INTEGRITY", KEY)
    caplog.set_level(logging.INFO, logger="lmcache_remote")
    settings = {"integrity_key": "env:LMCR_TEST_INTEGRITY", "remote_write_lanes": 6,
                "load_policy": "pays"}
    with engine(url, key_prefix, **settings) as e:
        kv_tokens = 256
        assert e.lookup(list(range(kv_tokens))) == 0
    with engine(url, key_prefix, **settings):
        pass  # the same engine again in this process: said already
    found = lines(caplog)
    assert len(found) == 1, found
    line = found[0]
    assert line.startswith(f"lmcache-remote {__version__} engine started: namespace "
                           "'test/model'")
    assert "native loop on, native rows on" in line  # the suite runs with the build
    assert "connections <= 13 (6 write lanes + 4 read lanes + toucher + publisher + 1 caller)" \
        in line
    assert "serde threads" in line and "CPUs available" in line
    assert ("load policy pays, from link 1250.0 MB/s (prior), round trip 1.00 ms (prior), "
            "prefill 4000 tokens/s (prior)") in line
    assert f"remote_url='redis://:***@127.0.0.1:{server.port}/0'" in line
    assert f"key_prefix='{key_prefix}'" in line and "integrity_key='set'" in line
    for secret in (PASSWORD, KEY, "LMCR_TEST_INTEGRITY"):
        assert secret not in caplog.text
    caplog.clear()
    with engine(url, key_prefix + "b", **settings):
        pass  # another prefix: another cache, its own line
    assert len(lines(caplog)) == 1


def test_once_per_process_start(redis_url: str, key_prefix: str) -> None:
    code = textwrap.dedent(f"""
        import logging, sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        logging.basicConfig(level=logging.INFO, format="%(name)s|%(message)s")
        from kvutil import engine
        for _ in range(3):
            with engine({redis_url!r}, {key_prefix!r}, stats_publish_interval=None):
                pass
    """)
    for _ in range(2):  # each start of a process says it once
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, check=True, cwd=ROOT)
        said = [line for line in out.stderr.splitlines()
                if line.startswith("lmcache_remote.startup|")]
        assert len(said) == 1, out.stderr
        assert "connections <= 14 (8 write lanes + 4 read lanes + toucher + 1 caller)" \
            in said[0]


def _without_extension(body: str, env: dict[str, str] | None = None
                       ) -> subprocess.CompletedProcess[str]:
    """Run `body` in a process where lmcache_remote.native._wire cannot be imported (as after a
    build without a compiler)."""
    code = "import sys\nsys.modules['lmcache_remote.native._wire'] = None\n" + textwrap.dedent(body)
    full_env = {k: v for k, v in os.environ.items() if k != "LMCR_REQUIRE_NATIVE"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=full_env)


def test_require_native_fails_without_the_extension() -> None:
    body = """
        import logging
        logging.basicConfig(level=logging.INFO, format="%(name)s|%(message)s")
        import torch
        from lmcache_remote import CacheConfig, CacheEngine, ConfigError, EngineMetadata
        meta = EngineMetadata("m", 1, 0, torch.bfloat16, 2, 2, 8)
        config = CacheConfig(remote_url=None, require_native={flag})
        try:
            CacheEngine(config, meta).close()
        except ConfigError as exc:
            print("REFUSED", exc)
        else:
            print("STARTED")
    """
    off = _without_extension(body.replace("{flag}", "False"))
    assert "STARTED" in off.stdout, off.stderr
    said = [x for x in off.stderr.splitlines() if x.startswith("lmcache_remote.startup|")]
    assert len(said) == 1 and "native loop off, native rows off (C extension not built: " \
        "ModuleNotFoundError: import of lmcache_remote.native._wire halted" in said[0]
    on = _without_extension(body.replace("{flag}", "True"))
    assert "REFUSED require_native: the C extension lmcache_remote.native._wire is not available " \
        "(ModuleNotFoundError: " in on.stdout, on.stdout + on.stderr
    assert "python3-dev" in on.stdout
    # the environment variable alone, on a config built without load_config
    env = _without_extension(body.replace("{flag}", "False"), {"LMCR_REQUIRE_NATIVE": "1"})
    assert "REFUSED require_native" in env.stdout, env.stdout + env.stderr


def test_require_native_with_the_extension_starts(redis_url: str, key_prefix: str) -> None:
    with engine(redis_url, key_prefix, require_native=True) as e:
        assert e.lookup([1] * 256) == 0


def test_the_config_field_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_remote import load_config

    monkeypatch.setenv("LMCR_REQUIRE_NATIVE", "1")
    assert load_config().require_native is True
    monkeypatch.setenv("LMCR_REQUIRE_NATIVE", "0")
    assert load_config().require_native is False
    with pytest.raises(ConfigError, match="remote_read_lanes"):
        CacheConfig(remote_read_lanes=0)


def test_the_vllm_sides_say_theirs(private_redis: RedisServer, key_prefix: str,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="lmcache_remote")
    config = {"remote_url": private_redis.url, "key_prefix": key_prefix, "chunk_size": 64,
              "stats_publish_interval": None}
    geometry = KVGeometry(2, 2, 8, torch.bfloat16, False)
    lookup = PrefixLookup(CacheConfig(**config), geometry.metadata("m@abc", 2, 0).layout,
                          [KeyNamespace("m@abc", 2, r, "bfloat16") for r in range(2)])
    lookup.close()
    side = WorkerSide(load_settings(config), "m@abc", 2, 1)
    caches = {f"l{i}": torch.randn(40, 2, 16, 16).to(torch.bfloat16) for i in range(2)}
    side.register(caches, use_mla=False, dtype=torch.bfloat16, block_size=16,
                  writer=packed_writer(caches["l0"]))
    assert side.engine is not None
    side.close()
    found = lines(caplog)
    assert len(found) == 2, found  # the worker's engine says nothing of its own
    scheduler, worker = found
    assert "vllm scheduler started: namespace 'm@abc'" in scheduler
    assert "connections <= 1 (1 caller)" in scheduler
    assert "vllm worker (rank 1) started: namespace 'm@abc'" in worker
    assert "KV layout packed, proven" in worker
    assert "connections <= 16 (8 write lanes + 4 read lanes + toucher + 3 callers)" in worker
    assert startup.vllm_version() is None or "vLLM " in worker  # vLLM is not loaded here
