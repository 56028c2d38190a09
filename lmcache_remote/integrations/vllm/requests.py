"""What names a vLLM request's KV: its token ids and its `RequestIdentity` (scheduler side).

vLLM's own prefix cache binds, besides the tokens, "extra keys" into its block hashes: the
cache salt, the LoRA adapter (its name and path), every multimodal item overlapping a block
(its identifier and offset) and the digest of prompt-embedding rows. The connector binds the
same things into its chunk keys (`lmcache_remote.naming.identity`, docs/key-schema.md), with two
differences, both to be safer across a fleet sharing one Redis:

- **Adapters** are named by a fingerprint of their files (`fingerprint.adapter_fingerprint`),
  never by name, path or vLLM's int id: an adapter replaced in place under the same name and
  path is another adapter. `Adapters` keeps each adapter's fingerprint with a `stat`
  signature of its files, checked on every request: files changed since they were
  fingerprinted are fingerprinted again when the request reloads the adapter
  (`load_inplace`, vLLM then reads the new files); otherwise which weights vLLM computes with
  is not known, and the request is passed through (WARNING once per adapter).
- **Multimodal items** (`mm_items`, the setting): `"content"` (the default) names an item by
  a digest of the processed inputs its encoder runs on (`item_digest`: `pixel_values`,
  `image_grid_thw`, ...), so a client-supplied id (`multi_modal_uuids`, which vLLM uses
  verbatim as the identifier) can neither fetch nor poison another image's KV in a shared
  Redis; an item whose data the scheduler does not hold (vLLM's shared-memory processor
  cache) passes the request through. `"identifier"` names it by vLLM's identifier (its
  content hash, or the client's id): the fleet then trusts every client's ids as vLLM trusts
  them within one engine.

A request the keys cannot name (`UnnamedRequest`) is neither looked up nor stored: vLLM
computes it as without the connector. The prompt of a request given as embeddings is its
token ids as vLLM keeps them (zeros where embeddings stand).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import threading
from typing import Any

from lmcache_remote.integrations.vllm_core.settings import MM_ITEM_MODES
from lmcache_remote.naming.fingerprint import (
    FingerprintError,
    adapter_fingerprint,
    adapter_signature,
)
from lmcache_remote.naming.identity import (
    HASH_BYTES,
    MMItem,
    RequestIdentity,
    embeds_digests,
    field,
    field_header,
    sorted_items,
)

logger = logging.getLogger(__name__)

__all__ = ["MM_ITEM_MODES", "Adapters", "RequestNames", "UnnamedRequest", "item_digest"]

ITEM_PERSON = b"lmcr-mm-item1"


#: The `kv_transfer_params` a request asks for retention with (docs/pins.md): pinned for
#: this many seconds, or (`lmcr_pin: true`) for the operator's `max_retain_seconds`.
RETAIN_SECONDS, PIN = "lmcr_retain_seconds", "lmcr_pin"


class BadRetention(ValueError):
    """A request's retention parameter is not one the connector understands."""


def retention(params: Any) -> float | None:
    """Seconds a request asks its prefix to stay pinned (`math.inf` for `lmcr_pin: true`),
    from vLLM's `kv_transfer_params` (the field its OpenAI server hands to connectors); None
    when it asks nothing. `BadRetention` for a value that is not a positive number or a
    boolean."""
    if not isinstance(params, dict):
        return None
    pin, seconds = params.get(PIN), params.get(RETAIN_SECONDS)
    if pin is not None and not isinstance(pin, bool):
        raise BadRetention(f"{PIN} must be true or false, got {pin!r}")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float)
                                or not seconds > 0 or seconds != seconds):
        raise BadRetention(f"{RETAIN_SECONDS} must be a positive number, got {seconds!r}")
    if pin:
        return math.inf
    return None if seconds is None else float(seconds)


class UnnamedRequest(Exception):
    """The request's KV depends on something its keys cannot bind: pass it through."""


def item_digest(data: Any) -> str:
    """`c1-` and 32 hex digits: BLAKE2b-128 (`person=b"lmcr-mm-item1"`) over the processed
    inputs of one multimodal item (vLLM's `MultiModalKwargsItem`: field name -> element
    whose `.data` is a tensor, a list of them, or a plain value), fields in name order."""
    if data is None or not hasattr(data, "items"):
        raise UnnamedRequest("a multimodal item's data is not held by the scheduler")
    digest = hashlib.blake2b(digest_size=HASH_BYTES, person=ITEM_PERSON)
    for name in sorted(data.keys()):
        if name == "address":
            raise UnnamedRequest("a multimodal item lives in shared memory (vLLM's shm "
                                 "processor cache): its content is not readable here")
        element = data[name]
        digest.update(field(b"key", str(name).encode("utf-8")))
        _feed(digest, getattr(element, "data", element))
    return "c1-" + digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        digest.update(field(b"dtype", str(t.dtype).removeprefix("torch.").encode()))
        digest.update(field(b"shape", b"".join(struct.pack("<Q", d) for d in t.shape)))
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        digest.update(field_header(b"data", raw.numel()))
        digest.update(raw.numpy())  # the tensor's own bytes: no copy
    elif isinstance(value, (list, tuple)):
        digest.update(field(b"list", struct.pack("<Q", len(value))))
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(field(b"scalar", repr(value).encode("utf-8")))
    else:
        raise UnnamedRequest(f"a multimodal item holds a {type(value).__name__}, which the "
                             "keys cannot digest")


