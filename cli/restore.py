"""`lmcache-remote import FILE`: a snapshot back into Redis (overwriting what is there)."""

from __future__ import annotations

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.output import size
from lmcache_remote_cli.transfer import import_file


@click.command(name="import")
@common_options
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
def import_(cx: CliContext, file: str) -> None:
    """Import FILE (an export) under the prefix; a damaged file imports nothing."""
    result = import_file(cx, file, skip_existing=False)
    if cx.json:
        cx.emit({"file": file, "entries": result.chunks, "bytes": result.bytes,
                 "skipped": result.skipped})
        return
    cx.out.print(f"imported {result.chunks} entries ({size(result.bytes)}) from {file}",
                 markup=False)
