"""GGUF block weights kept quantized: the kernels, the loading, and the model through them.

- `quant_linear` and `dequantize` (quant_ops.cpp) against gguf's own dequantization followed by a
  float64 matmul, for Q8_0, Q4_0 and Q4_1, float32 and bfloat16, several shapes; once as built
  for this CPU and once built without AVX-512 (the AVX2 path of CPUs such as AMD Zen 3).
- A tiny llama written as a GGUF by gguf's GGUFWriter (quantized by gguf.quants, q/k rows in
  llama.cpp's order, one fused group of mixed types: a QuantLinear a part): the model with its
  blocks kept gives the logits of the same model with the dequantized weights.
- The default SmolLM2 Q4_1 GGUF: its blocks, q/k reordered and fused, equal the float
  conversion; and through the Engine, greedy tokens and logprobs of `--quantization gguf`
  against `none`, both float32.

Tolerances: the kernel dequantizes exactly the values gguf does (up to one rounding of
d * q + m, which it may fuse) and sums K products in float32, so against a float64 reference its
error is within (K + 2) * 2^-24 * sum_k |x_k w_k| (the classic bound for a sum of K rounded
terms, plus the dequantization's rounding); bfloat16 output adds its own rounding, 2^-8 |y|.
With int8 activations (bfloat16 x, `int8_activations=True`) x is rounded to int8 per block of
32 first: the bound becomes sum_k |w_k| dx_b(k) / 2 plus float terms (`_int8_bound`), for each
build of the integer path (AVX-512 VNNI, AVX-VNNI, AVX2 maddubs, scalar). On AVX-512 VNNI builds
the row-interleaved layout's kernel takes the same integer sums as the per-row one, its float
sums in another order: the two agree within twice the float part of that bound (then bfloat16).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from sluice.checkpoint.model_config import ModelConfig  # noqa: E402
from sluice.model import quant as quant_module  # noqa: E402
from sluice.model.kernels import QUANT_SOURCE, _build, quant_ops  # noqa: E402
from sluice.model.quant import QuantLinear, QuantLinearParts, resolve_quantization  # noqa: E402
from sluice.utils.system import cpu_flags  # noqa: E402

T = gguf.GGMLQuantizationType
# The other instruction sets' builds are for their code paths, not their code generation (the
# native build keeps -O3): -O1 halves their build time, several minutes of a run on a fresh machine
VARIANT_O = "-O1"
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1]
SHAPES = [(1, 32, 1), (1, 576, 193), (3, 64, 7), (8, 96, 33), (13, 160, 20), (40, 128, 65)]


@pytest.fixture(scope="module")
def native_ops():
    ops = quant_ops()
    if ops is None:
        pytest.skip("the quantized-weight kernels did not build here")
    return ops


@pytest.fixture(scope="module")
def avx2_ops(native_ops):
    """The kernels built as for a CPU without AVX-512 (the lanes split over two AVX2 registers)."""
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if native_ops.isa != "avx512":
        return native_ops  # already the AVX2 (or generic) build
    ops = _build("sluice_quant_ops_avx2", QUANT_SOURCE, ("-mno-avx512f", VARIANT_O))
    assert ops.isa == "avx2"
    return ops


@pytest.fixture(scope="module")
def avx2_maddubs_ops(native_ops):
    """Built for an AVX2 CPU without AVX-VNNI (AMD Zen 3): the integer path's maddubs variant."""
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    if native_ops.int8_isa == "avx2":
        return native_ops
    ops = _build(
        "sluice_quant_ops_avx2_maddubs", QUANT_SOURCE, ("-mno-avx512f", "-mno-avxvnni", VARIANT_O)
    )
    assert ops.int8_isa == "avx2"
    return ops


@pytest.fixture(scope="module")
def generic_ops(native_ops):
    """Built without AVX: the scalar paths (and the software fp16 conversion)."""
    if native_ops.isa == "generic":
        return native_ops
    ops = _build("sluice_quant_ops_generic", QUANT_SOURCE, ("-mno-avx", VARIANT_O))
    assert ops.isa == "generic" and ops.int8_isa == "generic"
    return ops


@pytest.fixture(params=["native", "avx2"])
def ops(request):
    return request.getfixturevalue(f"{request.param}_ops")


@pytest.fixture(params=["native", "avx2", "avx2_maddubs", "generic"])
def int8_ops(request):
    return request.getfixturevalue(f"{request.param}_ops")


def _blocks(n: int, k: int, qtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [n, k] weights as blocks of `qtype`, and the float64 values gguf reads from them."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, qtype)
    return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_dequantize_then_matmul(ops, qtype, m, k, n, dtype) -> None:
    raw, w = _blocks(n, k, qtype)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n)
    assert_float_path_result(ops.quant_linear(x, raw, int(qtype), bias), x, w, bias)


