"""A rolling upgrade: engines of two releases share one Redis and never erase each other's
values (DESIGN.md, "Redis layout": evolution).

The other release is this code with its value format version raised to 2, in a process of its
own (`_next_release`): what a release with a new format would do with this one's values, and
this one with its. What this cannot show: a real next release's header layout (this reader
refuses every other version without reading further, so the layout does not matter to it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import kvutil
import redis
from faultkit import check_retrieve, det_kv, sentinel_kv
from kvutil import chunk_heads

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 256

_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import lmcache_remote.values.value_format as value_format
    value_format.FORMAT_VERSION = 2  # the next release
    import faultkit, kvutil
    url, prefix, op, seed = sys.argv[1:5]
    toks = kvutil.tokens(3 * 256, int(seed))
    with kvutil.engine(url, prefix, store_async=False, local_cpu=False) as engine:
        if op == "store":
            done = engine.store(toks, faultkit.det_kv(toks))
        else:
            dst, read = faultkit.sentinel_kv(len(toks))
            done = faultkit.check_retrieve(engine.retrieve(toks, dst), toks, read)
        remote = engine.stats()["remote"]
    print(json.dumps({{"tokens": done, "foreign": remote.get("foreign_chunks", 0),
                      "corrupt": remote.get("corrupt_chunks", 0)}}))
""")


def _next_release(url: str, prefix: str, op: str, seed: int) -> dict[str, int]:
    script = _SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"))
    out = subprocess.run([sys.executable, "-c", script, url, prefix, op, str(seed)],
                         capture_output=True, text=True, timeout=120, check=True)
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _values(client: redis.Redis, prefix: str) -> dict[bytes, bytes]:
    keys = sorted(client.scan_iter(match=f"{prefix}:v1:*"))
    return dict(zip(keys, client.mget(keys), strict=True))


def test_two_releases_share_redis_without_erasing_each_other(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    ours, theirs = kvutil.tokens(3 * CHUNK, 1), kvutil.tokens(3 * CHUNK, 2)
    with kvutil.engine(redis_url, key_prefix, store_async=False, local_cpu=False) as engine:
        assert engine.store(ours, det_kv(ours)) == 3 * CHUNK
    assert _next_release(redis_url, key_prefix, "store", 2)["tokens"] == 3 * CHUNK
    assert len(chunk_heads(redis_client.scan_iter(match=f"{key_prefix}:v1:*"))) == 6
    before = _values(redis_client, key_prefix)

    # this release reads the next one's chunks: a miss, left in place, counted apart
    with kvutil.engine(redis_url, key_prefix, local_cpu=False) as engine:
        dst, read = sentinel_kv(len(theirs))
        assert check_retrieve(engine.retrieve(theirs, dst), theirs, read) == 0
        remote = engine.stats()["remote"]
        assert remote.get("foreign_chunks") == 1 and not remote.get("corrupt_chunks")
        assert engine.lookup(theirs) == 0  # no longer promised by this process
        dst, read = sentinel_kv(len(ours))
        assert check_retrieve(engine.retrieve(ours, dst), ours, read) == 3 * CHUNK
    # the next release reads this one's: the same, the other way round
    assert _next_release(redis_url, key_prefix, "retrieve", 1) == {
        "tokens": 0, "foreign": 1, "corrupt": 0}
    assert _next_release(redis_url, key_prefix, "retrieve", 2)["tokens"] == 3 * CHUNK
    assert _values(redis_client, key_prefix) == before  # nothing erased, nothing rewritten
