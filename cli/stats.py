"""`lmcache-remote stats`: entries and bytes per group, Redis memory, the fleet's hit rate.

`--watch` refreshes the same view in the terminal (rich `Live`) every `--interval` seconds
until Ctrl-C (exit code 0): the fleet view for an operator without Grafana."""

from __future__ import annotations

import time
from typing import Any

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.output import size, table
from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text


@click.command()
@click.option("--watch", is_flag=True, help="Refresh the view every --interval seconds "
              "until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--count", type=click.IntRange(min=0), default=0, hidden=True,
              help="With --watch: stop after this many refreshes (0: never; for tests).")
@common_options
def stats(cx: CliContext, watch: bool, interval: float, count: int) -> None:
    """Entries (chunks) and bytes under the prefix, per group; Redis memory; engines."""
    if watch:
        if cx.json:
            raise click.UsageError("--watch shows a live view; --json gives one document")
        _watch(cx, interval, count)
        return
    with cx.progress("scanning keys", unit="keys") as advance:
        result = cx.admin.stats(progress=advance)
    if cx.json:
        cx.emit(result)
        return
    cx.out.print(_render(cx, result))
    for warning in result.get("warnings", []):  # stderr, a line each
        cx.warn(warning)


def _watch(cx: CliContext, interval: float, count: int) -> None:
    """Scan and redraw until Ctrl-C (or `count` refreshes); the last view stays on screen."""
    done = 0
    try:
        with Live(console=cx.out, auto_refresh=False, transient=False) as live:
            while True:
                result = cx.admin.stats()
                done += 1
                header = Text(f"refresh {done} at {time.strftime('%H:%M:%S')}, every "
                              f"{interval:g} s (Ctrl-C to stop)", style="dim")
                live.update(Group(header, _render(cx, result)), refresh=True)
                if count and done >= count:
                    return
                time.sleep(interval)
    except KeyboardInterrupt:  # the way a watch ends
        return


def _render(cx: CliContext, result: dict[str, Any]) -> RenderableType:
    t = table("model", "world", "worker", "dtype", "entries", "bytes",
              title=f"prefix {result['prefix']!r} at {cx.admin.url}")
    for g in result["groups"]:
        t.add_row(g["model_name"], str(g["world_size"]), str(g["worker_id"]), g["dtype"],
                  str(g["entries"]), size(g["bytes"]))
    t.add_section()
    t.add_row("total", "", "", "", str(result["entries"]), size(result["bytes"]))
    r = result["redis"]
    limit = size(r["maxmemory"]) if r["maxmemory"] else "no limit"
    e = result["engines"]
    rate = "-" if e["hit_rate"] is None else f"{100 * e['hit_rate']:.1f}%"
    lines = [
        f"redis: used {size(r['used_memory'])} of {limit}, policy "
        f"{r['maxmemory_policy']}, evicted keys {r['evicted_keys']}",
        f"engines: {e['count']} publishing, lookups {e['lookup_tokens']} tokens, "
        f"hits {e['hit_tokens']} tokens, hit rate {rate}",
        f"lookup promises broken: {e['promise_broken_tokens']} tokens (no memory "
        f"{e['no_room_chunks']}, incomplete {e['remote_incomplete_chunks']}, corrupt "
        f"{e['remote_corrupt_chunks']}, foreign {e['remote_foreign_chunks']}, "
        f"unauthenticated {e['remote_unauthenticated_chunks']} chunks); "
        f"duplicate writes skipped {e['duplicate_writes_skipped']}",
    ]
    keep = result.get("keep")
    if keep is not None and keep["policy"] == "learned":
        lines.append(f"keep policy: {keep['chunks']} chunks held ({size(keep['bytes'])}), "
                     f"{keep['ghosts']} remembered, learned from {keep['accesses']} accesses")
    pins = result.get("pins")
    if pins is not None:
        lines.append(f"pinned: {pins['entries']} chunks, {size(pins['bytes'])} of the "
                     f"{size(pins['budget_bytes'])} pin budget ({pins['timed']} held by "
                     "requests for a time)")
    return Group(t, *_pages(result.get("pages", {})), *(Text(line) for line in lines),
                 *_served(e.get("by_model", {})))


def _pages(pages: dict[str, Any]) -> list[RenderableType]:
    """The SGLang HiCache backend's pages per model and geometry, when there are any."""
    if not pages.get("groups"):
        return []
    t = table("model", "geometry", "pages", "bytes", title="SGLang HiCache pages")
    for g in pages["groups"]:
        t.add_row(g["model_name"], g["geometry"], str(g["entries"]), size(g["bytes"]))
    t.add_section()
    t.add_row("total", "", str(pages["entries"]), size(pages["bytes"]))
    return [t]


def _served(by_model: dict[str, dict[str, Any]]) -> list[RenderableType]:
    """Per model namespace with a vLLM scheduler publishing: where the prompt tokens came
    from (vLLM's own cache, the local tier, Redis, declined because computing was cheaper,
    computed), the cache's hit rate, and the figures of the load decision."""
    rows = {m: v for m, v in by_model.items() if v.get("schedulers")}
    if not rows:
        return []
    t = table("model", "prompt tokens", "vLLM cache", "local tier", "Redis", "declined",
              "computed", "hit rate", "broken", "link", "round trip", "prefill",
              title="prompt tokens by source (vLLM fleet)")
    for model, v in rows.items():
        rate = "-" if v["cache_hit_rate"] is None else f"{100 * v['cache_hit_rate']:.1f}%"
        link = v.get("link_bytes_per_s")
        rtt = v.get("link_rtt_s")
        prefill = v.get("prefill_tokens_per_s")
        t.add_row(model, str(v["prompt_tokens"]), str(v["device_cached_tokens"]),
                  str(v["local_hit_tokens"]), str(v["remote_hit_tokens"]),
                  str(v["declined_tokens"]), str(v["computed_tokens"]), rate,
                  str(v["promise_broken_tokens"]),
                  "-" if link is None else f"{size(int(link))}/s",
                  "-" if rtt is None else f"{rtt * 1e3:.2f} ms",
                  "-" if prefill is None else f"{prefill:.0f} tok/s")
    return [t]