def assert_float_path_result(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    """y = x w^T + bias (w float64 [N, K]) within the float path's bound (the module's doc)."""
    (m, k), n = x.shape, w.shape[0]
    assert y.dtype == x.dtype and y.shape == (m, n)
    ref = x.double() @ w.T + bias.double()
    bound = (k + 2) * 2.0**-24 * (x.double().abs() @ w.abs().T) + 2.0**-24 * bias.abs().double()
    if x.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert (err <= bound + 1e-30).all(), f"max error / bound {(err / bound).max():.3g}"


# M = 1..8 (one tile) and 13 (two); K = 32 * an odd number of blocks in most (a pair of blocks
# a 512-bit register: the last one alone); K = 2208: the minimums of a row on the heap
INT8_SHAPES = [
    (1, 32, 5), (2, 96, 33), (3, 576, 193), (4, 160, 20), (5, 1536, 70), (6, 64, 7),
    (7, 224, 64), (8, 608, 9), (13, 96, 21), (2, 2208, 5),
]  # fmt: skip


def _int8_bound(x: torch.Tensor, raw: torch.Tensor, w: torch.Tensor, qtype) -> torch.Tensor:
    """`int8_bound` for blocks `raw` of a 32-value type."""
    return int8_bound(x, w, _block_mins(raw, qtype, w.shape[0], x.shape[1] // 32))


def _block_mins(raw: torch.Tensor, qtype, n: int, nb: int) -> torch.Tensor:
    """m_b of each block of `raw` (a 32-value type), float64 [n, nb]."""
    blocks = raw.numpy().reshape(n, nb, -1)
    d = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16).astype(np.float64))[..., 0]
    if qtype == T.Q4_1:
        mins = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16).astype(np.float64))
        mins = mins[..., 0]
    else:
        mins = d * (-8.0 if qtype == T.Q4_0 else -128.0)
    return mins


def int8_bound(x: torch.Tensor, w: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The integer path's error bound against x @ w^T in float64, [M, N]; mins [N, K / 32]:
    each 32 weights' m_b (below).

    Per block b of 32 values the kernel rounds x to x^_j = dx_b q_j, dx_b = max|x| / 127, q_j
    in [-127, 127], so |x_j - x^_j| <= dx_b / 2 (times 1 + 2^-14 for the rounding of x * 127 /
    max|x|), and computes sum_j w_j x^_j with w_j = d_b u_j + m_b as
        sum_b d_b dx_b (sum_j u_j q_j) + m_b (dx_b sum_j q_j),
    the integer sums exact. Each term is rounded a few times and the nb terms and 16 lanes are
    summed in float32: within (nb + 10) 2^-24 times the sum of their magnitudes, which is at
    most sum_j (|w_j| + 2 |m_b|) |x^_j| since |d_b u_j| <= |w_j| + |m_b|, with |x^_j| <= max|x|.
    So |y - x w^T| <= sum_j |w_j| dx_b / 2 (1 + 2^-14)
                      + (nb + 10) 2^-24 sum_j (|w_j| + 2 |m_b|) max_b|x| (1 + 2^-20)."""
    m, k = x.shape
    n, nb = w.shape[0], k // 32
    amax = x.double().view(m, nb, 32).abs().amax(-1)  # [M, nb]
    w_abs = w.abs().view(n, nb, 32).sum(-1)  # [N, nb]
    rounding = (amax / 127 / 2 * (1 + 2**-14)) @ w_abs.T
    return rounding + int8_float_bound(x, w, mins)


def int8_float_bound(x: torch.Tensor, w: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 part of `int8_bound`: how far the integer path's float sums may be from
    exact, [M, N], whatever order they are taken in."""
    m, k = x.shape
    n, nb = w.shape[0], k // 32
    amax = x.double().view(m, nb, 32).abs().amax(-1)  # [M, nb]
    w_abs = w.abs().view(n, nb, 32).sum(-1)  # [N, nb]
    return (nb + 10) * 2.0**-24 * (1 + 2**-20) * (amax @ (w_abs + 64 * mins.abs()).T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_is_rounded_to_int8_per_block_alike_by_every_build(int8_ops, dtype) -> None:
    """The integer path's rounding of x (`quantize_activations`), per block of 32 values: q =
    round(x * (127 / max|x|)) in float32, ties to even, dx = max|x| / 127, s = dx * sum q. The
    AVX-512 and AVX2 builds vectorize it; every build must give these bits."""
    m, nb = 19, 5  # rows past one chunk of the row split (16); an odd number of blocks
    x = torch.randn(m, nb * 32, generator=torch.Generator().manual_seed(7))
    x[0, :32] *= 1000  # blocks of very different scales
    x[1, 32:64] = 0  # dx = 0
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5] * 4)
    x[2, 64:96] = ties
    x[2, 64] = -127.0  # max |x| = 127 from a negative value: 127 / max|x| = 1, ties stay ties
    x[3, 96:128] = -x[3, 96:128].abs()
    x = x.to(dtype)
    q, dx, s = int8_ops.quantize_activations(x)
    xf = x.float().numpy().reshape(m, nb, 32)
    amax = np.abs(xf).max(-1)
    inv = np.float32(127) / np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, inv, np.float32(0)).astype(np.float32)
    ref = np.clip(np.rint(xf * inv[..., None]), -127, 127).astype(np.int8)
    assert ref[2, 2, :8].tolist() == [-127, 2, 2, 0, -2, -2, 126, -126]  # the ties, to even
    assert q.dtype == torch.int8 and np.array_equal(q.numpy(), ref.reshape(m, -1))
    assert np.array_equal(dx.numpy(), amax / np.float32(127))
    assert np.array_equal(s.numpy(), dx.numpy() * ref.sum(-1).astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,k,n", INT8_SHAPES)
def test_int8_activations_within_the_rounding_bound(int8_ops, qtype, m, k, n) -> None:
    raw, w = _blocks(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + n)).bfloat16()
    x[0, :32] *= 100  # blocks of very different scales
    if k >= 64:
        x[-1, 32:64] = 0  # a block of zeros: dx = 0
    bias = torch.randn(n)
    y = int8_ops.quant_linear(x, raw, int(qtype), bias, True)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.T + bias.double()
    bound = _int8_bound(x, raw, w, qtype) + 2.0**-24 * bias.abs().double() + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"
    if m * n >= 64:  # not the float path: x really was rounded
        assert not torch.equal(y, int8_ops.quant_linear(x, raw, int(qtype), bias, False))


