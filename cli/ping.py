"""`lmcache-remote ping`: is Redis there, what is it, how far, will it evict when full."""

from __future__ import annotations

import dataclasses

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.output import size

from lmcache_remote.admin.server import ServerInfo


@click.command()
@common_options
def ping(cx: CliContext) -> None:
    """Reachability, server name and version, latency, eviction policy, whether it can honour
    pins, and whether this user may use the cache (exit 1 if Redis refuses it a command the
    cache needs)."""
    info = cx.admin.ping()
    if cx.json:
        cx.emit({"url": cx.admin.url, **dataclasses.asdict(info),
                 "warnings": list(info.warnings), "pin_warnings": list(info.pin_warnings)})
    else:
        _print(cx, info)
    if info.access != "ok":
        raise click.exceptions.Exit(1)


def _print(cx: CliContext, info: ServerInfo) -> None:
    cx.out.print(f"{cx.admin.url}: {info.server} {info.version} ({info.mode}), "
                 f"round trip {info.latency_ms:.3f} ms")
    limit = size(info.maxmemory) if info.maxmemory else "no limit"
    cx.out.print(f"maxmemory {limit}, maxmemory-policy {info.maxmemory_policy}")
    for warning in (*info.warnings, *info.pin_warnings):
        cx.warn(warning)
    if info.access != "ok":
        cx.warn(f"this user cannot use the cache: {info.access}")
