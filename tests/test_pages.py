"""Page keys (`keys.PageKey`) and the page store (`storage.pages.PageStore`) that SGLang's
HiCache backend stands on, against real servers (no SGLang needed: tests/sglang_hicache/
drives the same store from SGLang's own controller)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from lmcache_remote import load_config
from lmcache_remote.errors import KeyFormatError
from lmcache_remote.naming.keys import (
    CacheEngineKey,
    PageKey,
    page_scan_pattern,
    scan_pattern,
    split_page_part_key,
)
from lmcache_remote.storage.pages import PageStore

SHAPE = (2, 3000)  # two regions of 3000 bfloat16 values: 12,000 bytes a page
HASH = "ab" * 32


def store(url: str, prefix: str, shape: tuple[int, ...] = SHAPE, **fields: Any) -> PageStore:
    config = load_config(remote_url=url, key_prefix=prefix, **fields)
    return PageStore(config, shape, torch.bfloat16, 16)


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(torch.bfloat16) for _ in range(n)]


def keys(n: int, geometry: str = "mha.page-first.bfloat16.p16.tp0of1.r2x6000") -> list[PageKey]:
    return [PageKey("org/model:v2@f1-00", geometry, f"{i:064x}") for i in range(n)]


def write(st: PageStore, ks: list[PageKey], data: list[torch.Tensor]) -> list[bool]:
    return st.write(ks, lambda i, page: page.copy_(data[i]))


def read(st: PageStore, ks: list[PageKey]) -> tuple[list[bool], dict[int, torch.Tensor]]:
    got: dict[int, torch.Tensor] = {}
    return st.read(ks, lambda i, page: got.__setitem__(i, page.clone())), got


# -- keys ---------------------------------------------------------------------------------------


def test_page_key_round_trip_and_family() -> None:
    key = PageKey("org/model:v2{x}", "mla.layer-first.float16.p64.r3x2048", HASH)
    text = key.redis_key("lmcr")
    assert text == f"lmcr:hc1:org/model%3Av2%7Bx%7D:mla.layer-first.float16.p64.r3x2048:{{{HASH}}}"
    assert PageKey.from_redis_key("lmcr", text) == key
    assert split_page_part_key("lmcr", text + "#2") == (key, 2)
    assert key.part_keys("lmcr", 2) == [text, text + "#1"]
    # its own family: chunk patterns never match it, nor page patterns a chunk key
    chunk = CacheEngineKey("m", 1, 0, "bfloat16", "0" * 32).redis_key("lmcr")
    from fnmatch import fnmatchcase
    assert not fnmatchcase(text, scan_pattern("lmcr"))
    assert fnmatchcase(text, page_scan_pattern("lmcr", "org/model:v2{x}"))
    assert not fnmatchcase(chunk, page_scan_pattern("lmcr"))
    with pytest.raises(KeyFormatError):
        PageKey.from_redis_key("lmcr", chunk)
    # the digest a value carries binds the key without its prefix
    assert key.hash_bytes != PageKey(key.model_name, "mla.page-first.float16.p64.r1x6144",
                                     HASH).hash_bytes


@pytest.mark.parametrize("bad", ["", "a" * 129, "ab:cd", "ab}cd", "ab{", "a b"])
def test_page_key_refuses_a_hash_that_would_break_the_key(bad: str) -> None:
    with pytest.raises(KeyFormatError):
        PageKey("m", "mha.p16", bad)


# -- the store ----------------------------------------------------------------------------------


@pytest.mark.parametrize("part_size", [4 * 1024 * 1024, 4096], ids=["one-value", "parts"])
def test_round_trip_and_leading_run(backend_url: str, key_prefix: str, part_size: int) -> None:
    st = store(backend_url, key_prefix, remote_part_size=part_size)
    ks, data = keys(4), pages(4)
    assert write(st, ks, data) == [True] * 4
    assert st.present(ks) == 4
    assert st.present([ks[0], keys(9)[8], ks[1]]) == 1  # a leading run
    served, got = read(st, ks)
    assert served == [True] * 4
    assert all(torch.equal(got[i], data[i]) for i in range(4))
    if part_size == 4096:  # 12,000 bytes: several values, written and read as one page
        assert st.nparts >= 3
    st.close()


def test_windows_bound_a_call_and_keep_the_order(redis_url: str, key_prefix: str) -> None:
    config = load_config(remote_url=redis_url, key_prefix=key_prefix)
    st = PageStore(config, SHAPE, torch.bfloat16, 16, window_bytes=30000)  # 2 pages a window
    ks, data = keys(5), pages(5, seed=1)
    assert write(st, ks, data) == [True] * 5
    served, got = read(st, ks)
    assert served == [True] * 5 and all(torch.equal(got[i], data[i]) for i in range(5))


def test_staging_stays_within_the_memory_budget(redis_url: str, key_prefix: str) -> None:
    """Staging comes from one pool bounded by max_local_cpu_size: windows no larger than the
    budget, its buffers reused; a call that finds the budget held by another is cut short,
    counted, without raising, and goes on once the memory is back."""
    budget = 3 * 12000  # three pages
    config = load_config(remote_url=redis_url, key_prefix=key_prefix,
                         max_local_cpu_size=budget / 2**30, remote_read_lanes=1,
                         remote_write_lanes=1)
    st = PageStore(config, SHAPE, torch.bfloat16, 16)  # 32 MiB windows asked for
    ks, data = keys(8), pages(8, seed=3)
    assert write(st, ks, data) == [True] * 8
    served, got = read(st, ks)
    assert served == [True] * 8 and all(torch.equal(got[i], data[i]) for i in range(8))
    assert 0 < st.pool.held_bytes <= budget and st.pool.used_bytes == 0
    assert st.metrics.get("pages.budget_short") == 0
    other_call = st.pool.allocate((3, *SHAPE), torch.bfloat16)  # the whole budget, held
    assert other_call is not None
    assert read(st, ks)[0] == [False] * 8
    assert write(st, keys(8, geometry="mha.page-first.bfloat16.p16.tp0of1.r2x6000.b"),
                 data) == [False] * 8
    assert st.metrics.get("pages.budget_short") == 2
    other_call.release()
    served, got = read(st, ks)
    assert served == [True] * 8 and torch.equal(got[7], data[7])
    st.close()
    assert st.pool.held_bytes == 0


@pytest.mark.parametrize("lanes", [1, 4])
def test_a_missing_page_cuts_the_read_on_every_lane(redis_client: redis.Redis, redis_url: str,
                                                    key_prefix: str, lanes: int) -> None:
    """Windows of one page on `lanes` connections at once: the pages after a missing one
    are never served, whichever window finished first."""
    config = load_config(remote_url=redis_url, key_prefix=key_prefix, remote_read_lanes=lanes)
    st = PageStore(config, SHAPE, torch.bfloat16, 16, window_bytes=12000 * lanes)
    ks, data = keys(6), pages(6, seed=2)
    assert write(st, ks, data) == [True] * 6
    redis_client.unlink(ks[2].redis_key(key_prefix))
    served, got = read(st, ks)
    assert served == [True, True, False, False, False, False]
    assert sorted(got)[:2] == [0, 1] and torch.equal(got[1], data[1])


def test_damage_is_a_miss_deleted_and_the_read_stops(redis_client: redis.Redis, redis_url: str,
                                                     key_prefix: str) -> None:
    st = store(redis_url, key_prefix)
    ks = keys(3)
    write(st, ks, pages(3))
    name = ks[1].redis_key(key_prefix)
    redis_client.setrange(name, 200, b"\x00\x01")
    served, _ = read(st, ks)
    assert served == [True, False, False]
    assert redis_client.exists(name) == 0
    assert st.metrics.get("pages.corrupt") == 1


def test_a_missing_part_is_incomplete(redis_client: redis.Redis, redis_url: str,
                                      key_prefix: str) -> None:
    st = store(redis_url, key_prefix, remote_part_size=4096)
    ks = keys(2)
    write(st, ks, pages(2))
    redis_client.unlink(ks[0].redis_key(key_prefix) + "#2")
    assert st.present(ks) == 0
    assert read(st, ks)[0] == [False, False]
    assert st.metrics.get("pages.incomplete") == 1
    assert redis_client.exists(ks[0].redis_key(key_prefix)) == 0


def test_a_value_moved_under_another_key_is_foreign_and_left(
        redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    """Another page's (or geometry's) value under this key: readable, not this page's: a miss
    left in place, counted apart from damage."""
    st = store(redis_url, key_prefix)
    ks = keys(2)
    write(st, ks, pages(2))
    first, second = (k.redis_key(key_prefix) for k in ks)
    redis_client.set(second, redis_client.get(first))
    assert read(st, ks)[0] == [True, False]
    assert st.metrics.get("pages.foreign") == 1 and redis_client.exists(second) == 1
    other = store(redis_url, key_prefix, shape=(1, 6000))  # same bytes, another shape
    assert read(other, ks[:1])[0] == [False]
    assert other.metrics.get("pages.foreign") == 1


def test_integrity_key(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    key_file, other_file = tmp_path / "a.key", tmp_path / "b.key"
    key_file.write_bytes(b"8f3a" * 16)
    other_file.write_bytes(b"1b2c" * 16)
    for path in (key_file, other_file):
        path.chmod(0o600)
    signed = store(redis_url, key_prefix, integrity_key=f"file:{key_file}")
    ks, data = keys(2), pages(2)
    assert write(signed, ks, data) == [True, True]
    served, got = read(signed, ks)
    assert served == [True, True] and torch.equal(got[1], data[1])
    stranger = store(redis_url, key_prefix, integrity_key=f"file:{other_file}")
    assert read(stranger, ks)[0] == [False, False]
    assert stranger.metrics.get("pages.unauthenticated") == 1
    unsigned_prefix = key_prefix + "u"
    write(store(redis_url, unsigned_prefix), ks, data)
    strict = store(redis_url, unsigned_prefix, integrity_key=f"file:{key_file}")
    assert read(strict, ks)[0] == [False, False]  # no MAC: not served


def test_ttl(redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    st = store(redis_url, key_prefix, remote_ttl=60, remote_part_size=4096)
    ks = keys(1)
    write(st, ks, pages(1))
    ttls = [redis_client.pttl(name) for name in ks[0].part_keys(key_prefix, st.nparts)]
    assert all(0 < t <= 60_000 for t in ttls)


def test_clear_and_delete_touch_pages_only(redis_client: redis.Redis, redis_url: str,
                                           key_prefix: str) -> None:
    st = store(redis_url, key_prefix, remote_part_size=4096)
    ks = keys(3)
    write(st, ks, pages(3))
    other = keys(1, geometry="mha.layer-first.bfloat16.p16.tp0of1.r6x2000")
    write(st, other, pages(1))
    chunk = CacheEngineKey("m", 1, 0, "bfloat16", "0" * 32).redis_key(key_prefix)
    redis_client.set(chunk, b"x")
    assert st.delete(ks[:1]) == 1
    assert st.clear(ks[0].model_name, ks[0].geometry) == 2 * st.nparts
    assert st.present(other) == 1 and redis_client.exists(chunk) == 1
    assert st.clear() == st.nparts
    assert redis_client.exists(chunk) == 1


def test_server_gone_or_hung_is_a_miss(private_redis: Any, key_prefix: str) -> None:
    """Never an exception: a refused connection, then a server that never answers (each call
    ends at `remote_timeout`, then the health gate skips the server)."""
    st = store(private_redis.url, key_prefix, remote_timeout=0.3, unhealthy_backoff=0.1)
    ks = keys(2)
    assert write(st, ks, pages(2)) == [True, True]
    private_redis.pause()
    try:
        assert read(st, ks)[0] == [False, False]
        assert write(st, keys(3)[2:], pages(1)) == [False]
        assert st.present(ks) == 0
    finally:
        private_redis.resume()
    private_redis.stop()
    assert read(st, ks)[0] == [False, False]
    assert st.metrics.get("pages.errors") >= 3


def test_stats_count_pages_apart_from_chunks(redis_client: redis.Redis, redis_url: str,
                                             key_prefix: str) -> None:
    """`lmcache-remote stats` (the admin library and the CLI): pages per model and geometry,
    with the bytes of all their values; the chunk groups do not count them."""
    from cliutil import run, run_json

    st = store(redis_url, key_prefix, remote_part_size=4096)
    write(st, keys(3), pages(3))
    other = keys(1, geometry="mla.page-first.bfloat16.p16.r1x12000")
    write(st, other, pages(1))
    out = run_json("stats", "--url", redis_url, "--prefix", key_prefix)
    assert out["entries"] == 0 and out["groups"] == []
    values = list(redis_client.scan_iter(match=page_scan_pattern(key_prefix)))
    assert out["pages"]["entries"] == 4
    assert out["pages"]["bytes"] == sum(redis_client.strlen(k) for k in values)
    assert [(g["geometry"], g["entries"]) for g in out["pages"]["groups"]] == [
        ("mha.page-first.bfloat16.p16.tp0of1.r2x6000", 3),
        ("mla.page-first.bfloat16.p16.r1x12000", 1)]
    human = run("stats", "--url", redis_url, "--prefix", key_prefix)
    assert human.exit_code == 0 and "SGLang HiCache pages" in human.stdout


def test_evict_pages(redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    """`lmcache-remote evict --pages`: one model namespace's pages (every value), or all
    pages with --all; chunks and other models' pages stay; --dry-run deletes nothing."""
    from cliutil import run, run_json

    st = store(redis_url, key_prefix, remote_part_size=4096)
    write(st, keys(3), pages(3))
    theirs = [PageKey("other", "mha.p16", f"{i:064x}") for i in range(2)]
    write(st, theirs, pages(2))
    chunk = CacheEngineKey("org/model:v2@f1-00", 1, 0, "bfloat16", "0" * 32)
    redis_client.set(chunk.redis_key(key_prefix), b"x")
    base = ("evict", "--url", redis_url, "--prefix", key_prefix, "--pages")
    plan = run_json(*base, "--model", "org/model:v2@f1-00", "--dry-run")
    assert (plan["matched"], plan["deleted"]) == (3, 0) and plan["bytes"] > 3 * 12000
    done = run_json(*base, "--model", "org/model:v2@f1-00", "--yes")
    assert (done["matched"], done["deleted"], done["bytes"]) == (3, 3, plan["bytes"])
    assert st.present(keys(3)) == 0 and st.present(theirs) == 2
    assert redis_client.exists(chunk.redis_key(key_prefix)) == 1
    assert not [k for k in redis_client.scan_iter(match=f"{key_prefix}:hc1:org*")]
    assert run_json(*base, "--all", "--yes")["deleted"] == 2
    assert st.present(theirs) == 0 and redis_client.exists(chunk.redis_key(key_prefix)) == 1
    assert run(*base, "--dtype", "bfloat16", "--yes").exit_code == 2


