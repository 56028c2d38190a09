"""The `lmcache-remote` Click group; each command lives in its own module."""

from __future__ import annotations

import click

import lmcache_remote


@click.group()
@click.version_option(lmcache_remote.__version__, prog_name="lmcache-remote")
def cli() -> None:
    """Inspect, warm, export and evict the lmcache-remote KV cache in Redis."""
