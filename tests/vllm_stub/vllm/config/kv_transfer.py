"""Test stand-in of vllm/config/kv_transfer.py (the fields a connector reads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
