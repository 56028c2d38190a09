"""`lmcache-remote inspect KEY`: one entry's decoded header and checksum verdict."""

from __future__ import annotations

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.output import seconds, size


@click.command()
@common_options
@click.argument("key")
@click.option("--no-verify", is_flag=True, help="Read the header only, skip the checksums.")
def inspect(cx: CliContext, key: str, no_verify: bool) -> None:
    """Show one entry. KEY is a Redis key (a chunk's, or an SGLang page's) or
    model:world_size:worker:dtype:hash."""
    info = cx.admin.inspect(key, verify=not no_verify)
    if cx.json:
        cx.emit(info)
        return
    if info.get("kind") == "page":  # an SGLang HiCache page
        lines = [("key", info["redis_key"]), ("model", info["model_name"]),
                 ("geometry", info["geometry"]), ("page hash", info["page_hash"])]
    else:
        lines = [
            ("key", info["redis_key"]),
            ("model", info["model_name"]),
            ("world size / worker", f"{info['world_size']} / {info['worker_id']}"),
            ("dtype", info["dtype"]),
            ("chunk hash", info["chunk_hash"]),
        ]
    if "codec" in info:
        lines += [
            ("codec", info["codec"]),
            ("shape", " x ".join(map(str, info["shape"])) + f" ({info['value_dtype']})"),
            ("tokens", str(info["num_tokens"])),
            ("raw size", size(info["raw_bytes"])),
            ("stored size", f"{size(info['stored_bytes'])} in {info['parts']} part(s), "
                            f"header {info['header_bytes']} B"),
        ]
    verdict = {True: "verified", False: "FAILED", None: "not checked"}[info["checksum_ok"]]
    lines += [
        ("total bytes", size(info["bytes"])),
        ("idle", seconds(info["idle_seconds"])),
        ("ttl", seconds(info["ttl_seconds"], none="none")),
        ("checksums", verdict),
    ]
    if info["error"]:
        lines.append(("error", info["error"]))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        cx.out.print(f"{k:<{width}}  {v}", markup=False)
