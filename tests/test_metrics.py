"""Metrics: latency histograms, the Prometheus exporter, engines publishing fleet counters."""

from __future__ import annotations

import urllib.request

import redis
import torch
from kvutil import engine, metadata, tokens, view
from prometheus_client import CollectorRegistry, generate_latest

from lmcache_remote.engine.reporting import _host
from lmcache_remote.naming.keys import engine_stats_key
from lmcache_remote.telemetry import prometheus
from lmcache_remote.telemetry.metrics import LATENCY_BUCKETS, Metrics
from tests.faultkit import bound, timed, wait_for
from tests.servers import free_port, listen_addresses


def _workload(e, n: int = 600) -> None:  # type: ignore[no-untyped-def]
    kv, _ = view("kv_split", torch.bfloat16, n, seed=1)
    e.store(tokens(n), kv)
    e.lookup(tokens(n))
    e.retrieve(tokens(n), kv)


def test_observe_keeps_the_total_and_fills_buckets() -> None:
    m = Metrics()
    m.observe("engine.lookup_seconds", 0.003)
    m.observe("engine.lookup_seconds", 0.003)
    m.observe("engine.lookup_seconds", 99.0)
    assert abs(m.snapshot()["engine"]["lookup_seconds"] - 99.006) < 1e-9
    hist = m.histograms()["engine.lookup_seconds"]
    assert hist.count == 3 and hist.counts[LATENCY_BUCKETS.index(0.005)] == 2
    assert hist.counts[-1] == 1  # +Inf


def test_a_lookup_counts_its_hit_tokens_by_the_tier_that_has_them(
        redis_url: str, key_prefix: str) -> None:
    with engine(redis_url, key_prefix, store_async=False, local_cpu=False) as writer:
        kv, _ = view("kv_split", torch.bfloat16, 512, seed=1)
        assert writer.store(tokens(512), kv) == 512  # both chunks in Redis only
    with engine(redis_url, key_prefix, store_async=False) as reader:
        kv, _ = view("kv_split", torch.bfloat16, 256, seed=1)
        assert reader.store(tokens(256), kv) == 256  # the first chunk in its local tier too
        assert reader.lookup(tokens(512)) == 512
        stats = reader.stats()
    assert stats["local"]["lookup_hit_tokens"] == 256
    assert stats["remote"]["lookup_hit_tokens"] == 256


def test_engine_counts_per_tier(redis_url: str, key_prefix: str) -> None:
    with engine(redis_url, key_prefix, store_async=False) as a:
        _workload(a)
        local, remote = a.stats()["local"], a.stats()["remote"]
        hists = a.metrics.histograms()
    assert local["stored_tokens"] == 512 and remote["stored_tokens"] == 512
    assert local["lookup_hit_tokens"] == 512 and "lookup_hit_tokens" not in remote
    assert local["hit_tokens"] == 512 and local["hit_bytes"] == 2 * 32768
    assert hists["remote.put_seconds"].count == 1
    assert hists["remote.contains_seconds"].count == 2  # the store's plan, the lookup's tail
    with engine(redis_url, key_prefix, local_cpu=False) as b:
        _workload(b)
        stats = b.stats()
        hists = b.metrics.histograms()
    assert stats["remote"]["lookup_hit_tokens"] == 512
    assert stats["remote"]["hit_tokens"] == 512 and stats["remote"]["hit_chunks"] == 2
    assert stats["remote"]["hit_bytes"] == 2 * 32768
    assert "stored_tokens" not in stats["remote"]  # everything was there already
    assert hists["remote.get_seconds"].count == 1


def test_prometheus_collector_exports_counters_and_histograms(redis_url: str,
                                                              key_prefix: str) -> None:
    registry = CollectorRegistry()
    registry.register(prometheus.collector())
    model = f"test/{key_prefix}"  # no other engine of this process shares the labels
    with engine(redis_url, key_prefix, metadata(model=model), store_async=False) as e:
        _workload(e)
        text = generate_latest(registry).decode()
        # stable labels: the host, the namespace, the rank (no per-process id)
        labels = f'host="{_host()}",model="{model}",worker="0"'
    assert f"lmcr_engine_lookup_tokens_total{{{labels}}} 600.0" in text
    assert f"lmcr_engine_lookup_hit_tokens_total{{{labels}}} 512.0" in text
    assert f"lmcr_engine_retrieved_tokens_total{{{labels}}} 512.0" in text
    assert 'tier="local"' in text and "lmcr_tier_hit_tokens_total" in text
    assert "lmcr_tier_written_bytes_total" in text and 'tier="remote"' in text
    assert f'lmcr_engine_lookup_seconds_count{{{labels}}} 1.0' in text
    assert 'lmcr_engine_retrieve_seconds_bucket{' in text and 'le="+Inf"' in text
    assert 'lmcr_tier_put_seconds_count{' in text and 'tier="remote"' in text
    assert "lookup_seconds_total" not in text  # latency totals are histograms only
    # the load decision's figures, gauges: the prior link until a load measured it
    assert f"lmcr_decision_link_rtt_seconds{{{labels}}}" in text
    assert f"lmcr_decision_prefill_tokens_per_s{{{labels}}} 4000.0" in text
    assert "# TYPE lmcr_decision_link_bytes_per_s gauge" in text
    after = generate_latest(registry).decode()
    assert model not in after  # a closed engine leaves the exporter