# M past one pass of the per-row kernels, with tails of 1, 2 and 3 rows past the 4-row groups;
# N not a multiple of the 16-row tiles, an odd number of tiles (the last pair a single tile);
# M = 300, 303: two blocks of rows (256 a block)
PACKED_SHAPES = [
    (9, 32, 5), (10, 64, 37), (13, 96, 21), (15, 96, 16), (16, 576, 193), (40, 1536, 70),
    (300, 160, 48), (303, 96, 16),
]  # fmt: skip


@pytest.fixture(scope="module")
def packed_native_ops(native_ops):
    if not native_ops.packed_gemm:
        pytest.skip(f"no integer GEMM in this build (integer path: {native_ops.int8_isa})")
    return native_ops


@pytest.fixture(scope="module")
def packed_nobf16_ops(packed_native_ops):
    """Built as for an AVX-512 VNNI CPU without AVX512-BF16 (Cascade Lake, Ice Lake): the
    integer GEMM rounds its output to bfloat16 with integer ops instead of vcvtneps2bf16."""
    if "avx512_bf16" not in cpu_flags():
        return packed_native_ops  # already that build
    ops = _build("sluice_quant_ops_nobf16", QUANT_SOURCE, ("-mno-avx512bf16", VARIANT_O))
    assert ops.packed_gemm
    return ops


@pytest.fixture(params=["native", "nobf16"])
def packed_ops(request):
    return request.getfixturevalue(f"packed_{request.param}_ops")


def test_packed_linear_keeps_a_nan(packed_ops) -> None:
    """A block whose scale is an fp16 NaN (corrupt weights) gives NaN outputs, never a zero (the
    bfloat16 rounding without vcvtneps2bf16 must not wrap a NaN's payload)."""
    raw, _ = _blocks(32, 64, T.Q8_0)
    raw[3, 0:2] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)  # d = fp16 0x7fff, a NaN
    raw[5, 0:2] = torch.tensor([0x00, 0xFE], dtype=torch.uint8)  # d = fp16 0xfe00, a NaN
    x = torch.randn(12, 64).bfloat16()
    y = packed_ops.packed_linear(x, packed_ops.repack(raw, int(T.Q8_0), 64), 32, None)
    assert torch.isnan(y[:, [3, 5]]).all()
    assert torch.isfinite(y[:, [n for n in range(32) if n not in (3, 5)]]).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,k,n", PACKED_SHAPES)
def test_packed_linear_within_the_rounding_bound(packed_ops, qtype, m, k, n) -> None:
    """The integer GEMM on repacked blocks rounds x as the integer path does: the same bound,
    and the per-row kernel's result up to float32 summation order (then bfloat16 rounding)."""
    raw, w = _blocks(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + n)).bfloat16()
    x[0, :32] *= 100
    if k >= 64:
        x[-1, 32:64] = 0
    bias = torch.randn(n)
    packed = packed_ops.repack(raw, int(qtype), k)
    assert packed.shape == ((n + 15) // 16, k // 32 * 640)
    y = packed_ops.packed_linear(x, packed, n, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.T + bias.double()
    bound = _int8_bound(x, raw, w, qtype) + 2.0**-24 * bias.abs().double() + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"
    rows = packed_ops.quant_linear(x, raw, int(qtype), bias, True).double()
    torch.testing.assert_close(y.double(), rows, rtol=2**-7, atol=1e-3 * ref.abs().max().item())
    assert packed_ops.packed_linear(x[:0], packed, n, None).shape == (0, n)


def test_quant_linear_module_takes_the_packed_gemm_for_many_bf16_rows(
    packed_ops, monkeypatch
) -> None:
    monkeypatch.setenv("SLUICE_QUANT_INT8_ACT", "1")
    monkeypatch.setattr(quant_module, "has_amx_bf16", lambda: False)
    raw, _ = _blocks(40, 96, T.Q4_1)
    x = torch.randn(20, 96).bfloat16()
    layer = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)
    layer.keep_dense(torch.bfloat16, min_rows=16)
    assert layer.packed is not None and layer.dense is None
    packed = packed_ops.repack(raw, int(T.Q4_1), 96)
    assert torch.equal(layer(x), packed_ops.packed_linear(x, packed, 40, None))
    assert torch.equal(layer(x[:2]), packed_ops.quant_linear(x[:2], raw, int(T.Q4_1), None, True))
    x32 = x.float()  # float32 rows on a layer packed for bfloat16: the exact float kernel
    assert torch.equal(layer(x32), packed_ops.quant_linear(x32, raw, int(T.Q4_1), None, False))
    layer.keep_dense(torch.float32, min_rows=16)  # made again: the packed copy is gone
    assert layer.packed is None and layer.dense is not None
    monkeypatch.setenv("SLUICE_QUANT_INT8_ACT", "0")  # no integer path: a float copy
    off = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)
    off.keep_dense(torch.bfloat16, min_rows=16)
    assert off.packed is None and off.dense is not None
    float32 = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)
    float32.keep_dense(torch.float32, min_rows=16)
    assert float32.packed is None and float32.dense is not None
    monkeypatch.setenv("SLUICE_QUANT_INT8_ACT", "1")
    # AMX: the integer GEMM up to AMX_PACKED_MAX_ROWS rows, the float copy's GEMMs past them
    monkeypatch.setattr(quant_module, "has_amx_bf16", lambda: True)
    amx = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)
    amx.keep_dense(torch.bfloat16, min_rows=16)
    assert amx.packed is not None and amx.dense is not None
    # up to 16 rows where the float copy has its AMX copy (this CPU's tiles), else up to 32
    has_tiles = amx.dense.amx is not None
    most = QuantLinear.AMX_PACKED_MAX_ROWS if has_tiles else QuantLinear.ONEDNN_PACKED_MAX_ROWS
    assert (amx.packed_min_rows, amx.packed_max_rows, amx.dense_min_rows) == (16, most, most + 1)
    assert (amx.dense.packed is None) == has_tiles  # oneDNN's copy only where it takes batches
    monkeypatch.setenv("SLUICE_AMX_LINEAR", "0")
    onednn = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)
    onednn.keep_dense(torch.bfloat16, min_rows=16)
    assert onednn.dense.amx is None and onednn.dense.packed is not None
    assert onednn.packed_max_rows == QuantLinear.ONEDNN_PACKED_MAX_ROWS
    monkeypatch.delenv("SLUICE_AMX_LINEAR")
    import sluice.model.layers as layers_module

    with monkeypatch.context() as patch:  # no oneDNN: a plain float copy, past 32 rows
        patch.setattr(layers_module, "can_pack_linears", lambda *_: False)
        plain = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)
        plain.keep_dense(torch.bfloat16, min_rows=16)
    assert not isinstance(plain.dense, layers_module.PackedLinear)
    assert (plain.packed_max_rows, plain.dense_min_rows) == (32, 33)
    assert torch.equal(plain(x[:16]), packed_ops.packed_linear(x[:16], packed, 40, None))
    assert torch.equal(amx(x[:2]), packed_ops.quant_linear(x[:2], raw, int(T.Q4_1), None, True))
    assert torch.equal(amx(x[:most]), packed_ops.packed_linear(x[:most], packed, 40, None))
    many = torch.randn(most + 1, 96).bfloat16()
    assert torch.equal(amx(many), amx.dense(many))
    assert not torch.equal(amx(many), packed_ops.packed_linear(many, packed, 40, None))
    assert torch.equal(amx(many[:most]), packed_ops.packed_linear(many[:most], packed, 40, None))


