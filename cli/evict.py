"""`lmcache-remote evict`: delete the matching entries, after showing them and asking."""

from __future__ import annotations

import sys
from typing import Any

import click
from lmcache_remote_cli.context import CliContext, Refused, common_options
from lmcache_remote_cli.filters import build_filter, filter_options
from lmcache_remote_cli.output import size


@click.command()
@common_options
@filter_options
@click.option("--all", "everything", is_flag=True, help="Every entry under the prefix.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option("--dry-run", is_flag=True, help="Only count what would be deleted.")
@click.option("--pages", is_flag=True, help="The SGLang HiCache backend's pages instead of "
              "chunks: with --model (a model namespace) or --all.")
def evict(cx: CliContext, filter_args: dict[str, Any], everything: bool, yes: bool,
          dry_run: bool, pages: bool) -> None:
    """Delete entries (all values of each chunk) under the prefix. Needs a filter or --all."""
    flt = build_filter(filter_args, cx.config.chunk_size)
    if flt.is_empty and not everything:
        raise click.UsageError("give a filter (--model, --older-than, ...) or --all")
    if everything and not flt.is_empty:
        raise click.UsageError("--all cannot be combined with filters")
    if pages and any(v is not None for k, v in filter_args.items() if k != "model"):
        raise click.UsageError("--pages takes --model or --all only")
    model = filter_args.get("model")
    kind = "pages" if pages else "entries"
    if not yes or dry_run:
        with cx.progress("counting matches", unit="keys") as advance:
            plan = (cx.admin.plan_page_eviction(model, advance) if pages
                    else cx.admin.plan_eviction(flt, advance))
        what = f"{plan.matched} {kind} ({size(plan.bytes)}) under prefix {cx.admin.prefix!r}"
        if dry_run or plan.matched == 0:
            _report(cx, plan.matched, 0, plan.bytes,
                    f"would delete {what}" if dry_run else "nothing matches")
            return
        if not sys.stdin.isatty():
            raise Refused(f"refusing to delete {what} without --yes (no terminal to ask)")
        if not click.confirm(f"delete {what}?", err=True):
            raise Refused("nothing deleted")
    with cx.progress("deleting", unit="keys") as advance:
        result = (cx.admin.evict_pages(model, advance) if pages
                  else cx.admin.evict(flt, advance))
    _report(cx, result.matched, result.deleted, result.bytes,
            f"deleted {result.deleted} of {result.matched} {kind} ({size(result.bytes)})")


def _report(cx: CliContext, matched: int, deleted: int, nbytes: int, text: str) -> None:
    if cx.json:
        cx.emit({"matched": matched, "deleted": deleted, "bytes": nbytes})
    else:
        cx.out.print(text, markup=False)
