"""Request identity in the chunk keys (docs/key-schema.md, "Request identity"): the golden
vectors against the library and against the spec's own Python (run from the page), the
adapter fingerprint, multimodal items and prompt embeddings, and the engine's `identity=`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_remote import CacheConfig, CacheEngine, DenseKV, EngineMetadata
from lmcache_remote.naming.fingerprint import (
    adapter_fingerprint,
    adapter_signature,
    model_fingerprint,
)
from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
from lmcache_remote.naming.identity import EmbedsDigests, MMItem, RequestIdentity, embeds_digests

DOC = Path(__file__).resolve().parents[1] / "docs" / "key-schema.md"
AD = "a1-00112233445566778899aabbccddeeff"
IMG = "d97b1ef8510ebdef0cb9ec8d9ae4a397986ba6bb4c14a310667138f19088de4e"
CONTENT = "c1-000102030405060708090a0b0c0d0e0f"


def section() -> str:
    text = DOC.read_text()
    start = text.index("## Request identity")
    return text[start:text.index("\n## ", start + 1)]


def spec_impl() -> Any:
    """The spec's Python, run from the page."""
    code = re.search(r"```python\n(.*?)```", section(), re.S)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(code.group(1), namespace)  # noqa: S102 - the documented reference implementation
    return namespace["chunk_hashes"]


def golden() -> dict[str, list[str]]:
    rows = {}
    for line in section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and all(re.fullmatch(r"`[0-9a-f]{32}`", c) for c in cells[1:]):
            rows[cells[0]] = [c.strip("`") for c in cells[1:]]
    return rows


EMBED_DIGESTS = tuple(bytes([i]) * 16 for i in range(3))
MIXED_MASKS = tuple(bytes(1 if j % 2 == 0 else 0 for j in range(s, min(s + 256, 600)))
                    for s in range(0, 600, 256))
#: row of the golden table -> (library identity, spec arguments, tokens)
CASES: dict[str, tuple[Any, dict[str, Any], list[int]]] = {
    "text": (None, {}, list(range(600))),
    "salt `s`": ("s", {"salt": "s"}, list(range(600))),
    f"adapter `{AD}`": (RequestIdentity(adapter=AD), {"adapter": AD}, list(range(600))),
    "salt `s` and that adapter": (RequestIdentity(cache_salt="s", adapter=AD),
                                  {"salt": "s", "adapter": AD}, list(range(600))),
    f"image `mm_identifier` `{IMG}`, offset 300, length 64": (
        RequestIdentity(mm_items=(MMItem("image", IMG, 300, 64),)),
        {"items": [("image", "identifier", IMG, 300, 64)]}, list(range(600))),
    "the same image across a boundary: offset 240": (
        RequestIdentity(mm_items=(MMItem("image", IMG, 240, 64),)),
        {"items": [("image", "identifier", IMG, 240, 64)]}, list(range(600))),
    f"image `mm_content` `{CONTENT}`, offset 300, length 64": (
        RequestIdentity(mm_items=(MMItem("image", CONTENT, 300, 64, kind="content"),)),
        {"items": [("image", "content", CONTENT, 300, 64)]}, list(range(600))),
    "prompt embeddings (600 zero ids), `bfloat16`, row digests `bytes([i]) * 16` for chunk `i`": (
        RequestIdentity(embeds=EmbedsDigests(256, "bfloat16", EMBED_DIGESTS)),
        {"embeds": ("bfloat16", EMBED_DIGESTS, None)}, [0] * 600),
    "a mixed prompt: ids `i` at even positions `i`, embeddings (id 0) at odd ones, mask 1 at "
    "even positions, digests as above": (
        RequestIdentity(embeds=EmbedsDigests(256, "bfloat16", EMBED_DIGESTS, MIXED_MASKS)),
        {"embeds": ("bfloat16", EMBED_DIGESTS, MIXED_MASKS)},
        [i if i % 2 == 0 else 0 for i in range(600)]),
}


