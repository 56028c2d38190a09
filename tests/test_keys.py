from __future__ import annotations

import contextlib
import fnmatch

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_remote import CacheEngineKey, KeyFormatError
from lmcache_remote.naming.keys import (
    KEEP_PARTS,
    keep_key,
    keep_pattern,
    pins_key,
    scan_pattern,
    split_part_key,
)

H = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def test_redis_key_layout() -> None:
    key = CacheEngineKey("meta-llama/Llama-3.1-8B", 1, 0, "bfloat16", H)
    assert key.redis_key("lmcr") == f"lmcr:v1:meta-llama/Llama-3.1-8B:1:0:bfloat16:{{{H}}}"
    head = key.redis_key("lmcr")
    assert key.part_keys("lmcr", 3) == [head, head + "#1", head + "#2"]


def test_admission_count_and_pin_registry_keys_as_the_schema_gives_them() -> None:
    key = CacheEngineKey("meta-llama/Llama-3.1-8B", 1, 0, "bfloat16",
                         "0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    assert key.store_count_key("lmcr") == (
        "lmcr:n1:meta-llama/Llama-3.1-8B:1:0:bfloat16:{0f1e2d3c4b5a69788796a5b4c3d2e1f0}")
    assert pins_key("lmcr") == "lmcr:pins1"
    # neither is ever taken for a chunk by the listing, export or eviction
    assert not fnmatch.fnmatchcase(key.store_count_key("lmcr"), scan_pattern("lmcr"))
    assert not fnmatch.fnmatchcase(pins_key("lmcr"), scan_pattern("lmcr"))


def test_keep_keys_as_the_schema_gives_them() -> None:
    assert keep_key("lmcr", "index") == "lmcr:keep1:{lmcr}:index"
    assert [keep_key("p", part) for part in KEEP_PARTS] == [
        "p:keep1:{p}:index", "p:keep1:{p}:meta", "p:keep1:{p}:ghosts", "p:keep1:{p}:figures"]
    for part in KEEP_PARTS:  # never a chunk to the listing; each under its own pattern
        assert not fnmatch.fnmatchcase(keep_key("lmcr", part), scan_pattern("lmcr"))
        assert fnmatch.fnmatchcase(keep_key("lmcr", part), keep_pattern("lmcr"))
    with pytest.raises(KeyFormatError):
        keep_key("lmcr", "other")


def test_hostile_model_names_cannot_split_or_move_the_tag() -> None:
    key = CacheEngineKey("a:b{c}%3A:x}", 2, 1, "float16", H)
    rk = key.redis_key("p")
    assert rk.count("{") == 1 and rk.count("}") == 1 and rk.endswith(f"{{{H}}}")
    assert CacheEngineKey.from_redis_key("p", rk) == key
    assert CacheEngineKey.from_string(key.to_string()) == key


@given(
    model=st.text(min_size=1, max_size=40),
    world=st.integers(1, 64),
    data=st.data(),
    h=st.binary(min_size=16, max_size=16),
)
def test_round_trip_any_model_name(model: str, world: int, data: st.DataObject, h: bytes) -> None:
    worker = data.draw(st.integers(0, world - 1))
    key = CacheEngineKey(model, world, worker, "bfloat16", h.hex())
    assert CacheEngineKey.from_string(key.to_string()) == key
    assert CacheEngineKey.from_redis_key("lmcr", key.redis_key("lmcr")) == key
    assert split_part_key("lmcr", key.redis_key("lmcr") + "#7") == (key, 7)


@given(st.text(max_size=80))
def test_parsing_arbitrary_strings_raises_only_key_errors(text: str) -> None:
    for parse in (CacheEngineKey.from_string, lambda s: CacheEngineKey.from_redis_key("lmcr", s)):
        with contextlib.suppress(KeyFormatError):
            parse(text)


@pytest.mark.parametrize(
    "bad",
    [
        "m:1:0:bfloat16:" + H.upper(),
        "m:1:0:bfloat16:" + H[:-1],
        "m:1:1:bfloat16:" + H,
        "m:0:0:bfloat16:" + H,
        "m:01:0:bfloat16:" + H,
        "m%zz:1:0:bfloat16:" + H,
        "m:1:0:bfloat16",
        ":1:0:bfloat16:" + H,
    ],
)
def test_bad_keys_rejected(bad: str) -> None:
    with pytest.raises(KeyFormatError):
        CacheEngineKey.from_string(bad)


def test_scan_pattern_escapes_glob_characters() -> None:
    pattern = scan_pattern("lmcr", model_name="m*[x]", dtype="bfloat16")
    assert pattern == r"lmcr:v1:m\*\[x\]:*:*:bfloat16:{*"
