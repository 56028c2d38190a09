"""KV cache groups: what each group of layers keeps, how its chunks are named, and which of
its chunks a hit needs.

vLLM's hybrid KV cache manager (HMA) splits a model's layers into groups by what they keep:
full attention keeps every block of a request, a sliding window (SWA) only the blocks of the
last window (vLLM frees the others during the request and hands the connector its null block,
id 0, in their place). The connector serves full-attention and sliding-window groups:

- a model of one full-attention (or MLA) group keeps today's keys, untouched (`tag` ""), so
  existing caches keep hitting;
- any other model names each group's chunks apart: `{model namespace}~{tag}` in the keys'
  model field, the tag being `{kind}{window}-{8 hex digits}` (`full-...`, `swa256-...`), the
  digits from the group's layer names (docs/key-schema.md, "KV cache groups");
- one chunk size for all groups (`model_chunk_size`): the configured one, cut to the greatest
  common divisor with each window's retained span, so that every window starts on a chunk
  boundary and a window's chunks hold no null block;
- the hit rule (`KVGroup.first_kept`): a full group needs every chunk below the hit, an SWA
  group only the chunks from the first block vLLM keeps for a request at the hit, a Mamba
  group (a recurrent state: Gated DeltaNet, Mamba) the one chunk ending at the hit, which
  holds the state after it.

A Mamba group's chunk is the state itself: vLLM's "align" mode keeps the state after `p`
tokens in the block at index `(p - 1) // block_size`, only where a step ended on a block
boundary. The chunk size is that block size, and the chunk ending at `p` holds, seen as
`block_size` rows of `ceil(state_bytes / block_size)` bytes, the first bytes of that
block's page for each of the group's layers (an opaque copy: a state is not per token). It
is stored only from a step that ended at `p`, and loaded only into the block vLLM allocated
for the state of a hit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

from lmcache_remote.integrations.vllm_core.settings import KVGeometry

#: Group kinds the connector loads and stores.
FULL, SWA, MAMBA = "full", "swa", "mamba"


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """One KV cache group as the connector serves it (vLLM's `KVCacheGroupSpec`, read)."""

    index: int
    kind: str
    layer_names: tuple[str, ...]
    block_size: int
    geometry: KVGeometry
    window: int = 0
    """SWA: the sliding window in tokens."""
    extra_retained: int = 0
    """SWA: tokens vLLM keeps beyond the window (`extra_retained_tokens`)."""
    state_bytes: int = 0
    """Mamba: the bytes of one state (vLLM's `state_content_size_bytes`), at the start of its
    block's page."""

    def first_kept(self, num_tokens: int) -> int:
        """The first token whose block vLLM still holds for a request with `num_tokens`
        computed (vLLM's `get_num_skipped_tokens`, floored to a block): 0 for a full group;
        for a Mamba group the block of the state after `num_tokens` (vLLM's `n - 1`)."""
        if self.kind == MAMBA:
            return max(0, num_tokens - 1) // self.block_size * self.block_size
        if self.kind != SWA:
            return 0
        skipped = max(0, num_tokens - self.window + 1 - self.extra_retained)
        return skipped // self.block_size * self.block_size

    @property
    def retained(self) -> int:
        """SWA: the tokens below a block-aligned hit whose blocks vLLM keeps (0: full)."""
        if self.kind != SWA:
            return 0
        return math.ceil((self.window - 1 + self.extra_retained) / self.block_size) \
            * self.block_size

    @property
    def tag(self) -> str:
        """`{kind}{window}-{digest}`; see `group_tag`."""
        return group_tag(self.kind, self.window, self.layer_names)


def group_tag(kind: str, window: int, layer_names: Sequence[str]) -> str:
    """The group's name in its chunks' keys: the kind, the window for SWA, and 8 hex digits of
    `blake2b(digest_size=4, person=b"lmcr-kv-group1")` over the layer names joined by `\\n`
    (UTF-8): two groups of one model never share a key."""
    digest = hashlib.blake2b("\n".join(layer_names).encode("utf-8"), digest_size=4,
                             person=b"lmcr-kv-group1").hexdigest()
    return f"{kind}{window if kind == SWA else ''}-{digest}"


def plain(groups: Sequence[KVGroup]) -> bool:
    """Whether the model keeps today's keys: one full-attention group."""
    return len(groups) == 1 and groups[0].kind == FULL


def group_namespace(model: str, group: KVGroup, groups: Sequence[KVGroup]) -> str:
    """The keys' model field for `group`'s chunks: `model` for a plain model, else
    `{model}~{tag}`."""
    return model if plain(groups) else f"{model}~{group.tag}"


def model_chunk_size(groups: Sequence[KVGroup], chunk_size: int) -> int:
    """The chunk size every group of this model uses: a Mamba group's block size where there
    is one (a state is one block, one chunk: it exists only at block boundaries), else
    `chunk_size`; cut to its greatest common divisor with each SWA group's `retained` span (a
    window must start on a chunk boundary). `ValueError` when that is not a multiple of every
    group's block size, or cuts a Mamba block."""
    mamba = {g.block_size for g in groups if g.kind == MAMBA}
    if len(mamba) > 1:
        raise ValueError(f"Mamba groups of block sizes {sorted(mamba)}")
    size = mamba.pop() if mamba else chunk_size
    for group in groups:
        if group.kind == SWA:
            size = math.gcd(size, group.retained)
    if any(g.kind == MAMBA and g.block_size != size for g in groups):
        raise ValueError(f"a sliding window does not start on a Mamba block boundary "
                         f"(chunk size {size})")
    for group in groups:
        if size % group.block_size:
            raise ValueError(f"chunk size {size} (from chunk_size {chunk_size} and the sliding "
                             f"windows) is not a multiple of group {group.index}'s block size "
                             f"{group.block_size}")
    return size
