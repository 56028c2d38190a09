"""Pages per second through SGLang's own HiCache controller: this project's Redis backend
beside SGLang's `file` backend, in one run.

    PY="$(bash -c '. scripts/env.sh; ensure_sglang_env')"
    PYTHONPATH=. "$PY" -m benchmarks.sglang_hicache [--pages 128] [--rounds 3] [--layers 4]

Both backends sit under the same SGLang 0.5.23 `HybridCacheController` with real device and
host pools on the CPU (tests/sglang_hicache/rig.py): MHA, bfloat16, page size 64, 8 KV heads
of 128, `--layers` layers (4: 1 MiB a page), `page_first` host layout (SGLang's default). A row
is one backend and one direction, the median over `--rounds` rounds of `--pages` pages (128:
one of SGLang's storage batches), each round on fresh tokens:

- write: `write_storage` of pages already in the host pool until SGLang's backup ack (its
  backup thread calls the backend: `batch_set_v1` for Redis with `interface_v1`, `batch_set`
  of flat pages otherwise and for `file`);
- read: a second engine (its own controller and pools) prefetches the same tokens: the hit
  query, then the transfer into its host pool until the last ack (`batch_exists`, then
  `batch_get_v1` / `batch_get`).

Redis is a private `redis-server` on loopback (no persistence); the file backend writes to a
directory on local disk (`--dir`, default a temporary one under /tmp). The file backend's reads
of pages written moments before come from the kernel's page cache, as they would on a server
that wrote them; nothing here drops caches. Target (issue 28): the Redis backend at least as
fast as the file backend on both. The last row is the limit of any Redis client here: the plain
socket (`limits.PlainSocket`) reading the values the Redis backend stored, no checks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "sglang_hicache"), str(ROOT / "tests")]

import rig  # noqa: E402
from servers import RedisServer  # noqa: E402

from benchmarks.limits import PlainSocket  # noqa: E402


def measure(make: Any, pages: int, rounds: int, seed: int) -> dict[str, float]:
    """Median pages per second written and read for one backend (`make()` builds an
    engine on it)."""
    writer, reader = make(), make()
    write_s, read_s = [], []
    try:
        for r in range(rounds):
            tokens = rig.tokens_for(pages, seed=seed + r, page=writer.page)
            slots = writer.fill(pages, seed=seed + 100 + r)
            start = time.perf_counter()
            done = writer.backup(tokens, slots)
            write_s.append(time.perf_counter() - start)
            assert done == pages * writer.page, f"backed up {done} tokens"
            start = time.perf_counter()
            loaded, dest = reader.prefetch(tokens)
            read_s.append(time.perf_counter() - start)
            assert loaded == pages * reader.page, f"loaded {loaded} tokens"
            assert reader.page_bytes(dest, 1) == writer.page_bytes(slots, 1)
            writer.host.free(slots)
            reader.host.free(dest)
    finally:
        reader.close()
        writer.close()
    return {"write": pages / statistics.median(write_s), "read": pages / statistics.median(read_s)}


def plain_socket_read(server: RedisServer, pages: int, rounds: int) -> float:
    """Pages per second the plain socket (`limits.PlainSocket`: pipelined GETs received with
    ``recv_into``, no checks) reads of the values the Redis backend stored: the same bytes
    from the same server, the limit of any Redis client on this machine."""
    client = server.client()
    names = sorted(client.scan_iter(match="bench:hc1:*", count=1000))
    by_page: dict[bytes, list[bytes]] = {}
    for name in names:
        by_page.setdefault(name.split(b"}")[0], []).append(name)
    chosen = [n for group in list(by_page.values())[:pages] for n in group]
    assert len(by_page) >= pages, f"only {len(by_page)} pages stored"
    into = [memoryview(bytearray(int(client.strlen(n)))) for n in chosen]
    sock = PlainSocket(server.port)
    times = []
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            sock.get_many(chosen, into)
            times.append(time.perf_counter() - start)
    finally:
        sock.close()
    return pages / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="the file backend's directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmcr-sglang-bench-"))
    model_dir = rig.save_model_dir(work / "tiny-llama")
    rig.start_sglang(model_dir, work)
    spec = {"page": 64, "layers": args.layers, "heads": 8, "head_dim": 128,
            "size": (args.pages + 1) * 64}
    page_mib = 2 * args.layers * 64 * 8 * 128 * 2 / 2**20
    server = RedisServer().start()
    rows: list[tuple[str, dict[str, float]]] = []
    try:
        redis_extra = {"remote_url": server.url, "key_prefix": "bench",
                       "model_fingerprint": "bench"}
        files = args.dir or work / "files"
        backends = [
            ("Redis (lmcache-remote, interface_v1)",
             lambda: rig.Engine(redis_extra, **spec)),
            ("Redis (lmcache-remote, generic)",
             lambda: rig.Engine(redis_extra, zero_copy=False, **spec)),
            ("SGLang file backend (local disk)",
             lambda: rig.Engine({"file_storage_path": str(files)}, storage="file", **spec)),
        ]
        for seed, (name, make) in enumerate(backends):
            rows.append((name, measure(make, args.pages, args.rounds, seed * 1000)))
        limit = plain_socket_read(server, args.pages, max(5, args.rounds))
    finally:
        server.stop()
    print(f"\n{args.pages} pages of {page_mib:g} MiB (page size 64, {args.layers} layers, 8 KV "
          f"heads of 128, bfloat16, page_first), median of {args.rounds} rounds\n")
    print("| backend | write pages/s | read pages/s | write GB/s | read GB/s |")
    print("|---|---|---|---|---|")
    for name, figures in rows:
        gb = page_mib * 2**20 / 1e9
        print(f"| {name} | {figures['write']:.0f} | {figures['read']:.0f} | "
              f"{figures['write'] * gb:.2f} | {figures['read'] * gb:.2f} |")
    gb = page_mib * 2**20 / 1e9
    print(f"| plain socket (GETs of the same values, no checks; the limit) | - | {limit:.0f} "
          f"| - | {limit * gb:.2f} |")
    redis_row, file_row = rows[0][1], rows[-1][1]
    for op in ("write", "read"):
        verdict = "met" if redis_row[op] >= file_row[op] else "NOT met"
        print(f"\ntarget {op}: Redis {redis_row[op]:.0f} >= file {file_row[op]:.0f} pages/s: "
              f"{verdict}", end="")
    print(f"\nread: Redis at {redis_row['read'] / limit:.2f}x the plain socket; the plain socket "
          f"at {limit / file_row['read']:.2f}x the file backend")


if __name__ == "__main__":
    main()
