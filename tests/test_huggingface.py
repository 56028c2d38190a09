"""transformers end to end: tiny random models, real Redis; cached prefill equals recompute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from hfutil import CHUNK, cache_engine, full_logits, prompt, tiny_model

from lmcache_remote.integrations.huggingface import (
    CachedLM,
    engine_metadata,
    model_name_for,
)

HERE = Path(__file__).parent
KINDS = ["llama", "qwen2"]
TOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def model(request: pytest.FixtureRequest):
    return tiny_model(request.param)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_metadata_from_config() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=3, intermediate_size=32, vocab_size=50)
    meta = engine_metadata(config, model_name="m", dtype=torch.bfloat16)
    assert (meta.num_layers, meta.num_kv_heads, meta.head_size) == (3, 2, 16)
    assert meta.kv_dtype == torch.bfloat16
    config.head_dim = 8
    assert engine_metadata(config, model_name="m", dtype=torch.float16).head_size == 8
    with pytest.raises(ValueError, match="model_name"):
        engine_metadata(config, dtype=torch.float16)  # built from a config: no name


def test_model_name_is_folder_name_or_hub_id(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    config = LlamaConfig()
    config.name_or_path = str(folder) + "/"
    assert model_name_for(config) == "tiny-llama"
    config.name_or_path = "meta-llama/Llama-3.1-8B"
    assert model_name_for(config) == "meta-llama/Llama-3.1-8B"


def test_cached_prefix_gives_the_same_logits_and_kv(model, redis_url: str,
                                                     key_prefix: str) -> None:
    ids = prompt(100)
    with cache_engine(model, redis_url, key_prefix) as engine:
        lm = CachedLM(model, engine)
        first = lm.prefill(ids)
        assert first.hit_tokens == 0 and first.stored_tokens == [96]
        assert max_diff(first.logits, full_logits(model, ids)) == 0.0
        second = lm.prefill(ids)
    assert second.hit_tokens == 96
    assert second.logits.shape[1] == 4
    assert max_diff(second.logits, full_logits(model, ids)[:, 96:]) <= TOL
    for a, b in zip(second.cache.layers, first.cache.layers, strict=True):
        assert max_diff(a.keys, b.keys) <= TOL and max_diff(a.values, b.values) <= TOL


def test_greedy_generate_gives_the_same_tokens(model, redis_url: str, key_prefix: str) -> None:
    ids = prompt(70, seed=1)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    with cache_engine(model, redis_url, key_prefix) as engine:
        lm = CachedLM(model, engine)
        cold = lm.generate(ids, max_new_tokens=12, do_sample=False)
        warm = lm.generate(ids, max_new_tokens=12, do_sample=False)
    assert cold.hit_tokens == 0 and cold.stored_tokens == [64]
    assert warm.hit_tokens == 64
    assert torch.equal(cold.sequences, expected)
    assert torch.equal(warm.sequences, expected)


def test_whole_prompt_cached_still_runs_one_chunk(model, redis_url: str,
                                                  key_prefix: str) -> None:
    ids = prompt(64, seed=2)  # exactly 4 chunks, all stored
    with cache_engine(model, redis_url, key_prefix) as engine:
        lm = CachedLM(model, engine)
        assert lm.prefill(ids).stored_tokens == [64]
        again = lm.prefill(ids)
    assert again.hit_tokens == 48  # at most T - 1 tokens, whole chunks: the last chunk reruns
    assert max_diff(again.logits, full_logits(model, ids)[:, 48:]) <= TOL


def test_prompt_extending_a_cached_one(model, redis_url: str, key_prefix: str) -> None:
    short, extra = prompt(40, seed=3), prompt(50, seed=4)
    long = torch.cat([short, extra], dim=1)
    with cache_engine(model, redis_url, key_prefix) as engine:
        lm = CachedLM(model, engine)
        lm.prefill(short)  # stores 2 chunks
        out = lm.prefill(long)
        assert out.hit_tokens == 32 and out.stored_tokens == [48]  # chunks 3..5 added
        assert engine.lookup(long[0]) == 80
    assert max_diff(out.logits, full_logits(model, long)[:, 32:]) <= TOL


def test_missing_middle_chunk_cuts_the_hit(model, redis_url: str, key_prefix: str,
                                           redis_client: redis.Redis) -> None:
    ids = prompt(100, seed=5)
    with cache_engine(model, redis_url, key_prefix, local_cpu=False, store_async=False) as engine:
        lm = CachedLM(model, engine)
        lm.prefill(ids)
        keys = [s.key.redis_key(key_prefix) for s in engine.token_db.chunks(ids[0])]
        assert redis_client.unlink(keys[2]) == 1  # chunk 3 of 6 gone
        partial = lm.prefill(ids)
        assert partial.hit_tokens == 32
        assert max_diff(partial.logits, full_logits(model, ids)[:, 32:]) <= TOL
        assert redis_client.exists(keys[2]) == 1  # the recomputed chunk was stored again
        assert lm.prefill(ids).hit_tokens == 96


def test_batch_with_different_prefixes(model, redis_url: str, key_prefix: str) -> None:
    a, b = prompt(90, seed=6), prompt(90, seed=7)
    batch = torch.cat([a, b])
    with cache_engine(model, redis_url, key_prefix) as engine:
        lm = CachedLM(model, engine)
        lm.prefill(a[:, :70])  # row a: 64 tokens cached
        lm.prefill(b[:, :40])  # row b: 32 tokens cached
        out = lm.prefill(batch)
        assert out.hit_tokens == 32  # the shortest hit among the rows
        assert out.stored_tokens == [48, 48]  # tokens 32..80 of each row now held
        assert engine.lookup(a[0]) == engine.lookup(b[0]) == 80
        gen = lm.generate(batch, max_new_tokens=6, do_sample=False)
    assert gen.hit_tokens == 80
    assert max_diff(out.logits, full_logits(model, batch)[:, 32:]) <= TOL
    with torch.no_grad():
        assert torch.equal(gen.sequences, model.generate(batch, max_new_tokens=6,
                                                         do_sample=False))


def test_store_false_and_padding_refused(model, redis_url: str, key_prefix: str) -> None:
    ids = prompt(40, seed=8)
    with cache_engine(model, redis_url, key_prefix) as engine:
        lm = CachedLM(model, engine, store=False)
        assert lm.prefill(ids).stored_tokens == [0]
        assert engine.lookup(ids[0]) == 0
        mask = torch.ones_like(ids)
        mask[0, 0] = 0
        with pytest.raises(ValueError, match="padd"):
            lm.generate(ids, attention_mask=mask, max_new_tokens=2)


def test_engine_for_another_model_is_refused(redis_url: str, key_prefix: str) -> None:
    llama, other = tiny_model("llama"), tiny_model("llama")
    other.config.num_key_value_heads = 4
    with cache_engine(other, None, key_prefix) as engine, pytest.raises(ValueError):
        CachedLM(llama, engine)


def test_another_process_hits_from_redis(tmp_path: Path, redis_url: str,
                                         key_prefix: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "tiny-qwen2"
    tiny_model("qwen2", seed=3).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()  # as the other process does
    ids = prompt(90, seed=9)
    with CachedLM.open(model, cache_engine(model, redis_url, key_prefix).config) as lm:
        assert lm.engine.metadata.model_name.startswith("tiny-qwen2@f1-")
        assert lm.prefill(ids).stored_tokens == [80]
        assert lm.engine.flush()
        namespace = lm.engine.metadata.model_name
    env = dict(os.environ, PYTHONPATH=str(HERE), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "hf_worker.py"), str(folder), redis_url, key_prefix,
         json.dumps(ids[0].tolist())],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["model_name"] == namespace  # the folder's name and weights, as here
    assert out["hit_tokens"] == 80 and out["remote_hit_chunks"] == 80 // CHUNK
    assert out["max_diff"] <= TOL


def test_sliding_window_model_is_refused(key_prefix: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         use_sliding_window=True, sliding_window=16, max_window_layers=0)
    model = Qwen2ForCausalLM(config)
    with cache_engine(model, None, key_prefix) as engine, pytest.raises(ValueError,
                                                                         match="full attention"):
        CachedLM(model, engine)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_next"])
def test_hybrid_models_are_refused_at_construction(key_prefix: str, kind: str) -> None:
    """A Gemma3-style model (sliding-window layers beside full ones) and a Qwen3-Next-style
    one (Gated DeltaNet linear attention beside full): the cache is a `DynamicCache` of
    other layer kinds, which `CachedLM` does not load or store: refused with the reason."""
    import transformers

    common = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if kind == "gemma3":
        config: Any = transformers.Gemma3TextConfig(
            **common, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    else:
        config = transformers.Qwen3NextConfig(
            **common, layer_types=["linear_attention", "full_attention"], num_experts=2,
            num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with cache_engine(model, None, key_prefix) as engine, pytest.raises(ValueError,
                                                                         match="full attention"):
        CachedLM(model, engine)


def lora(folder: Path, seed: int) -> Any:
    """The tiny Llama with a random LoRA adapter (peft, r=4 on q/k/v/o, `init_lora_weights`
    off so the KV moves), saved to `folder` by `save_pretrained` if not there yet, and loaded
    from it onto a fresh base model."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if not (folder / "adapter_config.json").exists():
        base = tiny_model("llama")
        torch.manual_seed(seed)  # after the base model's own seed
        config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        get_peft_model(base, config).save_pretrained(folder)
    return PeftModel.from_pretrained(tiny_model("llama"), folder).eval()


