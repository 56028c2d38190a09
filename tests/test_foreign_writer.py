"""`lookup` counts what `retrieve` reads, however another writer cut its chunks into parts.

The chunks are written with redis-py by `docwriter`, which follows the docs alone: one value
where the project's plan cuts two, many small parts, parts of a size that is no multiple of
anything, lz4, and the planned cut itself. `lookup` and `retrieve` must agree on every prefix,
and the KV must come back bit-exact; a chunk whose header lists a part that is not there is
absent to both. The cluster tier's copy of this check is in test_cluster.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import kvutil
import pytest
import redis
import torch
from docwriter import chunk_hashes, chunk_key, chunk_values, write_chunk

from lmcache_remote import CacheEngine, DenseKV, EngineMetadata

CHUNK = 16
MODEL = "org/we:ird{model}%"
DTYPE = torch.float32
# 2 layers x 2 (K, V) x 16 tokens x 2 heads x 8 x 4 bytes: a 4 KiB chunk, which the plan cuts
# into 2 parts (3712 + 384 bytes, docs/value-format.md)
CHUNK_BYTES = kvutil.LAYERS * 2 * CHUNK * kvutil.HEADS * kvutil.HEAD * 4
#: How the foreign writer cuts each chunk of the prompt: (part_size, codec).
CUTS = [(CHUNK_BYTES, "raw"), (1024, "raw"), (1000, "raw"), (CHUNK_BYTES, "lz4"), (3712, "raw"),
        (64, "raw")]


def _meta() -> EngineMetadata:
    return EngineMetadata(MODEL, 1, 0, DTYPE, kvutil.LAYERS, kvutil.HEADS, kvutil.HEAD)


def _canonical(keys: list[torch.Tensor], values: list[torch.Tensor], start: int, end: int
               ) -> torch.Tensor:
    """[layers, 2, tokens, heads, head] of tokens [start, end) of a dense cache."""
    per_layer = [torch.stack([k[0, :, start:end].transpose(0, 1), v[0, :, start:end]
                              .transpose(0, 1)]) for k, v in zip(keys, values, strict=True)]
    return torch.stack(per_layer)


Writer = Callable[[Sequence[int], list[torch.Tensor], list[torch.Tensor], str], list[str]]


@pytest.fixture
def foreign_writer(backend_url: str) -> Iterator[Writer]:
    client = redis.Redis.from_url(backend_url)

    def write(tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor],
              prefix: str) -> list[str]:
        return write_foreign_chunks(client, tokens, keys, values, prefix)

    try:
        yield write
    finally:
        client.close()


def write_foreign_chunks(client: object, tokens: Sequence[int], keys: list[torch.Tensor],
                         values: list[torch.Tensor], prefix: str) -> list[str]:
    """Every chunk of `tokens`, chunk i cut as `CUTS[i]`; returns the chunk keys."""
    names = []
    for i, chunk_hash in enumerate(chunk_hashes(tokens, CHUNK)):
        kv = _canonical(keys, values, i * CHUNK, (i + 1) * CHUNK)
        part_size, codec = CUTS[i]
        name = chunk_key(prefix, MODEL, 1, 0, "float32", chunk_hash)
        write_chunk(client, name, chunk_values(kv, DTYPE, chunk_hash, part_size, codec))
        names.append(name)
    return names


def check_lookup_is_retrieve(url: str, prefix: str, tokens: list[int], keys: list[torch.Tensor],
                             values: list[torch.Tensor], expected: int) -> None:
    """lookup == retrieve == `expected` tokens, the retrieved KV bit-exact."""
    config = {"chunk_size": CHUNK, "local_cpu": False, "store_async": False,
              "stats_publish_interval": None}
    with kvutil.engine(url, prefix, _meta(), **config) as engine:
        assert isinstance(engine, CacheEngine)
        assert engine.lookup(tokens) == expected
        out_k, out_v = kvutil.dense_cache(len(tokens), DTYPE, None)
        mask = engine.retrieve(tokens, DenseKV(out_k, out_v))
        assert int(mask.sum()) == expected and bool(mask[:expected].all())
        for got, want in zip([*out_k, *out_v], [*keys, *values], strict=True):
            assert torch.equal(got[:, :, :expected], want[:, :, :expected])  # bit-exact
        assert engine.lookup(tokens) == expected  # reading changed nothing


def test_every_cut_counts_and_reads(foreign_writer: Writer, backend_url: str,
                                    key_prefix: str) -> None:
    tokens = list(range(1000, 1000 + CHUNK * len(CUTS)))
    keys, values = kvutil.dense_cache(len(tokens), DTYPE, seed=3)
    foreign_writer(tokens, keys, values, key_prefix)
    check_lookup_is_retrieve(backend_url, key_prefix, tokens, keys, values, len(tokens))


@pytest.mark.parametrize(("broken", "part"), [(1, 1), (2, 1), (5, 1)])
def test_a_listed_part_missing_is_absent_to_both(foreign_writer: Writer, backend_url: str,
                                                 key_prefix: str, broken: int, part: int) -> None:
    """Chunk `broken` (cut into more parts than the plan's two) loses part #1, a key the plan
    names: lookup reads its header, finds a listed part gone, and stops there, as retrieve does."""
    tokens = list(range(5000, 5000 + CHUNK * len(CUTS)))
    keys, values = kvutil.dense_cache(len(tokens), DTYPE, seed=4)
    names = foreign_writer(tokens, keys, values, key_prefix)
    with redis.Redis.from_url(backend_url) as client:
        assert client.unlink(f"{names[broken]}#{part}") == 1
    check_lookup_is_retrieve(backend_url, key_prefix, tokens, keys, values, broken * CHUNK)


def test_a_part_beyond_the_planned_keys_missing_costs_one_miss(
        foreign_writer: Writer, backend_url: str, key_prefix: str) -> None:
    """The documented limit: a chunk cut into more parts than the plan is counted by the keys
    the plan names (one round trip), so when a later part is gone (evicted) lookup still counts
    it; retrieve checks every part the header lists, stops there, and deletes the chunk, and
    from then on both agree."""
    tokens = list(range(7000, 7000 + CHUNK * len(CUTS)))
    keys, values = kvutil.dense_cache(len(tokens), DTYPE, seed=6)
    names = foreign_writer(tokens, keys, values, key_prefix)
    with redis.Redis.from_url(backend_url) as client:
        assert client.unlink(f"{names[2]}#3") == 1  # chunk 2: 5 parts, the plan names 2
    config = {"chunk_size": CHUNK, "local_cpu": False, "store_async": False,
              "stats_publish_interval": None}
    with kvutil.engine(backend_url, key_prefix, _meta(), **config) as engine:
        assert engine.lookup(tokens) == len(tokens)
        out_k, out_v = kvutil.dense_cache(len(tokens), DTYPE, None)
        assert int(engine.retrieve(tokens, DenseKV(out_k, out_v)).sum()) == 2 * CHUNK
    check_lookup_is_retrieve(backend_url, key_prefix, tokens, keys, values, 2 * CHUNK)


def test_a_head_of_another_chunk_is_absent_to_both(foreign_writer: Writer, backend_url: str,
                                                   key_prefix: str) -> None:
    """A one-value chunk copied under another chunk's key: its header names another hash."""
    tokens = list(range(9000, 9000 + CHUNK * len(CUTS)))
    keys, values = kvutil.dense_cache(len(tokens), DTYPE, seed=5)
    names = foreign_writer(tokens, keys, values, key_prefix)
    with redis.Redis.from_url(backend_url) as client:
        client.set(names[1], client.get(names[0]))  # a valid value of chunk 0
        client.unlink(*(f"{names[1]}#{i}" for i in range(1, 4)))
    check_lookup_is_retrieve(backend_url, key_prefix, tokens, keys, values, CHUNK)