def region_places(n: int, cuts: tuple[int, ...] = (5000,)) -> tuple[list[list[torch.Tensor]],
                                                                   Any]:
    """Per page, its bytes in separate buffers (cut at `cuts`), and the `places` of a read."""
    bounds = (0, *cuts, 12000)
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    regions = [[torch.zeros(b - a, dtype=torch.uint8) for a, b in spans] for _ in range(n)]
    return regions, lambda i: [r.numpy().data for r in regions[i]]


@pytest.mark.parametrize("part_size", [4 * 1024 * 1024, 4096], ids=["one-value", "parts"])
def test_read_in_place(redis_client: redis.Redis, redis_url: str, key_prefix: str,
                       part_size: int) -> None:
    """With `places` the values land in the caller's buffers (parts across several of them)
    and are checked there: nothing is drained; damage found there is deleted all the same."""
    st = store(redis_url, key_prefix, remote_part_size=part_size)
    ks, data = keys(3), pages(3, seed=5)
    write(st, ks, data)
    regions, places = region_places(3, cuts=(1000, 7001))
    drained: list[int] = []
    served = st.read(ks, lambda i, page: drained.append(i), places=places)
    assert served == [True] * 3 and drained == []
    for i in range(3):
        assert torch.equal(torch.cat(regions[i]), data[i].reshape(-1).view(torch.uint8))
    name = ks[1].redis_key(key_prefix)
    value = redis_client.get(name)
    assert value is not None
    redis_client.setrange(name, len(value) - 3, bytes([value[-3] ^ 1]))
    assert st.read(ks, lambda i, page: None, places=region_places(3)[1]) == [True, False, False]
    assert st.metrics.get("pages.corrupt") == 1 and redis_client.exists(name) == 0


