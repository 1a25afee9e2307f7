"""Building blocks shared by decoder models: RMSNorm, rotary embedding, paged attention."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.model.attention import (
    AttentionBackend,
    AttentionLayer,
    CpuKernelAttention,
    SdpaAttention,
    pick_backend,
)
from sluice.model.attention import cuda_sdpa_backends as cuda_sdpa_backends  # re-exported
from sluice.model.forward_batch import ForwardBatch
from sluice.model.kv_cache import KVCache
from sluice.utils import envs


class RMSNorm(nn.Module):
    # sluice.model.kernels.cpu_ops() on CPU (set by the runner), else None: PyTorch ops
    cpu_ops: Any | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rms_norm(x) of x [T, hidden]; with `residual`, (rms_norm(x + residual), x + residual),
        which the kernel writes into x and residual (the caller hands both over)."""
        ops = self.cpu_ops
        if residual is None:
            if ops is not None:
                return ops.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if ops is not None:
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return F.rms_norm(residual, (x.shape[-1],), self.weight, self.eps), residual


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin table."""

    cpu_ops: Any | None = None  # as RMSNorm.cpu_ops

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        t = torch.arange(max_pos, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [max_pos, head_dim / 2]
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(
        self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, Hkv, D] rotated, and v [T, Hkv, D], from one fused qkv
        projection [T, (H + 2 Hkv) D]; the kernel rotates in place (views of qkv come back)."""
        d = self.cos.shape[1] * 2
        if self.cpu_ops is not None:
            self.cpu_ops.rope_(qkv, positions, self.cos, self.sin, num_heads + num_kv_heads, d)
        q, k, v = qkv.split((num_heads * d, num_kv_heads * d, num_kv_heads * d), dim=-1)
        q, k, v = q.view(-1, num_heads, d), k.view(-1, num_kv_heads, d), v.view(-1, num_kv_heads, d)
        if self.cpu_ops is None:
            cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
            sin = self.sin[positions].unsqueeze(1).to(q.dtype)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return q, k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN reordered once, for float32 on CPU.

    torch's default CPU linear (MKL sgemm) re-blocks the weight on every call; with the weight
    prepacked, oneDNN runs the small-M matmuls of decoding 1.2-2.4x faster here, and the vocab
    projection 2.5x faster at M = 32. The arithmetic is the same up to summation order.

    oneDNN keeps a compiled kernel (and its buffers, ~1.5 MB) per distinct row count, so the
    packed path serves batches of up to PACKED_MAX_ROWS rows (decode), which bounds that cache.
    Larger float32 batches (prefill) go through it in blocks of that many rows, 15% faster here
    than the plain weight (about 210 vs 180 GFLOP/s); larger bfloat16 ones use the plain weight,
    kept beside the packed one, which is as fast there.

    Where the CPU has AMX tiles, bfloat16 batches of AMX_MIN_ROWS rows or more (decode batches
    of 17 requests or more, and prefills) instead take sluice's AMX GEMM
    (`amx_linear` in cpu_ops.cpp) on a third copy laid out for it (in_features a multiple of
    32): the same float32 sums rounded once, in another order. A gate_up projection
    (`fuse_silu_mul`) then also gives its activation from the GEMM's last step (`silu_mul`),
    without writing the [rows, 2 x intermediate] product out and reading it back. The third
    copy costs the weight's size again (SLUICE_AMX_LINEAR=0: none); a layer that never sees
    batches of a few rows (a block-weight layer's float copy, QuantLinear.keep_dense) then
    drops its plain weight (`drop_plain`), which only those batches and the fallback read,
    and one whose batches all have AMX_MIN_ROWS rows or more oneDNN's copy (`drop_onednn`).
    """

    PACKED_MAX_ROWS = 64
    # bfloat16 batches of this many rows or more take the AMX copy where there is one: at 32
    # rows, SmolLM2's 120 decoder GEMMs in a row (weights out of L2, as in a decode step) took
    # 9.95 ms against 15.13 on the blocks repacked for the integer GEMM (one layer's four, hot:
    # 238 against 503 µs, oneDNN's 464); at 16 rows (padded to 32) 11.41 against 11.71 (Xeon
    # model 207)
    AMX_MIN_ROWS = 17

    # sluice's C++ kernels (as RMSNorm.cpu_ops): up to `small_linear_max_rows` rows (decoding one
    # or a few requests) stream the plain weight at the memory's speed, 1.4-1.6x faster here
    cpu_ops: Any | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight: torch.Tensor | None = weight.detach()  # [out, in]; None: `drop_plain`
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # opaque layout; None: `drop_onednn`
        self.packed: torch.Tensor | None = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        self.bias = None if bias is None else bias.detach()
        self.amx_ops = _amx_ops(self.weight)  # cpu_ops() where this weight can take AMX tiles
        self.amx = None if self.amx_ops is None else self.amx_ops.amx_pack_linear(self.weight)
        self.amx_bias = self.bias
        self.amx_gated = False  # `amx` holds the rows of a gate_up layer paired for silu_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, in_features] -> [N, out_features]
        ops = self.cpu_ops
        if (
            ops is not None
            and self.weight is not None
            and 0 < x.shape[0] <= ops.small_linear_max_rows  # 0: no logits wanted
            and x.shape[1] % ops.small_linear_k_multiple == 0
        ):
            return ops.small_linear(x.contiguous(), self.weight, self.bias)
        takes_amx = x.shape[0] >= self.AMX_MIN_ROWS or self.packed is None
        if self.amx is not None and takes_amx and x.dtype == torch.bfloat16:
            y = self.amx_ops.amx_linear(x, self.amx, self.out_features, self.amx_bias)
            return _unpaired(y) if self.amx_gated else y
        if x.shape[0] <= self.PACKED_MAX_ROWS:
            return self._packed(x)
        if x.dtype == torch.float32:
            return torch.cat([self._packed(block) for block in x.split(self.PACKED_MAX_ROWS)])
        return F.linear(x, self.weight, self.bias)

    def warm_onednn(self, rows_from: int = 1) -> None:
        """Build oneDNN's kernel for each row count from `rows_from` that its copy takes (up to
        PACKED_MAX_ROWS; where the AMX copy takes AMX_MIN_ROWS and more, up to those), so that
        the memory they keep is paid at start-up rather than in the first minutes of serving."""
        if self.packed is None:
            return
        last = self.AMX_MIN_ROWS - 1 if self.amx is not None else self.PACKED_MAX_ROWS
        with torch.inference_mode():
            for rows in range(rows_from, last + 1):
                self._packed(torch.zeros(rows, self.in_features, dtype=self.dtype))

    def drop_plain(self) -> bool:
        """Free the plain weight where the AMX copy takes the batches past PACKED_MAX_ROWS
        rows, the fallback's (True): for a caller whose batches start past small_linear's
        rows, the only others that read it (such batches would then take oneDNN's copy, the
        same sums up to order, more slowly)."""
        if self.amx is None:
            return False
        self.weight = None
        return True

    def drop_onednn(self) -> bool:
        """Free oneDNN's reordered copy where the AMX copy exists (True): for a caller whose
        batches all have AMX_MIN_ROWS rows or more, which the AMX copy takes (a smaller one
        would take it too, its rows padded to a tile's)."""
        if self.amx is None:
            return False
        self.packed = None
        return True

    def fuse_silu_mul(self) -> bool:
        """For a gate_up projection (the gate's rows, then as many of the up's): pair the AMX
        copy's rows, 16 of the gate's with their 16 of the up's, so that `silu_mul` can give
        silu(gate) * up from the GEMM; plain calls put the GEMM's columns back in order. The
        copy's tiles are moved, not laid out again from the plain weight. False, and nothing
        changed, without the AMX copy or for an intermediate size that is not a multiple of
        16."""
        out = self.out_features
        if self.amx is None or out % 32 or self.amx_gated:
            return False
        pairs = out // 32  # I / 16
        # amx_pack_linear's layout: [out / 32 blocks, K / 32 steps, 2 tiles of 16 outputs, tile]
        # -> [16-output groups, steps, tile], the groups of the gate and of the up interleaved
        # -> back to blocks of two groups
        tiles = self.amx.reshape(out // 32, -1, 2, TILE_VALUES).transpose(1, 2)
        groups = tiles.reshape(2, pairs, *tiles.shape[2:]).transpose(0, 1)
        self.amx = groups.reshape(tiles.shape).transpose(1, 2).contiguous().reshape(-1)
        self.amx_bias = None if self.bias is None else _paired(self.bias)
        self.amx_gated = True
        return True

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate_up layer's output for x [N, in_features], computed in
        the AMX GEMM: what the kernels' silu_and_mul gives on the AMX GEMM's plain product (see
        `amx_linear`); None where these rows do not take it (`fuse_silu_mul` not done, or a
        batch of fewer than AMX_MIN_ROWS rows), and the caller computes the two steps."""
        if not self.amx_gated or x.shape[0] < self.AMX_MIN_ROWS or x.dtype != torch.bfloat16:
            return None
        return self.amx_ops.amx_linear(x, self.amx, self.out_features, self.amx_bias, True)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:  # `drop_onednn`: only bfloat16 rows, on the AMX copy
            raise TypeError(f"this layer keeps only its AMX copy: {x.dtype} rows cannot take it")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


TILE_VALUES = 16 * 32  # bfloat16 values of one AMX tile (16 rows of 64 bytes)


def _paired(t: torch.Tensor) -> torch.Tensor:
    """A gate_up layer's [2 I, ...] rows in the order of fuse_silu_mul's copy: 16 of the
    gate's, then their 16 of the up's, and so on."""
    pairs = t.shape[0] // 32
    return t.reshape(2, pairs, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _unpaired(y: torch.Tensor) -> torch.Tensor:
    """A gated layer's output [N, 2 I] with its columns in `_paired`'s order, put back: the
    gate's, then the up's."""
    n, out = y.shape
    return y.reshape(n, out // 32, 2, 16).transpose(1, 2).reshape(n, out)


def _amx_ops(weight: torch.Tensor) -> Any | None:
    """sluice's CPU kernels where `weight` [out, in] can take their AMX GEMM: bfloat16, in a
    multiple of 32, built with AMX tiles on a CPU that lets this process use them."""
    if weight.dtype != torch.bfloat16 or weight.shape[1] % 32 or weight.device.type != "cpu":
        return None
    if not envs.get_bool("SLUICE_AMX_LINEAR"):
        return None
    from sluice.model.kernels import cpu_ops

    ops = cpu_ops()
    return ops if ops is not None and ops.amx_linear_ok() else None


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of a loaded model by a PackedLinear; returns how many.

    Then build oneDNN's kernel for every batch size the packed path serves, once per distinct
    weight shape (layers of one shape share kernels): the memory this takes is paid at start-up
    instead of growing during the first minutes of serving.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    warmed: set[tuple[int, int, bool]] = set()
    for parent, name, child in targets:
        packed = PackedLinear(child.weight, child.bias)
        setattr(parent, name, packed)
        shape = (child.in_features, child.out_features, child.bias is not None)
        if shape not in warmed:
            warmed.add(shape)
            packed.warm_onednn()
    return len(targets)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the pool, then hands the batch to the first of its `backends`
    (sluice.model.attention) that takes it. The runner sets the backends at load, one list for
    all layers (`select_backends`); a module built alone has SDPA only."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer = AttentionLayer(layer_id, num_heads, num_kv_heads, head_dim, head_dim**-0.5)
        self.backends: list[AttentionBackend] = [SdpaAttention()]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D] -> [T, H * D]
        kv.write(self.layer.layer_id, fb.out_cache_loc, k, v)
        return pick_backend(self.backends, fb).forward(q, k, v, fb, kv, self.layer)

    # the `cpu_ops` slot every module with C++ kernels has (as RMSNorm.cpu_ops), kept so that
    # code handing out or withdrawing the kernels (the parity tests, benchmarks/cpu_attention.py)
    # reaches attention too: the kernels among the backends, or None
    @property
    def cpu_ops(self) -> Any | None:
        kernels = (b.ops for b in self.backends if isinstance(b, CpuKernelAttention))
        return next(kernels, None)

    @cpu_ops.setter
    def cpu_ops(self, ops: Any | None) -> None:
        """The kernels first (None: none), the other backends after them in their order; the
        kernels hand dense requests to SDPA where it computes bfloat16 natively (AMX), as
        select_backends sets them."""
        rest = [b for b in self.backends if not isinstance(b, CpuKernelAttention)]
        dense = any(isinstance(b, SdpaAttention) and b.cpu_native for b in rest)
        self.backends = rest if ops is None else [CpuKernelAttention(ops, dense), *rest]