def test_a_quant_gate_up_gives_its_silu_from_its_float_copys_amx_gemm(packed_ops, monkeypatch):
    """On a CPU with AMX, a block-weight gate_up projection's float copy (a PackedLinear) can
    give silu(gate) * up from its GEMM (`fuse_silu_mul`): `silu_mul` delegates to it for the
    batches that copy takes on its AMX GEMM (from PackedLinear.AMX_MIN_ROWS rows), and answers
    None for the others (the integer GEMM's), where the MLP computes the two steps."""
    from sluice.model.kernels import cpu_ops
    from sluice.model.layers import PackedLinear

    ops = cpu_ops()
    if ops is None or not ops.amx_linear_ok():
        pytest.skip("no AMX tiles here (amx_linear_ok)")
    monkeypatch.setenv("SLUICE_QUANT_INT8_ACT", "1")
    monkeypatch.setattr(quant_module, "has_amx_bf16", lambda: True)
    raw, _ = _blocks(64, 96, T.Q4_1)  # 32 gate rows, 32 up rows
    layer = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)
    layer.keep_dense(torch.bfloat16, min_rows=16)
    assert isinstance(layer.dense, PackedLinear) and layer.fuse_silu_mul()
    assert layer.dense.weight is None  # its batches start past small_linear's: no plain copy
    assert layer.dense.packed is None  # and at AMX_MIN_ROWS: no oneDNN copy either
    assert QuantLinear.AMX_PACKED_MAX_ROWS + 1 == PackedLinear.AMX_MIN_ROWS
    for rows in (1, QuantLinear.AMX_PACKED_MAX_ROWS):
        assert layer.silu_mul(torch.randn(rows, 96).bfloat16()) is None
    for rows in (PackedLinear.AMX_MIN_ROWS, PackedLinear.PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 96).bfloat16()
        product = ops.amx_linear(x, ops.amx_pack_linear(layer.dequantized(torch.bfloat16)), 64)
        assert torch.equal(layer.silu_mul(x), ops.silu_and_mul(product))
    plain = QuantLinear(raw, int(T.Q4_1), 96, None, packed_ops)  # no float copy: nothing fused
    assert not plain.fuse_silu_mul() and plain.silu_mul(x) is None


# N = 16 (one tile), 33, 37, 70 (tiles then 1-6 GGUF rows), 5 (no tile: GGUF rows only), 600
# (37 tiles, then 8 rows); K = 32 * an odd number of blocks in most; M = 1..8 (one pass) and 13
# (two). At one and two rows the kernel reads up to 8 tiles at once, a range's last ones 4, 2,
# then 1 at once: 307 and 600 (19 and 37 tiles) take several of those on any split of threads
INTERLEAVED_SHAPES = [
    (1, 32, 16), (2, 96, 33), (3, 576, 192), (4, 160, 37), (5, 1536, 70), (6, 64, 5),
    (7, 224, 48), (8, 608, 600), (13, 96, 33), (1, 96, 307), (2, 160, 600), (1, 608, 600),
]  # fmt: skip


