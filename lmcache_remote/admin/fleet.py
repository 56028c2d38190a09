"""The fleet's hit rate: the sum of the counters every live engine publishes into Redis.

Engines publish one hash each (`storage.publisher.StatsPublisher`, key
`{prefix}:engines:{engine_id}`, expiring when the engine stops). `fleet_stats` finds them with
SCAN, reads them in one pipeline per page and adds the counters up.
"""

from __future__ import annotations

from typing import Any

from lmcache_remote.keys import engine_stats_pattern
from lmcache_remote.storage.scan import scan_batches

#: Counters summed over the engines (the fields engines publish, see `engine.published_fields`).
SUMMED = (
    "lookup_requests", "lookup_tokens", "hit_tokens", "retrieve_tokens", "retrieved_tokens",
    "store_tokens", "stored_tokens", "remote_errors", "remote_hit_chunks", "remote_read_bytes",
    "remote_written_bytes", "local_evicted_chunks", "promise_broken_tokens", "no_room_chunks",
    "remote_incomplete_chunks", "remote_corrupt_chunks", "remote_foreign_chunks",
    "remote_unauthenticated_chunks", "duplicate_writes_skipped",
)  # fmt: skip


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
    for node, keys in scan_batches(client, engine_stats_pattern(prefix)):
        pipe = node.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for fields in pipe.execute():
            if not fields:
                continue
            data = {_text(k): v for k, v in fields.items()}
            count += 1
            models.add(_text(data.get("model_name", b"?")))
            for name in SUMMED:
                totals[name] += _number(data.get(name))
    out: dict[str, Any] = {"count": count}
    out.update({k: int(v) if float(v).is_integer() else v for k, v in totals.items()})
    out["hit_rate"] = _ratio(totals["hit_tokens"], totals["lookup_tokens"])
    out["retrieve_hit_rate"] = _ratio(totals["retrieved_tokens"], totals["retrieve_tokens"])
    out["models"] = sorted(models)
    return out


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 6) if den else None
