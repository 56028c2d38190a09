"""One tensor-parallel rank of an SGLang engine with the Redis backend, in a process of its
own (tests/sglang_hicache/test_tensor_parallel.py starts two). Usage:

    python tp_rank.py SPEC_JSON

SPEC: rank, world, init_file, model_dir, workdir, extra (the backend's config), mla, out.
Each rank fills 4 host pages with its own values (MHA: its share of the heads; MLA: the same
values on every rank) and backs them up with SGLang's page hashes; after a barrier the page
`drop` names is deleted by rank `drop_rank`; after another, both prefetch. Writes a JSON
report: tokens backed up, tokens loaded, whether the loaded bytes equal the written ones, the
backend's counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import redis
import torch.distributed as dist
from rig import Engine, start_sglang, tokens_for

from lmcache_remote.naming.keys import PageKey


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = spec["rank"]
    start_sglang(Path(spec["model_dir"]), Path(spec["workdir"]), rank=rank,
                 world=spec["world"], init_file=Path(spec["init_file"]))
    engine = Engine(spec["extra"], mla=spec["mla"])
    tokens = tokens_for(4, seed=90)
    slots = engine.fill(4, seed=91 if spec["mla"] else 91 + rank)
    backed_up = engine.backup(tokens, slots)
    dist.barrier()
    if rank == spec["drop_rank"]:
        backend = engine.backend
        key = PageKey(backend._model, backend._pages_geometry, engine.hashes(tokens)[2])
        client = redis.Redis.from_url(spec["extra"]["remote_url"])
        client.unlink(key.redis_key(spec["extra"]["key_prefix"]))
    dist.barrier()
    reader = Engine(spec["extra"], mla=spec["mla"])
    loaded, dest = reader.prefetch(tokens, rid="r-tp")
    pages = loaded // engine.page
    report = {
        "rank": rank, "backed_up": backed_up, "loaded": loaded,
        "equal": dest is not None and reader.page_bytes(dest, pages)
        == engine.page_bytes(slots, pages),
        "geometry": engine.backend._pages_geometry,
        "written": engine.backend.stats().get("pages", {}).get("written", 0),
    }
    Path(spec["out"]).write_text(json.dumps(report))
    dist.barrier()
    reader.close()
    engine.close()


if __name__ == "__main__":
    main()
