"""The connector inside a real vLLM. Skipped where vLLM is not installed (as on the CI and
development machines of this project: vLLM's only PyPI wheel is a CUDA build).

- Always (with vLLM installed): `LmcrConnector` subclasses the installed vLLM's
  `KVConnectorBase_V1`, implements every abstract hook, and its hooks take the parameters the
  installed base class declares.
- With a CUDA device and `LMCR_VLLM_MODEL` naming a local Hugging Face model folder: two vLLM
  processes share one Redis through the connector; the second gets the prompt's chunks from
  Redis (`num_cached_tokens`, with vLLM's own prefix cache off) and generates the same tokens.

The stand-in vLLM of tests/vllm_stub must never be what this module imports: it checks that.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
if getattr(vllm, "IS_LMCR_STUB", False):  # pragma: no cover - a test set-up error
    raise RuntimeError("tests/vllm_stub is on sys.path: this module needs the real vLLM")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402

from lmcache_remote.integrations.vllm import LmcrConnector  # noqa: E402

HOOKS = ["get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "request_finished", "register_kv_caches", "start_load_kv", "wait_for_layer_load",
         "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors"]


def test_connector_matches_the_installed_base_class() -> None:
    assert issubclass(LmcrConnector, KVConnectorBase_V1)
    assert not getattr(LmcrConnector, "__abstractmethods__", set())
    init = inspect.signature(LmcrConnector.__init__).parameters
    assert list(init)[:4] == ["self", "vllm_config", "role", "kv_cache_config"]
    for hook in HOOKS:
        base = getattr(KVConnectorBase_V1, hook, None)
        if base is None:
            continue  # a hook this vLLM version does not have
        ours = inspect.signature(getattr(LmcrConnector, hook)).parameters
        theirs = inspect.signature(base).parameters
        assert list(ours) == list(theirs), hook


RUN = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
model, url, prefix, prompt = sys.argv[1:5]
transfer = KVTransferConfig(
    kv_connector="LmcrConnector", kv_connector_module_path="lmcache_remote.integrations.vllm",
    kv_role="kv_both",
    kv_connector_extra_config={"remote_url": url, "key_prefix": prefix, "store_async": False})
llm = LLM(model=model, kv_transfer_config=transfer, enable_prefix_caching=False,
          gpu_memory_utilization=0.5, max_model_len=4096, enforce_eager=True)
out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
print(json.dumps({"text": out.outputs[0].text, "cached": out.num_cached_tokens or 0,
                  "prompt_tokens": len(out.prompt_token_ids)}))
"""


def _run(model: str, url: str, prefix: str, prompt: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-c", RUN, model, url, prefix, prompt],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_vllm_processes_share_the_prefix(redis_url: str, key_prefix: str) -> None:
    model = os.environ.get("LMCR_VLLM_MODEL")
    torch = pytest.importorskip("torch")
    if not model or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and LMCR_VLLM_MODEL (a local model folder)")
    prompt = "You are a careful assistant. " * 150 + "Summarise the above in one line."
    first = _run(model, redis_url, key_prefix, prompt)
    second = _run(model, redis_url, key_prefix, prompt)
    assert first["cached"] == 0
    assert second["cached"] >= 256  # whole chunks from Redis, vLLM's own cache was off
    assert second["cached"] < second["prompt_tokens"]
    assert second["text"] == first["text"]
