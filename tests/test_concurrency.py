"""Four processes, each with several threads sharing one engine, storing and retrieving
overlapping prefixes against one Redis: every hit bit-exact, nothing deadlocks, and afterwards
Redis holds only whole, correct chunks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

from concurrency_worker import request
from faultkit import check_retrieve, det_kv, sentinel_kv
from kvutil import engine
from servers import RedisServer

HERE = Path(__file__).parent
PROCESSES, THREADS, ROUNDS = 4, 3, 30  # 360 request rounds, ~1000 engine calls


def test_processes_and_threads_share_one_redis(private_redis: RedisServer,
                                                key_prefix: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{HERE.parent}")
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "concurrency_worker.py"), private_redis.url, key_prefix,
             str(seed), str(ROUNDS), str(THREADS), str(seed % 2)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for seed in range(PROCESSES)
    ]
    results = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise AssertionError(f"a worker process hung:\n{stderr[-4000:]}") from None
        assert proc.returncode == 0, stderr[-4000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for res in results:
        assert res["failures"] == [], res["failures"][0]
        assert res["hung_threads"] == 0
        assert res["rounds"] == THREADS * ROUNDS
        assert res["flushed"] is True
        assert res["stats"]["remote"].get("corrupt_chunks", 0) == 0
        assert res["stats"]["remote"].get("errors", 0) == 0
    assert sum(r["hit_tokens"] for r in results) > 0

    # what the processes left in Redis: every chunk whole and exact
    rng = random.Random(0)
    with engine(private_redis.url, key_prefix, local_cpu=False) as e:
        for _ in range(40):
            toks = request(rng)
            dst, read = sentinel_kv(len(toks))
            check_retrieve(e.retrieve(toks, dst), toks, read)
        assert e.stats()["remote"].get("corrupt_chunks", 0) == 0


def test_one_engine_many_threads_store_retrieve_close(private_redis: RedisServer,
                                                      key_prefix: str) -> None:
    """Threads race stores, retrieves, lookups, stats and freeze on one engine (with a local
    tier small enough to evict all the time): nothing raises, nothing hangs, every hit exact;
    then two threads close it at once."""
    failures: list[BaseException] = []
    with engine(private_redis.url, key_prefix, max_local_cpu_size=0.002) as e:

        def work(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(25):
                    toks = request(rng)
                    e.store(toks, det_kv(toks))
                    dst, read = sentinel_kv(len(toks))
                    check_retrieve(e.retrieve(toks, dst), toks, read)
                    e.lookup(toks)
                    e.stats()
                    if seed == 0:
                        e.freeze(rng.random() < 0.3)
            except BaseException as exc:  # noqa: BLE001
                failures.append(exc)

        pool = [threading.Thread(target=work, args=(s,)) for s in range(6)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(60)
        assert not any(t.is_alive() for t in pool), "deadlock"
        assert not failures, failures[0]
        assert e.flush(10.0) is True
        closers = [threading.Thread(target=e.close) for _ in range(2)]
        for t in closers:
            t.start()
        for t in closers:
            t.join(30)
        assert not any(t.is_alive() for t in closers)
