"""Model fingerprints (`lmcache_remote.naming.fingerprint`, docs/key-schema.md "Model fingerprint"):
what changes them, what does not, the documented worked example, and two folders of one name
with different weights never sharing a chunk (real Redis, the transformers integration).
vLLM's connector computing the same namespace as transformers for the same files is tested
inside the real engine (tests/vllm_cpu)."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hfutil import CHUNK, prompt, tiny_model

from lmcache_remote import CacheConfig
from lmcache_remote.integrations.huggingface import CachedLM, engine_metadata
from lmcache_remote.naming.fingerprint import (
    FingerprintError,
    model_fingerprint,
    model_name_of,
    namespace,
    resolve_fingerprint,
)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "key-schema.md"


def _example(root: Path) -> Path:
    """The worked example of docs/key-schema.md, byte for byte."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 8, "_name_or_path": "/models/x"}')
    header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    (root / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + struct.pack("<4f", 1, 2, 3, 4))
    return root


def test_the_documented_worked_example(tmp_path: Path) -> None:
    doc = DOCS.read_text()
    shown = dict(re.findall(r"kv_dtype=\"(\w+)\"\) == \"(f1-[0-9a-f]{16})\"", doc))
    assert set(shown) == {"bfloat16", "float16"}  # the doc shows both
    root = _example(tmp_path / "example")
    for dtype, value in shown.items():
        assert model_fingerprint(root, kv_dtype=dtype) == value


def test_what_changes_the_fingerprint_and_what_does_not(tmp_path: Path) -> None:
    root = _example(tmp_path / "a" / "final")
    base = model_fingerprint(root, kv_dtype="bfloat16")
    assert re.fullmatch(r"f1-[0-9a-f]{16}", base)
    # the same files elsewhere, under another name: the same fingerprint
    other = shutil.copytree(root, tmp_path / "b" / "renamed")
    assert model_fingerprint(other, kv_dtype="bfloat16") == base
    # what says where the folder was or who wrote it does not count
    config = json.loads((other / "config.json").read_text())
    config.update(_name_or_path="/elsewhere", transformers_version="9.9")
    (other / "config.json").write_text(json.dumps(config, indent=4))
    assert model_fingerprint(other, kv_dtype="bfloat16") == base
    # everything that changes the KV does
    assert model_fingerprint(root, kv_dtype="float16") != base
    assert model_fingerprint(root, kv_dtype="bfloat16", quantization="fp8") != base
    assert model_fingerprint(root, kv_dtype="bfloat16", overrides={"rope_theta": 1e6}) != base
    assert model_fingerprint(root, kv_dtype="bfloat16", kv_scales=[0.5, 0.25]) != base
    config["rope_theta"] = 500000.0
    (other / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(other, kv_dtype="bfloat16") != base
    # one weight changed, in a large tensor, at a sampled place (its middle)
    big = tmp_path / "big"
    _safetensors(big, {"a": torch.arange(4096, dtype=torch.float32),
                       "b": torch.ones(4096, dtype=torch.float32)})
    before = model_fingerprint(big, kv_dtype="bfloat16")
    _safetensors(big, {"a": torch.arange(4096, dtype=torch.float32),
                       "b": torch.ones(4096, dtype=torch.float32).index_fill_(0, torch.tensor(
                           [2040, 2041]), 2.0)})
    assert model_fingerprint(big, kv_dtype="bfloat16") != before


def test_every_weight_file_and_format_counts(tmp_path: Path) -> None:
    root = _example(tmp_path / "m")
    base = model_fingerprint(root, kv_dtype="bfloat16")
    header = b'{"v":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    (root / "model-2.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + struct.pack("<f", 5))
    assert model_fingerprint(root, kv_dtype="bfloat16") != base  # a second shard counts
    pt = tmp_path / "pt"
    pt.mkdir()
    shutil.copy(root / "config.json", pt)
    torch.save({"w": torch.arange(10000.0)}, pt / "pytorch_model.bin")
    first = model_fingerprint(pt, kv_dtype="bfloat16")
    torch.save({"w": torch.arange(10000.0) * 2}, pt / "pytorch_model.bin")
    assert model_fingerprint(pt, kv_dtype="bfloat16") != first


@pytest.mark.parametrize("damage", ["no-config", "no-weights", "bad-header", "outside"])
def test_files_that_cannot_be_fingerprinted_say_why(tmp_path: Path, damage: str) -> None:
    root = _example(tmp_path / "m")
    weights = root / "model.safetensors"
    if damage == "no-config":
        (root / "config.json").unlink()
    elif damage == "no-weights":
        weights.unlink()
    elif damage == "bad-header":
        weights.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    else:  # a tensor whose bytes lie past the end of the file
        header = b'{"w":{"dtype":"F32","shape":[400],"data_offsets":[0,1600]}}'
        weights.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(FingerprintError, match=str(root)):
        model_fingerprint(root, kv_dtype="bfloat16")


def test_the_setting_and_the_namespace() -> None:
    assert resolve_fingerprint("auto", lambda: "f1-x") == "f1-x"
    assert resolve_fingerprint(None, lambda: "f1-x") == "f1-x"
    assert resolve_fingerprint("off", lambda: pytest.fail("not computed")) is None
    assert resolve_fingerprint("run-7", lambda: pytest.fail("not computed")) == "run-7"
    with pytest.raises(FingerprintError):
        resolve_fingerprint("two words", lambda: "")
    assert namespace("llama", "f1-ab") == "llama@f1-ab" and namespace("llama", None) == "llama"
    assert model_name_of("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"


def test_two_folders_named_alike_with_other_weights_never_share(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    """`/models/run1/final` and `/models/run2/final`: one name, other weights. Before the
    fingerprint both engines used the keys of `final` and the second read the first's KV."""
    from transformers import AutoModelForCausalLM

    folders = [tmp_path / run / "final" for run in ("run1", "run2")]
    for seed, folder in enumerate(folders):
        tiny_model("llama", seed=seed).save_pretrained(folder)
    models = [AutoModelForCausalLM.from_pretrained(f).eval() for f in folders]
    config = CacheConfig(remote_url=redis_url, key_prefix=key_prefix, chunk_size=CHUNK,
                         local_cpu=False, store_async=False, load_policy="always")
    ids = prompt(3 * CHUNK + 1, seed=4)
    with CachedLM.open(models[0], config) as first:
        assert first.prefill(ids).stored_tokens == [3 * CHUNK]
        space = first.engine.metadata.model_name
    with CachedLM.open(models[1], config) as second:
        assert second.engine.metadata.model_name.split("@")[0] == "final"
        assert second.engine.metadata.model_name != space
        assert second.engine.lookup(ids[0]) == 0
        assert second.prefill(ids).hit_tokens == 0
    again = AutoModelForCausalLM.from_pretrained(folders[0]).eval()  # the same files again
    with CachedLM.open(again, config) as third:
        assert third.engine.metadata.model_name == space
        assert third.prefill(ids).hit_tokens == 3 * CHUNK
    # off: the name alone, as before; an explicit string: used as the fingerprint
    assert engine_metadata(models[1], model_fingerprint="off").model_name == "final"
    assert engine_metadata(models[1], model_fingerprint="v7").model_name == "final@v7"


def _safetensors(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    root.mkdir(exist_ok=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    save_file(tensors, str(root / "model.safetensors"))
