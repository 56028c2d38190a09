"""Model fingerprints: the part of a key's model field that names the weights, not the name.

`model_fingerprint(folder, ...)` reads a model folder as `from_pretrained` and vLLM load it and
returns `f1-` followed by 16 hex digits, the same in every process and on every machine that
loads the same files, different when the weights, the config, the quantization or the KV cache's
dtype and scales differ. `namespace(name, fingerprint)` is the model field of the keys:
`{name}@{fingerprint}`. The algorithm is specified in docs/key-schema.md ("Model
fingerprint"), which other implementations follow; a test checks its worked example.

Cheap at start-up: the weights are not hashed whole. A safetensors file gives its header (every
tensor's name, dtype, shape and place) and, per tensor, three samples of 64 bytes (its first,
middle and last); any other weight file gives its size and 16 samples of 4 KiB. A training
step or a fine-tune changes essentially every byte of the tensors it touches, so every
changed tensor changes the fingerprint; an edit of a few bytes that no sample covers does
not (set `model_fingerprint` explicitly for weights edited that way).

What is left out, because it does not change the KV of a token sequence: the config's
`_name_or_path` and `transformers_version`, the tokenizer, generation settings files, the
folder's name and place.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmcache_remote.naming.identity import field_header

__all__ = ["ADAPTER_FINGERPRINT_VERSION", "FINGERPRINT_VERSION", "FingerprintError",
           "PROCESSOR_FILES", "adapter_fingerprint", "adapter_signature", "model_fingerprint",
           "model_folder", "model_name_of", "namespace", "resolve_fingerprint"]

FINGERPRINT_VERSION = "f1"
#: Config keys that do not change the KV: where the folder was, which library wrote it.
_CONFIG_IGNORED = ("_name_or_path", "transformers_version")
#: Weight files, in the order they are looked for: the first pattern with files is used.
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
#: A multimodal processor's settings: they decide what reaches the vision encoder.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")
ADAPTER_FINGERPRINT_VERSION = "a1"
#: Adapter config keys that do not change the KV: where the base model was.
_ADAPTER_CONFIG_IGNORED = ("base_model_name_or_path", "revision")
_ADAPTER_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
_TENSOR_SAMPLE = 64
_FILE_SAMPLE, _FILE_SAMPLES = 4096, 16
#: safetensors caps its header at 100 MB; a bigger length is not a safetensors file.
_MAX_HEADER = 100_000_000


class FingerprintError(ValueError):
    """The model's files cannot be fingerprinted (no config.json, no weights, a bad file)."""


def namespace(model_name: str, fingerprint: str | None) -> str:
    """The model field of the keys: `model_name`, with `@fingerprint` where there is one."""
    return model_name if not fingerprint else f"{model_name}@{fingerprint}"


def model_name_of(source: str) -> str:
    """The default model name for a model loaded from `source` (a folder or a hub id): a
    local folder gives its own name (`/models/tiny-llama` -> `tiny-llama`), a hub id is used
    as is. vLLM and the transformers integration name a model alike."""
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        return os.path.basename(os.path.normpath(os.path.abspath(path)))
    return source