@pytest.fixture(scope="module")
def interleaved_ops(native_ops):
    if not native_ops.interleaved_types:
        pytest.skip(f"no interleaved kernel in this build (integer path: {native_ops.int8_isa})")
    return native_ops


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,k,n", INTERLEAVED_SHAPES)
def test_interleaved_kernel_gives_the_per_row_integer_result(
    interleaved_ops, qtype, m, k, n
) -> None:
    """The row-interleaved layout holds the same bytes (put back exactly by gguf_blocks, the
    last N % 16 rows untouched); its kernel rounds x as the per-row integer path does and takes
    the same exact integer sums, so the two differ by float32 summation order alone (each
    within `int8_float_bound` of exact), then the bfloat16 rounding of each (2^-8 |y|); and it
    is within the rounding bound."""
    ops = interleaved_ops
    raw, w = _blocks(n, k, qtype, seed=m)
    ilv, kind = ops.interleave(raw, int(qtype), k), ops.interleaved_types[int(qtype)]
    assert ilv.shape == raw.shape and kind != int(qtype)
    assert torch.equal(ops.gguf_blocks(ilv, kind, k), raw)
    tail = n // 16 * 16
    assert torch.equal(ilv[tail:], raw[tail:])
    assert n < 16 or not torch.equal(ilv[:tail], raw[:tail])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + n)).bfloat16()
    x[0, :32] *= 100
    if k >= 64:
        x[-1, 32:64] = 0
    floats = int8_float_bound(x, w, _block_mins(raw, qtype, n, k // 32))
    for bias in (torch.randn(n, generator=torch.Generator().manual_seed(m)), None):
        y = ops.quant_linear(x, ilv, kind, bias, True)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        b = torch.zeros(n) if bias is None else bias
        rows = ops.quant_linear(x, raw, int(qtype), bias, True)
        assert_same_up_to_float_order(y, rows, floats + 2.0**-24 * b.abs().double())
        ref = x.double() @ w.T + b.double()
        bound = _int8_bound(x, raw, w, qtype) + 2.0**-24 * b.abs().double() + 2.0**-8 * ref.abs()
        err = (y.double() - ref).abs()
        assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k,n", [(96, 307), (608, 600), (160, 37)])
def test_interleaved_kernel_rows_do_not_depend_on_their_batch(interleaved_ops, qtype, k, n):
    """Up to two rows of x the kernel reads eight tiles at once (a range's last ones 4, 2, 1);
    past them one: each row's output is the same bits either way (the same sums in the same
    order), and the same as the row gets alone, on one thread (19 tiles: 8, 8, 2, 1) or two."""
    ops = interleaved_ops
    raw, _ = _blocks(n, k, qtype, seed=n)
    ilv, kind = ops.interleave(raw, int(qtype), k), ops.interleaved_types[int(qtype)]
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for b in (bias, None):
                five = ops.quant_linear(x, ilv, kind, b, True)
                for m in (1, 2, 3):
                    assert torch.equal(ops.quant_linear(x[:m], ilv, kind, b, True), five[:m])
                assert torch.equal(ops.quant_linear(x[3:], ilv, kind, b, True), five[3:])
    finally:
        torch.set_num_threads(threads)


def assert_same_up_to_float_order(
    y: torch.Tensor, rows: torch.Tensor, floats: torch.Tensor
) -> None:
    """y and rows (bfloat16) are two float32 summations each within `floats` of exact, each then
    rounded to bfloat16 (2^-8 of the value at most)."""
    slack = 2 * floats + 2.0**-7 * rows.double().abs()
    assert ((y.double() - rows.double()).abs() <= slack).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_interleaved_blocks_serve_every_other_path_as_gguf_blocks(interleaved_ops, qtype) -> None:
    """float32 x, bfloat16 x off the integer path, dequantize and repack read an interleaved
    weight as its GGUF blocks: the same results, bit for bit."""
    ops = interleaved_ops
    raw, _ = _blocks(37, 96, qtype, seed=3)
    ilv, kind = ops.interleave(raw, int(qtype), 96), ops.interleaved_types[int(qtype)]
    x, bias = torch.randn(3, 96), torch.randn(37)
    for int8 in (True, False):
        want = ops.quant_linear(x, raw, int(qtype), bias, int8)
        assert torch.equal(ops.quant_linear(x, ilv, kind, bias, int8), want)
    xb = x.bfloat16()
    assert torch.equal(
        ops.quant_linear(xb, ilv, kind, bias, False), ops.quant_linear(xb, raw, int(qtype), bias)
    )
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            ops.dequantize(ilv, kind, 96, dtype), ops.dequantize(raw, int(qtype), 96, dtype)
        )
    assert torch.equal(ops.repack(ilv, kind, 96), ops.repack(raw, int(qtype), 96))
    with pytest.raises(RuntimeError, match="interleaves none"):
        ops.interleave(torch.zeros(4, 144, dtype=torch.uint8), int(T.Q4_K), 256)


def test_quant_linear_module_interleaves_bf16_layers_in_place(interleaved_ops) -> None:
    from sluice.model.quant import keep_dense_copies

    ops = interleaved_ops
    raw, w = _blocks(40, 96, T.Q4_1)
    x = torch.randn(3, 96).bfloat16()
    model = torch.nn.ModuleList([QuantLinear(raw, int(T.Q4_1), 96, None, ops) for _ in range(2)])
    want = model[0](x)
    assert not model[0].can_interleave(torch.float32)  # float32 rows: the float path, as it is
    keep_dense_copies(model, torch.bfloat16)
    layer = model[0]
    assert layer.kernel_type == ops.interleaved_types[int(T.Q4_1)] and layer.qtype == int(T.Q4_1)
    assert layer.qweight.shape == raw.shape and not layer.can_interleave(torch.bfloat16)
    assert torch.equal(layer.qweight, ops.interleave(raw, int(T.Q4_1), 96))
    assert layer.packed is not None or layer.dense is not None  # made from the GGUF blocks
    assert_same_up_to_float_order(
        layer(x), want, int8_float_bound(x, w, _block_mins(raw, T.Q4_1, 40, 3))
    )
    assert torch.equal(layer(x), ops.quant_linear(x, layer.qweight, layer.kernel_type, None, True))
    assert torch.equal(layer.dequantized(torch.float32), ops.dequantize(raw, int(T.Q4_1), 96, torch.float32))  # fmt: skip
    assert torch.equal(layer(x.float()), ops.quant_linear(x.float(), raw, int(T.Q4_1)))


def test_int8_activations_leave_float32_x_exact(native_ops) -> None:
    raw, _ = _blocks(40, 96, T.Q4_1)
    x = torch.randn(3, 96)
    a = native_ops.quant_linear(x, raw, int(T.Q4_1), None, True)
    assert torch.equal(a, native_ops.quant_linear(x, raw, int(T.Q4_1), None, False))


def test_quant_linear_module_takes_the_int8_path_unless_turned_off(native_ops, monkeypatch) -> None:
    raw, _ = _blocks(33, 64, T.Q4_1)
    x = torch.randn(2, 64).bfloat16()
    on = QuantLinear(raw, int(T.Q4_1), 64, None, native_ops)  # the default: on
    monkeypatch.setenv("SLUICE_QUANT_INT8_ACT", "0")
    off = QuantLinear(raw, int(T.Q4_1), 64, None, native_ops)
    assert on.int8_activations and not off.int8_activations
    assert torch.equal(on(x), native_ops.quant_linear(x, raw, int(T.Q4_1), None, True))
    assert torch.equal(off(x), native_ops.quant_linear(x, raw, int(T.Q4_1), None, False))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_gives_ggufs_values(ops, qtype) -> None:
    raw, w = _blocks(37, 96, qtype, seed=1)
    out = ops.dequantize(raw, int(qtype), 96, torch.float32)
    torch.testing.assert_close(out.double(), w, rtol=2**-23, atol=0)  # one rounding at most
    out16 = ops.dequantize(raw, int(qtype), 96, torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), w, rtol=2**-8, atol=0)


