"""QuantLinear: a linear layer whose weight stays in a GGUF block quantization (Q8_0, Q4_0, Q4_1,
and the K-quants Q4_K and Q6_K), computed by sluice's weight-only CPU kernels
(`sluice.model.kernels.quant_ops()`).

The weight is `qweight` [out_features, in_features / block_values * block_bytes] uint8: every
output row's blocks (32 values each; 256 for the K-quants) exactly as the GGUF file stores them
(see quant_ops.cpp), so loading is a copy of bytes, with whole rows permuted or concatenated at
most (sluice.model.gguf_weights).

`--quantization` (ServerArgs.quantization) chooses between these layers and float weights:
`resolve_quantization` turns "auto" into "gguf" or "none" once, and logs why. "int8" and "int4"
quantize a float checkpoint's linear layers at load (`quantize_linears`) into the same blocks,
per group of 32 input values: Q8_0 (int8 with a scale) and Q4_1 (4 bits with a scale and a
minimum), with gguf's own quantizer, so they run on the same kernels.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.utils import envs
from sluice.utils.system import has_amx_bf16

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "gguf", "none", "int8", "int4")
LOAD_TYPES = {"int8": 8, "int4": 3}  # --quantization -> the block type quantized into at load

# ggml type id -> (name, bytes of one block, values of one block)
BLOCK_TYPES = {
    8: ("Q8_0", 34, 32), 2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32),
    12: ("Q4_K", 144, 256), 14: ("Q6_K", 210, 256),
}  # fmt: skip
BLOCK_VALUES = 32  # values a block of the types quantized into at load (LOAD_TYPES)


class QuantLinear(nn.Module):
    """y = x w^T + b with w in GGUF blocks; x [T, in_features] float32 or bfloat16 on the CPU,
    y [T, out_features] in x's dtype.

    The kernel reads each block once per 8 rows of x: up to 8 rows (decoding a few requests)
    it is as fast as oneDNN on a float weight or faster, being bound by the weight's bytes;
    past that it is bound by its float32 FMAs and oneDNN's GEMM wins (1.5-2.8x at 64 rows,
    measured on an Intel Xeon model 207). So `keep_dense` can add a float copy of the weight,
    prepacked (a PackedLinear), for batches of `dense_min_rows` rows or more; dequantizing
    into a scratch weight at each call instead cost more than the GEMM it feeds. With bfloat16
    x on the integer path (below) and AVX-512 VNNI, the second copy is instead the blocks
    repacked for an integer GEMM (`packed_linear`, 1.25 bytes a weight against bfloat16's 2),
    which rounds x as the per-row integer path does: a batch and a single row agree. CPUs with
    AMX keep both copies: the repacked blocks up to `AMX_PACKED_MAX_ROWS` rows (small decode
    batches), a float copy past them (larger ones, prefills) on sluice's AMX GEMM (oneDNN's
    past `ONEDNN_PACKED_MAX_ROWS` where the copy has no AMX copy), which rounds differently.

    With bfloat16 x the kernel rounds each 32-value block of x to int8 with a float scale and
    takes integer dot products (VNNI where the CPU has it), as llama.cpp does: y then differs
    from the float result by at most sum_k |w_k| * scale_b(k) / 2 (scale_b = max |x| / 127 over
    x's block), and is 1.6-1.8x as fast at one row on Q4_1 (1.1-1.3x on Q8_0). float32 x always
    takes the float path, exact up to float32 rounding; so do the K-quants (Q4_K, Q6_K) where
    the build's integer path does not take them (`ops.int8_types`: AVX-512 VNNI builds do).
    SLUICE_QUANT_INT8_ACT=0 (read when the layer is made) keeps bfloat16 x on the float path
    too.

    On AVX-512 VNNI builds, a bfloat16 model's Q4_0, Q4_1 and Q8_0 layers then trade their GGUF
    layout for a row-interleaved one (`interleave`, made by `keep_dense_copies`; `kernel_type`
    says which `qweight` holds), whose kernel reads 16 output rows per dpbusd: 1.2-1.8x the
    per-row integer kernel at one row, 1.3-2.6x at four (Zen 4, one or two threads). Its results
    are the per-row kernel's up to float32 summation order (the integer sums are the same), so a
    bfloat16 y may differ from it by one rounding step; the fused decode reads the same layout
    through the same kernel, so it still equals the per-op path bit for bit."""

    KERNEL_MAX_ROWS = 8  # rows the kernel computes in one pass over the blocks
    # On CPUs with AMX, the most rows the integer GEMM takes before oneDNN's bfloat16 GEMM on a
    # float copy does (`keep_dense`). Xeon model 207 with AMX, SmolLM2-135M's layers, 2 threads:
    # the integer GEMM's time over oneDNN's 0.82 at 16 rows, 1.18 at 32, 1.58 at 64, 2.2-2.7 at
    # 512-1024 (weights hot in the cache); a decode step of 32 rows, where the integer GEMM lets
    # the fused decode take it, 1209-1245 against 920-1080 tok/s; 64 rows 1160-1505 against
    # 1475-1696 (benchmarks/decode_step.py). So without an AMX copy (SLUICE_AMX_LINEAR=0, an
    # input width not a multiple of 32) oneDNN takes the float copy's batches past 32 rows;
    # with one, sluice's own AMX GEMM beat both from 17 rows (PackedLinear.AMX_MIN_ROWS).
    ONEDNN_PACKED_MAX_ROWS = 32
    AMX_PACKED_MAX_ROWS = 16

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: int,
        in_features: int,
        bias: torch.Tensor | None,
        ops: Any,
    ) -> None:
        super().__init__()
        if qtype not in BLOCK_TYPES:
            raise ValueError(f"ggml type {qtype} is not one of {sorted(BLOCK_TYPES)}")
        name, block_bytes, block_values = BLOCK_TYPES[qtype]
        if in_features % block_values:
            raise ValueError(
                f"{name} holds {block_values} values a block: in_features {in_features} is not "
                f"a multiple of {block_values}"
            )
        row_bytes = in_features // block_values * block_bytes
        if qweight.dim() != 2 or qweight.shape[1] != row_bytes:
            raise ValueError(
                f"{name} weight of shape {tuple(qweight.shape)} does not hold {in_features} "
                "values a row"
            )
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.qtype = qtype  # ggml's type id of the blocks
        self.kernel_type = qtype  # the id the kernels take: qtype, or its interleaved layout's
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.ops = ops
        self.dense: nn.Module | None = None  # a float copy for many rows, or None
        self.packed: torch.Tensor | None = None  # the blocks repacked for packed_linear, or None
        self.dense_min_rows = 0  # batches of this many rows or more take `dense`
        self.packed_min_rows, self.packed_max_rows = 0, 0  # and these take `packed` (bfloat16)
        # bfloat16 x only, and the types the integer path takes
        self.int8_activations = qtype in ops.int8_types and envs.get_bool("SLUICE_QUANT_INT8_ACT")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        if self.packed_takes(x):
            return self.ops.packed_linear(x, self.packed, self.out_features, self.bias)
        if self.dense is not None and x.shape[0] >= self.dense_min_rows:
            return self.dense(x)
        return self.ops.quant_linear(
            x.contiguous(), self.qweight, self.kernel_type, self.bias, self.int8_activations
        )

    def fuse_silu_mul(self) -> bool:
        """A gate_up projection's float copy (PackedLinear.fuse_silu_mul); False without one."""
        fuse = getattr(self.dense, "fuse_silu_mul", None)
        return fuse is not None and fuse()

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up from the float copy's GEMM (PackedLinear.silu_mul) for the batches
        the copy takes, else None."""
        if self.dense is None or x.shape[0] < self.dense_min_rows or self.packed_takes(x):
            return None
        silu_mul = getattr(self.dense, "silu_mul", None)
        return None if silu_mul is None else silu_mul(x)

    def packed_takes(self, x: torch.Tensor) -> bool:
        rows = x.shape[0]
        return (
            self.packed is not None
            and self.packed_min_rows <= rows <= self.packed_max_rows
            and x.dtype == torch.bfloat16
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out_features, in_features] the blocks stand for."""
        return self.ops.dequantize(self.qweight, self.kernel_type, self.in_features, dtype)

    def can_interleave(self, dtype: torch.dtype) -> bool:
        """Whether `interleave` applies: `dtype` rows take the integer path (bfloat16, as
        `int8_activations` says) and the build has the interleaved kernel for this type."""
        return (
            dtype == torch.bfloat16
            and self.int8_activations
            and self.qtype in self.ops.interleaved_types
            and self.kernel_type == self.qtype
        )

    def interleave(self) -> None:
        """Replace `qweight` by its blocks in the row-interleaved layout of the few-row integer
        kernel (quant_ops.cpp, `interleave`: the same bytes, woven 16 output rows at a time), in
        place, no second copy: every use of the layer (the integer path, the float path,
        `dequantized`, `keep_dense`) takes `kernel_type`, which names the layout. Float32 x on
        such a layer still gets the exact float path, but on a copy of the blocks put back into
        GGUF's layout at every call: for layers whose rows are bfloat16 (`can_interleave`)."""
        self.qweight = self.ops.interleave(self.qweight, self.qtype, self.in_features)
        self.kernel_type = self.ops.interleaved_types[self.qtype]

    def takes_packed(self, dtype: torch.dtype) -> bool:
        """Batches of many `dtype` rows go through the integer GEMM on repacked blocks: bfloat16
        x on the integer path, for the 32-value types, where the kernels have that GEMM
        (AVX-512 VNNI; `ops.packed_types`). On CPUs with AMX only up to `AMX_PACKED_MAX_ROWS`
        rows (`ONEDNN_PACKED_MAX_ROWS` without an AMX copy): past them a bfloat16 GEMM on a
        float copy is the faster one (oneDNN's, Xeon model 167, `serving.py`: mixed 399 -> 478
        output tok/s, shared-prefix 352 -> 390; sluice's AMX GEMM from 17 rows, see
        PackedLinear.AMX_MIN_ROWS). The K-quants keep a float copy."""
        return (
            dtype == torch.bfloat16
            and self.int8_activations
            and self.qtype in self.ops.packed_types
        )

    def keep_dense(self, dtype: torch.dtype, min_rows: int = KERNEL_MAX_ROWS + 1) -> None:
        """Compute batches of `min_rows` rows or more with a second copy of the weight: the
        blocks repacked for the integer GEMM (`takes_packed`), else a float copy, a PackedLinear
        where oneDNN takes `dtype`, else a plain linear layer; on CPUs with AMX, the repacked
        blocks up to `AMX_PACKED_MAX_ROWS` rows and a float copy past them (with no AMX copy in
        it, up to `ONEDNN_PACKED_MAX_ROWS`)."""
        from sluice.model.layers import PackedLinear, can_pack_linears

        self.dense_min_rows, self.dense, self.packed = min_rows, None, None
        self.packed_min_rows = self.packed_max_rows = 0
        if self.takes_packed(dtype):
            self.packed = self.ops.repack(self.qweight, self.kernel_type, self.in_features)
            self.packed_min_rows, self.packed_max_rows = min_rows, sys.maxsize
            if not has_amx_bf16():
                return
        weight = self.dequantized(dtype)
        bias = None if self.bias is None else self.bias.detach()  # shared: loaded in place
        if can_pack_linears(weight.device, dtype):
            self.dense = PackedLinear(weight, bias)
        else:
            self.dense = _PlainLinear(weight, bias)
        if self.packed is not None:  # AMX: the float copy takes the batches past the blocks'
            amx = getattr(self.dense, "amx", None) is not None
            most = self.AMX_PACKED_MAX_ROWS if amx else self.ONEDNN_PACKED_MAX_ROWS
            self.packed_max_rows = max(min_rows, most)
            self.dense_min_rows = self.packed_max_rows + 1
        if not isinstance(self.dense, PackedLinear):
            return
        # its batches start past the block kernel's rows, so past small_linear's (fewer), the
        # plain weight's only reader besides the fallback that the AMX copy replaces
        if min_rows > self.KERNEL_MAX_ROWS:
            self.dense.drop_plain()
        if self.dense_min_rows >= PackedLinear.AMX_MIN_ROWS:  # all on the AMX copy, if any
            self.dense.drop_onednn()

    def extra_repr(self) -> str:
        name = BLOCK_TYPES[self.qtype][0]
        return f"in_features={self.in_features}, out_features={self.out_features}, {name}"


class QuantLinearParts(nn.Module):
    """A fused linear layer (qkv_proj, gate_up_proj) whose parts a GGUF holds in different block
    types, as Q4_K_M files do (q and k in Q4_K, v in Q6_K): one QuantLinear a part, their outputs
    side by side, then the fused bias. y [T, sum of the parts' out_features] in x's dtype."""

    def __init__(self, parts: list[QuantLinear], bias: torch.Tensor | None) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1 or any(p.bias is not None for p in parts):
            raise ValueError("the parts of a fused layer share in_features and have no bias")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias


class _PlainLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def keep_dense_copies(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every QuantLinear of `model` its float copy for many rows (`keep_dense`), then its
    row-interleaved blocks for few (`interleave`, where `can_interleave`: in place, no copy), and
    build oneDNN's kernels for those row counts once per weight shape, as `pack_linears` does;
    returns the bytes the copies take."""
    from sluice.model.layers import PackedLinear

    total, warmed = 0, set()
    modules = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for module in modules:
        module.keep_dense(dtype)
        if module.can_interleave(dtype):  # after keep_dense: it reads the GGUF blocks as they are
            module.interleave()
        dense = module.dense
        copies = (module.packed, getattr(dense, "weight", None), getattr(dense, "amx", None))
        for copy in copies:
            total += 0 if copy is None else copy.numel() * copy.element_size()
        onednn = isinstance(dense, PackedLinear) and dense.packed is not None
        if onednn:  # oneDNN's reordered copy: opaque, the weight's size
            total += module.in_features * module.out_features * dtype.itemsize
        shape = (module.in_features, module.out_features, module.bias is not None)
        if onednn and shape not in warmed:
            warmed.add(shape)
            dense.warm_onednn(module.dense_min_rows)
    packed = [m for m in modules if m.packed is not None]
    float_copy = str(dtype).removeprefix("torch.") + " copy"
    if not packed:
        more = f"a {float_copy}"
    elif packed[0].packed_max_rows == sys.maxsize:
        more = "the blocks repacked for the integer GEMM"
    else:  # AMX
        most = packed[0].packed_max_rows
        gemm = "oneDNN's AMX GEMM"
        if getattr(packed[0].dense, "amx", None) is not None:
            gemm = "laid out for sluice's AMX GEMM"
        more = (
            f"the blocks repacked for the integer GEMM up to {most} rows and a {float_copy} "
            f"({gemm}) past {most}"
        )
    woven = sum(m.kernel_type != m.qtype for m in modules)
    logger.info(
        "block weights: the kernel up to %d rows (%d of %d layers row-interleaved for it); past "
        "them %s (%.0f MB)",
        QuantLinear.KERNEL_MAX_ROWS, woven, len(modules), more, total / 1e6,
    )  # fmt: skip
    return total


def quantize_linears(model: nn.Module, qtype: int, ops: Any) -> int:
    """Replace the linear layers of `model`'s language model (attention, MLP, LM head; a vision
    tower stays float) by QuantLinear modules holding their weight quantized into `qtype`
    blocks; returns how many. A layer whose input width is not a multiple of 32 stays float."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    start = time.perf_counter()
    text_model = getattr(model, "language_model", model)
    linears = [(n, m) for n, m in text_model.named_modules() if isinstance(m, nn.Linear)]
    kept = [n for n, m in linears if m.in_features % BLOCK_VALUES]
    for name, module in linears:
        if name in kept:
            continue
        weight = module.weight.detach().float().cpu().numpy()
        blocks = torch.from_numpy(quantize(weight, GGMLQuantizationType(qtype)))
        bias = None if module.bias is None else module.bias.detach().clone()
        parent, _, leaf = name.rpartition(".")
        new = QuantLinear(blocks, qtype, module.in_features, bias, ops)
        setattr(text_model.get_submodule(parent) if parent else text_model, leaf, new)
    done = len(linears) - len(kept)
    logger.info(
        "quantized %d linear layers into %s blocks (per group of %d input values) in %.1f s%s",
        done, BLOCK_TYPES[qtype][0], BLOCK_VALUES, time.perf_counter() - start,
        f"; kept float (width not a multiple of {BLOCK_VALUES}): {', '.join(kept)}" if kept else "",
    )  # fmt: skip
    return done


def resolve_quantization(
    value: str, source_path: str, device: torch.device, dtype: torch.dtype
) -> str:
    """ "gguf" (keep a GGUF file's block weights, QuantLinear), "int8" or "int4" (quantize the
    float weights at load into blocks) or "none" (float weights in `dtype`) for `--quantization
    value`; "auto" is "gguf" for a GGUF file on the CPU, in float32 or bfloat16, when the kernels
    build and the file holds a type they take; the choice and its reason are logged. A choice
    that cannot be had raises."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {value!r}; choose from {', '.join(QUANTIZATIONS)}")
    if value == "none":
        return "none"
    if value in LOAD_TYPES:
        reason = _why_not_kernels(device, dtype)
        if reason is not None:
            raise ValueError(f"--quantization {value} is not available: {reason}")
        name = BLOCK_TYPES[LOAD_TYPES[value]][0]
        logger.info(
            "--quantization %s: linear weights quantized at load into %s blocks", value, name
        )
        return value
    reason = _why_not_gguf(source_path, device, dtype)
    if reason is None:
        logger.info("--quantization %s: gguf (block weights kept, computed by quant_ops)", value)
        return "gguf"
    if value == "gguf":
        raise ValueError(f"--quantization gguf is not available: {reason}")
    logger.info("--quantization auto: none (%s)", reason)
    return "none"


def _why_not_gguf(source_path: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if not source_path.lower().endswith(".gguf"):
        return "the model is not a GGUF file"
    reason = _why_not_kernels(device, dtype)
    if reason is not None:
        return reason
    types = linear_types(source_path)
    if not types & set(BLOCK_TYPES):
        names = ", ".join(name for name, _, _ in BLOCK_TYPES.values())
        return f"the file's linear weights are {sorted(types)}, none of {names}"
    return None


def _why_not_kernels(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"the block kernels run on the CPU, not {device}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the block kernels take float32 or bfloat16, not {dtype}"
    from sluice.model.kernels import quant_ops

    if quant_ops() is None:
        return "the quantized-weight kernels could not be built"
    return None


def linear_types(gguf_path: str) -> set[int]:
    """The ggml type ids of a GGUF's 2-D weights."""
    from sluice.checkpoint.gguf_tensors import read_gguf_tensors

    return {t.tensor_type for t in read_gguf_tensors(gguf_path) if len(t.shape) == 2}
