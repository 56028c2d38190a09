"""`lmcache-remote import FILE`: a snapshot back into Redis (overwriting what is there)."""

from __future__ import annotations

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.transfer import import_file, report_transfer


@click.command(name="import")
@common_options
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
def import_(cx: CliContext, file: str) -> None:
    """Import FILE (an export) under the prefix; a damaged file imports nothing."""
    report_transfer(cx, file, import_file(cx, file, skip_existing=False), "imported from")
