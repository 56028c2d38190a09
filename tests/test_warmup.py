"""`lmcache-remote warm --model-path DIR --prompts FILE`, then an engine hits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from hfutil import CHUNK, full_logits, save_tokenizer, tiny_model
from lmcache_remote_cli.main import cli

from lmcache_remote import CacheConfig
from lmcache_remote.integrations.huggingface import CachedLM
from lmcache_remote.integrations.warmup import PromptFileError, read_prompts

ENV = {"LMCR_CHUNK_SIZE": str(CHUNK), "HF_HUB_OFFLINE": "1"}
WORDS = "the cache keeps the prefix of every prompt then a question of the user follows and"
# 16 words: one chunk; the tokenizer adds no special tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_model("llama", seed=5).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def warm(model_dir: Path, prompts: Path, url: str, prefix: str, *extra: str) -> Result:
    return CliRunner().invoke(
        cli, ["warm", "--model-path", str(model_dir), "--prompts", str(prompts), "--url", url,
              "--prefix", prefix, *extra], env=ENV, catch_exceptions=False)


def cached_lm(model_dir: Path, url: str, prefix: str) -> CachedLM:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = CacheConfig(remote_url=url, key_prefix=prefix, chunk_size=CHUNK, local_cpu=False)
    return CachedLM.open(model, config, store=False)


def test_warm_text_prompts_then_an_engine_hits(model_dir: Path, tmp_path: Path,
                                               redis_url: str, key_prefix: str) -> None:
    from transformers import AutoTokenizer

    lines = [" ".join([WORDS] * 3), " ".join([WORDS] * 2) + " documents", "too short"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n\n")
    result = warm(model_dir, prompts, redis_url, key_prefix, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    # the folder's name and its weights' fingerprint, as the engine below makes them
    assert doc["model_name"].startswith("tiny-llama@f1-")
    # the second prompt's 2 whole chunks are the first prompt's: already cached when it comes
    assert (doc["prompts"], doc["warmed"], doc["skipped"], doc["too_short"]) == (3, 1, 1, 1)
    assert doc["computed_tokens"] == 48
    assert doc["flushed"] is True
    again = json.loads(warm(model_dir, prompts, redis_url, key_prefix, "--json").stdout)
    assert (again["warmed"], again["skipped"], again["too_short"]) == (0, 2, 1)

    ids = AutoTokenizer.from_pretrained(model_dir)(lines[0] + " follows")["input_ids"]
    assert len(ids) == 49
    with cached_lm(model_dir, redis_url, key_prefix) as lm:
        assert lm.engine.metadata.model_name == doc["model_name"]
        out = lm.prefill(torch.tensor([ids]))
        assert out.hit_tokens == 48  # the warmed 48-token prompt's 3 chunks, from Redis
        assert lm.engine.stats()["remote"]["hit_chunks"] == 3
        diff = (out.logits - full_logits(lm.model, torch.tensor([ids]))[:, 48:]).abs().max()
    assert diff <= 1e-5


def test_warm_jsonl_token_ids_and_strings(model_dir: Path, tmp_path: Path, redis_url: str,
                                          key_prefix: str) -> None:
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(ids) + "\n" + json.dumps(" ".join([WORDS] * 2)) + "\n")
    result = warm(model_dir, prompts, redis_url, key_prefix, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["warmed"] == 2
    with cached_lm(model_dir, redis_url, key_prefix) as lm:
        assert lm.engine.lookup(ids) == 32
        partly = ids[:20] + [1] * 30
        assert lm.prefill(torch.tensor([partly])).hit_tokens == 16


def test_warm_human_output_and_bad_prompt_file(model_dir: Path, tmp_path: Path,
                                               redis_url: str, key_prefix: str) -> None:
    good = tmp_path / "ids.jsonl"
    good.write_text(json.dumps(list(range(20))) + "\n")
    result = warm(model_dir, good, redis_url, key_prefix)
    assert result.exit_code == 0, result.stderr
    assert re.search(r"tiny-llama@f1-[0-9a-f]{16}: 1 prompts warmed", result.stdout)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps([1, 2]) + "\n" + json.dumps({"x": 1}) + "\n")
    result = warm(model_dir, bad, redis_url, key_prefix)
    assert result.exit_code == 2 and "bad.jsonl:2" in result.stderr
    with pytest.raises(PromptFileError, match="tokenizer"):
        read_prompts(_text(tmp_path), None)
    usage = CliRunner().invoke(cli, ["warm", "--url", redis_url], env=ENV)
    assert usage.exit_code == 2


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "plain.txt"
    path.write_text("some words\n")
    return path
