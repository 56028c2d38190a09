"""`lmcache-remote replay`: what a cache of a given size would keep of a request log.

Capacity planning for operators: the log's requests go through the real engine against a
private Redis at each capacity (`lmcache_remote.replay`), beside the offline optimum and
published policies simulated on the same requests; a table (or one JSON document with
`--json`) and, with `--plot`, a picture of the hit rate against capacity. It never touches
the Redis at `--url`: every replay runs on a server of its own on a loopback port.
"""

from __future__ import annotations

import click
from lmcache_remote_cli.context import CliContext, common_options

from lmcache_remote.config import KEEP_POLICIES


def _capacity(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
              ) -> list[int]:
    from lmcache_remote.replay.report import parse_tokens

    try:
        return [parse_tokens(v) for v in values] or [1_000_000, 3_000_000, 10_000_000]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@common_options
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--capacity", "capacities", multiple=True, callback=_capacity,
              help="Tokens of KV Redis holds (1M, 500k, ...); repeat it. Default: 1M 3M 10M.")
@click.option("--policy", "policies", multiple=True, type=click.Choice(KEEP_POLICIES),
              help="keep_policy to replay; repeat it (default: both).")
@click.option("--speedup", default=10.0, show_default=True, type=click.FloatRange(min=0.01),
              help="The trace's pace times this (1: real time).")
@click.option("--processes", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Engine processes sharing the Redis (requests dealt round-robin).")
@click.option("--bytes-per-token", default=64, show_default=True,
              type=click.IntRange(min=4), help="KV bytes a token (a multiple of 4).")
@click.option("--measure-from", default=0.5, show_default=True,
              type=click.FloatRange(0.0, 1.0, max_open=True),
              help="Count hits from this fraction of the trace's span on (before: warm-up).")
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N requests.")
@click.option("--block-size", type=click.IntRange(min=1),
              help="Tokens a chunk for a trace of token ids (default 512).")
@click.option("--simulate-only", is_flag=True, help="No replay: the simulated rows alone.")
@click.option("--server", type=click.Choice(["redis", "valkey"]), default="redis",
              show_default=True, help="The server binary the replays start.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write the hit rate against capacity here (.svg or .png; needs matplotlib).")
def replay(cx: CliContext, trace: str, capacities: list[int], policies: tuple[str, ...],
           speedup: float, processes: int, bytes_per_token: int, measure_from: float,
           limit: int | None, block_size: int | None, simulate_only: bool, server: str,
           plot_path: str | None) -> None:
    """Replay TRACE (Mooncake's JSONL or the project's, docs/replay.md) at each capacity."""
    from lmcache_remote.replay.driver import ReplaySettings
    from lmcache_remote.replay.report import compare, markdown, plot
    from lmcache_remote.replay.trace import TraceFormatError, read_trace

    if bytes_per_token % 4:
        raise click.BadParameter("must be a multiple of 4 (K and V in bfloat16)",
                                 param_hint="--bytes-per-token")
    try:
        loaded = read_trace(trace, block_size=block_size, limit=limit)
    except TraceFormatError as exc:
        raise click.BadParameter(str(exc), param_hint="TRACE") from None
    if not loaded.requests:
        raise click.BadParameter("the trace has no requests", param_hint="TRACE")
    settings = ReplaySettings(capacity_tokens=capacities[0], speedup=speedup,
                              processes=processes, bytes_per_token=bytes_per_token,
                              measure_from=measure_from, server=server)
    doc = compare(loaded, capacities, settings=settings,
                  policies=() if simulate_only else (policies or KEEP_POLICIES),
                  note=cx.info)
    if plot_path is not None:
        plot(doc, plot_path)
    if cx.json:
        cx.emit(doc)
        return
    cx.out.print(markdown(doc), markup=False)
    cx.out.print(f"{doc['requests']} requests over {doc['span_s']:.0f} s, hits counted from "
                 f"{doc['measure_from_s']:.0f} s on; each cell: token hit rate (its ratio to "
                 "the optimum's), chunks written", markup=False)
