"""The Redis backend inside SGLang's own HiCache controller (see rig.py): pages written by
SGLang's backup thread, found by its hit query and loaded by its prefetch, byte for byte."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch
from rig import PAGE, Engine, tokens_for
from sglang.srt.mem_cache.utils import get_storage_hash_str

from lmcache_remote.naming.keys import PageKey, page_scan_pattern, split_page_part_key


def page_keys(client: redis.Redis, prefix: str) -> list[PageKey]:
    """The pages under `prefix` (their first values; part keys left out)."""
    found = [split_page_part_key(prefix, k)
             for k in client.scan_iter(match=page_scan_pattern(prefix), count=1000)]
    return [key for key, part in found if part == 0]


def round_trip(engines: Callable[..., Engine], pages: int = 5,
               extra: dict[str, Any] | None = None, **spec: Any) -> tuple[Engine, Engine]:
    """A writer engine backs up `pages` pages; a second engine (its own controller and pools)
    prefetches them with two unknown pages after: exactly the written pages load, equal."""
    writer = engines(extra, **spec)
    tokens = tokens_for(pages, seed=1)
    slots = writer.fill(pages, seed=2)
    assert writer.backup(tokens, slots) == pages * PAGE
    reader = engines(extra, **spec)
    loaded, dest = reader.prefetch(tokens + tokens_for(2, seed=3))
    assert loaded == pages * PAGE
    assert reader.page_bytes(dest, pages) == writer.page_bytes(slots, pages)
    return writer, reader


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct",
                                    "page_head"])
def test_mha_round_trip(engines: Callable[..., Engine], layout: str,
                        redis_client: redis.Redis, key_prefix: str) -> None:
    writer, _ = round_trip(engines, layout=layout)
    keys = page_keys(redis_client, key_prefix)
    assert sorted(k.page_hash for k in keys) == sorted(writer.hashes(tokens_for(5, seed=1)))
    geometry = {k.geometry for k in keys}
    assert geometry == {f"mha.{layout.replace('_', '-')}.bfloat16.p16.tp0of1."
                        f"{'r6x512' if layout == 'layer_first' else 'r2x1536'}"}
    assert {k.model_name for k in keys} == {"tiny-llama@test"}
    assert writer.backend.stats()["pages"]["written"] == 5


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_mla_round_trip(engines: Callable[..., Engine], layout: str,
                        redis_client: redis.Redis, key_prefix: str) -> None:
    round_trip(engines, layout=layout, mla=True)
    assert {k.geometry.split(".")[0] for k in page_keys(redis_client, key_prefix)} == {"mla"}


@pytest.mark.parametrize(("layout", "mla"), [("layer_first", False), ("page_first", True)])
def test_generic_interface(engines: Callable[..., Engine], layout: str, mla: bool,
                           redis_client: redis.Redis, key_prefix: str) -> None:
    """`interface_v1` off: SGLang hands flat page tensors to batch_set/batch_get; stored
    under a `flat` geometry, which a zero-copy engine never reads (other byte order)."""
    round_trip(engines, layout=layout, mla=mla, zero_copy=False)
    assert {k.geometry.split(".")[-1][:4] for k in page_keys(redis_client, key_prefix)} == {
        "flat"}
    zero_copy = engines(layout=layout, mla=mla)
    assert zero_copy.prefetch(tokens_for(5, seed=1))[0] == 0


def test_two_engines_share_pages_of_one_geometry_only(engines: Callable[..., Engine]) -> None:
    """Two engines each write a prompt and load the other's; an engine of another layout or
    dtype finds nothing of either (its keys name another geometry)."""
    a, b = engines(), engines()
    ta, tb = tokens_for(3, seed=10), tokens_for(4, seed=11)
    sa, sb = a.fill(3, seed=12), b.fill(4, seed=13)
    assert a.backup(ta, sa) == 3 * PAGE and b.backup(tb, sb) == 4 * PAGE
    loaded, dest = a.prefetch(tb)
    assert loaded == 4 * PAGE and a.page_bytes(dest, 4) == b.page_bytes(sb, 4)
    loaded, dest = b.prefetch(ta)
    assert loaded == 3 * PAGE and b.page_bytes(dest, 3) == a.page_bytes(sa, 3)
    assert engines(layout="page_first_direct").prefetch(ta)[0] == 0
    assert engines(dtype=torch.float16).prefetch(ta)[0] == 0


def test_evicted_middle_page_cuts_the_prefix(engines: Callable[..., Engine],
                                             redis_client: redis.Redis, key_prefix: str) -> None:
    writer = engines()
    tokens = tokens_for(5, seed=20)
    slots = writer.fill(5, seed=21)
    assert writer.backup(tokens, slots) == 5 * PAGE
    victim = PageKey("tiny-llama@test", writer.backend._pages_geometry, writer.hashes(tokens)[2])
    assert redis_client.unlink(victim.redis_key(key_prefix)) == 1
    reader = engines()
    loaded, dest = reader.prefetch(tokens)
    assert loaded == 2 * PAGE
    assert reader.page_bytes(dest, 2) == writer.page_bytes(slots, 2)


def test_damaged_value_is_a_miss_and_deleted(engines: Callable[..., Engine],
                                             redis_client: redis.Redis, key_prefix: str) -> None:
    writer = engines()
    tokens = tokens_for(4, seed=30)
    slots = writer.fill(4, seed=31)
    assert writer.backup(tokens, slots) == 4 * PAGE
    damaged = PageKey("tiny-llama@test", writer.backend._pages_geometry,
                      writer.hashes(tokens)[1]).redis_key(key_prefix)
    value = redis_client.get(damaged)
    assert value is not None
    redis_client.setrange(damaged, len(value) - 1, bytes([value[-1] ^ 0xFF]))
    reader = engines()
    # the hit query still sees the page (EXISTS); the read finds the damage and stops there
    loaded, dest = reader.prefetch(tokens)
    assert loaded == 1 * PAGE
    assert reader.page_bytes(dest, 1) == writer.page_bytes(slots, 1)
    assert redis_client.exists(damaged) == 0
    assert reader.backend.stats()["pages"]["corrupt"] == 1
    assert reader.prefetch(tokens)[0] == 1 * PAGE  # gone: the hit query now stops there too


def test_redis_down_is_misses(engines: Callable[..., Engine], private_redis: Any) -> None:
    """Redis gone under a running engine: the backup reports nothing written, the hit query
    nothing found, and SGLang's threads go on (the next calls return at once)."""
    engine = engines({"remote_url": private_redis.url, "remote_timeout": 0.5})
    tokens = tokens_for(3, seed=40)
    private_redis.stop()
    assert engine.backup(tokens, engine.fill(3, seed=41)) == 0
    assert engine.prefetch(tokens)[0] == 0
    assert engine.backup(tokens, engine.fill(3, seed=42)) == 0
    assert engine.backend.stats()["pages"]["errors"] >= 2


