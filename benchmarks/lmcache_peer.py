"""The real LMCache as a benchmark contender: run with the LMCache side environment's python
(scripts/lmcache_env.sh), never with the project's; it imports lmcache and not lmcache_remote.

    <lmcache python> -m benchmarks.lmcache_peer URL DATA_FILE CHUNK_BYTES COUNT LAYERS HEADS HEAD

It builds what a new user gets from ``lmcache==0.5.6`` for a remote store: a `LocalCPUBackend`
over a `HostMemoryAllocator` (the allocator its connector tests hand in), an asyncio loop on a
thread, and a `RemoteBackend` for ``URL`` with ``remote_serde: naive`` (``redis://`` is its
redis-py connector, ``resp://`` its C++ RESP client with ``save_chunk_meta: False``). It fills
COUNT memory objects (LMCache's ``KV_2LTD`` layout) with the bytes of DATA_FILE, COUNT chunks
of CHUNK_BYTES each (the same bf16 bytes the project's rows move), then answers one command per
line on stdin with one JSON line on stdout:

- ``put``: `batched_submit_put_task` of every chunk, returns when LMCache reports each key
  written (its per-key completion callback), ``{"ok": true}``;
- ``get``: `batched_get_blocking` of every key, the objects kept for ``check``;
- ``check``: whether the objects last got hold exactly the bytes put; then frees them;
- ``clean``: frees what ``get`` returned (the driver deletes the keys itself);
- ``spin`` / ``still``: starts / stops a spinning Python thread in this process
  (`benchmarks.spinner`), for the duel beside a busy thread;
- ``quit``.

Timing happens in the driver (`benchmarks.contenders`), around the command's round trip on
the pipe (microseconds against the hundreds of milliseconds a command takes).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from typing import Any

from benchmarks.spinner import Spinner


def _build(url: str, layers: int, heads: int, head: int, count: int, chunk_bytes: int
           ) -> tuple[Any, Any, list[Any], list[Any], Any]:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.host_memory_allocator import HostMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    extra = {"save_chunk_meta": False} if url.startswith("resp://") else {}
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, remote_url=url, remote_serde="naive",
        max_local_cpu_size=0.0, extra_config=extra, blocking_timeout_secs=120,
    )
    metadata = LMCacheMetadata(
        model_name="lmcbench", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(layers, 2, 256, heads, head),
    )
    # Room for the chunks put and the ones a get allocates, with slack for alignment.
    allocator = HostMemoryAllocator(2 * count * chunk_bytes + (64 << 20))
    local = LocalCPUBackend(config, metadata, dst_device="cpu", memory_allocator=allocator)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    backend = RemoteBackend(config, metadata, loop, local, dst_device="cpu")
    shapes = metadata.get_shapes()
    objs = []
    for _ in range(count):
        obj = local.allocate(shapes, [torch.bfloat16], MemoryFormat.KV_2LTD)
        assert obj is not None, "LMCache's allocator is full"
        objs.append(obj)
    keys = [CacheEngineKey("lmcbench", 1, 0, i + 1, torch.bfloat16) for i in range(count)]
    return backend, loop, keys, objs, local


def _byte_view(obj: Any) -> memoryview:
    view = obj.byte_array
    view = view if isinstance(view, memoryview) else memoryview(view)
    return view.cast("B") if view.format != "B" else view


def main(argv: list[str]) -> None:
    # Replies go to the original stdout alone: whatever LMCache prints (its logs, its C++
    # client) goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    url, data_file = argv[0], argv[1]
    chunk_bytes, count, layers, heads, head = (int(a) for a in argv[2:7])
    backend, _loop, keys, objs, _ = _build(url, layers, heads, head, count, chunk_bytes)
    with open(data_file, "rb") as f:
        for obj in objs:
            view = _byte_view(obj)
            assert len(view) == chunk_bytes, (len(view), chunk_bytes)
            f.readinto(view)
    got: list[Any] = []

    def free_got() -> None:
        for obj in got:
            if obj is not None:
                obj.ref_count_down()
        got.clear()

    def put() -> dict[str, Any]:
        done = threading.Event()
        left = [len(keys)]
        lock = threading.Lock()

        def one(_key: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        backend.batched_submit_put_task(keys, objs, on_complete_callback=one)
        ok = done.wait(300)
        return {"ok": ok and backend.put_failed_count == 0}

    def get() -> dict[str, Any]:
        free_got()
        got.extend(backend.batched_get_blocking(keys))
        return {"ok": all(o is not None for o in got)}

    def check() -> dict[str, Any]:
        same = len(got) == len(objs) and all(
            o is not None and bytes(_byte_view(o)) == bytes(_byte_view(src))
            for o, src in zip(got, objs, strict=True))
        free_got()
        return {"ok": same}

    def clean() -> dict[str, Any]:
        free_got()
        return {"ok": True}

    spinner = Spinner()

    def spin() -> dict[str, Any]:
        spinner.set(True)
        return {"ok": True}

    def still() -> dict[str, Any]:
        spinner.set(False)
        return {"ok": True}

    commands = {"put": put, "get": get, "check": check, "clean": clean, "spin": spin,
                "still": still}
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            break
        print(json.dumps(commands[name]()), file=replies, flush=True)
    # No teardown: RemoteBackend.close() can wait on LMCache's own threads for a long time
    # (resp://); the process ends here and the kernel closes its connections.
    replies.close()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
