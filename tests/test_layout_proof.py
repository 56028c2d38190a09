"""The layout proof (`layout_proof`, `vllm_core.proof`) and the `mapped` PagedKV layout.

The write ops here are reference ops of `kvutil` (a packed block, a tiled block like vLLM's
CPU backend, MLA's latent), standing in for vLLM's own, which need vLLM: what these tests
cannot show is that the reference ops are vLLM's. tests/vllm_cpu proves the reading against
vLLM's CPU kernels themselves (a real forward), tests/vllm_real against vLLM 0.33's plumbing.
"""

from __future__ import annotations

import pytest
import torch
from kvutil import mla_writer, packed_writer, tiled_writer, vnni_writer

from lmcache_remote.connectors import BlockMap, PagedKV
from lmcache_remote.connectors.layout_proof import LayoutUnproven, find_block_map
from lmcache_remote.integrations.vllm_core import RequestPlan, Span, WorkerSide, load_settings
from lmcache_remote.integrations.vllm_core.proof import proven_layout

B, H, D = 32, 2, 8


def _cache(blocks: int = 8, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(blocks, H, B, 2 * D, dtype=dtype)


def _kv(n: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(2, n, H, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("pairs", [False, True])
def test_a_tiled_block_is_read_per_token_through_the_ops_map(pairs: bool) -> None:
    """A block tiled by its op is found tiled, and the mapped view reads and writes each
    token's own K/V: whole blocks, parts of blocks, slots out of order."""
    layers = [_cache(), _cache()]
    writer = tiled_writer(layers[0], pairs=pairs)
    reading = proven_layout(layers, "packed", writer)
    assert reading.tiled and reading.layout == "mapped"
    assert reading.block_map is not None and reading.block_map.width == (2 if pairs else 1)
    slots = torch.tensor([3 * B + 5, 3 * B + 6, *range(B, 2 * B), 2 * B + 31, 4 * B])
    n = len(slots)
    kv = _kv(n, 1)
    for i in range(2):  # the op writes every layer the same way
        tiled_writer(layers[i], pairs=pairs)(kv, slots)
    view = reading.view(slots)
    out = torch.empty(view.chunk_shape(n), dtype=torch.bfloat16)
    view.gather([(0, n)], [out])
    assert torch.equal(out[0], kv) and torch.equal(out[1], kv)
    part = torch.empty(view.chunk_shape(10), dtype=torch.bfloat16)
    view.gather([(5, 15)], [part])
    assert torch.equal(part[0], kv[:, 5:15])
    # scatter: the bytes the op would leave
    fresh = [_cache(), _cache()]
    again = proven_layout(fresh, "packed", tiled_writer(fresh[0], pairs=pairs))
    again.view(slots).scatter([(0, n)], [out])
    assert torch.equal(fresh[0].view(torch.int16), layers[0].view(torch.int16))
    assert torch.equal(fresh[1].view(torch.int16), layers[1].view(torch.int16))


_WRITERS = {"vec": lambda c: tiled_writer(c), "vec-pairs": lambda c: tiled_writer(c, pairs=True),
            "vnni": lambda c: vnni_writer(c)}


@pytest.mark.parametrize("kind", list(_WRITERS))
def test_tiled_blocks_move_as_strided_copies_where_runs_allow(kind: str) -> None:
    """The CPU backend's tilings are strided views of a block (`BlockMap.tiles`): whole
    blocks and runs on a tile's edge move as strided copies, other runs through element
    indexes, in one call; both read each token's own K/V and write the op's bytes."""
    make = _WRITERS[kind]
    layers = [_cache(), _cache()]
    reading = proven_layout(layers, "packed", make(layers[0]))
    bm = reading.block_map
    assert bm is not None and bm.tiles is not None
    assert bm.tile_tokens == (16 if kind == "vnni" else 1)
    # in order: block 5 whole, block 2's second half; then single slots, out of order
    slots = torch.tensor([*range(5 * B, 6 * B), *range(2 * B + 16, 3 * B), 7 * B + 3, B + 9])
    n = len(slots)
    kv = _kv(n, 3)
    for layer in layers:
        make(layer)(kv, slots)
    view = reading.view(slots)
    assert isinstance(view, PagedKV)
    ranges = [(0, B), (B, B + 16), (B + 16, n)]
    assert view._mapped is not None
    aligned = view._mapped.tile_copies(range(2), B, B + 16,
                                       torch.empty(view.chunk_shape(16)), to_host=True)
    assert aligned is not None and len(aligned) == 4  # 2 layers x 2 planes, one run
    outs = [torch.full(view.chunk_shape(b - a), 7.0, dtype=torch.bfloat16) for a, b in ranges]
    view.gather(ranges, outs)
    got = torch.cat(outs, dim=2)
    assert torch.equal(got[0], kv) and torch.equal(got[1], kv)
    fresh = [_cache(), _cache()]
    again = proven_layout(fresh, "packed", make(fresh[0]))
    again.view(slots).scatter(ranges, outs)
    for a, b in zip(fresh, layers, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_map_no_strided_view_reads_takes_element_indexes() -> None:
    """A block map with no tiling (elements shuffled within the block) still reads and
    writes each token's own K/V, through element indexes."""
    like = _cache()
    perm = torch.randperm(2 * B * H * D, generator=torch.Generator().manual_seed(4))
    bm = BlockMap(perm.view(2, B, H, D), like)
    assert bm.tiles is None
    layers = [like, _cache()]
    slots = torch.tensor([*range(3 * B, 4 * B), 2 * B + 5])
    kv = torch.stack([_kv(len(slots), 5)] * 2)  # [layers, planes, tokens, heads, dims]
    view = PagedKV(layers, slots, layout="mapped", block_map=bm)
    view.scatter([(0, len(slots))], [kv])
    block, at = 3, int(perm.view(2, B, H, D)[1, 7, 1, 2])
    assert layers[1][block].reshape(-1)[at] == kv[1, 1, 7, 1, 2]
    out = torch.empty_like(kv)
    view.gather([(0, len(slots))], [out])
    assert torch.equal(out, kv)


def test_a_packed_block_keeps_its_row_copies() -> None:
    layers = [_cache()]
    reading = proven_layout(layers, "packed", packed_writer(layers[0]))
    assert not reading.tiled and reading.layout == "packed" and reading.block_map is None


def test_mla_latent_is_proven() -> None:
    layers = [torch.zeros(6, B, 24, dtype=torch.bfloat16)]
    reading = proven_layout(layers, "mla", mla_writer(layers[0]))
    assert reading.layout == "mla" and not reading.tiled


def test_the_guess_that_the_op_contradicts_is_refused_by_the_proof() -> None:
    """Reading a tiled cache as packed (the connector's old mistake) fails the proof."""
    from lmcache_remote.connectors.layout_proof import prove

    layers = [_cache()]
    writer = tiled_writer(layers[0])
    with pytest.raises(LayoutUnproven, match="read back different"):
        prove(layers[0], writer, lambda s: PagedKV(layers, s, layout="packed"),
              shape=(2, B, H, D), in_dtype=torch.bfloat16, scratch=(7, 6))


@pytest.mark.parametrize("fault", ["scaled", "dropped", "doubled", "none"])
def test_an_op_that_does_not_place_each_value_once_is_unproven(fault: str) -> None:
    layers = [_cache()]
    right = packed_writer(layers[0])

    def writer(kv: torch.Tensor, slots: torch.Tensor) -> None:
        if fault == "scaled":
            right(kv * 3, slots)
        elif fault == "dropped":
            right(kv[:, 1:], slots[1:])
        elif fault == "doubled":  # token 1 lands on token 0's slot too
            right(kv, slots)
            right(kv[:, 1:2], slots[:1])

    with pytest.raises(LayoutUnproven):
        proven_layout(layers, "packed", None if fault == "none" else writer)


def test_the_scratch_blocks_are_restored() -> None:
    layers = [torch.randn(5, H, B, 2 * D).to(torch.bfloat16)]
    before = layers[0].clone()
    proven_layout(layers, "packed", tiled_writer(layers[0]))
    assert torch.equal(layers[0], before)


def test_find_block_map_gives_storage_offsets_of_strided_blocks() -> None:
    """The map is in storage offsets: a cache with the block axis in the middle of its
    storage (strides permuted, as vLLM 0.33's layouts do) maps to where the bytes are."""
    storage = torch.zeros(H, 6, B, 2 * D, dtype=torch.bfloat16)  # heads outermost
    cache = storage.permute(1, 0, 2, 3)  # [blocks, heads, B, 2D] view
    found = find_block_map(cache, packed_writer(cache), shape=(2, B, H, D),
                           in_dtype=torch.bfloat16, scratch=5)
    assert torch.equal(found, PagedKV([cache], [], layout="packed").block_map)
    assert int(found[0, 0, 1, 0]) == storage.stride(0)


def test_block_map_checks_its_offsets() -> None:
    like = _cache()
    with pytest.raises(ValueError, match="distinct"):
        BlockMap(torch.zeros(2, B, H, D, dtype=torch.int64), like)
    good = PagedKV([like], [], layout="packed").block_map
    bm = BlockMap(good, like)
    with pytest.raises(ValueError, match="block map was made for"):
        PagedKV([torch.zeros(8, H, B, 2 * D, dtype=torch.float16)], [], layout="mapped",
                block_map=bm)


def test_an_unproven_worker_stores_nothing_and_fails_its_loads(private_redis) -> None:
    """Off: no engine, every planned load reported as failed blocks (vLLM recomputes), an
    asynchronous one as finished too, nothing stored."""
    config = {"remote_url": private_redis.url, "chunk_size": B, "local_cpu": False,
              "stats_publish_interval": None}
    side = WorkerSide(load_settings(config), "m", 1, 0)
    caches = {"l0": _cache(), "l1": _cache()}

    def broken(kv: torch.Tensor, slots: torch.Tensor) -> None:
        packed_writer(caches["l0"])(kv * 2, slots)

    side.register(caches, use_mla=False, dtype=torch.bfloat16, block_size=B, writer=broken)
    assert side.disabled is not None and not side.registered
    tokens = list(range(3 * B))
    slots = torch.arange(3 * B)
    side.begin_step([RequestPlan("sync", tokens, slots, None, Span(0, 0, 2 * B), None),
                     RequestPlan("async", tokens, slots + 3 * B, None, Span(0, 0, 2 * B),
                                 None, async_load=True),
                     RequestPlan("save", tokens, slots, None, None, Span(0, 0, 3 * B))])
    side.start_load()
    side.wait_for_save()
    assert side.take_load_errors() == {0, 1}
    assert side.finished_loads() == ({"async"}, set())  # failed by block, not by request
    assert side.take_load_errors() == {3, 4}
    assert private_redis.client().dbsize() == 0
