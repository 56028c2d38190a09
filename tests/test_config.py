from __future__ import annotations

import pytest

from lmcache_remote import CacheConfig, ConfigError, load_config
from lmcache_remote.config import mask_url


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("LMCR_"):
            monkeypatch.delenv(name)


def test_defaults_match_design() -> None:
    cfg = CacheConfig()
    assert cfg.chunk_size == 256
    assert cfg.remote_url == "redis://127.0.0.1:6379/0"
    assert cfg.key_prefix == "lmcr"
    assert cfg.local_cpu is True
    assert cfg.max_local_cpu_size == 5.0
    assert cfg.serde == "raw"  # chosen by DESIGN.md's codec-default rule (docs/benchmarks.md)
    assert cfg.remote_ttl == 30 * 24 * 3600  # volatile-lru can evict it; pins need that
    assert (cfg.store_after, cfg.store_after_window) == (1, 24 * 3600)  # every chunk stored
    assert (cfg.pin_budget, cfg.max_retain_seconds) == (1.0, 24 * 3600)
    assert cfg.save_unfull_chunk is False
    assert cfg.store_async is True
    assert cfg.remote_timeout == 2.0
    assert (cfg.metrics_port, cfg.metrics_host) == (None, "127.0.0.1")  # loopback when on
    with pytest.raises(AttributeError):
        cfg.chunk_size = 3  # type: ignore[misc]


def test_yaml_then_env_then_overrides(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 128\nserde: raw\nremote_ttl: 60\nkey_prefix: fromfile\n")
    cfg = load_config(path)
    got = (cfg.chunk_size, cfg.serde, cfg.remote_ttl, cfg.key_prefix)
    assert got == (128, "raw", 60.0, "fromfile")
    monkeypatch.setenv("LMCR_CHUNK_SIZE", "64")
    monkeypatch.setenv("LMCR_REMOTE_URL", "none")
    monkeypatch.setenv("LMCR_STORE_ASYNC", "false")
    cfg = load_config(path)
    assert (cfg.chunk_size, cfg.remote_url, cfg.store_async, cfg.serde) == (64, None, False, "raw")
    cfg = load_config(path, chunk_size=32)
    assert cfg.chunk_size == 32


def test_config_file_from_env(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("max_local_cpu_size: 1\n")
    monkeypatch.setenv("LMCR_CONFIG", str(path))
    assert load_config().max_local_cpu_size == 1.0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": "big"}, "chunk_size"),
        ({"serde": "zstd"}, "serde"),
        ({"remote_timeout": -1.0}, "remote_timeout"),
        ({"remote_url": "http://localhost"}, "remote_url"),
        ({"key_prefix": "a:b"}, "key_prefix"),
        ({"local_cpu": "yes"}, "local_cpu"),
        ({"remote_ttl": 0}, "remote_ttl"),
        ({"remote_part_size": 4095}, "remote_part_size"),
        ({"metrics_host": "0.0.0.0 --x"}, "metrics_host"),
        ({"metrics_host": ""}, "metrics_host"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_bad_values_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(**overrides)
    assert info.value.field == field
    assert field in str(info.value)


def test_bad_env_and_file_name_the_field(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCR_CHUNK_SIZE", "abc")
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config()
    monkeypatch.delenv("LMCR_CHUNK_SIZE")
    path = tmp_path / "c.yaml"
    path.write_text("chunk_sise: 3\n")
    with pytest.raises(ConfigError, match="chunk_sise"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="config_file"):
        load_config(path)
    with pytest.raises(ConfigError, match="config_file"):
        load_config(tmp_path / "missing.yaml")


def test_password_masked_in_errors_and_helpers() -> None:
    assert mask_url("redis://user:s3cret@host:1/0") == "redis://user:***@host:1/0"
    assert mask_url("redis://:s3cret@host") == "redis://:***@host"
    assert "s3cret" not in mask_url("rediss://h/0?password=s3cret")
    with pytest.raises(ConfigError) as info:
        load_config(remote_url="http://user:s3cret@host")
    assert "s3cret" not in str(info.value)