def test_storage_metrics(engines: Callable[..., Engine]) -> None:
    writer, reader = round_trip(engines)
    backup = writer.backend.get_stats()
    assert sum(backup.backup_pgs) == 5 and all(bw > 0 for bw in backup.backup_bandwidth)
    assert writer.backend.get_stats().backup_pgs == []  # drained
    assert sum(reader.backend.get_stats().prefetch_pgs) == 5


def test_redis_hung_is_bounded_misses(engines: Callable[..., Engine], private_redis: Any) -> None:
    """A server that accepts and never answers (SIGSTOP): each call ends at its deadline
    (`remote_timeout`) as a failed write or a miss, later ones are skipped while the health
    gate backs off, and once the server answers again the pages go through."""
    engine = engines({"remote_url": private_redis.url, "remote_timeout": 0.5,
                      "unhealthy_backoff": 0.2})
    tokens = tokens_for(3, seed=50)
    private_redis.pause()
    try:
        assert engine.backup(tokens, engine.fill(3, seed=51)) == 0
        assert engine.prefetch(tokens)[0] == 0
    finally:
        private_redis.resume()
    errors = engine.backend.stats()["pages"]["errors"]
    assert errors >= 2
    time.sleep(0.5)  # past the back-off: the next call probes the server again
    slots = engine.fill(3, seed=52)
    assert engine.backup(tokens, slots) == 3 * PAGE
    reader = engines({"remote_url": private_redis.url})
    loaded, dest = reader.prefetch(tokens)
    assert loaded == 3 * PAGE and reader.page_bytes(dest, 3) == engine.page_bytes(slots, 3)