def test_golden_vectors_of_the_library_and_of_the_spec() -> None:
    table = golden()
    assert set(table) == set(CASES)
    reference = spec_impl()
    for row, (identity, args, tokens) in CASES.items():
        ours = [h.hex() for h in chunk_hashes(tokens_to_array(tokens), 256, identity)]
        assert ours == table[row], row
        assert list(reference(tokens, 256, **args)) == table[row], row
    # text and salt keys are the chunk-hash spec's, unchanged
    assert table["text"][0] == "65d169dcbc055b777b60937838df07de"


def test_extras_only_where_an_item_overlaps_and_identity_flows_forward() -> None:
    t = tokens_to_array(list(range(600)))
    text = chunk_hashes(t, 256)
    x = chunk_hashes(t, 256, RequestIdentity(mm_items=(MMItem("image", "x", 300, 64),)))
    y = chunk_hashes(t, 256, RequestIdentity(mm_items=(MMItem("image", "y", 300, 64),)))
    moved = chunk_hashes(t, 256, RequestIdentity(mm_items=(MMItem("image", "x", 301, 64),)))
    assert x[0] == y[0] == text[0]  # before the image: a text chunk, shared
    assert len({x[1], y[1], moved[1], text[1]}) == 4  # the image's chunk names it and its place
    assert len({x[2], y[2], text[2]}) == 3  # chained: after the image too
    audio = chunk_hashes(t, 256, RequestIdentity(mm_items=(MMItem("audio", "x", 300, 64),)))
    assert audio[1] != x[1]
    content = chunk_hashes(t, 256, RequestIdentity(
        mm_items=(MMItem("image", "x", 300, 64, kind="content"),)))
    assert content[1] != x[1]  # an identifier never stands for a content digest


def test_no_text_chunk_shares_a_hash_with_a_chunk_with_extras() -> None:
    """A text prompt whose tokens spell out an extras chunk's bytes still hashes apart: the
    personalised BLAKE2b and the token count separate them."""
    ident = RequestIdentity(mm_items=(MMItem("image", "x", 0, 4),))
    tokens = [1, 2, 3, 4]
    with_extras = chunk_hashes(tokens_to_array(tokens), 256, ident)[0]
    extras = ident.extras(0, 4, 256)
    padded = extras + bytes(-len(extras) % 4)
    forged = tokens + [int.from_bytes(padded[i:i + 4], "little") for i in range(0, len(padded), 4)]
    assert with_extras not in chunk_hashes(tokens_to_array(forged), 256)
    assert with_extras != chunk_hashes(tokens_to_array(tokens), 256)[0]


