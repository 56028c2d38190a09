"""A second engine process for cross-process tests: `store|retrieve URL PREFIX N`.

Prints one JSON line: the chunk keys it computed, and what it stored or hit (checking the
hit bytes against the deterministic source KV itself)."""

from __future__ import annotations

import json
import sys

import torch
from kvutil import engine, tokens, view


def main() -> None:
    mode, url, prefix, n_text = sys.argv[1:5]
    n = int(n_text)
    toks = tokens(n)
    src, read_src = view("kv_split", torch.bfloat16, n, seed=1, slot_seed=5)
    out: dict = {}
    with engine(url, prefix, local_cpu=(mode == "store")) as e:
        out["keys"] = [s.key.redis_key(prefix) for s in e.token_db.chunks(toks)]
        if mode == "store":
            out["stored"] = e.store(toks, src)
            out["flushed"] = e.flush()
        else:
            out["lookup"] = e.lookup(toks)
            dst, read_dst = view("packed", torch.bfloat16, n, seed=None, slot_seed=6)
            hits = int(e.retrieve(toks, dst).sum())
            out["hits"] = hits
            out["exact"] = bool(torch.equal(read_dst(0, hits), read_src(0, hits)))
        out["stats"] = e.stats()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
