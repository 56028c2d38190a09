from __future__ import annotations

import numpy as np
import pytest
import torch
from kvutil import reference_hashes

from lmcache_remote.naming.hashing import KeyNamespace, TokenDatabase, chunk_hashes, tokens_to_array

NS = KeyNamespace("m", 1, 0, "bfloat16")


@pytest.mark.parametrize("salt", [None, "tenant-a", "ünïcode"])
def test_matches_spec(salt: str | None) -> None:
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, 2**32, 1000, dtype=np.uint64)]
    got = [h.hex() for h in chunk_hashes(tokens_to_array(tokens), 256, salt)]
    assert got == reference_hashes(tokens, 256, salt)


def test_input_kinds_agree_and_range_checked() -> None:
    ids = [0, 1, 2**32 - 1, 7]
    kinds = (ids, tuple(ids), iter(ids), np.array(ids, dtype=np.uint64),
             torch.tensor(ids, dtype=torch.int64), [np.int64(i) for i in ids])
    arrays = [tokens_to_array(x) for x in kinds]
    for arr in arrays:
        assert arr.dtype == np.dtype("<u4") and arr.tolist() == ids
    assert tokens_to_array([]).tolist() == [] and tokens_to_array(range(3)).tolist() == [0, 1, 2]
    for bad in ([-1], [2**32], [1.5], [None], [[1, 2]], b"\x01\x00\x00\x00", "ab",
                torch.tensor([1.0]), torch.tensor([[1, 2]]), ["a"]):
        with pytest.raises(ValueError):
            tokens_to_array(bad)


def test_token_database_chunks_and_partial() -> None:
    tokens = list(range(1000))
    db = TokenDatabase(NS, 256, save_unfull_chunk=False)
    specs = db.chunks(tokens, for_store=True)
    assert [(s.start, s.end) for s in specs] == [(0, 256), (256, 512), (512, 768)]
    assert [s.key.chunk_hash for s in specs] == reference_hashes(tokens, 256)[:3]
    assert db.chunks(tokens, for_store=False)[-1].end == 1000
    db_partial = TokenDatabase(NS, 256, save_unfull_chunk=True)
    assert db_partial.chunks(tokens, for_store=True)[-1].end == 1000


def test_mask_skips_prefix_and_is_validated() -> None:
    db = TokenDatabase(NS, 256, save_unfull_chunk=False)
    mask = torch.ones(1000, dtype=torch.bool)
    mask[:512] = False
    specs = db.chunks(list(range(1000)), mask, for_store=True)
    assert [(s.start, s.end) for s in specs] == [(512, 768)]
    assert specs[0].key.chunk_hash == reference_hashes(list(range(1000)), 256)[2]
    bad = torch.ones(1000, dtype=torch.bool)
    bad[:100] = False
    with pytest.raises(ValueError, match="multiple"):
        db.chunks(list(range(1000)), bad)
    holes = torch.ones(1000, dtype=torch.bool)
    holes[300:400] = False
    with pytest.raises(ValueError, match="prefix"):
        db.chunks(list(range(1000)), holes)
    with pytest.raises(ValueError):
        db.chunks(list(range(1000)), torch.ones(999, dtype=torch.bool))


def test_a_namespace_checks_its_fields_once_and_makes_the_keys_a_checked_key_would_be() -> None:
    from lmcache_remote.errors import KeyFormatError
    from lmcache_remote.naming.keys import CacheEngineKey

    for bad in (("", 1, 0, "bfloat16"), ("m", 1, 1, "bfloat16"), ("m", 1, 0, "Bad dtype")):
        with pytest.raises(KeyFormatError):
            KeyNamespace(*bad)
    ns = KeyNamespace("org/model:v{1}", 2, 1, "float16")
    digest = bytes(range(16))
    key = ns.key(digest)
    checked = CacheEngineKey("org/model:v{1}", 2, 1, "float16", digest.hex())
    assert key == checked and hash(key) == hash(checked)
    assert key.redis_key("p") == checked.redis_key("p")
    assert CacheEngineKey.from_string(key.to_string()) == checked
    with pytest.raises(KeyFormatError):
        ns.key(digest[:15])
