"""`lmcache-remote warm`: fill the cache before traffic arrives.

Sources (exactly one):

- `--from FILE`: an export; chunks already present are skipped (`import` with skip).

Each source is one `_warm_from_*` function returning a JSON-ready dict with at least
`entries` (chunks written) and `skipped`; a new source adds an option and a function.
"""

from __future__ import annotations

from typing import Any

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.output import size
from lmcache_remote_cli.transfer import import_file


@click.command()
@common_options
@click.option("--from", "from_file", type=click.Path(exists=True, dir_okay=False),
              help="A snapshot written by `export`.")
def warm(cx: CliContext, from_file: str | None) -> None:
    """Warm the cache from a snapshot; chunks already present are skipped."""
    if from_file is None:
        raise click.UsageError("give a source: --from FILE")
    result = _warm_from_file(cx, from_file)
    if cx.json:
        cx.emit(result)
        return
    cx.out.print(f"warmed {result['entries']} entries ({size(result['bytes'])}), "
                 f"{result['skipped']} already present", markup=False)


def _warm_from_file(cx: CliContext, path: str) -> dict[str, Any]:
    result = import_file(cx, path, skip_existing=True)
    return {"source": path, "entries": result.chunks, "bytes": result.bytes,
            "skipped": result.skipped}