def test_quant_linear_refuses_what_it_cannot_take(native_ops) -> None:
    raw, _ = _blocks(4, 64, T.Q4_1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native_ops.quant_linear(torch.randn(1, 48), raw[:, :30].contiguous(), int(T.Q4_1))
    with pytest.raises(RuntimeError, match="bytes a row"):
        native_ops.quant_linear(torch.randn(1, 64), raw, int(T.Q8_0))
    with pytest.raises(RuntimeError, match="type must be"):
        native_ops.quant_linear(torch.randn(1, 64), raw, 13)  # Q5_K


def test_quant_linear_module_dense_copy_for_many_rows(native_ops) -> None:
    raw, w = _blocks(33, 64, T.Q4_0)
    layer = QuantLinear(raw, int(T.Q4_0), 64, None, native_ops)
    x = torch.randn(20, 64)
    kernel = layer(x)
    layer.keep_dense(torch.float32, min_rows=16)
    torch.testing.assert_close(layer(x), kernel, rtol=1e-5, atol=1e-5)  # the dense copy
    torch.testing.assert_close(layer(x[:2]), kernel[:2], rtol=0, atol=0)  # still the kernel
    with pytest.raises(ValueError, match="does not hold"):
        QuantLinear(raw, int(T.Q4_0), 96, None, native_ops)


# ----------------------------------------------------------------------------- a tiny GGUF

# HF name part -> GGUF name part, and the type each is written in (attn_v differs from q/k in
# layer 1, so that layer's qkv_proj is a QuantLinearParts)
_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _type_of(layer: int, part: str):
    if part == "output":
        return T.Q8_0
    if layer == 1 and part == "attn_v":
        return T.Q8_0
    return {"attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q4_0, "ffn_down": T.Q8_0}.get(
        part, T.Q4_1
    )


def _to_llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF q/k rows into llama.cpp's order (the inverse of the loader's unpermutation)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(hf_dir: str, out: Path, type_of=_type_of, encode=quantize) -> tuple[str, str]:
    """(a GGUF of the tiny model's linear weights in block types, an HF dir whose float weights
    are exactly what those blocks hold). type_of(layer, part): a weight's type (layer -1 for the
    LM head, part "output"); encode(w, qtype): its blocks, the rows in the file's order."""
    from safetensors.numpy import load_file, save_file

    from sluice.checkpoint.gguf_convert import _unpermute_rope_rows

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    tensors = load_file(str(Path(hf_dir) / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out / "tiny.gguf"), "llama")
    floats = dict(tensors)
    for name, w in tensors.items():
        if name == "lm_head.weight":
            gguf_name, part, heads = "output.weight", "output", 0
        elif name.startswith("model.layers.") and name.endswith(".weight"):
            layer, hf_part = name.split(".")[2], ".".join(name.split(".")[3:5])
            if hf_part not in _PARTS:
                continue
            part = _PARTS[hf_part]
            gguf_name = f"blk.{layer}.{part}.weight"
            heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(part, 0)  # fmt: skip
        else:
            continue
        qtype = type_of(-1 if part == "output" else int(name.split(".")[2]), part)
        stored = _to_llama_cpp_rows(w, heads) if heads else w
        raw = encode(stored.astype(np.float32), qtype)
        writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        back = dequantize(raw, qtype).reshape(w.shape).astype(np.float32)
        floats[name] = np.ascontiguousarray(_unpermute_rope_rows(back, heads) if heads else back)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    float_dir = out / "float"
    shutil.copytree(hf_dir, float_dir)
    save_file(floats, str(float_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out / "tiny.gguf"), str(float_dir)


def _prefill_logits(runner, ids: list[int]) -> torch.Tensor:
    from sluice.model.forward_batch import ForwardBatch, ForwardMode

    n = len(ids)
    req_to_token = torch.arange(n, dtype=torch.int64).unsqueeze(0)  # as ReqToTokenPool
    fb = ForwardBatch.build(
        ForwardMode.EXTEND, ids, [0], [n], torch.arange(n), req_to_token, [0], list(range(n)),
        torch.device("cpu"),
    )  # fmt: skip
    return runner.forward(fb)


def test_a_tiny_gguf_with_its_blocks_kept_gives_the_dequantized_models_logits(
    tiny_llama_dir: str, tmp_path: Path, native_ops, caplog
) -> None:
    import logging

    from sluice.model.runner import ModelRunner

    gguf_path, float_dir = _write_tiny_gguf(tiny_llama_dir, tmp_path)
    cfg = ModelConfig.from_hf_dir(float_dir, source_path=gguf_path)
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", gguf_path, cpu, torch.float32) == "gguf"
    with caplog.at_level(logging.INFO, logger="sluice.model.runner"):
        quantized = ModelRunner(cfg, cpu, torch.float32, kv_size=64, quantization="gguf")
        plain = ModelRunner(cfg, cpu, torch.float32, kv_size=64, quantization="none")
    # the load log counts the weights in blocks with the others: the same total either way
    blocks = sum(m.in_features * m.out_features for m in quantized.model.modules()
                 if isinstance(m, QuantLinear))  # fmt: skip
    logs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded")]
    total = re.search(r"(\d+)M parameters, float32", logs[1])
    assert total is not None and int(total.group(1)) > blocks / 1e6 > 1
    assert f"{total.group(1)}M parameters, {blocks / 1e6:.0f}M of them in blocks" in logs[0]
    layers = quantized.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, QuantLinear)
    mixed = layers[1].self_attn.qkv_proj  # Q4_0/Q4_0/Q8_0: a QuantLinear a part
    assert isinstance(mixed, QuantLinearParts)
    assert [p.qtype for p in mixed.parts] == [int(T.Q4_0), int(T.Q4_0), int(T.Q8_0)]
    assert isinstance(layers[1].mlp.down_proj, QuantLinear)
    assert isinstance(quantized.model.lm_head, QuantLinear)
    ids = list(range(1000, 1020))
    a, b = _prefill_logits(quantized, ids), _prefill_logits(plain, ids)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_quantization_auto_means_none_off_gguf_and_gguf_refuses_it(tiny_llama_dir: str) -> None:
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", tiny_llama_dir, cpu, torch.float32) == "none"
    assert resolve_quantization("none", tiny_llama_dir, cpu, torch.float32) == "none"
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_quantization("gguf", tiny_llama_dir, cpu, torch.float32)