def model_folder(source: str, revision: str | None = None) -> Path | None:
    """The local folder of the model `source` names: the folder itself, or a hub id's
    snapshot in the local Hugging Face cache (never downloaded here); None when there is
    none."""
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
        found = snapshot_download(repo_id=source, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not installed, not a hub id, not cached: no folder
        return None
    return Path(found) if Path(found).is_dir() else None


def resolve_fingerprint(setting: str | None, compute: Any) -> str | None:
    """The fingerprint a `model_fingerprint` setting asks for: "auto" (or None) calls
    `compute()`, "off" gives None (the name alone), anything else is used as given."""
    if setting is None or setting == "auto":
        return str(compute())
    if setting == "off":
        return None
    if not isinstance(setting, str) or not setting.strip() or any(c.isspace() for c in setting):
        raise FingerprintError(f"model_fingerprint must be 'auto', 'off' or a string without "
                               f"spaces, got {setting!r}")
    return setting


def model_fingerprint(
    folder: str | os.PathLike[str],
    *,
    kv_dtype: str,
    quantization: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    kv_scales: Sequence[float] | None = None,
    processor_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The fingerprint of the model in `folder` (docs/key-schema.md, "Model fingerprint").

    `kv_dtype`: the KV cache's dtype as the keys name it (`bfloat16`, `float8_e4m3fn`, ...);
    `quantization`: the method the engine applies when it loads the weights (vLLM's
    `--quantization`; None: none, or the config's own `quantization_config`, which the config
    part covers); `overrides`: config fields the engine overrides (vLLM's `hf_overrides`);
    `kv_scales`: the KV cache's scales where they are not 1 (fp8 caches);
    `processor_kwargs`: the engine's multimodal processor settings (vLLM's
    `mm_processor_kwargs`). A folder with a multimodal processor's files (`PROCESSOR_FILES`)
    adds them, and those settings, as the last fields: they decide what the encoder sees."""
    root = Path(folder)
    digest = hashlib.blake2b(digest_size=8, person=b"lmcr-model-fp1")
    _field(digest, "config", _config_bytes(root, overrides))
    weights = _weight_files(root)
    for path in weights:
        _field(digest, "file", path.relative_to(root).as_posix().encode())
        _field(digest, "weights", _weight_bytes(path))
    _field(digest, "quantization", (quantization or "").encode())
    _field(digest, "kv_dtype", kv_dtype.encode())
    scales = list(kv_scales or [])
    _field(digest, "kv_scales", b"".join(struct.pack("<d", float(s)) for s in scales))
    processor = [name for name in PROCESSOR_FILES if (root / name).is_file()]
    for name in processor:
        _field(digest, "processor_file", name.encode())
        _field(digest, "processor", _canonical_json(root / name, ()))
    if processor or processor_kwargs:
        _field(digest, "processor_kwargs", _dumps(dict(processor_kwargs or {})))
    return f"{FINGERPRINT_VERSION}-{digest.hexdigest()}"


def adapter_fingerprint(folder: str | os.PathLike[str]) -> str:
    """The fingerprint of the LoRA adapter in `folder` (docs/key-schema.md, "Adapter
    fingerprint"): `a1-` and 32 hex digits over its `adapter_config.json` (canonical JSON,
    `base_model_name_or_path` and `revision` left out) and every weight file, read whole
    (adapters are small), so an adapter replaced under the same name and path gets another
    fingerprint. Never its name, path or vLLM's int id."""
    root = Path(folder)
    digest = hashlib.blake2b(digest_size=16, person=b"lmcr-adapter-fp1")
    _field(digest, "config", _canonical_json(root / "adapter_config.json",
                                             _ADAPTER_CONFIG_IGNORED))
    files = _adapter_files(root)
    for path in files:
        _field(digest, "file", path.relative_to(root).as_posix().encode())
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(field_header(b"weights", size))
            read = 0
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                read += len(chunk)
            if read != size:
                raise FingerprintError(f"{path} changed while it was read")
    return f"{ADAPTER_FINGERPRINT_VERSION}-{digest.hexdigest()}"


def adapter_signature(folder: str | os.PathLike[str]) -> tuple[tuple[str, int, int, int], ...]:
    """What the files of an adapter folder look like now (name, size, mtime, inode of each):
    a cheap check (a few `stat` calls) that they are the files last fingerprinted."""
    root = Path(folder)
    out = []
    for path in [root / "adapter_config.json", *_adapter_files(root)]:
        st = path.stat()
        out.append((path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def _adapter_files(root: Path) -> list[Path]:
    if not (root / "adapter_config.json").is_file():
        raise FingerprintError(f"{root} has no adapter_config.json: not a LoRA adapter folder")
    found = sorted({p for pattern in _ADAPTER_WEIGHTS for p in root.rglob(pattern)
                    if p.is_file()}, key=lambda p: p.relative_to(root).as_posix())
    if not found:
        raise FingerprintError(f"{root} holds no adapter weights "
                               f"({', '.join(_ADAPTER_WEIGHTS)})")
    return found


def _canonical_json(path: Path, ignored: Sequence[str]) -> bytes:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FingerprintError(f"cannot read {path}: {exc}") from exc
    if isinstance(data, dict):
        for key in ignored:
            data.pop(key, None)
    return _dumps(data)


def _dumps(data: Any) -> bytes:
    try:
        return json.dumps(data, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True).encode()
    except (TypeError, ValueError) as exc:
        raise FingerprintError(f"not plain JSON values: {exc}") from exc


def _field(digest: Any, name: str, data: bytes) -> None:
    """Each field as its name, its length (uint64 LE) and its bytes: no two inputs collide."""
    digest.update(field_header(name.encode(), len(data)))
    digest.update(data)


def _config_bytes(root: Path, overrides: Mapping[str, Any] | None) -> bytes:
    path = root / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise FingerprintError(f"{root} has no config.json: cannot fingerprint the model "
                               "(set model_fingerprint explicitly, or to 'off')") from exc
    except (OSError, ValueError) as exc:
        raise FingerprintError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise FingerprintError(f"{path} is not a JSON object")
    for key in _CONFIG_IGNORED:
        config.pop(key, None)
    config.update(dict(overrides or {}))
    try:
        return json.dumps(config, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True).encode()
    except (TypeError, ValueError) as exc:
        raise FingerprintError(f"config overrides are not plain JSON values: {exc}") from exc


def _weight_files(root: Path) -> list[Path]:
    for pattern in _WEIGHT_PATTERNS:
        found = sorted(p for p in root.rglob(pattern) if p.is_file())
        if found:
            return found
    raise FingerprintError(f"{root} holds no weight files ({', '.join(_WEIGHT_PATTERNS)}): "
                           "cannot fingerprint the model (set model_fingerprint explicitly)")


def _weight_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if path.suffix == ".safetensors":
            return _safetensors_bytes(f, size, path)
        parts = [struct.pack("<Q", size)]
        for i in range(_FILE_SAMPLES):
            at = 0 if size <= _FILE_SAMPLE else (size - _FILE_SAMPLE) * i // (_FILE_SAMPLES - 1)
            parts.append(os.pread(f.fileno(), _FILE_SAMPLE, at))
        return b"".join(parts)


def _safetensors_bytes(f: Any, size: int, path: Path) -> bytes:
    """The header as stored, then per tensor (in the header's name order) three samples of
    its data: first, middle and last `_TENSOR_SAMPLE` bytes (all of a smaller tensor)."""
    fd = f.fileno()
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise FingerprintError(f"{path} is not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", head)
    if length > min(_MAX_HEADER, size - 8):
        raise FingerprintError(f"{path} is not a safetensors file (header length {length})")
    header_bytes = os.pread(fd, length, 8)
    try:
        header = json.loads(header_bytes)
    except ValueError as exc:
        raise FingerprintError(f"{path} has a bad safetensors header: {exc}") from exc
    data_start = 8 + length
    parts = [struct.pack("<Q", size), header_bytes]
    for name in sorted(k for k in header if k != "__metadata__"):
        try:
            begin, end = (int(v) for v in header[name]["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FingerprintError(f"{path}: tensor {name!r} has no data_offsets") from exc
        n = end - begin
        if n < 0 or data_start + end > size:
            raise FingerprintError(f"{path}: tensor {name!r} lies outside the file")
        if n <= 3 * _TENSOR_SAMPLE:
            parts.append(os.pread(fd, n, data_start + begin))
            continue
        for at in (begin, begin + (n - _TENSOR_SAMPLE) // 2, end - _TENSOR_SAMPLE):
            parts.append(os.pread(fd, _TENSOR_SAMPLE, data_start + at))
    return b"".join(parts)
