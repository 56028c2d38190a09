"""`lmcache-remote export FILE`: the matching entries into a snapshot file."""

from __future__ import annotations

from typing import Any

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.filters import build_filter, filter_options
from lmcache_remote_cli.transfer import report_transfer


@click.command()
@common_options
@filter_options
@click.argument("file", type=click.Path(dir_okay=False, writable=True))
@click.option("--pages", is_flag=True, help="The SGLang HiCache backend's pages instead of "
              "chunks (--model: one model namespace's); import restores either.")
def export(cx: CliContext, filter_args: dict[str, Any], file: str, pages: bool) -> None:
    """Write the matching entries (values byte for byte, remaining TTLs) to FILE."""
    if pages:
        if any(v is not None for k, v in filter_args.items() if k != "model"):
            raise click.UsageError("--pages takes --model only")
        with cx.progress("exporting", unit="pages") as advance:
            result = cx.admin.export_pages(file, filter_args.get("model"), advance)
        report_transfer(cx, file, result, "exported to")
        return
    flt = build_filter(filter_args, cx.config.chunk_size)
    with cx.progress("exporting", unit="entries") as advance:
        result = cx.admin.export(file, flt, advance)
    report_transfer(cx, file, result, "exported to")
    if result.skipped and not cx.json:
        cx.warn(f"{result.skipped} entries vanished during the export and were left out")
