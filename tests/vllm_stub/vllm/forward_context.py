"""Test stand-in of vllm/forward_context.py's ForwardContext (the fields a connector reads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ForwardContext:
    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    attn_metadata: Any = None
    virtual_engine: int = 0
