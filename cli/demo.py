"""`lmcache-remote demo`: two transformers engines sharing one Redis, TTFT with and without.

The work is `demo_run.run_demo`; this module parses options and prints
its report (a rich table, or one JSON document with `--json`). With no Redis answering at the
configured URL it starts a private server for the run; with no server binary either it exits
3 saying how to get one.
"""

from __future__ import annotations

from typing import Any

import click
from lmcache_remote_cli.context import CliContext, common_options
from lmcache_remote_cli.output import size, table

from lmcache_remote.config import CacheConfig, load_config


@click.command()
@common_options
@click.option("--model-path", type=click.Path(exists=True, file_okay=False),
              help="A local Hugging Face model folder (default: a tiny random Llama).")
@click.option("--model-name", help="Model name in the cache keys (default: the folder name).")
@click.option("--requests", default=4, show_default=True, type=click.IntRange(min=2),
              help="Requests per engine; all share the long prefix.")
@click.option("--prefix-tokens", default=3072, show_default=True, type=click.IntRange(min=1),
              help="Tokens of the shared prefix (system prompt + documents).")
@click.option("--question-tokens", default=48, show_default=True, type=click.IntRange(min=1),
              help="Tokens of each request's own question.")
@click.option("--seed", default=0, show_default=True, help="Seed of the model and workload.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Timed rounds, each on prompts of its own (after one untimed warm-up).")
@click.option("--keep", is_flag=True, help="Keep the run's keys in Redis (default: removed).")
def demo(cx: CliContext, model_path: str | None, model_name: str | None, requests: int,
         prefix_tokens: int, question_tokens: int, seed: int, rounds: int, keep: bool) -> None:
    """Time to first token without the cache, cold, and warm from another engine."""
    from lmcache_remote_cli.demo_run import DemoOptions, run_demo

    options = DemoOptions(model_path=model_path, model_name=model_name, requests=requests,
                          prefix_tokens=prefix_tokens, question_tokens=question_tokens,
                          seed=seed, keep=keep, rounds=rounds)
    report = run_demo(_config(cx), options, note=cx.info)
    if cx.json:
        cx.emit(report.to_dict())
        return
    _print(cx, report.to_dict())


def _config(cx: CliContext) -> CacheConfig:
    """The configuration; unlike other commands, no URL at all is fine (a private server)."""
    overrides: dict[str, Any] = {}
    if cx.url is not None:
        overrides["remote_url"] = cx.url
    if cx.prefix is not None:
        overrides["key_prefix"] = cx.prefix
    return load_config(cx.config_file, **overrides)


def _print(cx: CliContext, doc: dict[str, Any]) -> None:
    t = table("phase", "requests", "median TTFT", "speed-up", "then stored in", "hit tokens",
              "next token",
              title=f"{doc['shared_prefix_tokens']} shared prefix tokens, model: "
                    f"{doc['model']}, chunk size {doc['chunk_size']}")
    for phase in doc["phases"]:
        stored = "-" if phase["name"] == "no_cache" else f"{phase['median_store_ms']:.1f} ms"
        t.add_row(
            phase["description"], str(phase["requests"]), f"{phase['median_ttft_ms']:.1f} ms",
            f"{doc['speedup'][phase['name']]:.2f}x", stored,
            f"{phase['hit_tokens']} / {phase['prompt_tokens']}",
            "same" if phase["same_next_token"] else "DIFFERENT",
        )
    cx.out.print(t)
    cx.out.print(
        f"{doc['rounds']} rounds after an untimed warm-up, each on prompts of its own. Every "
        "cached request is timed right after a no-cache run of the same prompt; speed-up is "
        "the median of those pairs' ratios. A miss (cold) is a full prefill plus a lookup, "
        "about 1.0x; storing its chunks comes after the first token.", markup=False)
    redis = doc["redis"]
    kept = "kept" if not redis["keys_removed"] else f"{redis['keys_removed']} keys removed after"
    cx.out.print(f"Redis: {redis['url']} ({redis['source']}); {redis['chunks']} chunks in "
                 f"{redis['keys']} values, "
                 f"{size(redis['bytes'])} ({redis['bytes']} bytes) under "
                 f"{redis['key_prefix']}, {kept}", markup=False)
    diff = max(p["max_logit_diff"] for p in doc["phases"])
    verdict = "match" if doc["outputs_match"] else "DO NOT match"
    cx.out.print(f"Next-token outputs {verdict} the no-cache run (largest logit difference "
                 f"{diff:.2e}).", markup=False)
