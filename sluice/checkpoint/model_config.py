"""ModelConfig: what the engine needs to know about a checkpoint, read once from its HF directory.

`from_hf_dir` reads config.json, generation_config.json and the tokenizer's eos token without
loading the tokenizer (plain JSON), so it is cheap to call in any process.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "LlavaForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
)

# What transformers' config classes default to, by model_type: a vision-language config.json
# (LLaVA-1.5's, for one) saves only the fields of its `text_config` that differ from these.
_LLAMA_SHAPE = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                "num_attention_heads": 32, "rms_norm_eps": 1e-6}  # fmt: skip
_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_SHAPE, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "mistral": {**_LLAMA_SHAPE, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072},
    "qwen2": {**_LLAMA_SHAPE, "vocab_size": 151936, "intermediate_size": 22016,
              "max_position_embeddings": 32768, "attention_bias": True},
}  # fmt: skip

# Vision-language architectures whose lm_head is tied by the top-level `tie_word_embeddings`
# (transformers reads that one, not text_config's).
_TIED_AT_TOP_LEVEL = {"Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"}

# Architectures whose q/k/v projections carry a bias unless config.json says otherwise.
_BIASED_BY_DEFAULT = {"Qwen2ForCausalLM"}

# A trailing quantization tag of a GGUF file stem: "SmolLM2-135M-Instruct.Q4_1" -> ".Q4_1".
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d[\w]*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    source_path: str  # what the user gave (a .gguf file or a directory)
    hf_dir: str  # Hugging Face layout: config.json, *.safetensors, tokenizer files
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None: plain rope
    max_position_embeddings: int  # the model's context length
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases
    eos_token_ids: tuple[int, ...]  # union of config, generation config and tokenizer eos
    bos_token_id: int | None
    model_name: str  # short name for the API, e.g. "SmolLM2-135M-Instruct"
    # vision-language checkpoints: config.json but its `text_config` (vision_config, projector,
    # image token); the fields above are the language model's. None: text only
    multimodal: dict[str, Any] | None = None

    @classmethod
    def from_hf_dir(cls, hf_dir: str, source_path: str | None = None) -> ModelConfig:
        root = Path(hf_dir)
        cfg = _read_json(root / "config.json")
        if cfg is None:
            raise FileNotFoundError(
                f"{root / 'config.json'} not found: not a Hugging Face model dir"
            )
        gen = _read_json(root / "generation_config.json") or {}
        arch = _architecture(cfg)
        multimodal = None
        tied = bool(cfg.get("tie_word_embeddings", False))
        if "text_config" in cfg:  # vision-language: the language model's config is nested
            multimodal = {k: v for k, v in cfg.items() if k != "text_config"}
            text = cfg["text_config"] or {}
            text_type = text.get("model_type", "llama")
            if text_type not in _TEXT_CONFIG_DEFAULTS:
                raise ValueError(
                    f"unsupported language model in {arch}: text_config.model_type {text_type!r}; "
                    f"sluice runs {', '.join(_TEXT_CONFIG_DEFAULTS)}"
                )
            defaults = _TEXT_CONFIG_DEFAULTS[text_type]
            cfg = {**defaults, **cfg, **text, "architectures": cfg["architectures"]}
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        rope_theta, rope_scaling = _rope(cfg)
        eos = _ids(cfg.get("eos_token_id")) | _ids(gen.get("eos_token_id")) | _tokenizer_eos(root)
        bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
        source = source_path or hf_dir
        return cls(
            architecture=arch,
            source_path=source,
            hf_dir=str(root),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=(
                tied if arch in _TIED_AT_TOP_LEVEL else bool(cfg.get("tie_word_embeddings", False))
            ),
            attention_bias=bool(cfg.get("attention_bias", arch in _BIASED_BY_DEFAULT)),
            eos_token_ids=tuple(sorted(eos)),
            bos_token_id=None if bos is None else int(bos),
            model_name=model_name_of(source),
            multimodal=multimodal,
        )


def model_name_of(source_path: str) -> str:
    """Short name: the directory name, or the GGUF stem without its quantization tag."""
    path = Path(source_path.rstrip("/"))
    if path.suffix.lower() != ".gguf":
        return path.name
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    found = ", ".join(archs) or f"none (model_type={cfg.get('model_type')!r})"
    raise ValueError(
        f"unsupported model architecture: {found}; "
        f"sluice supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers 4 or 5 layout of config.json."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(theta), scaling


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _tokenizer_eos(root: Path) -> set[int]:
    """The id of the tokenizer's eos token, looked up in tokenizer.json (empty when unknown)."""
    tok_cfg = _read_json(root / "tokenizer_config.json") or {}
    special = _read_json(root / "special_tokens_map.json") or {}
    eos = tok_cfg.get("eos_token") or special.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    tok = _read_json(root / "tokenizer.json")
    if not eos or tok is None:
        return set()
    for added in tok.get("added_tokens", []):
        if added.get("content") == eos:
            return {int(added["id"])}
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and eos in vocab:
        return {int(vocab[eos])}
    return set()


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
