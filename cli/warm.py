"""`lmcache-remote warm`: fill the cache before traffic arrives.

Sources (exactly one):

- `--from FILE`: an export; chunks already present are skipped (`import` with skip).
- `--model-path DIR --prompts FILE`: compute each prompt's KV with a local Hugging Face model
  (`lmcache_remote.integrations.warmup`); prompts already cached are skipped. Its JSON has
  `warmed`, `skipped`, `too_short`, `computed_tokens`, `loaded_tokens`, `model_name`.

Each source is one `_warm_from_*` function returning a JSON-ready dict with at least
`entries` (chunks written) and `skipped`; a new source adds an option and a function.
"""

from __future__ import annotations

from typing import Any

import click
from lmcache_remote_cli.context import CliContext, Refused, common_options
from lmcache_remote_cli.output import size
from lmcache_remote_cli.transfer import import_file

from lmcache_remote.admin import PinRefused


@click.command()
@common_options
@click.option("--from", "from_file", type=click.Path(exists=True, dir_okay=False),
              help="A snapshot written by `export`.")
@click.option("--model-path", type=click.Path(exists=True, file_okay=False),
              help="A local Hugging Face model folder: compute the KV of --prompts with it.")
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False),
              help="With --model-path: text lines, or .jsonl lines of token id lists/strings.")
@click.option("--model-name", help="With --model-path: model name in the keys "
              "(default: the folder's name).")
@click.option("--model-fingerprint", default="auto", show_default=True,
              help="With --model-path: 'auto' (the keys name the folder's weights, as vLLM's "
              "connector does), 'off' (the name alone) or a string used as the fingerprint.")
@click.option("--device", help="With --model-path: torch device for the model (default cpu).")
@click.option("--pin", is_flag=True, help="Then pin every chunk warmed (or already there): "
              "Redis never evicts them until `unpin` (docs/pins.md).")
def warm(cx: CliContext, from_file: str | None, model_path: str | None,
         prompts_file: str | None, model_name: str | None, model_fingerprint: str,
         device: str | None, pin: bool) -> None:
    """Warm the cache from a snapshot, or from a model and prompts; chunks already present
    (or prompts already cached) are skipped."""
    if (from_file is None) == (model_path is None):
        raise click.UsageError("give one source: --from FILE, or --model-path DIR --prompts FILE")
    if from_file is None:
        assert model_path is not None
        _warm_from_model(cx, model_path, prompts_file, model_name, model_fingerprint, device,
                         pin)
        return
    try:
        result = _warm_from_file(cx, from_file, pin)
    except PinRefused as exc:
        raise Refused(f"warmed, but not pinned: {exc}") from None
    if cx.json:
        cx.emit(result)
        return
    cx.out.print(f"warmed {result['entries']} entries ({size(result['bytes'])}), "
                 f"{result['skipped']} already present", markup=False)


def _warm_from_file(cx: CliContext, path: str, pin: bool) -> dict[str, Any]:
    result = import_file(cx, path, skip_existing=True, pin=pin)
    return {"source": path, "entries": result.chunks, "bytes": result.bytes,
            "skipped": result.skipped, "pinned": pin}


def _warm_from_model(cx: CliContext, model_path: str, prompts_file: str | None,
                     model_name: str | None, model_fingerprint: str, device: str | None,
                     pin: bool) -> None:
    from lmcache_remote.integrations.warmup import PromptFileError, warm_from_model
    from lmcache_remote.naming.fingerprint import FingerprintError

    if prompts_file is None:
        raise click.UsageError("--model-path needs --prompts FILE")
    with cx.progress("warming prompts", None, unit="prompts") as advance:
        try:
            result = warm_from_model(cx.config, model_path, prompts_file, model_name=model_name,
                                     model_fingerprint=model_fingerprint, device=device,
                                     progress=advance, pin=pin)
        except PromptFileError as exc:
            raise click.BadParameter(str(exc), param_hint="--prompts") from None
        except FingerprintError as exc:
            raise click.BadParameter(str(exc), param_hint="--model-fingerprint") from None
    doc = {"source": model_path, "prompts_file": prompts_file, **result.to_dict()}
    if cx.json:
        cx.emit(doc)
        return
    cx.out.print(f"{result.model_name}: {result.warmed} prompts warmed "
                 f"({result.computed_tokens} tokens computed, {result.loaded_tokens} loaded), "
                 f"{result.skipped} already cached, {result.too_short} shorter than a chunk",
                 markup=False)
    if pin:
        cx.out.print(f"pinned {result.pinned_chunks} chunks", markup=False)
    if result.refused_pin_chunks:
        raise Refused(f"{result.refused_pin_chunks} chunks not pinned: past the pin budget "
                      f"({cx.config.pin_budget} GiB): unpin something or raise pin_budget")