@pytest.mark.parametrize(("mode", "qtype"), [("int8", T.Q8_0), ("int4", T.Q4_1)])
def test_int8_and_int4_quantize_a_float_checkpoint_at_load(
    tiny_llama_dir: str, tmp_path: Path, native_ops, mode: str, qtype
) -> None:
    """Every linear layer holds exactly gguf's quantization of the float weight, and the model
    gives the logits of the float model whose weights are those blocks dequantized."""
    from safetensors.torch import load_file, save_file

    from sluice.model.runner import ModelRunner

    cfg = ModelConfig.from_hf_dir(tiny_llama_dir)
    cpu = torch.device("cpu")
    assert resolve_quantization(mode, tiny_llama_dir, cpu, torch.float32) == mode
    quantized = ModelRunner(cfg, cpu, torch.float32, kv_size=64, quantization=mode)
    # the reference: the checkpoint's weights rounded through gguf's quantizer, as floats
    rounded_dir = tmp_path / "rounded"
    shutil.copytree(tiny_llama_dir, rounded_dir)
    tensors = load_file(str(rounded_dir / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            raw = quantize(w.float().numpy(), qtype)
            tensors[name] = torch.from_numpy(dequantize(raw, qtype).reshape(w.shape)).to(w.dtype)
    save_file(tensors, str(rounded_dir / "model.safetensors"), metadata={"format": "pt"})
    rounded = ModelRunner(ModelConfig.from_hf_dir(str(rounded_dir)), cpu, torch.float32, kv_size=64)
    model = quantized.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    blocks = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert not linears and len(blocks) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down
    assert all(m.qtype == int(qtype) for m in blocks)
    layer0 = model.model.layers[0].mlp.down_proj
    original = load_file(f"{tiny_llama_dir}/model.safetensors")
    want = quantize(original["model.layers.0.mlp.down_proj.weight"].float().numpy(), qtype)
    assert np.array_equal(layer0.qweight.numpy(), want)
    ids = list(range(100, 120))
    for rows in (ids[:4], ids):  # the kernel (few rows) and the float copy (many)
        torch.testing.assert_close(
            _prefill_logits(quantized, rows), _prefill_logits(rounded, rows), rtol=1e-4, atol=1e-4
        )


def test_int8_and_int4_need_the_cpu_kernels_and_a_float_dtype(tiny_llama_dir: str) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="--quantization int8 is not available: .* not cuda"):
        resolve_quantization("int8", tiny_llama_dir, torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="--quantization int4 is not available: .*float16"):
        resolve_quantization("int4", tiny_llama_dir, cpu, torch.float16)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        resolve_quantization("int3", tiny_llama_dir, cpu, torch.float32)


# ----------------------------------------------------------------------------- SmolLM2 Q4_1


def test_smollm2_blocks_equal_the_float_conversion(
    smollm2_gguf: str, smollm2_hf_dir: str, native_ops
) -> None:
    from safetensors import safe_open

    from sluice.model.gguf_weights import install_quantized
    from sluice.model.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf_dir(smollm2_hf_dir, source_path=smollm2_gguf)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    done = install_quantized(model, cfg, native_ops)
    assert len(done.modules) == 4 * cfg.num_hidden_layers + 1  # qkv, o, gate_up, down; lm_head
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.qtype == int(T.Q8_0)  # the tied token_embd
    with safe_open(str(Path(smollm2_hf_dir) / "model.safetensors"), framework="pt") as f:
        attn = model.model.layers[3].self_attn.qkv_proj
        parts = [f.get_tensor(f"model.layers.3.self_attn.{p}_proj.weight") for p in "qkv"]
        torch.testing.assert_close(attn.dequantized(torch.float32), torch.cat(parts), rtol=2**-23, atol=0)  # fmt: skip
        embed = f.get_tensor("model.embed_tokens.weight")
        torch.testing.assert_close(head.dequantized(torch.float32), embed, rtol=2**-23, atol=0)


PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at",
    "The three primary colors are", "In 1492,", "To make a cup of tea,", "import numpy as np\n",
    "The largest planet in the solar system", "Photosynthesis is", "My favourite book is",
    "SELECT * FROM", "The opposite of hot is", "Machine learning models", "Dear Sir or Madam,",
    "The speed of light is",
]  # fmt: skip
TEXT = (
    "The river ran quietly beneath the old stone bridge, carrying leaves from the mountain "
    "forests down to the harbor, where fishermen mended their nets in the evening light."
)