class Adapters:
    """LoRA adapter fingerprints, kept per adapter with a `stat` signature of its files (the
    module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, str], tuple[Any, str]] = {}
        self._warned: set[tuple[int, str]] = set()
        self._lock = threading.Lock()

    def fingerprint(self, lora_request: Any) -> str:
        path = os.path.expanduser(str(getattr(lora_request, "lora_path", "") or ""))
        key = (int(getattr(lora_request, "lora_int_id", 0) or 0), path)
        try:
            signature = adapter_signature(path)
        except (OSError, FingerprintError) as exc:
            raise UnnamedRequest(f"adapter {lora_request.lora_name!r}: {exc}") from exc
        with self._lock:
            known = self._known.get(key)
        if known is not None and known[0] == signature:
            return known[1]
        if known is not None and not getattr(lora_request, "load_inplace", False):
            if key not in self._warned:
                self._warned.add(key)
                logger.warning(
                    "lmcache-remote: the files of adapter %r (%s) changed since vLLM loaded "
                    "them, and its requests do not reload it (load_inplace): its requests "
                    "pass through the cache (docs/integrations.md, LoRA)",
                    lora_request.lora_name, path)
            raise UnnamedRequest("the adapter's files changed under the engine")
        try:
            fingerprint = adapter_fingerprint(path)
            if adapter_signature(path) != signature:
                raise FingerprintError("the adapter's files changed while they were read")
        except (OSError, FingerprintError) as exc:
            raise UnnamedRequest(f"adapter {lora_request.lora_name!r}: {exc}") from exc
        with self._lock:
            self._known[key] = (signature, fingerprint)
            self._warned.discard(key)
        return fingerprint


class RequestNames:
    """A vLLM request's prompt (as its keys hash it) and `RequestIdentity`, scheduler side.

    `name(request)` answers once per request id (vLLM asks `get_num_new_matched_tokens`
    again while a request waits): the identity is remembered until `forget`."""

    def __init__(self, chunk_size: int, mm_items: str = "content") -> None:
        if mm_items not in MM_ITEM_MODES:
            raise ValueError(f"mm_items must be one of {MM_ITEM_MODES}, got {mm_items!r}")
        self.chunk_size = chunk_size
        self.mm_items = mm_items
        self.adapters = Adapters()
        self._named: dict[str, tuple[list[int], RequestIdentity | None] | str] = {}

    def name(self, request: Any) -> tuple[list[int], RequestIdentity | None]:
        """(prompt token ids, identity or None for a plain text request); `UnnamedRequest`
        for a request to pass through."""
        req_id = request.request_id
        known = self._named.get(req_id)
        if isinstance(known, str):
            raise UnnamedRequest(known)
        if known is None:
            try:
                known = self._name(request)
            except UnnamedRequest as exc:
                self._named[req_id] = str(exc)
                raise
            self._named[req_id] = known
        return known

    def known(self, req_id: str) -> tuple[list[int], RequestIdentity | None] | None:
        """What `name` answered for the request; None if it was passed through or never
        named."""
        known = self._named.get(req_id)
        return None if known is None or isinstance(known, str) else known

    def forget(self, req_id: str) -> None:
        self._named.pop(req_id, None)

    def _name(self, request: Any) -> tuple[list[int], RequestIdentity | None]:
        embeds = getattr(request, "prompt_embeds", None)
        tokens = request.prompt_token_ids
        if tokens is None:
            if embeds is None:
                raise UnnamedRequest("no prompt token ids and no prompt embeddings")
            prompt = [0] * int(embeds.shape[0])
        else:
            prompt = list(tokens)
        mask = getattr(request, "prompt_is_token_ids", None)
        if embeds is not None and mask is not None:
            # mixed: vLLM zeroes the token ids where embeddings stand
            prompt = [t if bool(m) else 0 for t, m in zip(prompt, mask, strict=True)]
        lora = getattr(request, "lora_request", None)
        identity = RequestIdentity(
            cache_salt=getattr(request, "cache_salt", None),
            adapter=None if lora is None else self.adapters.fingerprint(lora),
            mm_items=self._items(getattr(request, "mm_features", None) or ()),
            embeds=None if embeds is None else embeds_digests(embeds, self.chunk_size,
                                                              mask=mask),
        )
        return prompt, (None if identity == RequestIdentity() else identity)

    def _items(self, features: Any) -> tuple[MMItem, ...]:
        items = []
        for feature in features:
            position = feature.mm_position
            identifier = (item_digest(feature.data) if self.mm_items == "content"
                          else str(feature.identifier))
            items.append(MMItem(str(feature.modality), identifier, int(position.offset),
                                int(position.length),
                                kind="content" if self.mm_items == "content" else "identifier"))
        return sorted_items(items)
