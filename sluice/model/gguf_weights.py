"""Reading a llama GGUF's block-quantized linear weights as they are, into QuantLinear modules.

Only the linear layers are read here (q/k/v, o, gate/up, down, and the LM head: `output.weight`,
or `token_embd.weight` when the embeddings are tied); norms and the embedding table come from the
float conversion as before (sluice.checkpoint). A fused module (qkv_proj, gate_up_proj) whose
parts share one type the kernels take is one QuantLinear over their rows; one whose parts are of
several such types (Q4_K_M's q/k in Q4_K and v in Q6_K) is a QuantLinearParts, a QuantLinear a
part; one with any part of another type stays float.

The rows of q and k are reordered from llama.cpp's rotary layout to Hugging Face's, as the float
conversion does: whole rows move, so the blocks of each row are untouched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.quant import BLOCK_TYPES, QuantLinear, QuantLinearParts

logger = logging.getLogger(__name__)

# GGUF layer tensor kind -> (fused module after "model.layers.N.", its checkpoint names' part)
_LAYER_PARTS = {
    "attn_q": ("self_attn.qkv_proj", "self_attn.q_proj"),
    "attn_k": ("self_attn.qkv_proj", "self_attn.k_proj"),
    "attn_v": ("self_attn.qkv_proj", "self_attn.v_proj"),
    "attn_output": ("self_attn.o_proj", "self_attn.o_proj"),
    "ffn_gate": ("mlp.gate_up_proj", "mlp.gate_proj"),
    "ffn_up": ("mlp.gate_up_proj", "mlp.up_proj"),
    "ffn_down": ("mlp.down_proj", "mlp.down_proj"),
}
_PART_ORDER = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")  # order of fused slices


@dataclass(frozen=True)
class BlockTensor:
    """One GGUF tensor's blocks: [rows, in_features / block_values * block_bytes] uint8."""

    kind: str  # attn_q, ffn_up, ..., or "lm_head"
    qtype: int  # ggml type id
    in_features: int
    blocks: np.ndarray


@dataclass(frozen=True)
class QuantizedModules:
    """What `install_quantized` replaced: module names, and the checkpoint tensors they cover
    (which the float loading then skips)."""

    modules: tuple[str, ...]
    checkpoint_names: frozenset[str]


def install_quantized(model: nn.Module, cfg: ModelConfig, ops: Any) -> QuantizedModules:
    """Replace the linear layers of `model` (a LlamaForCausalLM) that the GGUF `cfg.source_path`
    holds in a kernel type by QuantLinear modules holding the file's blocks."""
    start = time.perf_counter()
    groups = _read_groups(cfg)
    modules, covered = [], set()
    for module_name, parts in groups.items():
        if not all(_in_kernel_type(p) for p in parts):
            continue
        old = model.get_submodule(module_name)
        rows = sum(p.blocks.shape[0] for p in parts)
        if rows != old.out_features or any(p.in_features != old.in_features for p in parts):
            raise ValueError(f"GGUF blocks for {module_name} do not fit {old}")
        bias = None if old.bias is None else torch.empty_like(old.bias)  # loaded afterwards
        if len({p.qtype for p in parts}) == 1:
            new = _linear(parts, bias, ops)
        else:
            new = QuantLinearParts([_linear([p], None, ops) for p in parts], bias)
        parent, _, leaf = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        modules.append(module_name)
        covered.update(_checkpoint_names(module_name, parts))
    total = sum(m.qweight.numel() for m in model.modules() if isinstance(m, QuantLinear))
    kinds = sorted({BLOCK_TYPES[p.qtype][0] for ps in groups.values() for p in ps})
    logger.info(
        "kept %d linear layers in their GGUF blocks (%s, %.1f MB) in %.1f s",
        len(modules), "/".join(kinds), total / 1e6, time.perf_counter() - start,
    )  # fmt: skip
    return QuantizedModules(tuple(modules), frozenset(covered))


def _read_groups(cfg: ModelConfig) -> dict[str, list[BlockTensor]]:
    """module name -> its GGUF tensors in slice order, for the 2-D weights of the file."""
    from sluice.checkpoint.gguf_tensors import read_gguf_tensors

    tensors = read_gguf_tensors(cfg.source_path)
    names = {t.name for t in tensors}
    groups: dict[str, list[BlockTensor]] = {}
    for t in tensors:
        module, kind = _module_of(t.name, cfg.tie_word_embeddings and "output.weight" not in names)
        if module is None:
            continue
        in_features, rows = t.shape  # GGUF lists the fastest dim first
        blocks = np.empty((0, 0), np.uint8)  # other types: not read, the module stays float
        if t.tensor_type in BLOCK_TYPES:
            blocks = np.array(t.data).reshape(rows, -1)  # a copy: the file's memmap closes
            if kind == "attn_q":
                blocks = _unpermute_rope_rows(blocks, cfg.num_attention_heads)
            elif kind == "attn_k":
                blocks = _unpermute_rope_rows(blocks, cfg.num_key_value_heads)
        groups.setdefault(module, []).append(BlockTensor(kind, t.tensor_type, in_features, blocks))
    for parts in groups.values():
        parts.sort(key=lambda p: _PART_ORDER.index(p.kind) if p.kind in _PART_ORDER else 0)
    return groups


def _module_of(gguf_name: str, lm_head_from_embedding: bool) -> tuple[str | None, str]:
    if gguf_name == "output.weight" or (
        lm_head_from_embedding and gguf_name == "token_embd.weight"
    ):
        return "lm_head", "lm_head"
    parts = gguf_name.split(".")  # blk.<layer>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_PARTS and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_LAYER_PARTS[parts[2]][0]}", parts[2]
    return None, ""


def _in_kernel_type(part: BlockTensor) -> bool:
    return part.qtype in BLOCK_TYPES and part.in_features % BLOCK_TYPES[part.qtype][2] == 0


def _linear(parts: list[BlockTensor], bias: torch.Tensor | None, ops: Any) -> QuantLinear:
    """One QuantLinear over the rows of `parts`, all of one type."""
    blocks = parts[0].blocks if len(parts) == 1 else np.concatenate([p.blocks for p in parts])
    qweight = torch.from_numpy(np.ascontiguousarray(blocks))
    return QuantLinear(qweight, parts[0].qtype, parts[0].in_features, bias, ops)


def _checkpoint_names(module_name: str, parts: list[BlockTensor]) -> set[str]:
    if module_name == "lm_head":
        return {"lm_head.weight"}
    layer = module_name.split(".")[2]
    return {f"model.layers.{layer}.{_LAYER_PARTS[p.kind][1]}.weight" for p in parts}


def _unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (per head, the two rotary halves interleaved) back to Hugging
    Face's (per head, first half then second): the same row permutation as the float
    conversion's, applied to [num_heads * head_dim, row_bytes] rows of blocks."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, rows.shape[1]).swapaxes(1, 2).reshape(rows.shape)