def test_read_in_place_of_another_part_plan(redis_url: str, key_prefix: str) -> None:
    """A page another writer cut into other parts (another `remote_part_size`) is read apart:
    decoded into staging and drained."""
    ks, data = keys(2), pages(2, seed=6)
    write(store(redis_url, key_prefix, remote_part_size=4096), ks, data)
    reader = store(redis_url, key_prefix)
    got: dict[int, torch.Tensor] = {}
    regions, places = region_places(2)
    served = reader.read(ks, lambda i, page: got.__setitem__(i, page.clone()), places=places)
    assert served == [True, True] and sorted(got) == [0, 1]
    assert torch.equal(got[1], data[1])


@pytest.mark.parametrize("part_size", [4 * 1024 * 1024, 4096], ids=["one-value", "parts"])
def test_write_in_place_makes_the_same_values(redis_client: redis.Redis, redis_url: str,
                                              key_prefix: str, part_size: int) -> None:
    """Pages sent from the caller's buffers (parts across several of them, checksummed
    there) are byte for byte the values a write through staging makes, and read back."""
    data = pages(2, seed=7)
    regions, places = region_places(2, cuts=(1000, 7001))
    for i in range(2):
        flat = data[i].reshape(-1).view(torch.uint8)
        at = 0
        for r in regions[i]:
            r.copy_(flat[at:at + len(r)])
            at += len(r)
    ks = keys(2)
    staged = store(redis_url, key_prefix + "s", remote_part_size=part_size)
    direct = store(redis_url, key_prefix, remote_part_size=part_size)
    assert write(staged, ks, data) == [True, True]
    assert direct.write(ks, lambda i, page: pytest.fail("filled"), places=places) == [True] * 2
    for k in ks:
        for a, b in zip(k.part_keys(key_prefix + "s", staged.nparts),
                        k.part_keys(key_prefix, direct.nparts), strict=True):
            assert redis_client.get(a) == redis_client.get(b)
    served, got = read(direct, ks)
    assert served == [True, True] and torch.equal(got[1], data[1])


