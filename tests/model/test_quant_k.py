"""The K-quants (Q4_K, Q6_K: 256-value blocks) kept in their blocks: the kernels and a model.

gguf cannot quantize into K-quants, so the blocks are random bytes with finite fp16 scales (any
such bytes are a valid block), and the reference is gguf's own dequantization of those bytes.

- `dequantize` equals gguf's values exactly (each value is one float product, exact in float32,
  then at most one rounding for the minimum of Q4_K; fused or not, the same float).
- `quant_linear` against that dequantization and a float64 matmul, within the float path's bound
  of test_quant ((K + 2) 2^-24 sum_k |x_k w_k|, plus 2^-8 |y| for bfloat16 output), for 1 to 64
  rows of x (one tile of 8, a tile and one row, many tiles) and N not a multiple of the chunk,
  in each build (AVX-512, AVX2, scalar); where the build's integer path does not take the
  K-quants, bfloat16 x takes the float path even when the integer path is asked for.
- The integer path (AVX-512 VNNI builds: x rounded to int8 per 32 values) within test_quant's
  bound for it (`int8_bound`), with each group's m_b: Q4_K's -dmin * mn_g; none for Q6_K, whose
  -32 d is applied inside the exact integer sums.
- A tiny llama whose GGUF mixes Q4_K, Q6_K and Q8_0 as a Q4_K_M file does (one layer's v in
  Q6_K, its q/k in Q4_K: that fused qkv a QuantLinearParts) gives the logits of the same model
  with the dequantized weights, through the kernel (few rows) and the float copies (many).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sluice.checkpoint.model_config import ModelConfig
from sluice.model.quant import QuantLinear, QuantLinearParts, resolve_quantization
from tests.model.test_quant import (  # noqa: F401 (fixtures)
    T,
    _prefill_logits,
    _write_tiny_gguf,
    assert_float_path_result,
    avx2_ops,
    dequantize,
    generic_ops,
    int8_bound,
    native_ops,
    quantize,
)
from tests.tiny_models import make_tiny_llama

K_TYPES = [T.Q4_K, T.Q6_K]
# (M, K, N): N = 1, 7, 33 (four rows a group: a short group), 193 and 70 (chunks of 64 and a rest)
K_SHAPES = [(1, 256, 1), (1, 512, 193), (3, 768, 7), (8, 256, 33), (9, 512, 70), (64, 256, 65)]
_SCALE_AT = {T.Q4_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of a block's fp16 d (and dmin)


def random_k_blocks(n: int, k: int, qtype, rng: np.random.Generator, top: float) -> np.ndarray:
    """[n, k / 256 * block bytes] random blocks of `qtype`, each fp16 scale in [top / 10, top]."""
    nb, size = k // 256, {T.Q4_K: 144, T.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, size=(n, nb, size), dtype=np.uint8)
    for at in _SCALE_AT[qtype]:
        scale = rng.uniform(top / 10, top, size=(n, nb)).astype(np.float16)
        raw[:, :, at : at + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.fixture(params=["native", "avx2", "generic"])
def ops(request):
    return request.getfixturevalue(f"{request.param}_ops")


def _k_blocks(n: int, k: int, qtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_k_blocks(n, k, qtype, np.random.default_rng(seed), top=1e-2)
    return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_dequantize_equals_ggufs_values(ops, qtype) -> None:
    raw, w = _k_blocks(37, 768, qtype, seed=1)
    assert torch.isfinite(w).all() and w.abs().max() > 0
    assert torch.equal(ops.dequantize(raw, int(qtype), 768, torch.float32).double(), w)
    out16 = ops.dequantize(raw, int(qtype), 768, torch.bfloat16)
    assert torch.equal(out16, w.float().bfloat16())


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,k,n", K_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_quant_linear_matches_dequantize_then_matmul(ops, qtype, m, k, n, dtype) -> None:
    raw, w = _k_blocks(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + n)).to(dtype)
    bias = torch.randn(n)
    y = ops.quant_linear(x, raw, int(qtype), bias)
    assert_float_path_result(y, x, w, bias)
    if dtype == torch.bfloat16 and int(qtype) not in ops.int8_types:  # asking changes nothing
        assert torch.equal(ops.quant_linear(x, raw, int(qtype), bias, True), y)


def _k_mins(raw: torch.Tensor, qtype) -> torch.Tensor:
    """[N, K / 32] each group's m_b as the integer path sees it: Q4_K's -dmin * mn_g; Q6_K's
    -32 d is inside its exact integer sums, so 0."""
    n, nb = raw.shape[0], raw.shape[1] // {T.Q4_K: 144, T.Q6_K: 210}[qtype]
    if qtype == T.Q6_K:
        return torch.zeros(n, nb * 8, dtype=torch.float64)
    blocks = raw.numpy().reshape(n * nb, 144)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)  # [n * nb, 1]
    _, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return torch.from_numpy(-dmin * mn.astype(np.float64)).reshape(n, nb * 8)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m,k,n", [*K_SHAPES, (2, 8192, 9)])
def test_k_int8_activations_within_the_rounding_bound(native_ops, qtype, m, k, n) -> None:  # noqa: F811
    if int(qtype) not in native_ops.int8_types:
        pytest.skip(f"this build's integer path ({native_ops.int8_isa}) takes no K-quants")
    raw, w = _k_blocks(n, k, qtype, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + n)).bfloat16()
    x[0, :32] *= 100  # blocks of very different scales
    x[-1, 32:64] = 0  # a block of zeros: dx = 0
    bias = torch.randn(n)
    y = native_ops.quant_linear(x, raw, int(qtype), bias, True)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.T + bias.double()
    bound = int8_bound(x, w, _k_mins(raw, qtype)) + 2.0**-24 * bias.abs().double()
    bound = bound + 2.0**-8 * ref.abs()
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"
    assert not torch.equal(y, native_ops.quant_linear(x, raw, int(qtype), bias, False))


def test_k_quant_linear_refuses_widths_not_a_multiple_of_256(native_ops, monkeypatch) -> None:  # noqa: F811
    raw, _ = _k_blocks(4, 512, T.Q4_K)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        native_ops.quant_linear(torch.randn(1, 288), raw[:, :162].contiguous(), int(T.Q4_K))
    with pytest.raises(RuntimeError, match="bytes a row"):
        native_ops.quant_linear(torch.randn(1, 512), raw, int(T.Q6_K))
    with pytest.raises(ValueError, match="Q6_K holds 256 values a block: in_features 576"):
        QuantLinear(torch.zeros(4, 473, dtype=torch.uint8), int(T.Q6_K), 576, None, native_ops)
    monkeypatch.setenv("SLUICE_QUANT_INT8_ACT", "1")
    layer = QuantLinear(raw, int(T.Q4_K), 512, None, native_ops)
    assert layer.int8_activations == (int(T.Q4_K) in native_ops.int8_types)
    assert "Q4_K" in repr(layer)


def test_k_quants_keep_a_float_copy_for_many_bf16_rows(native_ops) -> None:  # noqa: F811
    """The integer GEMM on repacked blocks takes the 32-value types only: a K-quant layer's
    second copy is a float one, and repack refuses its blocks."""
    raw, w = _k_blocks(20, 256, T.Q6_K)
    layer = QuantLinear(raw, int(T.Q6_K), 256, None, native_ops)
    layer.keep_dense(torch.bfloat16, min_rows=16)
    assert layer.packed is None and layer.dense is not None
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    y, ref = layer(x).double(), x.double() @ w.T
    assert torch.equal(layer(x), layer.dense(x))
    assert (y - ref).norm() <= 2**-6 * ref.norm()  # the bfloat16 copy's rounding, not a GEMM's
    with pytest.raises(RuntimeError, match="repack takes"):
        native_ops.repack(raw, int(T.Q6_K), 256)


# ----------------------------------------------------------------------------- a tiny Q4_K_M


def _k_type_of(layer: int, part: str):
    """As llama.cpp's Q4_K_M: mostly Q4_K, some v and down in Q6_K, the LM head in Q6_K; one
    down in Q8_0 (a third type in the file)."""
    if part == "output" or (part, layer) in (("attn_v", 1), ("ffn_down", 0)):
        return T.Q6_K
    return T.Q8_0 if part == "ffn_down" else T.Q4_K


def _k_encode(rng: np.random.Generator):
    def encode(w: np.ndarray, qtype) -> np.ndarray:
        if qtype not in K_TYPES:
            return quantize(w, qtype)
        # weights of about the float model's size (|w| <= 0.06): d * 63 * 15 (Q4_K) or
        # d * 127 * 32 (Q6_K) at most; some d subnormal fp16
        top = 6e-5 if qtype == T.Q4_K else 1.5e-5
        return random_k_blocks(w.shape[0], w.shape[1], qtype, rng, top)

    return encode


def test_a_tiny_q4_k_m_gguf_gives_the_dequantized_models_logits(
    tmp_path,
    smollm2_hf_dir: str,
    native_ops,  # noqa: F811 (the fixture)
) -> None:
    from sluice.model.runner import ModelRunner

    hf_dir = make_tiny_llama(
        tmp_path / "hf", tokenizer_dir=smollm2_hf_dir, hidden_size=256, intermediate_size=512
    )
    encode = _k_encode(np.random.default_rng(7))
    gguf_path, float_dir = _write_tiny_gguf(hf_dir, tmp_path, _k_type_of, encode)
    cfg = ModelConfig.from_hf_dir(float_dir, source_path=gguf_path)
    cpu = torch.device("cpu")
    assert resolve_quantization("auto", gguf_path, cpu, torch.float32) == "gguf"
    quantized = ModelRunner(cfg, cpu, torch.float32, kv_size=64, quantization="gguf")
    plain = ModelRunner(cfg, cpu, torch.float32, kv_size=64, quantization="none")
    layers, want = quantized.model.model.layers, {}
    for i in range(2):
        want[f"model.layers.{i}.self_attn.o_proj"] = T.Q4_K
        want[f"model.layers.{i}.mlp.gate_up_proj"] = T.Q4_K
        want[f"model.layers.{i}.mlp.down_proj"] = _k_type_of(i, "ffn_down")
    want["model.layers.0.self_attn.qkv_proj"] = T.Q4_K
    want["lm_head"] = T.Q6_K
    for name, qtype in want.items():
        module = quantized.model.get_submodule(name)
        assert isinstance(module, QuantLinear) and module.qtype == int(qtype), name
    mixed = layers[1].self_attn.qkv_proj  # Q4_K/Q4_K/Q6_K: a QuantLinear a part
    assert isinstance(mixed, QuantLinearParts)
    assert [p.qtype for p in mixed.parts] == [int(T.Q4_K), int(T.Q4_K), int(T.Q6_K)]
    ids = list(range(1000, 1020))
    for rows in (ids[:3], ids):  # the kernel (few rows) and the float copies (many)
        a, b = _prefill_logits(quantized, rows), _prefill_logits(plain, rows)
        assert b.abs().max() > 1e-3  # the weights do something
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))  # the same greedy tokens
