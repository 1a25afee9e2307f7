"""sluice's C++ decode-attention kernel against PyTorch's SDPA over the gathered slots, and its
wiring into the model runner (the end-to-end logits parity in test_parity.py runs through it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.model import kernels
from sluice.model.layers import PagedAttention
from sluice.model.model_config import ModelConfig
from sluice.model.runner import ModelRunner

SLOTS = 4096


def _reference(q, k_pool, v_pool, indices, lens, scale) -> torch.Tensor:
    """Per request: SDPA of its one query over its first lens[b] slots, in float32."""
    rows = []
    for b in range(q.shape[0]):
        slots = indices[b, : lens[b]]
        k, v = k_pool[slots].float().transpose(0, 1), v_pool[slots].float().transpose(0, 1)
        qb = q[b].float().unsqueeze(1)  # [H, 1, D]
        out = F.scaled_dot_product_attention(
            qb, k, v, scale=scale, enable_gqa=q.shape[1] != k_pool.shape[1]
        )
        rows.append(out.squeeze(1))
    return torch.stack(rows)  # [B, H, D]


@pytest.fixture(scope="module")
def op():
    op = kernels.decode_attention()
    assert op is not None, "the decode-attention kernel did not build (see the warning log)"
    return op


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_sdpa(op, dtype, atol, num_heads, num_kv_heads) -> None:
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    head_dim, lens = 64, [1, 7, 130, 64, 255]
    k_pool = torch.randn(SLOTS, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_pool = torch.randn(SLOTS, num_kv_heads, head_dim, generator=gen).to(dtype)
    indices = torch.zeros(len(lens), max(lens), dtype=torch.int64)  # 0-padded, like the runner's
    for b, n in enumerate(lens):  # scattered slots, as decode leaves them
        indices[b, :n] = torch.randperm(SLOTS - 1, generator=gen)[:n] + 1
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype) * 3
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    out = op(q, k_pool, v_pool, indices, seq_lens, head_dim**-0.5)
    want = _reference(q, k_pool, v_pool, indices, lens, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


def test_kernel_refuses_mismatched_inputs(op) -> None:
    q = torch.zeros(2, 4, 64)
    pool = torch.zeros(16, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        op(
            q,
            pool,
            pool,
            torch.zeros(2, 3, dtype=torch.int64),
            torch.ones(2, dtype=torch.int64),
            1.0,
        )


def test_runner_hands_the_kernel_to_every_layer(tiny_llama_dir: str, op) -> None:
    runner = ModelRunner(
        ModelConfig.from_hf_dir(tiny_llama_dir), torch.device("cpu"), torch.float32, kv_size=64
    )
    layers = [m for m in runner.model.modules() if isinstance(m, PagedAttention)]
    assert layers and all(m.decode_op is op for m in layers)


def test_float16_on_cpu_keeps_the_pytorch_path(tiny_llama_dir: str) -> None:
    runner = ModelRunner(
        ModelConfig.from_hf_dir(tiny_llama_dir), torch.device("cpu"), torch.float16, kv_size=64
    )
    layers = [m for m in runner.model.modules() if isinstance(m, PagedAttention)]
    assert layers and all(m.decode_op is None for m in layers)