def test_inspect_a_page(redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    """`lmcache-remote inspect` of a page key (or one of its part keys): the header, checked
    against the page key, and the checksum verdict; damage shows as FAILED."""
    from cliutil import run, run_json

    st = store(redis_url, key_prefix, remote_part_size=4096)
    ks = keys(1)
    write(st, ks, pages(1))
    name = ks[0].redis_key(key_prefix)
    info = run_json("inspect", "--url", redis_url, "--prefix", key_prefix, name + "#1")
    assert (info["kind"], info["geometry"], info["page_hash"]) == (
        "page", ks[0].geometry, ks[0].page_hash)
    assert info["checksum_ok"] is True and info["header_hash_matches_key"] is True
    assert (info["parts"], info["shape"], info["num_tokens"]) == (st.nparts, list(SHAPE), 16)
    assert info["bytes"] == sum(redis_client.strlen(k) for k in ks[0].part_keys(key_prefix,
                                                                              st.nparts))
    redis_client.setrange(name + "#1", 10, b"\xff\xfe")
    damaged = run_json("inspect", "--url", redis_url, "--prefix", key_prefix, name)
    assert damaged["checksum_ok"] is False and "checksum" in damaged["error"]
    human = run("inspect", "--url", redis_url, "--prefix", key_prefix, name)
    assert "geometry" in human.stdout and "FAILED" in human.stdout


def test_ls_pages(redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    """`lmcache-remote ls --pages`: one row per page (part keys folded in), narrowed by
    --model, with the bytes of all its values; chunks are not listed."""
    from cliutil import run, run_json

    st = store(redis_url, key_prefix, remote_part_size=4096)
    write(st, keys(3), pages(3))
    write(st, [PageKey("other", "mha.p16", "ff" * 32)], pages(1))
    redis_client.set(CacheEngineKey("m", 1, 0, "bfloat16", "0" * 32).redis_key(key_prefix), b"x")
    base = ("ls", "--url", redis_url, "--prefix", key_prefix, "--pages")
    out = run_json(*base, "--model", "org/model:v2@f1-00")
    assert out["count"] == 3
    assert sorted(r["page_hash"] for r in out["pages"]) == sorted(k.page_hash for k in keys(3))
    row = out["pages"][0]
    assert (row["parts"], row["num_tokens"], row["error"]) == (st.nparts, 16, None)
    assert row["bytes"] == sum(redis_client.strlen(k) for k in
                               PageKey.from_redis_key(key_prefix, row["redis_key"])
                               .part_keys(key_prefix, st.nparts))
    assert run_json(*base, "--limit", "0")["count"] == 4
    assert run_json(*base, "--limit", "2")["count"] == 2
    human = run(*base)
    assert human.exit_code == 0 and "geometry" in human.stdout
    assert run(*base, "--dtype", "bfloat16").exit_code == 2


def test_export_and_import_pages(redis_url: str, key_prefix: str, tmp_path: Path) -> None:
    """`export --pages` writes one record per page (values byte for byte); `import` restores
    them under another prefix, where the page store reads them (a value binds its key without
    the prefix)."""
    from cliutil import run, run_json

    st = store(redis_url, key_prefix, remote_part_size=4096)
    ks, data = keys(3), pages(3, seed=8)
    write(st, ks, data)
    write(st, [PageKey("other", "mha.p16", "ff" * 32)], pages(1))
    snap = str(tmp_path / "pages.lmcr")
    out = run_json("export", "--url", redis_url, "--prefix", key_prefix, "--pages", "--model",
                   "org/model:v2@f1-00", snap)
    assert (out["entries"], out["skipped"]) == (3, 0)
    moved = key_prefix + "m"
    assert run_json("import", "--url", redis_url, "--prefix", moved, snap)["entries"] == 3
    served, got = read(store(redis_url, moved, remote_part_size=4096), ks)
    assert served == [True] * 3 and torch.equal(got[2], data[2])
    assert run("export", "--url", redis_url, "--prefix", key_prefix, "--pages", "--dtype",
               "bfloat16", snap).exit_code == 2


def test_pages_on_a_redis_cluster(key_prefix: str) -> None:
    """A `redis+cluster://` URL: pages (in parts, every part on its page's slot thanks to the
    hash tag) spread over the masters, are counted, read back exact, deleted and cleared."""
    from tests.cluster_servers import ClusterServers
    from tests.servers import RedisServer

    cluster = ClusterServers(3, 0, RedisServer).start()
    try:
        st = store(cluster.url, key_prefix, remote_part_size=4096)
        ks, data = keys(12), pages(12, seed=9)
        assert write(st, ks, data) == [True] * 12 and st.present(ks) == 12
        served, got = read(st, ks)
        assert served == [True] * 12 and all(torch.equal(got[i], data[i]) for i in range(12))
        holders = [m for m in cluster.masters
                   if list(m.client().scan_iter(match=f"{key_prefix}:hc1:*", count=1000))]
        assert len(holders) > 1  # spread over the masters
        assert st.delete(ks[:2]) == 2
        assert st.clear() == 10 * st.nparts and st.present(ks) == 0
    finally:
        cluster.stop()
