"""Test stand-in of vllm/v1/request.py's Request (the fields a connector reads)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    mm_features: list = field(default_factory=list)
    lora_request: object | None = None
    prompt_embeds: object | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
