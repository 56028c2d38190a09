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
def export(cx: CliContext, filter_args: dict[str, Any], file: str) -> None:
    """Write the matching entries (values byte for byte, remaining TTLs) to FILE."""
    flt = build_filter(filter_args, cx.config.chunk_size)
    with cx.progress("exporting", unit="entries") as advance:
        result = cx.admin.export(file, flt, advance)
    report_transfer(cx, file, result, "exported to")
    if result.skipped and not cx.json:
        cx.warn(f"{result.skipped} entries vanished during the export and were left out")
