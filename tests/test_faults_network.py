"""Connections cut in the middle of a value (a loopback proxy that closes after N bytes).

No partial value may ever be used: a retrieve through a connection cut anywhere in a reply
reports a miss (or a shorter exact prefix), never wrong bytes, and never deletes the intact
chunk it could not read. A write cut anywhere in a request never leaves half a chunk in Redis.
"""

from __future__ import annotations

import random

import pytest
from faultkit import CuttingProxy, bound, check_retrieve, det_kv, sentinel_kv, timed
from kvutil import engine
from servers import RedisServer

TIMEOUT = 0.5
CLEAN_TIMEOUT = 30.0  # a read through the proxy with no cut: exactness, not speed
CHUNK = 256
# one chunk of the test geometry is 32 KiB raw (2 layers x 2 x 256 tokens x 2 heads x 8 x bf16)
CUT_POINTS = [0, 1, 5, 40, 100, 1000, 16_000, 16_500, 33_000, 40_000, 65_000]


@pytest.mark.parametrize("serde", ["raw", "lz4"])  # raw parts are received into the chunk
@pytest.mark.parametrize("part_size", [None, 4096], ids=["one_value", "multipart"])
def test_reply_cut_mid_value_is_never_used(private_redis: RedisServer, key_prefix: str,
                                          part_size: int | None, serde: str) -> None:
    rng = random.Random(21)
    toks = [rng.randrange(50_000) for _ in range(4 * CHUNK)]
    extra = {"serde": serde} if part_size is None else {"remote_part_size": part_size,
                                                        "serde": serde}
    with engine(private_redis.url, key_prefix, store_async=False, **extra) as w:
        assert w.store(toks, det_kv(toks)) == len(toks)
    client = private_redis.client()
    keys_before = sorted(client.scan_iter(match=f"{key_prefix}:v1:*"))
    with CuttingProxy(private_redis.port) as proxy:
        for cut in CUT_POINTS:
            proxy.set_limits(down_limit=cut)
            with engine(proxy.url, key_prefix, local_cpu=False, remote_timeout=TIMEOUT,
                        unhealthy_backoff=0.05, **extra) as r:
                dst, read = sentinel_kv(len(toks))
                hit, took = timed(lambda r=r, d=dst: r.retrieve(toks, d))
                n = check_retrieve(hit, toks, read)
                assert n < len(toks)  # every request is cut somewhere before its end
                assert took < bound(2, TIMEOUT)
                _, took = timed(lambda r=r: r.lookup(toks))
                assert took < bound(2, TIMEOUT)
                stats = r.stats()["remote"]
                assert stats.get("corrupt_chunks", 0) == 0, f"cut at {cut} seen as corruption"
        assert proxy.cuts > 0
        # nothing was deleted for having been read through a broken connection
        assert sorted(client.scan_iter(match=f"{key_prefix}:v1:*")) == keys_before
        # the same proxy without a cut serves everything, exact (what this shows is
        # exactness, not speed: a busy machine took more than TIMEOUT to pass 128 KiB through
        # the Python proxy in 4 KiB parts, so a timeout no machine reaches)
        proxy.set_limits(down_limit=None)
        with engine(proxy.url, key_prefix, local_cpu=False, remote_timeout=CLEAN_TIMEOUT,
                    **extra) as r:
            dst, read = sentinel_kv(len(toks))
            assert check_retrieve(r.retrieve(toks, dst), toks, read) == len(toks)
    client.close()


@pytest.mark.parametrize("part_size", [None, 4096], ids=["one_value", "multipart"])
def test_write_cut_mid_value_leaves_whole_chunks_or_none(private_redis: RedisServer,
                                                         key_prefix: str,
                                                         part_size: int | None) -> None:
    rng = random.Random(22)
    extra = {} if part_size is None else {"remote_part_size": part_size}
    requests = []
    with CuttingProxy(private_redis.port) as proxy:
        for cut in [10, 200, 5_000, 16_400, 20_000, 40_000, 60_000]:
            proxy.set_limits(down_limit=None, up_limit=cut)
            toks = [rng.randrange(50_000) for _ in range(4 * CHUNK)]
            requests.append(toks)
            with engine(proxy.url, key_prefix, local_cpu=False, store_async=False, serde="raw",
                        remote_timeout=TIMEOUT, **extra) as w:
                _, took = timed(lambda w=w, t=toks: w.store(t, det_kv(t)))
                assert took < bound(3, TIMEOUT)
        assert proxy.cuts > 0
    with engine(private_redis.url, key_prefix, local_cpu=False, **extra) as r:
        for toks in requests:
            dst, read = sentinel_kv(len(toks))
            check_retrieve(r.retrieve(toks, dst), toks, read)
        assert r.stats()["remote"].get("corrupt_chunks", 0) == 0
