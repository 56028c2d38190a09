"""The soak's requests and the KV they must get back.

- `Corpus`: one shared system prompt and `num_docs` documents of token ids, the same in every
  engine process (a fixed seed). `PromptStream` draws a prompt per request, as a chat service
  sees them: the system prompt, then 1-6 distinct documents drawn Zipf-like (document k with
  weight 1 / (k + 1) ** zipf_s, so document k has popularity rank k + 1; fewer documents more
  often), then a question that no other request shares. `draw` also names the documents.
- `expected_kv(tokens)`: the KV that "prefill" computes for `tokens`, a function of the token
  prefix alone: chunk c's values are drawn from a generator seeded with a SHA-256 chain over
  the tokens of chunks 0..c (independent of the library's BLAKE2b keys, so a chunk served
  under the wrong key is caught). Values are small integers, exact in bfloat16.
- `PagedCache`: one engine's vLLM-style paged KV cache (`kv_split` layout) with a fresh,
  shuffled block table per request; it fills the request's slots with a sentinel before a
  retrieve, writes "prefill" KV, and reads a request's KV back to check it bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from lmcache_remote import PagedKV

VOCAB = 32_000
SENTINEL = 1000.0  # exact in bfloat16, outside the values expected_kv draws (-128..127)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The engines' (tiny) model: chunks of `chunk_size` tokens, `token_bytes` each."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 64
    chunk_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def token_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size * self.token_bytes


class Corpus:
    """The system prompt and the documents every engine shares (seeded, so identical)."""

    def __init__(self, geometry: Geometry, num_docs: int = 200, seed: int = 1234) -> None:
        rng = np.random.default_rng(seed)
        c = geometry.chunk_size
        self.system = rng.integers(0, VOCAB, 2 * c, dtype=np.uint32)
        self.docs = [rng.integers(0, VOCAB, int(rng.integers(c, 6 * c + 1)), dtype=np.uint32)
                     for _ in range(num_docs)]


class PromptStream:
    """One engine's requests: system prompt + Zipf-drawn documents + a unique question."""

    def __init__(self, corpus: Corpus, seed: int, zipf_s: float = 1.1, max_docs: int = 6) -> None:
        self.corpus = corpus
        self.rng = np.random.default_rng(seed)
        ranks = np.arange(1, len(corpus.docs) + 1, dtype=np.float64)
        weights = ranks ** -zipf_s
        self.doc_p = weights / weights.sum()
        counts = 1.0 / np.arange(1, max_docs + 1)
        self.count_p = counts / counts.sum()
        self.max_docs = max_docs

    def next(self) -> np.ndarray:
        return self.draw()[0]

    def draw(self) -> tuple[np.ndarray, list[int]]:
        """(the prompt's tokens, its documents in order): document k has Zipf rank k + 1."""
        n_docs = int(self.rng.choice(self.max_docs, p=self.count_p)) + 1
        docs = self.rng.choice(len(self.corpus.docs), size=n_docs, replace=False, p=self.doc_p)
        question = self.rng.integers(0, VOCAB, int(self.rng.integers(8, 48)), dtype=np.uint32)
        parts = [self.corpus.system, *(self.corpus.docs[d] for d in docs), question]
        return np.concatenate(parts).astype(np.uint32), [int(d) for d in docs]


def expected_kv(tokens: np.ndarray, geometry: Geometry) -> torch.Tensor:
    """[layers, 2, T, heads, head_size]: the one right KV for `tokens` (see the module doc)."""
    g = geometry
    out = torch.empty((g.num_layers, 2, len(tokens), g.num_kv_heads, g.head_size),
                      dtype=g.dtype)
    data = np.ascontiguousarray(tokens, dtype="<u4")
    prev = b"soak-kv"
    gen = torch.Generator()
    for start in range(0, len(tokens), g.chunk_size):
        end = min(start + g.chunk_size, len(tokens))
        prev = hashlib.sha256(prev + data[start:end].tobytes()).digest()
        gen.manual_seed(int.from_bytes(prev[:8], "little") & (2**63 - 1))
        shape = (g.num_layers, 2, end - start, g.num_kv_heads, g.head_size)
        out[:, :, start:end] = torch.randint(-128, 128, shape, generator=gen).to(g.dtype)
    return out


class PagedCache:
    """A paged `kv_split` cache, one tensor per layer, big enough for one request."""

    def __init__(self, geometry: Geometry, max_tokens: int, seed: int) -> None:
        g = geometry
        self.geometry = g
        self.num_blocks = -(-max_tokens // g.block_size) + 1
        shape = (2, self.num_blocks, g.block_size, g.num_kv_heads, g.head_size)
        self.layers = [torch.full(shape, SENTINEL, dtype=g.dtype) for _ in range(g.num_layers)]
        self._flat = [t.view(2, -1, g.num_kv_heads, g.head_size) for t in self.layers]
        self.rng = np.random.default_rng(seed)
        self.slots = torch.zeros(0, dtype=torch.long)

    def begin(self, num_tokens: int) -> PagedKV:
        """A view for a new request: shuffled blocks, its slots filled with the sentinel."""
        bs = self.geometry.block_size
        n_blocks = -(-num_tokens // bs)
        blocks = self.rng.permutation(self.num_blocks)[:n_blocks]
        slots = (blocks[:, None] * bs + np.arange(bs)[None, :]).reshape(-1)[:num_tokens]
        self.slots = torch.from_numpy(slots.astype(np.int64))
        for flat in self._flat:
            flat[:, self.slots] = SENTINEL
        return PagedKV(self.layers, self.slots)

    def write(self, start: int, kv: torch.Tensor) -> None:
        """Prefill: put `kv` ([layers, 2, n, heads, head]) at positions start..start+n-1."""
        idx = self.slots[start:start + kv.shape[2]]
        for layer, flat in enumerate(self._flat):
            flat[:, idx] = kv[layer]

    def read(self) -> torch.Tensor:
        """The request's KV as [layers, 2, T, heads, head] (a copy)."""
        return torch.stack([flat[:, self.slots] for flat in self._flat])


def count_wrong(got: torch.Tensor, want: torch.Tensor, hit: int) -> tuple[int, int]:
    """(hit tokens whose KV differs from `want` in any element, tokens past the hit run
    that were written at all, i.e. no longer hold the sentinel)."""
    bits, want_bits = _bits(got), _bits(want)
    wrong = int((bits[:hit] != want_bits[:hit]).any(dim=1).sum())
    sentinel = torch.tensor(SENTINEL, dtype=got.dtype).view(torch.int16)
    stray = int((bits[hit:] != sentinel).any(dim=1).sum())
    return wrong, stray


def _bits(kv: torch.Tensor) -> torch.Tensor:
    """[T, everything else] of the raw 16-bit patterns: compared bit for bit, not by value."""
    return kv.transpose(0, 2).contiguous().view(torch.int16).reshape(kv.shape[2], -1)
