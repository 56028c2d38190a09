"""One process of the concurrency test: `URL PREFIX SEED ROUNDS THREADS LOCAL`.

Its threads share one CacheEngine and store, retrieve and look up requests built from a few
shared prefixes (so processes and threads overlap on chunks), checking every hit against KV
derived from the tokens alone. Prints one JSON line: rounds done, hit tokens, the slowest call,
and every failure as text. A thread that does not finish in time is reported as hung.
"""

from __future__ import annotations

import faulthandler
import json
import random
import sys
import threading
import time
import traceback

from faultkit import check_retrieve, det_kv, sentinel_kv
from kvutil import engine

CHUNK = 256


def request(rng: random.Random) -> list[int]:
    """One of a few shared 2-chunk prefixes, then one of a few shared tails: heavy overlap."""
    head = random.Random(rng.randrange(4)).choices(range(50_000), k=2 * CHUNK)
    tail = random.Random(100 + rng.randrange(6)).choices(range(50_000), k=CHUNK * rng.randint(0, 2))
    return head[: CHUNK * rng.randint(1, 2)] + tail


def main() -> None:
    url, prefix, seed, rounds, threads, local = sys.argv[1:7]
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows its stacks, then ends
    out: dict = {"rounds": 0, "hit_tokens": 0, "slowest": 0.0, "failures": []}
    lock = threading.Lock()
    cfg = {"local_cpu": local == "1", "max_local_cpu_size": 0.002, "remote_timeout": 5.0}
    with engine(url, prefix, **cfg) as e:

        def work(tid: int) -> None:
            rng = random.Random(int(seed) * 1000 + tid)
            for _ in range(int(rounds)):
                toks = request(rng)
                try:
                    t0 = time.monotonic()
                    if rng.random() < 0.6:
                        e.store(toks, det_kv(toks))
                    dst, read = sentinel_kv(len(toks))
                    n = check_retrieve(e.retrieve(toks, dst), toks, read)
                    assert e.lookup(toks) % CHUNK == 0
                    if rng.random() < 0.1:
                        e.flush(5.0)
                        e.stats()
                    took = time.monotonic() - t0
                    with lock:
                        out["rounds"] += 1
                        out["hit_tokens"] += n
                        out["slowest"] = max(out["slowest"], took)
                except Exception:  # noqa: BLE001 - reported to the test
                    with lock:
                        out["failures"].append(traceback.format_exc())

        pool = [threading.Thread(target=work, args=(t,)) for t in range(int(threads))]
        for t in pool:
            t.start()
        for t in pool:
            t.join(60)
        out["hung_threads"] = sum(t.is_alive() for t in pool)
        out["flushed"] = e.flush(10.0)
        out["stats"] = e.stats()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
