"""Converting a llama GGUF file into a Hugging Face directory: config.json,
generation_config.json, float32 safetensors with HF names, and tokenizer files with the chat
template. Called once per file by `hf_dir.prepare_hf_dir`, which owns where the result lives.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, generation config, float32 safetensors and tokenizer of a llama GGUF."""
    import gguf
    from safetensors.torch import save_file

    start = time.perf_counter()
    logger.info("converting %s into %s (once; later loads use the cache)", gguf_path, out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = _GGUFMeta(reader)
    config = _hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    tensors = _dequantized_tensors(reader, config)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    logger.info("weights written in %.1f s", time.perf_counter() - start)
    _save_tokenizer(gguf_path, meta, out_dir)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)


class _GGUFMeta:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.arch = str(self.get("general.architecture"))
        if self.arch != "llama":
            raise ValueError(
                f"GGUF architecture {self.arch!r} is not supported (only 'llama'); "
                "convert the model to a Hugging Face directory instead"
            )

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)


def _hf_config(meta: _GGUFMeta, has_output: bool) -> dict[str, Any]:
    hidden = int(meta.arch_get("embedding_length"))
    heads = int(meta.arch_get("attention.head_count"))
    kv_heads = int(meta.arch_get("attention.head_count_kv", heads))
    rope_theta = float(meta.arch_get("rope.freq_base", 10000.0))
    vocab = len(meta.reader.get_field("tokenizer.ggml.tokens").data)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_get("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta.arch_get("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "max_position_embeddings": int(meta.arch_get("context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }
    scaling = meta.arch_get("rope.scaling.type")
    if scaling == "linear":
        factor = float(meta.arch_get("rope.scaling.factor", 1.0))
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        config["rope_parameters"] = {"rope_theta": rope_theta, **config["rope_scaling"]}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    return config


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}


def _dequantized_tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """All tensors as float32 [out_features, in_features] with HF names, q/k rows unpermuted."""
    import torch
    from gguf.quants import dequantize

    total = len(reader.tensors)
    step = max(1, total // 10)
    tensors: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    for i, t in enumerate(reader.tensors):
        name = _hf_name(t.name)
        # GGUF lists dims fastest-first; numpy/torch order is the reverse.
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        array = array.reshape(tuple(int(d) for d in reversed(t.shape)))
        if name.endswith("self_attn.q_proj.weight"):
            array = _unpermute_rope_rows(array, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            array = _unpermute_rope_rows(array, config["num_key_value_heads"])
        if not array.flags.writeable:  # float32 tensors come straight from the file's memmap
            array = array.copy()
        tensors[name] = torch.from_numpy(np.ascontiguousarray(array))
        if (i + 1) % step == 0 or i + 1 == total:
            elapsed = time.perf_counter() - start
            logger.info("dequantized %d/%d tensors (%.1f s)", i + 1, total, elapsed)
    return tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<layer>.<kind>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart")


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (per head, rotary pairs interleaved) back to HF halves.

    llama.cpp stores rows of head h as [r0, r(d/2), r1, r(d/2+1), ...]; HF keeps [r0..r(d/2-1),
    r(d/2)..r(d-1)]. Shape [num_heads * head_dim, in_features] in and out.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _save_tokenizer(gguf_path: Path, meta: _GGUFMeta, out_dir: Path) -> None:
    """Tokenizer files built by transformers' own GGUF conversion, plus the GGUF chat template."""
    from transformers import AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = meta.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out_dir))
    logger.info("tokenizer converted in %.1f s", time.perf_counter() - start)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