def test_lora_adapters_are_named_by_their_files(tmp_path: Path, redis_url: str,
                                                key_prefix: str) -> None:
    """A peft adapter's chunks hit only under the same adapter files: adapter A's cached
    prefill equals A's recompute; B and the base model get no hit over A's chunks (their
    logits differ from A's on the same ids: each check can fail); A without `adapter=`,
    or with B's folder, is refused."""
    ids = prompt(50, seed=21)
    outputs = {}
    models = {}
    for name, seed in (("a", 1), ("b", 2)):
        models[name] = lora(tmp_path / name, seed)
        outputs[name] = full_logits(models[name], ids)
    base = tiny_model("llama")
    outputs["base"] = full_logits(base, ids)
    assert max_diff(outputs["a"], outputs["base"]) > 1e-2
    assert max_diff(outputs["a"], outputs["b"]) > 1e-2
    with cache_engine(base, redis_url, key_prefix) as engine:
        with CachedLM(models["a"], engine, adapter=str(tmp_path / "a")) as lm:
            assert lm.prefill(ids).stored_tokens == [48]
        again = lora(tmp_path / "a", 1)  # another process would load it so
        with CachedLM(again, engine, adapter=str(tmp_path / "a")) as lm:
            got = lm.prefill(ids)
            assert got.hit_tokens == 48
            assert max_diff(got.logits, outputs["a"][:, 48:]) <= TOL
        with CachedLM(models["b"], engine, adapter=str(tmp_path / "b")) as lm:
            assert lm.prefill(ids).hit_tokens == 0
        with CachedLM(base, engine, store=False) as lm:
            assert lm.prefill(ids).hit_tokens == 0
        with pytest.raises(ValueError, match="pass adapter="):
            CachedLM(models["a"], engine)
        with pytest.raises(ValueError, match="not the files"):
            CachedLM(models["a"], engine, adapter=str(tmp_path / "b"))
        with pytest.raises(ValueError, match="no active LoRA adapter"):
            CachedLM(base, engine, adapter=str(tmp_path / "a"))


def test_inputs_other_than_token_ids_are_refused(model, redis_url: str,
                                                  key_prefix: str) -> None:
    ids = prompt(40, seed=22)
    with cache_engine(model, redis_url, key_prefix) as engine, CachedLM(model, engine) as lm:
        embeds = model.get_input_embeddings()(ids)
        for kwargs in ({"inputs_embeds": embeds}, {"pixel_values": torch.zeros(1, 3, 8, 8)},
                       {"position_ids": torch.arange(40)[None]}):
            with pytest.raises(ValueError, match="token ids"):
                lm.prefill(ids, **kwargs)
            with pytest.raises(ValueError, match="token ids"):
                lm.generate(ids, max_new_tokens=1, **kwargs)
        assert engine.stats()["engine"].get("store_requests", 0) == 0  # nothing was stored
