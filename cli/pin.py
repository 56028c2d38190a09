"""`lmcache-remote pin` / `unpin`: keep chunks in Redis whatever its LRU would evict.

They take the filters of `ls` and `evict`, and destroy nothing, so they ask for no
confirmation. A pin holds under a `volatile-*` maxmemory-policy, with every engine writing
with `remote_ttl` (`ping` warns when the server cannot honour pins); all pins together stay
within `pin_budget` (a pin past it is refused whole, exit 2). docs/pins.md.
"""

from __future__ import annotations

import time
from typing import Any

import click
from lmcache_remote_cli.context import CliContext, Refused, common_options
from lmcache_remote_cli.filters import build_filter, filter_options
from lmcache_remote_cli.output import size

from lmcache_remote.admin import EntryFilter, PinRefused, PinResult, parse_duration


def _filter(cx: CliContext, filter_args: dict[str, Any], everything: bool) -> EntryFilter:
    flt = build_filter(filter_args, cx.config.chunk_size)
    if flt.is_empty and not everything:
        raise click.UsageError("give a filter (--model, --tokens FILE, ...) or --all")
    if everything and not flt.is_empty:
        raise click.UsageError("--all cannot be combined with filters")
    return flt


@click.command()
@common_options
@filter_options
@click.option("--all", "everything", is_flag=True, help="Every chunk under the prefix.")
@click.option("--for", "duration", metavar="DURATION",
              help="End the pin after this long (90s, 15m, 2h, 1d); default: until unpinned.")
def pin(cx: CliContext, filter_args: dict[str, Any], everything: bool,
        duration: str | None) -> None:
    """Pin the matching chunks: Redis never evicts them while they are pinned."""
    flt = _filter(cx, filter_args, everything)
    until = None
    if duration is not None:
        try:
            until = time.time() + parse_duration(duration)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--for") from None
    try:
        result = cx.admin.pin(flt, until)
    except PinRefused as exc:
        raise Refused(str(exc)) from None
    _report(cx, result, f"pinned {result.matched} chunks ({size(result.bytes)} newly)")
    info = cx.admin.ping()
    for warning in info.pin_warnings:
        cx.warn(warning)


@click.command()
@common_options
@filter_options
@click.option("--all", "everything", is_flag=True, help="Every pin under the prefix.")
def unpin(cx: CliContext, filter_args: dict[str, Any], everything: bool) -> None:
    """Unpin the matching pinned chunks: Redis may evict them again (`remote_ttl` again)."""
    flt = _filter(cx, filter_args, everything)
    result = cx.admin.unpin(flt)
    _report(cx, result, f"unpinned {result.matched} chunks ({size(result.bytes)})")


def _report(cx: CliContext, result: PinResult, text: str) -> None:
    budget = cx.config.pin_budget_bytes
    if cx.json:
        cx.emit({"matched": result.matched, "bytes": result.bytes,
                 "pinned_bytes": result.pinned_bytes, "budget_bytes": budget})
        return
    cx.out.print(f"{text}; {size(result.pinned_bytes)} of the {size(budget)} pin budget "
                 "pinned", markup=False)
