"""The tiers: the local CPU tier, Redis (one server, Sentinel, a Cluster), SGLang's pages, the
wire under them and the manager that puts them in front of each other.

Folders by concept, from the bottom up (each opens with its contract; imports run one way,
`tests/test_imports.py`):

- `tier`: `StorageTier`, the contract every tier keeps;
- `local/`: memory (the pool and its budget) and the local CPU tier;
- `wire/`: bytes to and from one server (RESP, bulk pipelines, deadlines, chunk commands);
- `session/`: the client and its health, access, SCAN, pins, the publisher, the cluster
  scatter, connection counts;
- `value/`: one stored value's path, chunks' and pages' alike (encode and seal, check and
  decode, what a foreign or damaged value costs);
- `keep/`: the keep policy (its judgment, its scripts, its state in Redis: `KeepBook`);
- `chunks/`: the chunk tier in Redis (lookup, reads, writes, a cluster's, the factory);
- `pages/`: `PageStore`, SGLang's pages;
- `manager/`: `StorageManager`, the write-behind queue, the memory budget's shares.

The modules' earlier paths (`lmcache_remote.storage.bulk`, `.redis_tier`, `.remote_lookup`, ...,
all side by side in this folder before) still import: each gives the very objects of the
module (or, for `redis_commands`, the two modules) that hold its names now (`MOVED`), so code
written against them keeps working; so do `chunks.value_checks` (now `value.checks`) and
`chunks.cluster_tier` (a cluster's tier is now `chunks.redis_tier.RedisTier` over a cluster's
channel).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

#: Each earlier module of this folder -> its path now (under `lmcache_remote.storage`; two
#: paths where it was split in two: its names are in one or the other).
MOVED = {
    "access": "session.access", "arena": "wire.arena", "base": "tier",
    "budget": "manager.budget", "bulk": "wire.bulk", "client": "session.client",
    "cluster_scatter": "session.cluster_scatter", "cluster_tier": "chunks.redis_tier",
    "connections": "session.connection_count", "cpus": "local.cpus",
    "deadline": "wire.deadline", "health": "session.health", "lanes": "wire.lanes",
    "local_cpu": "local.cpu_tier", "memory": "local.memory", "page_base": "pages.base",
    "page_reads": "pages.reads", "page_writes": "pages.writes", "pins": "session.pins",
    "publisher": "session.publisher", "redis_commands": "wire.commands wire.windows",
    "redis_tier": "chunks.redis_tier", "remote_lookup": "chunks.lookup",
    "remote_reads": "chunks.reads", "remote_writes": "chunks.writes",
    "resp": "wire.resp", "scan": "session.scan",
    "tiers": "chunks.factory", "toucher": "chunks.toucher",
    "value_checks": "value.checks", "write_behind": "manager.write_behind",
    # moved again since, inside a folder (a cluster's tier is a `RedisTier` on its channel)
    "chunks.value_checks": "value.checks", "chunks.cluster_tier": "chunks.redis_tier",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `lmcache_remote.storage.<earlier name>` as the modules of its new paths: every
    name is the very object of the module that holds it now."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        name = fullname[len(__name__) + 1:] if fullname.startswith(f"{__name__}.") else ""
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        moved = [importlib.import_module(f"{__name__}.{path}")
                 for path in MOVED[spec.name[len(__name__) + 1:]].split()]
        return _Alias(spec.name, moved)

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = module


class _Alias(types.ModuleType):
    """The earlier path of a moved module: every attribute is read from (and set on) the moved
    module that has it."""

    def __init__(self, name: str, moved: list[types.ModuleType]) -> None:
        super().__init__(name, moved[0].__doc__)
        object.__setattr__(self, "_moved", moved)

    def _holder(self, attr: str) -> types.ModuleType:
        moved: list[types.ModuleType] = object.__getattribute__(self, "_moved")
        return next((module for module in moved if hasattr(module, attr)), moved[0])

    def __getattr__(self, attr: str) -> object:
        return getattr(self._holder(attr), attr)

    def __setattr__(self, attr: str, value: object) -> None:
        if attr.startswith("__") and attr.endswith("__"):  # the import system's own
            object.__setattr__(self, attr, value)
        else:
            setattr(self._holder(attr), attr, value)

    def __dir__(self) -> list[str]:
        moved: list[types.ModuleType] = object.__getattribute__(self, "_moved")
        return sorted({name for module in moved for name in dir(module)})


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.append(_Moved())