def test_engine_greedy_tokens_and_logprobs_with_blocks_kept(smollm2_gguf: str, capsys) -> None:
    from sluice import Engine

    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    outputs, logprobs = {}, {}
    for quant in ("gguf", "none"):
        engine = Engine(
            smollm2_gguf, dtype="float32", quantization=quant, embedding_model_path="none",
            max_total_tokens=8192, num_threads=2,
        )  # fmt: skip
        assert engine.resources.quantization == quant
        for module in engine.scheduler.runner.model.modules():
            if isinstance(module, QuantLinear):
                module.dense = None  # the kernel for every row count, the prefill's too
        # one request at a time: the single-stream decode the kernel is for
        outputs[quant] = [engine.generate(p, params)["output_ids"] for p in PROMPTS]
        scored = engine.generate(
            TEXT, {**params, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=0
        )
        values = scored["meta_info"]["input_token_logprobs"]
        logprobs[quant] = torch.tensor([lp for lp in values if lp is not None])
        engine.shutdown()
    agree = sum(a == b for a, b in zip(outputs["gguf"], outputs["none"], strict=True))
    diff = (logprobs["gguf"] - logprobs["none"]).abs().mean().item()
    with capsys.disabled():
        print(f"\ngguf vs none (float32): greedy agreement {agree}/{len(PROMPTS)} prompts; mean "
              f"|logprob difference| {diff:.2e} over {len(logprobs['gguf'])} tokens")  # fmt: skip
    # the same weights, summed in another order: a near-tie may flip a token, rarely
    assert agree >= len(PROMPTS) - 2
    assert diff < 1e-3


def test_quant_linear_parts_side_by_side_then_the_bias(native_ops) -> None:
    (raw_a, w_a), (raw_b, w_b) = _blocks(24, 64, T.Q4_0), _blocks(9, 64, T.Q8_0, seed=2)
    parts = [
        QuantLinear(raw_a, int(T.Q4_0), 64, None, native_ops),
        QuantLinear(raw_b, int(T.Q8_0), 64, None, native_ops),
    ]
    bias = torch.randn(33)
    layer = QuantLinearParts(parts, bias.clone())
    assert (layer.in_features, layer.out_features) == (64, 33)
    x = torch.randn(3, 64)
    want = torch.cat([parts[0](x), parts[1](x)], dim=-1) + bias
    assert torch.equal(layer(x), want)
    ref = x.double() @ torch.cat([w_a, w_b]).T + bias.double()
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    wider = QuantLinear(_blocks(4, 96, T.Q4_0)[0], int(T.Q4_0), 96, None, native_ops)
    with pytest.raises(ValueError, match="share in_features"):
        QuantLinearParts([parts[0], wider], None)
