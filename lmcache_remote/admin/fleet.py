"""The fleet's hit rate: the sum of the counters every live engine publishes into Redis.

Engines publish one hash each (`storage.publisher.StatsPublisher`, key
`{prefix}:engines:{engine_id}`, expiring when the engine stops). `fleet_stats` finds them with
SCAN, reads them in one pipeline per page and adds the counters up.

A vLLM engine publishes from every worker (loads and stores, per rank) and from its scheduler
(`role` `scheduler`: the prompt tokens vLLM was sent, what vLLM's own prefix cache held, what
this cache promised, what it declined because computing was cheaper, and the figures of its
load decision; `integrations.vllm_core.fleet`). Per model namespace (`by_model`) the
view then says where the prompt tokens came from: vLLM's own cache, the local CPU tier, Redis,
or computed; each rank loads its share of the heads, so a worker's tokens count divided by
its world size.
"""

from __future__ import annotations

from typing import Any

from lmcache_remote.naming.keys import engine_stats_pattern
from lmcache_remote.storage.session.scan import scan_batches

#: Counters summed over the engines (the fields engines publish, see `engine.published_fields`).
SUMMED = (
    "lookup_requests", "lookup_tokens", "hit_tokens", "retrieve_tokens", "retrieved_tokens",
    "store_tokens", "stored_tokens", "remote_errors", "remote_hit_chunks", "remote_read_bytes",
    "remote_written_bytes", "local_evicted_chunks", "promise_broken_tokens", "no_room_chunks",
    "remote_incomplete_chunks", "remote_corrupt_chunks", "remote_foreign_chunks",
    "remote_unauthenticated_chunks", "duplicate_writes_skipped", "local_hit_tokens",
    "remote_hit_tokens", "prompt_tokens", "device_cached_tokens", "promised_tokens",
    "scheduler_lookup_requests", "scheduler_lookup_errors", "unnamed_requests",
    "declined_tokens", "probe_loads", "failed_load_requests",
)  # fmt: skip
#: Per model: counters of the workers, divided by their world size (tokens of a request).
_PER_REQUEST = ("local_hit_tokens", "remote_hit_tokens", "retrieved_tokens",
                "promise_broken_tokens")
#: Per model: counters of the schedulers, as they are.
_SCHEDULER = ("prompt_tokens", "device_cached_tokens", "promised_tokens", "declined_tokens")
#: Per model: the schedulers' decision figures (the slowest link, the fastest prefill shown).
_FIGURES = {"link_bytes_per_s": min, "link_rtt_s": max, "prefill_tokens_per_s": max}


def _number(value: bytes | str | None) -> float:
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0


def fleet_stats(client: Any, prefix: str) -> dict[str, Any]:
    """`{"count", <each SUMMED counter>, "hit_rate", "retrieve_hit_rate", "models"}`."""
    totals = dict.fromkeys(SUMMED, 0.0)
    count = 0
    models: set[str] = set()
    per_model: dict[str, dict[str, float]] = {}
    for node, keys in scan_batches(client, engine_stats_pattern(prefix)):
        pipe = node.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for fields in pipe.execute():
            if not fields:
                continue
            data = {_text(k): v for k, v in fields.items()}
            count += 1
            model = _text(data.get("model_name", b"?"))
            models.add(model)
            for name in SUMMED:
                totals[name] += _number(data.get(name))
            row = per_model.setdefault(model, dict.fromkeys(
                ("engines", "schedulers", *_SCHEDULER, *_PER_REQUEST), 0.0))
            if _text(data.get("role", b"engine")) == "scheduler":
                row["schedulers"] += 1
                for name in _SCHEDULER:
                    row[name] += _number(data.get(name))
                for name, pick in _FIGURES.items():
                    if data.get(name) is not None:
                        value = _number(data.get(name))
                        row[name] = pick(row[name], value) if name in row else value
            else:
                row["engines"] += 1
                world = max(1.0, _number(data.get("world_size")) or 1.0)
                for name in _PER_REQUEST:
                    row[name] += _number(data.get(name)) / world
    out: dict[str, Any] = {"count": count}
    out.update({k: int(v) if float(v).is_integer() else v for k, v in totals.items()})
    out["hit_rate"] = _ratio(totals["hit_tokens"], totals["lookup_tokens"])
    out["retrieve_hit_rate"] = _ratio(totals["retrieved_tokens"], totals["retrieve_tokens"])
    out["models"] = sorted(models)
    out["by_model"] = {model: _model_view(row) for model, row in sorted(per_model.items())}
    return out


def _model_view(row: dict[str, float]) -> dict[str, Any]:
    """One namespace's figures; with a scheduler's (vLLM), where its prompt tokens came from
    and the hit rate of this cache (`cache_hit_rate`: local tier and Redis over the prompt)."""
    view: dict[str, Any] = {k: int(v) if float(v).is_integer() else round(v, 6)
                            for k, v in row.items()}
    prompt = row["prompt_tokens"]
    served = row["local_hit_tokens"] + row["remote_hit_tokens"]
    # declined tokens were held but computed because that was cheaper: not misses
    view["computed_tokens"] = (
        max(0, round(prompt - row["device_cached_tokens"] - served - row["declined_tokens"]))
        if row["schedulers"] else None)
    view["cache_hit_rate"] = _ratio(served, prompt)
    view["promised_rate"] = _ratio(row["promised_tokens"], prompt)
    return view


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 6) if den else None
