"""Test stand-in of vllm.distributed.kv_transfer.kv_connector.v1."""

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole"]
