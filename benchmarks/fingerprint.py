"""How long `model_fingerprint` takes on the files of an 8B model (docs/key-schema.md).

    python -m benchmarks.fingerprint [--dir DIR]

Writes a folder shaped like Llama-3.1-8B's safetensors release (config.json; 4 shards, 291
tensors, 16.06 GB of bfloat16 data) as sparse files (headers written, data left as holes, so
it costs no disk), then times `model_fingerprint` on it: cold (the first call after writing)
and warm (median of 5). Sparse holes read as zeros from memory, so this measures the number
of reads and the Python work, not a cold disk; on a disk each of the ~870 samples is one random
read of 64 bytes (one page).
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import tempfile
import time
from pathlib import Path

from lmcache_remote.naming.fingerprint import model_fingerprint

LAYERS, HIDDEN, INTER, VOCAB, KV = 32, 4096, 14336, 128256, 1024


def tensors() -> list[tuple[str, list[int]]]:
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN]),
           ("model.norm.weight", [HIDDEN])]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", [HIDDEN, HIDDEN]),
                (p + "self_attn.k_proj.weight", [KV, HIDDEN]),
                (p + "self_attn.v_proj.weight", [KV, HIDDEN]),
                (p + "self_attn.o_proj.weight", [HIDDEN, HIDDEN]),
                (p + "mlp.gate_proj.weight", [INTER, HIDDEN]),
                (p + "mlp.up_proj.weight", [INTER, HIDDEN]),
                (p + "mlp.down_proj.weight", [HIDDEN, INTER]),
                (p + "input_layernorm.weight", [HIDDEN]),
                (p + "post_attention_layernorm.weight", [HIDDEN])]
    return out


def write_model(root: Path, shards: int = 4) -> tuple[int, int]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": VOCAB, "torch_dtype": "bfloat16"}))
    all_tensors = tensors()
    per = -(-len(all_tensors) // shards)
    total = 0
    for s in range(shards):
        header: dict[str, object] = {}
        offset = 0
        for name, shape in all_tensors[s * per:(s + 1) * per]:
            n = 2
            for d in shape:
                n *= d
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode()
        path = root / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)
        total += offset
    return len(all_tensors), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="where to write the model (default: a temp folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp) / "llama-8b-shaped"
        count, nbytes = write_model(root)
        start = time.perf_counter()
        value = model_fingerprint(root, kv_dtype="bfloat16")
        cold = time.perf_counter() - start
        warm = []
        for _ in range(5):
            start = time.perf_counter()
            model_fingerprint(root, kv_dtype="bfloat16")
            warm.append(time.perf_counter() - start)
    print(f"{count} tensors, {nbytes / 1e9:.2f} GB in 4 shards: {value}; first call "
          f"{cold * 1e3:.1f} ms, then median {statistics.median(warm) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
