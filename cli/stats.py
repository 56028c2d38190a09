"""`lmcache-remote stats`: entries and bytes per group, Redis memory, the fleet's hit rate."""

from __future__ import annotations

from typing import Any

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.output import size, table


@click.command()
@common_options
def stats(cx: CliContext) -> None:
    """Entries (chunks) and bytes under the prefix, per group; Redis memory; engines."""
    with cx.progress("scanning keys", unit="keys") as advance:
        result = cx.admin.stats(progress=advance)
    if cx.json:
        cx.emit(result)
        return
    _print(cx, result)


def _print(cx: CliContext, result: dict[str, Any]) -> None:
    t = table("model", "world", "worker", "dtype", "entries", "bytes",
              title=f"prefix {result['prefix']!r} at {cx.admin.url}")
    for g in result["groups"]:
        t.add_row(g["model_name"], str(g["world_size"]), str(g["worker_id"]), g["dtype"],
                  str(g["entries"]), size(g["bytes"]))
    t.add_section()
    t.add_row("total", "", "", "", str(result["entries"]), size(result["bytes"]))
    cx.out.print(t)
    r = result["redis"]
    limit = size(r["maxmemory"]) if r["maxmemory"] else "no limit"
    cx.out.print(f"redis: used {size(r['used_memory'])} of {limit}, policy "
                 f"{r['maxmemory_policy']}, evicted keys {r['evicted_keys']}")
    e = result["engines"]
    rate = "-" if e["hit_rate"] is None else f"{100 * e['hit_rate']:.1f}%"
    cx.out.print(f"engines: {e['count']} publishing, lookups {e['lookup_tokens']} tokens, "
                 f"hits {e['hit_tokens']} tokens, hit rate {rate}")
    cx.out.print(f"lookup promises broken: {e['promise_broken_tokens']} tokens (no memory "
                 f"{e['no_room_chunks']}, incomplete {e['remote_incomplete_chunks']}, corrupt "
                 f"{e['remote_corrupt_chunks']}, foreign {e['remote_foreign_chunks']}, "
                 f"unauthenticated {e['remote_unauthenticated_chunks']} chunks); "
                 "duplicate writes skipped "
                 f"{e['duplicate_writes_skipped']}")