def test_sglang_failure_injector(engines: Callable[..., Engine],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own fault injector around the backend (every call fails): nothing is written
    or found, and SGLang's detach still closes the backend through the wrapper."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
    engine = engines()
    assert type(engine.controller.storage_backend).__name__ == "HiCacheStorageFailureInjector"
    tokens = tokens_for(3, seed=60)
    assert engine.backup(tokens, engine.fill(3, seed=61)) == 0
    assert engine.prefetch(tokens)[0] == 0
    backend = engine.backend
    engine.controller.detach_storage_backend()
    assert backend._pages._closed.is_set()


def test_detach_and_reattach(engines: Callable[..., Engine]) -> None:
    """SGLang's runtime detach closes the backend; a new one attached in its place finds the
    pages the first one wrote."""
    engine = engines()
    tokens = tokens_for(4, seed=70)
    slots = engine.fill(4, seed=71)
    assert engine.backup(tokens, slots) == 4 * PAGE
    first = engine.backend
    engine.reattach()
    assert engine.backend is not first and first._pages._closed.is_set()
    loaded, dest = engine.prefetch(tokens)
    assert loaded == 4 * PAGE and engine.page_bytes(dest, 4) == engine.page_bytes(slots, 4)


def test_batches_of_128_pages(engines: Callable[..., Engine], redis_client: redis.Redis,
                              key_prefix: str) -> None:
    """130 pages of 64 tokens (256 KiB each): SGLang writes them as a batch of 128 and one of
    2, each cut into windows of the page store; all of them come back byte for byte."""
    spec = {"page": 64, "layers": 2, "heads": 4, "head_dim": 128, "size": 131 * 64}
    writer = engines(**spec)
    tokens = tokens_for(130, seed=80, page=64)
    slots = writer.fill(130, seed=81)
    assert writer.backup(tokens, slots) == 130 * 64
    assert writer.backend._pages.page_nbytes == 256 * 1024
    reader = engines(**spec)
    loaded, dest = reader.prefetch(tokens)
    assert loaded == 130 * 64
    assert reader.page_bytes(dest, 130) == writer.page_bytes(slots, 130)
    assert len(page_keys(redis_client, key_prefix)) == 130


def test_model_namespace_is_the_fingerprint_of_the_files(
        engines: Callable[..., Engine], sglang: Any, redis_client: redis.Redis,
        key_prefix: str) -> None:
    """`model_fingerprint` auto: the keys' model field is SGLang's model folder's name and the
    fingerprint of its files with the host pool's KV dtype, as the vLLM connector computes it
    for the same files."""
    from safetensors.torch import save_file

    from lmcache_remote.naming.fingerprint import model_fingerprint
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(sglang / "model.safetensors"))
    try:
        round_trip(engines, pages=2, extra={"model_fingerprint": "auto"})
        expected = f"tiny-llama@{model_fingerprint(sglang, kv_dtype='bfloat16')}"
    finally:
        (sglang / "model.safetensors").unlink()
    assert {k.model_name for k in page_keys(redis_client, key_prefix)} == {expected}


@pytest.mark.parametrize(("extra", "field"), [
    ({"chunk_sise": 256}, "chunk_sise"),
    ({"remote_timeout": -1}, "remote_timeout"),
    ({"model_fingerprint": "has space"}, "model_fingerprint"),
    ({"model_fingerprint": "auto", "model_name": "x"}, None),
])
def test_bad_configuration_stops_the_start(sglang: Any, redis_url: str, extra: dict[str, Any],
                                           field: str | None) -> None:
    """A bad extra config fails SGLang's attach with a `ConfigError` naming the field (the
    tiny model has no weights: `auto` cannot fingerprint it and says so)."""
    from lmcache_remote.errors import ConfigError
    with pytest.raises(ConfigError, match=field or "model_fingerprint"):
        Engine({"remote_url": redis_url, "model_fingerprint": "test", **extra})