def test_embeddings_rows_name_their_chunk() -> None:
    rows = torch.randn(600, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    changed = rows.clone()
    changed[300, 5] += 1
    zeros = tokens_to_array([0] * 600)
    a = chunk_hashes(zeros, 256, RequestIdentity(embeds=embeds_digests(rows, 256)))
    b = chunk_hashes(zeros, 256, RequestIdentity(embeds=embeds_digests(changed, 256)))
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # the change ends the hit at chunk 1
    assert a[0] != chunk_hashes(zeros, 256)[0]  # never the zero token ids' text chunk
    mixed = embeds_digests(rows, 256, mask=[i % 2 == 0 for i in range(600)])
    assert chunk_hashes(zeros, 256, RequestIdentity(embeds=mixed))[0] != a[0]
    with pytest.raises(ValueError, match="chunks of 256"):
        chunk_hashes(zeros, 128, RequestIdentity(embeds=embeds_digests(rows, 256)))
    as_f16 = embeds_digests(rows.to(torch.float16), 256)
    assert chunk_hashes(zeros, 256, RequestIdentity(embeds=as_f16))[0] != a[0]


def test_bad_identities_are_refused() -> None:
    with pytest.raises(ValueError, match="sorted"):
        RequestIdentity(mm_items=(MMItem("image", "b", 9, 1), MMItem("image", "a", 1, 1)))
    with pytest.raises(ValueError, match="placeholder"):
        MMItem("image", "a", -1, 4)
    with pytest.raises(ValueError, match="adapter"):
        RequestIdentity(adapter="has space")


def write_adapter(folder: Path, config: dict[str, Any], weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_adapter_fingerprint_names_the_files_not_the_place(tmp_path: Path) -> None:
    config = {"r": 8, "base_model_name_or_path": "/models/x", "peft_type": "LORA"}
    a = adapter_fingerprint(write_adapter(tmp_path / "a", config, b"abc"))
    worked = re.search(r"fingerprints as `(a1-[0-9a-f]{32})`", section())
    assert worked is not None and a == worked.group(1)
    moved = dict(config, base_model_name_or_path="/elsewhere/x")
    assert adapter_fingerprint(write_adapter(tmp_path / "b", moved, b"abc")) == a
    assert adapter_fingerprint(write_adapter(tmp_path / "c", config, b"abd")) != a
    assert adapter_fingerprint(write_adapter(tmp_path / "d", dict(config, r=16), b"abc")) != a
    before = adapter_signature(tmp_path / "a")
    write_adapter(tmp_path / "a", config, b"xyz")  # replaced in place, same name and path
    assert adapter_fingerprint(tmp_path / "a") != a
    assert adapter_signature(tmp_path / "a") != before


def test_processor_files_take_part_in_a_multimodal_models_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llava"}')
    (tmp_path / "model.bin").write_bytes(b"w" * 100)
    text_only = model_fingerprint(tmp_path, kv_dtype="bfloat16")
    (tmp_path / "preprocessor_config.json").write_text('{"crop_size": 224}')
    with_processor = model_fingerprint(tmp_path, kv_dtype="bfloat16")
    (tmp_path / "preprocessor_config.json").write_text('{"crop_size": 336}')
    other = model_fingerprint(tmp_path, kv_dtype="bfloat16")
    kwargs = model_fingerprint(tmp_path, kv_dtype="bfloat16",
                               processor_kwargs={"max_pixels": 100})
    assert len({text_only, with_processor, other, kwargs}) == 4


def test_the_engine_keeps_identities_apart(redis_url: str) -> None:
    """Through `CacheEngine` and a real Redis: a chunk stored under one identity is found only
    under it; `cache_salt=` is `identity=RequestIdentity(cache_salt=...)`."""
    meta = EngineMetadata("ident", 1, 0, torch.float32, 2, 2, 8)
    config = CacheConfig(remote_url=redis_url, key_prefix="lmcrt-identity", chunk_size=16,
                         local_cpu=False, store_async=False, stats_publish_interval=None,
                         load_policy="always")
    tokens = list(range(48))
    kv = DenseKV([torch.randn(2, 48, 8) for _ in range(2)], [torch.randn(2, 48, 8)
                                                             for _ in range(2)])
    image = RequestIdentity(mm_items=(MMItem("image", "x", 20, 8),))
    with CacheEngine(config, meta) as engine:
        assert engine.store(tokens, kv, identity=image) == 48
        assert engine.lookup(tokens, identity=image) == 48
        other = RequestIdentity(mm_items=(MMItem("image", "y", 20, 8),))
        assert engine.lookup(tokens, identity=other) == 16  # the text chunk before the image
        assert engine.lookup(tokens) == 16
        assert engine.lookup(tokens, identity=RequestIdentity(adapter="a1-x")) == 0
        assert engine.store(tokens, kv, cache_salt="s") == 48
        assert engine.lookup(tokens, identity=RequestIdentity(cache_salt="s")) == 48
        with pytest.raises(ValueError, match="give one of them"):
            engine.lookup(tokens, cache_salt="t", identity=RequestIdentity(cache_salt="s"))
