"""docs/grafana-dashboard.json queries only metrics the Prometheus exporter really exports.

Every metric name in every PromQL expression of the dashboard (panel targets and template
queries) is compared with the sample names `prometheus.collector()` yields over real engines
on a real redis-server, after a workload that makes each counter the dashboard shows count
something: local and remote hits, an eviction, a damaged value, a broken promise, a Redis
that refuses writes (OOM)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import redis
import torch
from kvutil import engine, tokens, view
from prometheus_client import CollectorRegistry

from lmcache_remote.telemetry import prometheus
from tests.servers import RedisServer

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
             "and", "or", "unless", "inf", "nan"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers less functions and
    aggregations (followed by `(`), keywords, label names (inside `{}`, `by (...)` and the
    like) and what sits in strings and range brackets."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "", expr)  # strings
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges, [$__rate_interval]
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ",
                  expr)  # label lists
    expr = re.sub(r"\blabel_values\s*\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,[^)]*\)", r"\1", expr)
    names = set()
    for match in _IDENT.finditer(expr):
        rest = expr[match.end():].lstrip()
        word = match.group()
        if rest.startswith("(") or word.lower() in _KEYWORDS or word.startswith("$"):
            continue
        if expr[max(0, match.start() - 1):match.start()] == "$":  # a Grafana variable
            continue
        names.add(word)
    return names


def dashboard_exprs(node: Any) -> list[str]:
    """Every `expr` of a panel target and every template variable's query, anywhere."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            query = key in ("expr", "definition") or (key == "query" and "(" in str(value))
            if query and isinstance(value, str):
                found.append(value)
            else:
                found.extend(dashboard_exprs(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(dashboard_exprs(item))
    return found


def test_the_extractor() -> None:
    expr = ('sum by (tier) (rate(lmcr_tier_hit_tokens_total{model=~"$model"}[$__rate_interval]))'
            ' / ignoring(tier) group_left sum(rate(lmcr_engine_retrieve_tokens_total[5m]))')
    assert metric_names(expr) == {"lmcr_tier_hit_tokens_total",
                                  "lmcr_engine_retrieve_tokens_total"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(a_bucket[1m])))") == {
        "a_bucket"}
    assert metric_names("label_values(lmcr_x_total, model)") == {"lmcr_x_total"}


def exported_names(server: RedisServer, prefix: str) -> set[str]:
    """Sample names the collector yields after a workload that exercises every counter the
    dashboard shows, on live engines."""
    registry = CollectorRegistry()
    registry.register(prometheus.collector())
    n = 4 * 256
    kv, _ = view("kv_split", torch.bfloat16, n, seed=1)
    client: redis.Redis = server.client()
    small = 6 * 32768 / 1024**3  # the local tier holds about six 32 KiB chunks
    with engine(server.url, prefix, store_async=False, max_local_cpu_size=small) as writer, \
            engine(server.url, prefix, store_async=False, local_cpu=False) as reader:
        assert writer.store(tokens(512), kv) == 512
        assert writer.store(tokens(n), kv) == n
        writer.store(tokens(n, seed=3), kv)  # four more chunks: the local tier evicts
        assert writer.stats()["local"]["evicted_bytes"] > 0
        writer.lookup(tokens(n))
        writer.retrieve(tokens(256), kv)  # a local hit
        assert reader.lookup(tokens(n)) == n  # promised
        remote = reader.storage.remote
        assert remote is not None
        second = remote._keys(reader.token_db.prefix_keys(tokens(n))[1])[0]
        value = bytearray(client.get(second) or b"")
        value[-1] ^= 0xFF  # damage one chunk's payload: a corrupt chunk, the promise broken
        client.set(second, bytes(value))
        out, _ = view("kv_split", torch.bfloat16, n, seed=None)
        assert 0 < int(reader.retrieve(tokens(n), out).sum()) < n  # remote hits, then it cuts
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # every write refused (OOM): errors, dropped writes
        reader.store(tokens(n, seed=5), kv)
        client.config_set("maxmemory", 0)
        names = {s.name for family in registry.collect() for s in family.samples}
        counters = {**writer.stats(), **reader.stats()}
    client.close()
    assert reader.stats()["remote"].get("errors", 0) > 0, counters
    return names


def test_every_metric_the_dashboard_queries_is_exported(private_redis: RedisServer,
                                                         key_prefix: str) -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(board)
    assert len(exprs) >= 15
    queried = set().union(*(metric_names(e) for e in exprs))
    exported = exported_names(private_redis, key_prefix)
    missing = sorted(queried - exported)
    assert missing == [], f"queried, not exported: {missing}"
    panels = {p["title"] for p in board["panels"]}
    assert {"Hit rate by tier", "Bytes per second", "Errors", "Broken promises"} <= panels
    assert any("histogram_quantile" in e for e in exprs)