def test_fleet_stats(engines: Callable[..., Engine], redis_url: str, key_prefix: str) -> None:
    """Each backend publishes its counters (role `sglang`) like an engine does, so
    `lmcache-remote stats` shows the SGLang fleet's hit rate: the reader asked for 7 pages
    (5 written, 2 unknown) and found 5."""
    from lmcache_remote import load_config
    from lmcache_remote.admin import CacheAdmin

    writer, reader = round_trip(engines)
    writer.close()  # SGLang's detach: the backend publishes a last time
    reader.close()
    with CacheAdmin(load_config(remote_url=redis_url, key_prefix=key_prefix)) as admin:
        fleet = admin.stats()["engines"]
    assert fleet["count"] == 2 and fleet["models"] == ["tiny-llama@test"]
    assert (fleet["lookup_tokens"], fleet["hit_tokens"]) == (7 * PAGE, 5 * PAGE)
    assert fleet["stored_tokens"] == fleet["retrieved_tokens"] == 5 * PAGE
    assert fleet["remote_written_bytes"] > 5 * 2 * 1536


def test_clear_deletes_this_backends_pages_only(engines: Callable[..., Engine],
                                                redis_client: redis.Redis,
                                                key_prefix: str) -> None:
    """SGLang's `clear_storage_backend` (POST /hicache/storage-backend/clear): this engine's
    pages (its model and geometry) go; another geometry's and chunks stay."""
    writer, reader = round_trip(engines)
    other = engines(layout="layer_first")
    tokens = tokens_for(2, seed=95)
    assert other.backup(tokens, other.fill(2, seed=96)) == 2 * PAGE
    chunk = f"{key_prefix}:v1:m:1:0:bfloat16:{{{'0' * 32}}}"
    redis_client.set(chunk, b"x")
    assert writer.controller.clear_storage_backend() is True
    assert reader.prefetch(tokens_for(5, seed=1))[0] == 0
    assert {k.geometry.split(".")[1] for k in page_keys(redis_client, key_prefix)} == {
        "layer-first"}
    assert other.prefetch(tokens)[0] == 2 * PAGE and redis_client.exists(chunk) == 1


def test_pages_keep_sglangs_request_namespaces(engines: Callable[..., Engine]) -> None:
    """SGLang names a page by the SHA-256 chain over its tokens, seeded with the request's
    namespace (`storage_namespace_seed` of its `extra_key`, where SGLang puts the LoRA id, and
    its cache salt); an image's placeholders are tokens derived from the image's hash there.
    The backend keys pages by that hash and never sees the tokens: pages written for one
    adapter or salt are found for it alone, the same token ids in another namespace miss.
    What the hash binds is SGLang's: SGLang's LoRA id is the adapter's name, not its files
    (docs/integrations.md, SGLang)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    engine = engines()
    tokens = tokens_for(4, seed=41)
    keys = {"base": RadixKey(tokens), "lora-a": RadixKey(tokens, extra_key="lora-a"),
            "lora-b": RadixKey(tokens, extra_key="lora-b"),
            "salted": RadixKey(tokens, cache_salt="s")}
    assert len({engine.hashes(tokens)[0]} | {
        get_storage_hash_str(k, None, page_size=engine.page)[0] for k in keys.values()}) == 4
    slots = engine.fill(4, seed=42)
    assert engine.backup(keys["lora-a"], slots) == 4 * engine.page
    hit, got = engine.prefetch(keys["lora-a"])
    assert hit == 4 * engine.page and got is not None
    assert engine.page_bytes(got, 4) == engine.page_bytes(slots, 4)
    for name in ("base", "lora-b", "salted"):
        assert engine.prefetch(keys[name]) == (0, None), name