def test_engines_of_one_process_with_the_same_labels_are_one_sample(
        redis_url: str, key_prefix: str) -> None:
    """A restarted engine (same host, namespace, rank) continues the series of the one it
    replaces; two alive at once in one process are summed, never two samples of one series."""
    registry = CollectorRegistry()
    registry.register(prometheus.collector())
    model = f"test/{key_prefix}"
    labels = f'host="{_host()}",model="{model}",worker="0"'
    with engine(redis_url, key_prefix, metadata(model=model), store_async=False) as a:
        _workload(a)
        with engine(redis_url, key_prefix, metadata(model=model), store_async=False) as b:
            b.lookup(tokens(300, 5))
            text = generate_latest(registry).decode()
    assert text.count(f"lmcr_engine_lookup_tokens_total{{{labels}}}") == 1
    assert f"lmcr_engine_lookup_tokens_total{{{labels}}} 900.0" in text
    assert f"lmcr_engine_lookup_seconds_count{{{labels}}} 2.0" in text


def test_metrics_port_serves_http(redis_url: str, key_prefix: str) -> None:
    port = free_port()
    with engine(redis_url, key_prefix, store_async=False, metrics_port=port) as e:
        _workload(e)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert f'lmcr_engine_store_tokens_total{{host="{_host()}"'.encode() in body
        assert listen_addresses(port) == ["127.0.0.1"]  # loopback by default, nothing else


def test_metrics_host_picks_the_address(redis_url: str, key_prefix: str) -> None:
    """Another address is one setting away (127.0.0.2: loopback too, so the test exposes
    nothing; a real deployment names an interface's address or 0.0.0.0)."""
    port = free_port()
    with engine(redis_url, key_prefix, store_async=False, metrics_port=port,
                metrics_host="127.0.0.2") as e:
        _workload(e)
        assert listen_addresses(port) == ["127.0.0.2"]
        body = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10).read()
        assert b"lmcr_engine_store_tokens_total" in body


def test_engine_publishes_its_counters_on_flush_and_close(redis_url: str,
                                                          redis_client: redis.Redis,
                                                          key_prefix: str) -> None:
    with engine(redis_url, key_prefix, store_async=False) as e:
        _workload(e)
        e.flush()
        key = engine_stats_key(key_prefix, e.engine_id)
        published = redis_client.hgetall(key)
        assert int(published[b"lookup_tokens"]) == 600
        assert int(published[b"hit_tokens"]) == 512
        assert published[b"model_name"] == b"test/model"
        assert 0 < redis_client.ttl(key) <= 30
        e.lookup(tokens(256, 3))
    assert int(redis_client.hget(key, "lookup_tokens")) == 856  # the final publish on close


def test_engine_publishes_periodically(redis_url: str, redis_client: redis.Redis,
                                       key_prefix: str) -> None:
    with engine(redis_url, key_prefix, stats_publish_interval=0.2) as e:
        e.lookup(tokens(300))
        key = engine_stats_key(key_prefix, e.engine_id)
        assert wait_for(lambda: redis_client.hget(key, "lookup_tokens") == b"300")
        assert e.stats()["publisher"]["published"] >= 1


def test_publishing_is_skipped_while_redis_is_down(private_redis, key_prefix: str) -> None:
    with engine(private_redis.url, key_prefix, store_async=False, unhealthy_backoff=30) as e:
        e.lookup(tokens(300))
        e.flush()
        private_redis.kill()
        assert e.lookup(tokens(300)) == 0   # a miss, and the gate opens
        _, took = timed(e.flush)
        assert took < bound(1, 1.0)  # no wait on a dead server: bounded by remote_timeout
        stats = e.stats()["publisher"]
        assert stats["published"] == 1 and stats["skipped"] >= 1
