"""The entry filters shared by `ls`, `evict` and `export`, and how they become an EntryFilter."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from lmcache_remote.admin import EntryFilter, parse_duration, prompt_chunk_hashes

F = TypeVar("F", bound=Callable[..., Any])


def filter_options(func: F) -> F:
    """Adds --model, --world-size, --worker, --dtype, --older-than, --tokens, --cache-salt;
    passes `filter_args` (a dict) to the command."""

    @click.option("--model", help="Only this model name.")
    @click.option("--world-size", type=click.IntRange(min=1), help="Only this world size.")
    @click.option("--worker", type=click.IntRange(min=0), help="Only this worker id (rank).")
    @click.option("--dtype", help="Only this KV dtype (bfloat16, float16, ...).")
    @click.option("--older-than", metavar="DURATION",
                  help="Only entries idle at least this long (90s, 15m, 2h, 1d).")
    @click.option("--tokens", "tokens_file", type=click.Path(exists=True, dir_okay=False),
                  help="JSON list of token ids: only the chunks of that prompt.")
    @click.option("--cache-salt", help="The cache salt the prompt was stored with (--tokens).")
    @functools.wraps(func)
    def wrapper(*args: Any, model: str | None, world_size: int | None, worker: int | None,
                dtype: str | None, older_than: str | None, tokens_file: str | None,
                cache_salt: str | None, **kwargs: Any) -> Any:
        filter_args = {"model": model, "world_size": world_size, "worker": worker,
                       "dtype": dtype, "older_than": older_than, "tokens_file": tokens_file,
                       "cache_salt": cache_salt}
        return func(*args, filter_args=filter_args, **kwargs)

    return wrapper  # type: ignore[return-value]


def build_filter(args: dict[str, Any], chunk_size: int) -> EntryFilter:
    """The EntryFilter for parsed filter options; `click.BadParameter` for bad values."""
    older = None
    if args["older_than"] is not None:
        try:
            older = parse_duration(args["older_than"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--older-than") from None
    hashes = None
    if args["tokens_file"] is not None:
        hashes = prompt_chunk_hashes(_read_tokens(args["tokens_file"]), chunk_size,
                                     args["cache_salt"])
    elif args["cache_salt"] is not None:
        raise click.BadParameter("needs --tokens", param_hint="--cache-salt")
    return EntryFilter(args["model"], args["world_size"], args["worker"], args["dtype"],
                       older, hashes)


def _read_tokens(path: str) -> list[int]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"cannot read a JSON list from {path}: {exc}",
                                 param_hint="--tokens") from None
    if not isinstance(data, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in data
    ):
        raise click.BadParameter("must be a JSON list of token ids (ints in 0..2**32-1)",
                                 param_hint="--tokens")
    return data
