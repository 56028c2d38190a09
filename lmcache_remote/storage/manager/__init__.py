"""The manager: the local tier in front of Redis, and the writes behind the engine.

- `storage_manager`: `StorageManager` (what it promises the engine: its docstring), the
  store plan, admission counts of the local tier;
- `write_behind`: the queue that writes to Redis off the engine's thread;
- `budget`: the shares of the one memory budget.

`lmcache_remote.storage.manager` is the path `StorageManager` was documented at: it is here.
"""

from lmcache_remote.storage.manager.storage_manager import (
    AdmissionCounts,
    StorageManager,
    StorePlan,
)

__all__ = ["AdmissionCounts", "StorageManager", "StorePlan"]
