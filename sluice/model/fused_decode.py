"""FusedDecode: a decode step (or a short extend) through a llama decoder stack in one C++ call.

The per-op path (`LlamaModel.forward`) runs about ten kernels a layer, each behind
`nn.Module.__call__`, pybind and ATen's dispatch; at one row that glue costs about as much as the
kernels. `DecodeLayers` (cpu_ops.cpp) runs the same kernels in the same order on the same values
for all layers and the final norm at once, so its hidden states equal the per-op path's bit for
bit. The LM head, sampling and everything else stay as they are.

It is built once at load (`install_fused_decode`), holding every layer's weight handles and KV
pool tensors, when the model is a llama stack whose linear layers are all GGUF blocks (one type a
layer, no bias) on sluice's CPU kernels; otherwise the model keeps the per-op path alone, and the
log says why. Per batch it takes, over its own KV cache and up to `max_rows` tokens
(`supports`), decode steps and the extends whose attention the per-op path gives the kernels too
(few queries a request, or a sparse padded mask: a mixed step, where decoding requests meet an
arriving prompt, above all), each new token a row of its own that reads its request's slots up
to its position, as `extend_attention` does. Every other batch (a dense prefill, whose
attention SDPA or the kernels' AMX attention takes, more tokens, another cache, a vision model's
input embeddings) takes the per-op path.

`max_rows` follows the linear layers. DecodeLayers calls whatever GEMM QuantLinear would call
for the same rows:
- the blocks, or (bfloat16 past 8 rows on AVX-512 VNNI CPUs without AMX) the blocks repacked
  for the integer GEMM: any number of rows;
- in bfloat16 on CPUs with AMX, where every decoder layer's float copy has its AMX copy, that
  copy from 17 rows on (a gate_up's giving its SiLU): any number of rows too;
- where some float copy has none (float32; bfloat16 past 8 rows on CPUs without VNNI or for
  the K-quants, without AMX; SLUICE_AMX_LINEAR=0 or an input width that is not a multiple of
  32), oneDNN's reordered weight (PackedLinear): at most its 64 rows.

On the Xeon lscpu model 167 (bfloat16, SmolLM2-135M, on oneDNN) the fused path decoded 1293.9
tok/s at 40 rows and 1756.1 at 64 against 1079.1 and 1466.7 layer by layer; on model 207, on
the AMX copy, 1.21x at 96 rows, 1.15x at 128 and 0.99x at 192 (`benchmarks/decode_step.py
--rounds 3 --output-len 64 --batch-sizes 96,128,192`), and, in-process, 0.947 and 0.944 of the
per-op time on the extends of 32 fresh 20-token prompts (640 rows) and of 32 prompts' own 30
tokens after a cached 450-token prefix (960 rows).

SLUICE_FUSED_DECODE=0 turns it off at load; `enabled` turns it off in place
(benchmarks/decode_step.py compares the two in one process).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from sluice.model.attention import CpuKernelAttention
from sluice.model.forward_batch import ForwardBatch, ForwardMode
from sluice.model.kv_cache import KVCache
from sluice.model.layers import PackedLinear
from sluice.model.models.llama import LlamaModel
from sluice.model.quant import QuantLinear
from sluice.utils import envs

logger = logging.getLogger(__name__)

_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class FusedDecode:
    """The decode steps of `model` over `kv` in one call each (`forward`); `steps` counts them."""

    def __init__(self, model: LlamaModel, kv: KVCache, ops: Any) -> None:
        first = model.layers[0].self_attn
        rope = first.rope
        self.kv = kv
        self.dtype = kv.k[0].dtype  # the model's, its cache's
        self.head_dim = first.head_dim
        self.max_rows = _max_rows(model)
        self.attention = first.attn.backends[0]  # the kernels' (`why_not_fused`)
        self.enabled = True
        self.steps = 0
        self.layers = ops.DecodeLayers(
            model.embed_tokens.weight.detach(), model.norm.weight.detach(), rope.cos, rope.sin,
            model.norm.eps, first.num_heads, first.num_kv_heads, first.head_dim,
            first.attn.layer.scale,
        )  # fmt: skip
        for i, layer in enumerate(model.layers):
            linears = [_block_args(layer.get_submodule(name)) for name in _LINEARS]
            self.layers.add_layer(
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(), *linears, kv.k[i], kv.v[i],
            )  # fmt: skip

    def supports(self, fb: ForwardBatch, kv: KVCache) -> bool:
        """A decode step, or an extend whose queries the per-op path gives the kernels' attention
        too (few a request, e.g. a mixed step: decoding rows beside a prompt's uncached tail),
        of at most `max_rows` tokens, over this cache."""
        if not self.enabled or kv is not self.kv:
            return False
        if fb.mode == ForwardMode.DECODE:
            return 1 <= fb.batch_size <= self.max_rows
        # in bfloat16 on AMX CPUs, no request of DENSE_MIN_QUERIES tokens: the per-op path
        # hands those to the AMX kernel or SDPA
        split = self.attention.sdpa_dense and self.dtype == torch.bfloat16
        return (
            fb.mode == ForwardMode.EXTEND and fb.q_rows is not None
            and 1 <= fb.q_rows.shape[0] <= self.max_rows
            and self.attention.takes(fb, self.dtype, self.head_dim)
            and not (split and fb.max_q >= self.attention.DENSE_MIN_QUERIES)
        )  # fmt: skip

    def forward(self, fb: ForwardBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states [T, hidden] of the batch's tokens, or [len(rows),
        hidden] of those rows (the last layer past attention on them alone, as the per-op path
        runs it), each token's K/V written into the cache as the per-op path writes them."""
        self.steps += 1
        shared = self.attention.shared_prefix(fb, self.dtype)
        decode = fb.mode == ForwardMode.DECODE
        return self.layers.forward(
            fb.input_ids, fb.positions, fb.out_cache_loc, fb.kv_indices.contiguous(),
            fb.seq_lens if decode else fb.q_seq_lens, None if decode else fb.q_rows,
            shared_prefix=shared.slots, shared_requests=shared.requests, logits_rows=rows,
        )  # fmt: skip


def install_fused_decode(model: nn.Module, kv: KVCache) -> FusedDecode | None:
    """Give `model`'s llama stack (its own, or a vision-language model's language model's) a
    FusedDecode over `kv` where it can take one; returns it, or None (the reason logged)."""
    text_model = getattr(model, "language_model", model)
    stack = getattr(text_model, "model", None)
    if not isinstance(stack, LlamaModel):
        return None
    reason = why_not_fused(stack, kv)
    if reason is not None:
        logger.info("fused decode: off (%s)", reason)
        return None
    stack.fused_decode = FusedDecode(stack, kv, stack.norm.cpu_ops)  # why_not_fused: not None
    max_rows = stack.fused_decode.max_rows
    logger.info(
        "fused decode: decode steps of %s run all %d layers in one C++ call",
        "any size" if max_rows == sys.maxsize else f"1 to {max_rows} rows", len(stack.layers),
    )  # fmt: skip
    return stack.fused_decode


def why_not_fused(stack: LlamaModel, kv: KVCache) -> str | None:
    """Why `stack` cannot take the fused path, or None when it can."""
    if not envs.get_bool("SLUICE_FUSED_DECODE"):
        return "SLUICE_FUSED_DECODE=0"
    ops = stack.norm.cpu_ops
    if ops is None or not hasattr(ops, "DecodeLayers") or not ops._has_quant_linear():
        return "sluice's CPU kernels, with quant_ops' linear layers, are not in use"
    weight = stack.embed_tokens.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return f"the model is {weight.dtype} on {weight.device}, not float32/bfloat16 on the CPU"
    for layer in stack.layers:
        attn = layer.self_attn
        if not isinstance(attn.attn.backends[0], CpuKernelAttention):
            return f"attention is not sluice's kernel (head_dim {attn.head_dim})"
        if layer.mlp.cpu_ops is None or attn.rope.cpu_ops is None:
            return "the MLP or the rotary embedding does not use sluice's kernels"
        for name in _LINEARS:
            module = layer.get_submodule(name)
            if not isinstance(module, QuantLinear) or module.bias is not None:
                return f"{name} is {type(module).__name__}, not GGUF blocks of one type, no bias"
    if len(kv.k) != len(stack.layers) or kv.k[0].dtype != weight.dtype:
        return "the KV cache does not match the model"
    return None


def _max_rows(stack: LlamaModel) -> int:
    """Rows the fused path takes: any number while every linear layer computes them with its
    blocks, with the blocks repacked for the integer GEMM (`packed`), or, in bfloat16, with
    its float copy's AMX copy from at most PACKED_MAX_ROWS rows on (DecodeLayers calls each of
    them too); a layer with another float copy for many rows (`dense`) bounds it at the rows
    that copy takes through oneDNN's reordered weight (a PackedLinear's PACKED_MAX_ROWS, which
    DecodeLayers calls too), or below that copy's rows where it has none."""
    rows = sys.maxsize
    for layer in stack.layers:
        for name in _LINEARS:
            module = layer.get_submodule(name)
            if isinstance(module.dense, PackedLinear):
                if not _amx_takes_the_rest(module):
                    rows = min(rows, module.dense.PACKED_MAX_ROWS)
            elif module.dense is not None:
                rows = min(rows, module.dense_min_rows - 1)
    return rows


def _amx_min_rows(module: QuantLinear) -> int:
    """The rows from which the layer's bfloat16 batches take its float copy's AMX copy (if it
    has one), in QuantLinear.forward and in DecodeLayers alike."""
    return max(PackedLinear.AMX_MIN_ROWS, module.dense_min_rows)


def _amx_takes_the_rest(module: QuantLinear) -> bool:
    """Whether every batch past oneDNN's rows takes the layer's float copy's AMX copy (which
    only bfloat16 weights have), in both paths."""
    dense = module.dense
    return dense.amx is not None and _amx_min_rows(module) <= dense.PACKED_MAX_ROWS


def _block_args(module: QuantLinear) -> tuple:
    """DecodeLayers' view of a linear layer: its blocks (in the layout `kernel_type` names),
    the repacked copy it takes from `packed_min_rows` rows on (bfloat16 only), oneDNN's
    reordered float copy it takes from `dense_min_rows` rows on (`_max_rows` keeps batches
    within its rows), and that copy's AMX copy (if any; a gate_up's paired for its SiLU), which
    bfloat16 batches take from PackedLinear.AMX_MIN_ROWS rows on, as QuantLinear.forward does."""
    dense = module.dense.packed if isinstance(module.dense, PackedLinear) else None
    amx = getattr(module.dense, "amx", None)
    gated = amx is not None and module.dense.amx_gated
    return (
        module.qweight, module.kernel_type, module.in_features, module.int8_activations,
        module.packed, module.packed_min_rows, dense, module.dense_min_rows, amx, gated,
        _amx_min_rows(module),
    )  # fmt: skip
