"""Tiny random-weight checkpoints in Hugging Face layout, usable end to end with text.

Each carries the SmolLM2 tokenizer (vocab 49152, chat template) copied from the converted
default model, so prompts can be tokenized and outputs detokenized like with the real model.
Weights are deterministic (fixed seed), so two calls give identical checkpoints.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from sluice.checkpoint.hf_dir import default_model_path, prepare_hf_dir

SEED = 1234
_MODEL_FILES = ("config.json", "generation_config.json")

_TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def make_tiny_llama(dir: str | Path, tokenizer_dir: str | None = None, **overrides: Any) -> str:
    """A 2-layer LlamaForCausalLM (untied lm_head unless overridden) saved into `dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**_TINY_SHAPE, "rope_theta": 10000.0, **overrides})
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    return _save(model, dir, tokenizer_dir)


def make_tiny_qwen2(dir: str | Path, tokenizer_dir: str | None = None, **overrides: Any) -> str:
    """A 2-layer Qwen2ForCausalLM with non-zero random q/k/v biases and tied embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = {**_TINY_SHAPE, "rope_theta": 1000000.0, "tie_word_embeddings": True}
    config = Qwen2Config(**{**shape, **overrides})
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(torch.randn_like(proj.bias) * 0.5)
    return _save(model, dir, tokenizer_dir)


def copy_tokenizer(src_dir: str | Path, dst_dir: str | Path) -> None:
    """Copy every tokenizer file (all but weights and model configs) from src_dir to dst_dir."""
    for path in Path(src_dir).iterdir():
        if path.is_file() and path.name not in _MODEL_FILES and ".safetensors" not in path.name:
            shutil.copy2(path, Path(dst_dir) / path.name)


def _save(model: torch.nn.Module, dir: str | Path, tokenizer_dir: str | None) -> str:
    from transformers import GenerationConfig

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    config = model.config
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(str(out))
    copy_tokenizer(tokenizer_dir or prepare_hf_dir(default_model_path()), out)
    return str(out)


def add_special_tokens(dir: str | Path, tokens: list[str]) -> dict[str, int]:
    """Add `tokens` as additional special tokens to the tokenizer saved in `dir` (new ids after
    its vocabulary; the model's vocab_size must leave room), and return their ids as saved."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dir))
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.save_pretrained(str(dir))
    added = AutoTokenizer.from_pretrained(str(dir)).get_added_vocab()
    return {t: added[t] for t in tokens}


def make_tiny_llava(
    dir: str | Path,
    tokenizer_dir: str | None = None,
    vision_overrides: dict[str, Any] | None = None,
    **overrides: Any,
) -> str:
    """A LlavaForConditionalGeneration saved into `dir`, with a LlavaProcessor: a 2-layer CLIP
    tower on 32x32 images in 8x8 patches (16 image tokens under the default strategy), a
    2-layer Llama. The tokenizer gains `<image>` (the config's image token); the tower's and
    projector's biases and norms are perturbed so that none of them is a no-op."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tokenizer_dir or prepare_hf_dir(default_model_path()), out)
    image_token_id = add_special_tokens(out, ["<image>"])["<image>"]
    vision = CLIPVisionConfig(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": 32,
            "patch_size": 8,
            **(vision_overrides or {}),
        }
    )
    text = LlamaConfig(**{**_TINY_SHAPE, "vocab_size": 49152 + 64, "rope_theta": 10000.0})
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id, **overrides
    )
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" not in name and ("bias" in name or "norm" in name):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id
    ).save_pretrained(str(out))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": vision.image_size},
            crop_size={"height": vision.image_size, "width": vision.image_size},
        ),
        tokenizer=AutoTokenizer.from_pretrained(str(out)),
        patch_size=vision.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's class token
    )
    processor.save_pretrained(str(out))
    return str(out)


# what an Idefics3 / SmolVLM tokenizer adds for images: the processor's markers and tile tags
IDEFICS3_TOKENS = [
    "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]  # fmt: skip


def make_tiny_idefics3(
    dir: str | Path, tokenizer_dir: str | None = None, arch: str = "idefics3"
) -> str:
    """An Idefics3ForConditionalGeneration (or, `arch="smolvlm"`, a
    SmolVLMForConditionalGeneration: the same modules and names, with SmolVLM's image processor)
    saved into `dir` with an Idefics3Processor (SmolVLMProcessor needs num2words; the prompt it
    builds for images is the same): a 2-layer SigLIP-style tower on 32x32 tiles in 4x4 patches,
    pixel shuffle by 2 (16 image tokens per tile), a 2-layer Llama. Images are split into at
    most 2x2 tiles of 32x32 plus the global image. The tokenizer gains the image tokens; the
    tower's biases and norms are perturbed so none is a no-op."""
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        LlamaConfig,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessorPil,
    )

    config_cls, model_cls, image_processor_cls = {
        "idefics3": (
            Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil
        ),
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMImageProcessorPil),
    }[arch]  # fmt: skip
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tokenizer_dir or prepare_hf_dir(default_model_path()), out)
    image_token_id = add_special_tokens(out, IDEFICS3_TOKENS)["<image>"]
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 4}  # fmt: skip
    text = LlamaConfig(**{**_TINY_SHAPE, "vocab_size": 49152 + 64, "rope_theta": 10000.0})
    config = config_cls(
        vision_config=vision, text_config=text.to_dict(), image_token_id=image_token_id,
        scale_factor=2,
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision_model" in name and ("bias" in name or "norm" in name):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id
    ).save_pretrained(str(out))
    image_processor = image_processor_cls(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=AutoTokenizer.from_pretrained(str(out)),
        image_seq_len=(32 // 4) ** 2 // 2**2,
    )
    processor.save_pretrained(str(out))
    return str(out)
