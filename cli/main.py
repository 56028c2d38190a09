"""The `lmcache-remote` Click group; each command lives in its own module."""

from __future__ import annotations

import click
from lmcache_remote_cli.context import LmcrGroup
from lmcache_remote_cli.demo import demo
from lmcache_remote_cli.evict import evict
from lmcache_remote_cli.export import export
from lmcache_remote_cli.inspect import inspect
from lmcache_remote_cli.ls import ls
from lmcache_remote_cli.pin import pin, unpin
from lmcache_remote_cli.ping import ping
from lmcache_remote_cli.replay import replay
from lmcache_remote_cli.restore import import_
from lmcache_remote_cli.stats import stats
from lmcache_remote_cli.warm import warm

import lmcache_remote


@click.group(cls=LmcrGroup)
@click.version_option(lmcache_remote.__version__, prog_name="lmcache-remote")
def cli() -> None:
    """Inspect, warm, export and evict the lmcache-remote KV cache in Redis."""


for _command in (ping, stats, ls, inspect, evict, pin, unpin, export, import_, warm, demo,
                 replay):
    cli.add_command(_command)
