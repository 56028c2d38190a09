"""`lmcache-remote ls`: the entries under the prefix, filtered, at most --limit."""

from __future__ import annotations

import time
from typing import Any

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.filters import build_filter, filter_options
from lmcache_remote_cli.output import seconds, size, table

from lmcache_remote.admin import describe


@click.command(name="ls")
@common_options
@filter_options
@click.option("--limit", type=click.IntRange(min=0), default=100, show_default=True,
              help="At most this many entries (0 = all).")
@click.option("--pages", is_flag=True, help="The SGLang HiCache backend's pages instead of "
              "chunks (--model: one model namespace's).")
def ls(cx: CliContext, filter_args: dict[str, Any], limit: int, pages: bool) -> None:
    """List entries: model, worker, dtype, hash, size, idle time, TTL, pinned."""
    if pages:
        _ls_pages(cx, filter_args, limit)
        return
    flt = build_filter(filter_args, cx.config.chunk_size)
    rows = [describe(e) for e in cx.admin.entries(flt, limit or None)]
    pins = cx.admin.pin_registry.entries()
    for r in rows:
        pin = pins.get(r["redis_key"])
        r["pinned"] = pin is not None
        r["pinned_until"] = None if pin is None else pin.until
    if cx.json:
        cx.emit({"count": len(rows), "limit": limit, "entries": rows})
        return
    t = table("model", "world", "worker", "dtype", "hash", "tokens", "parts", "size", "idle",
              "ttl", "pinned")
    for r in rows:
        t.add_row(r["model_name"], str(r["world_size"]), str(r["worker_id"]), r["dtype"],
                  r["chunk_hash"], str(r.get("num_tokens", "?")), str(r["parts"]),
                  size(r["bytes"]), seconds(r["idle_seconds"]),
                  seconds(r["ttl_seconds"], none="none"), _pinned(r["pinned_until"])
                  if r["pinned"] else "")
    cx.out.print(t)
    if limit and len(rows) == limit:
        cx.info(f"showing the first {limit} entries (--limit 0 for all)")


def _pinned(until: float | None) -> str:
    """`yes` for a pin without end, else the time it ends in (`5m`, or `ended`)."""
    if until is None:
        return "yes"
    left = until - time.time()
    return "ended" if left <= 0 else f"{seconds(int(left))} left"


def _ls_pages(cx: CliContext, filter_args: dict[str, Any], limit: int) -> None:
    if any(v is not None for k, v in filter_args.items() if k != "model"):
        raise click.UsageError("--pages takes --model only")
    rows = list(cx.admin.page_entries(filter_args.get("model"), limit or None))
    if cx.json:
        cx.emit({"count": len(rows), "limit": limit, "pages": rows})
        return
    t = table("model", "geometry", "page hash", "tokens", "parts", "size", "idle", "ttl")
    for r in rows:
        t.add_row(r["model_name"], r["geometry"], r["page_hash"], str(r["num_tokens"] or "?"),
                  str(r["parts"]), size(r["bytes"]), seconds(r["idle_seconds"]),
                  seconds(r["ttl_seconds"], none="none"))
    cx.out.print(t)
    if limit and len(rows) == limit:
        cx.info(f"showing the first {limit} pages (--limit 0 for all)")
